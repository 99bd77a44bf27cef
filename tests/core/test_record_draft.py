"""A record the decoder builds as a draft (no guard call per field) is, once published, a plain
StepRecord: equal to one built the ordinary way, guarded, and frozen like any other."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from nummon._core.types import StepRecord, publish, record_draft


def test_a_draft_starts_with_every_field_at_its_default_and_dicts_of_its_own():
    a, b = record_draft(7), record_draft(7)
    assert publish(a) == StepRecord(step=7)
    assert a.__dict__ == StepRecord(step=7).__dict__
    a.layer_grad_norms["w"] = 1.0
    assert b.layer_grad_norms == {}


def test_a_published_draft_is_a_plain_step_record_that_freezes_and_pickles_as_one():
    d = record_draft(3)
    d.loss, d.layer_grad_norms = 1.5, {"w": 2.0}
    rec = publish(d)
    assert rec is d and type(rec) is StepRecord
    assert rec == StepRecord(step=3, loss=1.5, layer_grad_norms={"w": 2.0})
    assert type(dataclasses.replace(rec, loss=2.0)) is StepRecord
    assert type(pickle.loads(pickle.dumps(rec))) is StepRecord
    rec.freeze()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.loss = 0.0


def test_publishing_a_plain_record_changes_nothing():
    rec = StepRecord(step=1)
    assert publish(rec) is rec and type(rec) is StepRecord

"""Each statistic family is one unit: it declares its segments with their
cross-rank rules, its launch function and its decoders, and the collector and the decoder both
run from that one list, so a family cannot be launched without being decoded."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

import nummon
from nummon._stats import families
from nummon._stats.distributed import Reduce
from nummon._stats.families import FAMILIES, StatFamily, declared_rules, decoders


def test_every_family_declares_segments_rules_launch_and_decoder():
    assert [f.name for f in FAMILIES] == [
        "loss", "gradients", "parameters", "optimizer", "activations", "mechanisms", "inputs"
    ]  # fmt: skip
    for f in FAMILIES:
        assert f.segments and all(r and r <= Reduce.ALL for r in f.segments.values()), f.name
        assert callable(f.launch) and f.decode and all(map(callable, f.decode)), f.name


def test_each_family_is_one_module_holding_its_launch_and_its_decoders():
    modules = [f.launch.__module__ for f in FAMILIES]
    assert len(set(modules)) == len(FAMILIES)
    for f, module in zip(FAMILIES, modules):
        assert module.startswith("nummon._stats.families.") and module != "nummon._stats.families.family", f.name
        assert {d.__module__ for d in f.decode} == {module}, f.name
        assert sys.modules[module].FAMILY is f, f.name


def test_the_norm_families_declare_what_the_decoder_recomputes_across_ranks():
    mon = nummon.Monitor(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), sinks=[])
    try:
        assert list(mon._stats.decoder.overflow) == ["grad_norms", "param_norms", "state_norms"]
    finally:
        mon.close()


@pytest.mark.parametrize(
    "change",
    [
        {"decode": ()},
        {"segments": {}},
        {"segments": {"loss": frozenset({"average"})}},
        {"launch": None},
        {"overflow": {"param_norms": lambda p: p.params}},  # a segment the family does not declare
    ],
)
def test_a_family_missing_a_part_is_refused(change):
    with pytest.raises(ValueError, match="statistic family 'loss'"):
        dataclasses.replace(FAMILIES[0], **change)


def test_the_decoder_runs_exactly_the_families_decoders_in_their_order():
    mon = nummon.Monitor(nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), sinks=[])
    try:
        assert mon._stats.decoder.decoders == tuple(d for f in FAMILIES for d in f.decode)
    finally:
        mon.close()
    extra = StatFamily("extra", {"x": frozenset({Reduce.SUM})}, FAMILIES[0].launch, (FAMILIES[0].decode[0],))
    assert decoders((*FAMILIES, extra))[-1] is FAMILIES[0].decode[0]


def test_every_segment_a_real_step_packs_is_declared_with_its_rule(monkeypatch):
    """The declarations are the truth: every segment each family's launch returns on real steps
    (SGD with momentum, a batch, activations, mechanism probes, a tensor LR) is declared by that
    family, with the rule it carries."""
    seen: list[tuple[str, str, object]] = []
    wrapped = []
    for f in FAMILIES:

        def launch(c, s, f=f):
            segs = f.launch(c, s)
            seen.extend((f.name, seg.name, seg.reduce) for seg in segs)
            return segs

        wrapped.append(dataclasses.replace(f, launch=launch))
    monkeypatch.setattr(families, "FAMILIES", tuple(wrapped))
    from nummon._stats import collector

    monkeypatch.setattr(collector, "FAMILIES", tuple(wrapped))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    mon = nummon.Monitor(model, opt, sinks=[])
    try:
        for _ in range(3):
            x = torch.randn(5, 4)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 3, (5,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.post_step(loss, batch=(x,))
    finally:
        mon.close()
    names = {n for _, n, _ in seen}
    assert {"loss", "grad_norms", "param_norms", "state_norms", "lr", "fingerprint", "input_nonfinite"} <= names
    assert any(n.startswith("act_minmax:") for n in names)  # single process: (min, max) pairs
    for fam, name, reduce in seen:
        owner = next(f for f in FAMILIES if f.rules_for(name) is not None)
        assert owner.name == fam, name
        rules = {reduce} if isinstance(reduce, str) else set(reduce)
        assert rules <= declared_rules(name), (name, rules)

"""Batch fingerprints: deterministic, sensitive to one changed input, carried into alerts and
the flight recorder."""

import pytest
import torch
from helpers.models import MLP
from torch import nn

from nummon import AlertKind, Monitor

CE = nn.functional.cross_entropy


def batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _fingerprints(seed, poke=None):
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt)
    out = []
    g = torch.Generator().manual_seed(seed)
    for step in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if poke == step:
            x[2, 3] += 1e-3
        opt.zero_grad()
        loss = CE(model(x), y)
        loss.backward()
        opt.step()
        out.append(mon.post_step(loss, batch=(x, y)).record.fingerprint)
    mon.close()
    return out


@pytest.mark.slow
def test_fingerprints_are_deterministic_and_sensitive():
    a, b = _fingerprints(0), _fingerprints(0)
    assert a == b and len(set(a)) == 5
    c = _fingerprints(0, poke=3)
    assert [i for i in range(5) if a[i] != c[i]] == [3]


def test_fingerprint_is_in_alerts_and_flight_record(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, run_dir=tmp_path)
    x, y = batch(8)
    x[0, 0] = float("nan")
    loss = CE(model(x), y)
    loss.backward()
    r = mon.post_step(loss, batch=(x, y))
    a = next(a for a in r.alerts if a.kind is AlertKind.NONFINITE)
    assert a.details["batch_fingerprint"] == r.record.fingerprint
    assert mon.recent()[-1]["fingerprint"] == r.record.fingerprint
    mon.close()

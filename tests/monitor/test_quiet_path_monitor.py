"""The fast path for quiet steps inside a real training run: the same model trained twice from
the same seed, the engine's fast path on and off, raises the same alerts with the same messages
at the same steps and reports the same health every step; and it is taken on the quiet steps."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import nummon


def _train(late_lr: float, steps: int, fast: bool, run_dir) -> tuple[list, int]:
    """150 steps at lr 0.05, the last 70 at `late_lr`: a quiet start, then what `late_lr` does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    mon = nummon.Monitor(model, opt, policy={"alerts": {"stop_on_critical": False}}, run_dir=run_dir)
    engine = mon._steps.engine
    engine._quiet.skip = fast  # (off: every record judged in full, the regions still made)
    seen, fast_steps = [], 0
    for i in range(steps):
        if i == 80:
            opt.param_groups[0]["lr"] = late_lr
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y)
        loss.backward()
        opt.step()
        booked = len(engine._quiet.booked)
        report = mon.post_step(loss)
        fast_steps += len(engine._quiet.booked) > booked
        # (each run writes its own folder: its path is the one difference the alerts may show)
        alerts = [
            json.dumps(a.to_dict(), sort_keys=True, default=str).replace(str(run_dir), "<run>") for a in report.alerts
        ]
        seen.append((report.step, report.health, alerts, [e.state.value for e in report.incidents]))
    mon.close()
    return seen, fast_steps


@pytest.mark.parametrize("late_lr", [0.05, 0.5, 3.0])  # stays healthy; goes unstable; blows up
def test_a_monitored_run_alerts_alike_with_and_without_the_fast_path(late_lr, tmp_path):
    full, none = _train(late_lr, 150, fast=False, run_dir=tmp_path / "full")
    fast, taken = _train(late_lr, 150, fast=True, run_dir=tmp_path / "fast")
    assert none == 0
    assert fast == full
    assert taken > 30  # the quiet steps skipped the detectors
    if late_lr > 0.1:
        assert any(alerts for _, _, alerts, _ in full[80:])  # (the comparison covers the alerts)

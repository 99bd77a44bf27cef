"""Histograms where they matter: log-spaced early steps, the cadence, and every incident event's step."""

import pytest
import torch
from helpers.models import runaway_run
from torch import nn

from nummon import MemorySink, Monitor


class DrawsHistograms(MemorySink):
    """A sink that draws histograms at its default cadence, as TensorBoard and W&B do (every 500 steps)."""

    default_histogram_every = 500


@pytest.mark.slow
def test_a_200_step_run_gets_histograms_at_log_spaced_early_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = DrawsHistograms()
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with Monitor(model, opt, sinks=[sink], run_dir=tmp_path) as mon:
        for _ in range(200):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            mon.post_step(loss)
    assert [step for step, _ in sink.histograms] == [0, 1, 2, 5, 10, 20, 50, 100]


def test_every_incident_event_gets_histograms_at_its_step(tmp_path):
    sink = DrawsHistograms()
    mon, _ = runaway_run([sink], tmp_path, steps=80)
    event_steps = {e.step for e in mon.incidents}
    assert event_steps
    drawn = {step for step, _ in sink.histograms}
    assert event_steps <= drawn, (event_steps, sorted(drawn))
    step, hist = next((s, h) for s, h in sink.histograms if s in event_steps)
    assert any(k.startswith("grads/") for k in hist) and any(k.startswith("params/") for k in hist)

"""Gradient statistics before clipping: a plain loop with clip_grad_norm_ reports the norm
clip_grad_norm_ saw, and how much it clipped."""
import pytest
import torch
from torch import nn

from nummon import Monitor
from models import CNN, data


@pytest.mark.parametrize("accumulate", [1, 4])
def test_grad_norm_is_the_unclipped_norm_clip_grad_norm_returned(accumulate):
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = Monitor(model, opt, policy={"recorder": {"write": False}, "alerts": {"stop_on_critical": False}})
    x, y = data(n=32)
    for _ in range(3):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (nn.functional.cross_entropy(model(xs * 30), ys) / accumulate).backward()
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        rec = mon.post_step(torch.tensor(0.0)).record
        assert total > 1.0  # it did clip: the gradients now have norm 1
        assert rec.grad_norm == pytest.approx(total, rel=1e-5)
        assert rec.clip_ratio == pytest.approx(1.0 / total, rel=1e-4)
        assert rec.grad_max == pytest.approx(max(float(p.grad.abs().max()) for p in model.parameters()) * total, rel=1e-4)
    mon.close()


def test_without_clipping_the_ratio_is_one_and_norms_match_the_gradients():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt)
    opt.zero_grad()
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    rec = mon.post_step(1.0).record
    mon.close()
    assert rec.clip_ratio == pytest.approx(1.0)
    for name, p in model.named_parameters():
        assert rec.layer_grad_norms[name] == pytest.approx(float(p.grad.norm()), rel=1e-6)


def test_a_step_without_a_backward_measures_the_gradients_as_they_are():
    model = nn.Linear(2, 1)
    mon = Monitor(model)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    rec = mon.post_step(1.0).record
    mon.close()
    assert rec.layer_grad_norms["weight"] == pytest.approx(5.0) and rec.clip_ratio is None

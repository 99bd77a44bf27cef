"""An overflow of a product of finite operands names the operand that carries the magnitude (the
weights, the data, or activations grown through earlier layers), and the remedy follows it."""

import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nummon._forensics import explain_nonfinite, explain_quietly


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


def _model(seed=0):
    """Positive weights of an ordinary scale (below 1): sums of large terms cannot cancel."""
    torch.manual_seed(seed)
    model = Wrapped()
    with torch.no_grad():
        for p in model.parameters():
            p.abs_()
    return model


@settings(max_examples=10, deadline=None)
@given(st.floats(37.0, 38.0))
def test_an_overflow_through_grown_weights_names_the_weight_and_the_learning_rate(decades):
    model = _model()
    with torch.no_grad():
        model.net[2].weight.mul_(10.0**decades)
    x = 100 * torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # data of an ordinary scale
    report = explain_quietly(lambda: model(x).sum(), model)
    assert report is not None and report.cause == "overflow" and report.module == "net.2"
    top = float(model.net[2].weight.detach().abs().max())
    m = re.search(r"the weights carry the magnitude: net\.2\.weight reached max \|w\| ([-\d.e+]+)", report.input_ranges)
    assert m, report.input_ranges
    assert float(m.group(1)) == float(f"{top:.4g}")
    assert "learning rate" in report.remedy and "normalise the inputs" not in report.remedy


def test_an_overflow_from_the_data_names_the_batch_and_normalising_it():
    model = _model()
    x = torch.full((4, 8), 3e38)
    report = explain_nonfinite(lambda: model(x).sum())
    assert report is not None and report.cause == "overflow"
    assert "the data carries the magnitude" in report.input_ranges
    assert report.remedy.startswith("normalise the inputs")


def test_an_overflow_of_activations_with_weights_in_range_names_the_activations():
    model = _model()

    def fn():
        h = torch.relu(model.net[0](torch.ones(4, 8))).clamp(max=1) * 3e38  # grown between layers, not by a weight
        return model.net[2](h).sum()

    report = explain_quietly(fn, model)
    assert report is not None and report.cause == "overflow" and report.module == "net.2"
    assert "the activations carry the magnitude" in report.input_ranges
    assert report.remedy.startswith("normalise between layers")


def test_a_submodule_called_directly_is_named_by_its_qualified_name():
    model = _model()
    with torch.no_grad():
        model.net[2].weight.mul_(1e37)
    report = explain_quietly(lambda: model.net(1e3 * torch.ones(4, 8)).sum(), model)
    assert report is not None and report.module == "net.2" and "inside `net.2`" in report.headline()


def test_an_overflow_in_the_backward_with_weights_in_range_names_the_gradients():
    model = _model()
    with torch.no_grad():
        model.net[2].weight.mul_(1e-4)
        model.net[2].bias.zero_()
    x = 5 * torch.ones(4, 8)
    report = explain_quietly(lambda: (model(x) * 1e38).sum(), model)  # finite forward, huge gradients
    assert report is not None and report.stage == "backward" and report.cause == "overflow"
    assert "the gradients carry the magnitude" in report.input_ranges
    assert report.remedy.startswith("clip gradients") and "normalise the inputs" not in report.remedy

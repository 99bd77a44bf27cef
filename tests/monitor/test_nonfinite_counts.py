"""A count of non-finite elements counts what its sentence names: the gradient the location names,
the output of the operator the explanation names; never the parameters and gradients of the whole
model under another tensor's name. The truth is counted here from the real tensors."""

import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nummon import Monitor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _policy(tmp_path):
    return {"sinks": {"console": False}, "recorder": {"directory": str(tmp_path)}}


def _sci_matches(shown, n):
    return float(shown) == float(f"{n:.1e}") if "e" in shown else int(shown) == n


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 60))
def test_the_count_in_a_gradient_s_sentence_is_that_gradient_s(tmp_path_factory, poisoned):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    mask = torch.ones(16, 64)
    mask[0, :poisoned] = float("inf")  # the gradient reaching fc1's output: some of its columns infinite
    with Monitor(model, opt, policy=_policy(tmp_path_factory.mktemp("run"))) as mon:
        out = model.fc2(torch.relu(h := model.fc1(x)))
        h.register_hook(lambda g: g * mask)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        report = mon.post_step(loss)  # before the update: the gradients are the step's
    (alert,) = [a for a in report.alerts if a.kind.value == "nonfinite"]
    m = re.search(r"gradient of `([\w.]+)` \(backward\), ([\d.e+]+) non-finite elements? in it", alert.message)
    assert m, alert.message
    truth = int((~torch.isfinite(dict(model.named_parameters())[m.group(1)].grad)).sum())
    assert truth > 0 and _sci_matches(m.group(2), truth), (alert.message, truth)


def test_the_explanation_counts_the_output_it_names_and_the_alert_claims_no_other(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.weight[:5].mul_(1e37)  # 5 of fc1's 64 output columns overflow
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = 1e3 * torch.randn(16, 8), torch.randn(16, 4)
    seen = []
    model.fc1.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with Monitor(model, opt, policy=_policy(tmp_path)) as mon:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        report = mon.post_step(loss, recompute=lambda: nn.functional.mse_loss(model(x), y))
    truth, numel = int((~torch.isfinite(seen[0])).sum()), seen[0].numel()
    assert 0 < truth < numel
    assert mon.cause is not None and mon.cause.module == "fc1"
    assert f"{truth} of the {numel} elements of its output are non-finite" in mon.cause.input_ranges
    for alert in report.alerts:
        for shown in re.findall(r"([\d.e+]+) non-finite elements? in output of `?fc1", alert.message):
            assert _sci_matches(shown, truth), alert.message

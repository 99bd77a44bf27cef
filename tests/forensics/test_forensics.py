"""explain_nonfinite: one planted example per cause, each asserting the exact operator, cause,
stage and that the location is this file's own line; plus state preservation, module paths and
no false alarm on healthy steps (including a harmless -inf attention mask)."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nummon import NummonError
from nummon._forensics import CAUSES, NonfiniteReport, explain_nonfinite


def _next_line() -> str:
    """'this_file:N+1' where N is the caller's line: mark the line just below the call."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None  # CPython keeps frames
    return f"{__file__}:{frame.f_back.f_lineno + 1}"


def _assert_report(report: NonfiniteReport | None, op: str, cause: str, stage: str, location: str) -> NonfiniteReport:
    assert report is not None
    assert (report.op, report.cause, report.stage, report.location) == (op, cause, stage, location), str(report)
    assert report.cause in CAUSES and report.remedy and report.input_ranges
    return report


# -- one example per cause -----------------------------------------------------------------------
def test_log_of_softmax_that_underflowed_is_log_of_zero():
    torch.manual_seed(0)
    z = torch.randn(4, 8)
    where = _next_line()
    report = explain_nonfinite(lambda: torch.log(torch.softmax(1000 * z, -1)).mean())
    _assert_report(report, "aten::log", "log_of_zero", "forward", where)
    assert report.module is None and report.forward_op is None
    assert "exactly 0" in report.input_ranges and "log_softmax" in report.remedy
    assert report.source == "report = explain_nonfinite(lambda: torch.log(torch.softmax(1000 * z, -1)).mean())"


def test_normalising_an_all_zero_vector_is_division_by_zero():
    x = torch.zeros(5)
    where = _next_line()
    report = explain_nonfinite(lambda: (x / x.sum()).sum())
    _assert_report(report, "aten::div", "division_by_zero", "forward", where)
    assert "1 zero(s) in the denominator" in report.input_ranges and "epsilon" in report.remedy


def test_exp_of_100_in_float32_is_overflow_with_the_threshold():
    x = torch.full((3,), 100.0)
    where = _next_line()
    report = explain_nonfinite(lambda: torch.exp(x).sum())
    _assert_report(report, "aten::exp", "overflow", "forward", where)
    assert report.input_ranges == (
        "max input 100 to exp; float32 overflows above 88.7; 3 of the 3 elements of its output are non-finite"
    )
    assert "clamp" in report.remedy


def test_bf16_matmul_overflow():
    a = torch.full((4, 4), 1e20, dtype=torch.bfloat16)
    where = _next_line()
    report = explain_nonfinite(lambda: (a @ a).float().sum())
    _assert_report(report, "aten::mm", "overflow", "forward", where)
    assert "bfloat16 max is 3.39e+38" in report.input_ranges and "float32" in report.remedy


def test_backward_of_sqrt_at_zero_is_an_invalid_operation_of_sqrt():
    w = nn.Parameter(torch.ones(3))
    where = _next_line()
    report = explain_nonfinite(lambda: torch.sqrt(w * 0).sum())
    _assert_report(report, "aten::div", "invalid_operation", "backward", where)
    assert report.forward_op == "aten::sqrt"
    assert "1/(2*sqrt(x)) is infinite at x = 0" in report.input_ranges
    assert w.grad is None  # the backward went through autograd.grad, not into .grad


def test_inf_minus_inf_of_deliberate_infinities_is_an_invalid_operation():
    # The infinities are put there on purpose (a constant in masked_fill): not a failure until
    # arithmetic meets them. The NaN is made by the subtraction, so that is where the blame goes.
    x = torch.randn(6)
    mask = torch.tensor([True, False, True, False, False, False])

    def loss():
        padded = x.masked_fill(mask, float("inf"))
        where.append(_next_line())
        return (padded - padded).sum()

    where: list[str] = []
    report = explain_nonfinite(loss)
    _assert_report(report, "aten::sub", "invalid_operation", "forward", where[0])
    assert report.input_ranges == "inf - inf in sub (4 infinite input value(s))"


def test_softmax_over_a_fully_masked_row_is_an_invalid_operation():
    scores = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1] = True  # every key of query 1 masked
    where = _next_line()
    report = explain_nonfinite(lambda: scores.masked_fill(mask, float("-inf")).softmax(-1).sum())
    _assert_report(report, "aten::_softmax", "invalid_operation", "forward", where)
    assert "entirely -inf" in report.input_ranges and "finfo" in report.remedy


def test_inf_minus_inf_on_an_inf_from_the_batch_blames_the_batch():
    # The inf was in the data before any operation: the subtraction only reveals it.
    x = torch.tensor([1.0, float("inf"), 2.0])
    where = _next_line()
    report = explain_nonfinite(lambda: (x - x).sum())
    _assert_report(report, "aten::sub", "nonfinite_input", "forward", where)


def test_exp_overflow_followed_by_inf_minus_inf_reports_the_overflow():
    a = torch.full((2,), 100.0)
    where = _next_line()
    report = explain_nonfinite(lambda: (torch.exp(a) - torch.exp(a)).sum())
    _assert_report(report, "aten::exp", "overflow", "forward", where)


def test_nan_in_the_batch_fed_to_a_linear_model_is_nonfinite_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    x[2, 1] = float("nan")
    where = _next_line()
    report = explain_nonfinite(lambda: F.mse_loss(model(x), y))
    _assert_report(report, "aten::addmm", "nonfinite_input", "forward", where)
    assert report.module == "0"
    assert report.input_ranges == "input to Sequential (shape (8, 3)) holds 1 NaN and 0 inf among 24 values"
    assert "batch" in report.remedy


def test_a_nan_weight_is_named_as_the_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight[0, 3] = float("nan")
    report = explain_nonfinite(lambda: model(torch.randn(5, 3)).sum())
    assert (report.op, report.cause, report.module) == ("aten::addmm", "nonfinite_input", "2")
    assert report.input_ranges.startswith("parameter 2.weight (shape (1, 4)) holds 1 NaN")


def test_nan_of_an_unused_where_branch_is_traced_from_the_backward_to_the_forward_sqrt():
    # The classic trap: torch.where hides the NaN of sqrt(negative) in the forward, but its
    # gradient is 0 * NaN. The root is the forward sqrt, not the backward mul.
    w = nn.Parameter(torch.tensor([-1.0, 4.0]))
    where = _next_line()
    report = explain_nonfinite(lambda: torch.where(w > 0, torch.sqrt(w), torch.zeros_like(w)).sum())
    _assert_report(report, "aten::sqrt", "invalid_operation", "forward", where)
    assert "negative" in report.input_ranges


def test_a_deliberate_infinity_that_reaches_the_loss_is_reported_as_a_constant_input():
    x = torch.randn(4)
    mask = torch.tensor([False, True, False, False])
    where = _next_line()
    report = explain_nonfinite(lambda: x.masked_fill(mask, float("-inf")).sum())
    _assert_report(report, "aten::masked_fill", "nonfinite_input", "forward", where)
    assert report.input_ranges == "a non-finite constant (-inf) enters the computation in aten::masked_fill"


def test_infinite_literals_that_stay_harmless_are_not_reported():
    x = nn.Parameter(torch.randn(4))
    assert explain_nonfinite(lambda: (x + torch.tensor(float("-inf"))).exp().sum() + x.sum()) is None


def test_a_dict_result_is_judged_by_its_loss_not_by_masked_logits():
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])

    def step():
        logits = model(x).masked_fill(torch.tensor([False, False, False, True]), float("-inf"))
        return {"loss": F.cross_entropy(logits, y), "logits": logits}

    assert explain_nonfinite(step) is None
    x[0, 0] = float("nan")
    report = explain_nonfinite(step)
    assert (report.op, report.cause, report.module) == ("aten::addmm", "nonfinite_input", "Linear")


# -- module paths ----------------------------------------------------------------------------------
class Exploding(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.where = _next_line()
        return torch.exp(x + 100)


class Net(nn.Module):
    def __init__(self, last: nn.Module) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), last)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.where = _next_line()
        hidden = self.encoder(x)
        return self.head(hidden)


def test_an_op_in_a_submodule_reports_its_module_path_and_the_line_in_its_forward():
    torch.manual_seed(0)
    model = Net(Exploding())
    x = torch.full((2, 4), 3.0)
    report = explain_nonfinite(lambda: model(x).sum())
    _assert_report(report, "aten::exp", "overflow", "forward", model.encoder[2].where)
    assert report.module == "encoder.2"


def test_a_torch_layer_reports_its_path_and_the_users_call_line():
    torch.manual_seed(0)
    model = Net(nn.Linear(4, 4))
    fc2 = model.encoder[2]
    with torch.no_grad():
        model.encoder[0].weight.fill_(1.0)  # tanh(4) ~ 1 into fc2: 4 * 1e38 > float32 max
        fc2.weight.fill_(1e38)
    report = explain_nonfinite(lambda: model(torch.ones(2, 4)).sum())
    _assert_report(report, "aten::addmm", "overflow", "forward", model.where)
    assert report.module == "encoder.2"
    assert "inside encoder.2" in str(report)


def test_backward_failures_report_the_forward_ops_module():
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt((x * x).sum(-1))

    model = nn.Sequential(nn.Linear(3, 3, bias=False), Norm())
    with torch.no_grad():
        model[0].weight.zero_()
    report = explain_nonfinite(lambda: model(torch.randn(2, 3)).sum())
    assert (report.stage, report.forward_op, report.module, report.cause) == (
        "backward",
        "aten::sqrt",
        "1",
        "invalid_operation",
    )


# -- state, healthy steps, bad input ---------------------------------------------------------------
def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"value/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"grad/{k}": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return out


def test_parameters_grads_buffers_and_rng_are_bit_identical_after_the_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    F.cross_entropy(model(x), y).backward()  # real .grad fields and updated running stats
    before = _state(model)
    versions = {k: p._version for k, p in model.named_parameters()}
    random.seed(7)
    rng_before, py_before = torch.get_rng_state(), random.getstate()

    report = explain_nonfinite(lambda: torch.log(torch.softmax(model(x) * 1e4, -1)).mean())

    assert report is not None and report.cause == "log_of_zero"
    after = _state(model)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    assert versions == {k: p._version for k, p in model.named_parameters()}
    assert torch.equal(torch.get_rng_state(), rng_before) and random.getstate() == py_before
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks


def test_state_is_restored_when_fn_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train()
    running = model[1].running_mean.clone()
    rng = torch.get_rng_state()

    def broken():
        model(torch.randn(4, 2))
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        explain_nonfinite(broken)
    assert torch.equal(model[1].running_mean, running) and torch.equal(torch.get_rng_state(), rng)
    assert not torch.nn.modules.module._global_forward_hooks


def test_healthy_forward_and_backward_return_none():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    assert explain_nonfinite(lambda: F.cross_entropy(model(x), y)) is None
    assert explain_nonfinite(lambda: F.cross_entropy(model(x), y).detach()) is None
    assert all(p.grad is None for p in model.parameters())


def test_a_partial_minus_inf_attention_mask_is_not_a_false_alarm():
    torch.manual_seed(0)
    q = nn.Parameter(torch.randn(4, 8))
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)

    def attention_loss():
        scores = (q @ q.T).masked_fill(causal, float("-inf"))
        return (scores.softmax(-1) @ q).pow(2).mean()

    assert explain_nonfinite(attention_loss) is None


def test_report_serialises_and_reads_as_one_paragraph():
    x = torch.zeros(2)
    report = explain_nonfinite(lambda: (x / x.sum()).sum())
    as_dict = report.to_dict()
    assert as_dict["op"] == "aten::div" and as_dict["cause"] == "division_by_zero"
    assert set(as_dict) == {
        "op",
        "stage",
        "cause",
        "location",
        "module",
        "input_ranges",
        "remedy",
        "forward_op",
        "source",
    }
    text = str(report)
    assert "\n" not in text and text.startswith("division_by_zero in aten::div during the forward at ")
    assert "Remedy: add an epsilon" in text
    with pytest.raises(dataclasses_frozen_error()):
        report.op = "x"


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_fn_that_is_not_callable_is_a_one_line_error():
    with pytest.raises(NummonError, match="fn must be callable"):
        explain_nonfinite(torch.ones(2))

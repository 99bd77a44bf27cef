"""One process: a failing step is re-run on the weights and batch of its forward; a
fault that does not repeat is `not_reproducible` (naming rank, host and device), a poisoned batch
and a genuine high-LR blow-up are `reproducible` (naming the batch). The evidence is taken before
the update, so plain SGD's NaN weights after `optimizer.step()` do not decide it."""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from nummon import Monitor
from nummon._forensics.verdict import LOSS_RTOL, _same


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class OnceFault:
    """A forward hook that poisons fc1's output on the first forward of a chosen step only (a
    transient fault: the step's re-run does not meet it)."""

    def __init__(self, model, at_step):
        self.at_step, self.step, self.fired = at_step, -1, False
        model.fc1.register_forward_hook(self.hook)

    def new_step(self, step):
        self.step, self.fired = step, False

    def hook(self, module, args, out):
        if self.step == self.at_step and not self.fired:
            self.fired = True
            return out * float("inf")
        return None


def _policy(tmp_path, **extra):
    return {"sinks": {"console": False}, "recorder": {"directory": str(tmp_path)}, **extra}


def _train(tmp_path, steps=12, fault_at=None, lr=0.05, poison_at=None, policy=None, seed=0, before_update=False):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    fault = OnceFault(model, fault_at) if fault_at is not None else None
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(steps)]
    mon = Monitor(model, opt, policy=policy or _policy(tmp_path))
    reports = []
    for step, (x, y) in enumerate(data):
        if step == poison_at:
            x = x.clone()
            x[3, 2] = float("inf")
        if fault is not None:
            fault.new_step(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not before_update:
            opt.step()
        r = mon.post_step(loss, batch=(x, y), recompute=lambda x=x, y=y: nn.functional.mse_loss(model(x), y))
        if before_update:  # the callbacks' order: the weights are still the forward's
            opt.step()
        reports.append(r)
        if r.should_stop:
            break
    mon.close()
    return mon, reports, model, opt


def _critical(reports):
    return [a for r in reports for a in r.alerts if a.severity.value == "critical" and not a.cleared]


def test_a_fault_that_fires_once_in_the_step_is_not_reproducible_and_names_the_process(tmp_path):
    mon, reports, model, _ = _train(tmp_path, fault_at=5)
    crit = _critical(reports)
    assert crit and crit[0].step == 5
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # plain SGD: the update wrote NaN
    d = crit[0].details
    assert d["verdict"] == "not_reproducible" and "verdict: not reproducible" in crit[0].message
    ev = d["verdict_evidence"]
    assert ev["rerun_finite"] and math.isfinite(ev["rerun_loss"]) and math.isnan(ev["step_loss"])
    assert d["suspect"]["rank"] == 0 and d["suspect"]["device"] == "cpu" and d["suspect"]["host"]
    assert f"host {d['suspect']['host']}" in crit[0].message and "drain" in crit[0].hint
    # the loss the message claims is the re-run's
    shown = float(re.search(r"gives loss ([-\d.e+]+)", crit[0].message).group(1))
    assert shown == pytest.approx(ev["rerun_loss"], rel=1e-5)
    # the flight record and the incident carry it too
    assert '"verdict": "not_reproducible"' in open(crit[0].flight_record).read()
    assert [v.verdict for v in mon._steps.verdicts] == ["not_reproducible"]


def test_an_inf_in_the_batch_is_reproducible_and_names_the_batch(tmp_path):
    mon, reports, _, _ = _train(tmp_path, poison_at=4)
    crit = _critical(reports)
    assert crit and crit[0].step == 4
    d = crit[0].details
    assert d["verdict"] == "reproducible" and "verdict: reproducible" in crit[0].message
    assert d["verdict_evidence"]["batch_fingerprint"] == reports[4].record.fingerprint
    assert reports[4].record.fingerprint in crit[0].message and "suspect" not in d


def test_a_genuine_high_lr_blowup_is_reproducible(tmp_path):
    pol = _policy(tmp_path, alerts={"stop_on_critical": False})
    mon, reports, _, _ = _train(tmp_path, steps=60, lr=3.0, policy=pol)
    verdicts = [a.details.get("verdict") for a in _critical(reports) if "verdict" in a.details]
    assert verdicts and set(verdicts) == {"reproducible"}, [a.message for a in _critical(reports)]
    assert not any(v.verdict == "not_reproducible" for v in mon._steps.verdicts)


def test_in_the_callbacks_order_a_finite_critical_step_is_re_run_bitwise(tmp_path):
    mon, reports, _, _ = _train(tmp_path, steps=60, lr=3.0, before_update=True)
    crit = _critical(reports)
    assert crit and all(a.details["verdict"] == "reproducible" for a in crit)
    assert mon._steps.verdicts[0].bitwise and math.isfinite(mon._steps.verdicts[0].rerun_loss)


def test_recovery_retries_a_transient_step_and_the_run_matches_a_run_without_the_fault(tmp_path):
    pol = _policy(tmp_path, recovery={"enabled": True})
    mon, reports, model, opt = _train(tmp_path, fault_at=5, policy=pol)
    _, _, clean, clean_opt = _train(tmp_path, policy=_policy(tmp_path))
    assert [e["action"] for e in mon.recoveries] == ["skip", "retry"]
    assert mon.recoveries[1]["suspect"].startswith("rank 0, host ")
    assert opt.param_groups[0]["lr"] == clean_opt.param_groups[0]["lr"] == 0.05  # no LR cut
    for a, b in zip(model.parameters(), clean.parameters()):
        assert torch.equal(a, b)  # the retried update is the one the step should have made


def test_a_rollback_after_a_transient_fault_keeps_the_lr(tmp_path):
    pol = _policy(tmp_path, recovery={"enabled": True, "skip_nonfinite": False, "lr_factor": 0.5})
    mon, reports, model, opt = _train(tmp_path, fault_at=5, policy=pol)
    (rollback,) = [e for e in mon.recoveries if e["action"] == "rollback"]
    assert rollback["verdict"] == "not_reproducible" and rollback["lr_after"] == rollback["lr_before"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_without_a_recompute_nothing_is_re_run(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, policy=_policy(tmp_path)) as mon:
        x = torch.randn(4, 8)
        x[0, 0] = float("nan")
        loss = model(x).sum()
        loss.backward()
        opt.step()
        r = mon.post_step(loss)
    assert mon._steps.verdicts == [] and all("verdict" not in a.details for a in r.alerts)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(finite, finite)
def test_same_result_is_symmetric_and_bitwise_only_when_equal(a, b):
    same, bitwise = _same(a, b)
    assert (same, bitwise) == _same(b, a)
    assert bitwise == (a == b)
    assert same == (a == b or abs(a - b) <= LOSS_RTOL * max(abs(a), abs(b)))


@given(finite)
def test_nan_is_the_same_failure_as_nan_and_never_a_finite_value(a):
    assert _same(math.nan, math.nan) == (True, True)
    assert _same(a, math.nan) == (False, False) and _same(math.inf, a) == (False, False)

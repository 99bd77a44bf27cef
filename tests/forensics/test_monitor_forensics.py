"""The Monitor explains its first non-finite step (operator, cause, the user's line) when the loop
passes a way to recompute the loss, and changes nothing on healthy steps."""

import inspect

import pytest
import torch
from helpers.models import MLP
from torch import nn

from nummon import AlertKind, Monitor

LINE: dict[str, int] = {}


def planted_loss(logits, y, step):
    if step >= 30:  # log of a softmax that underflowed to exactly 0
        LINE["log"] = inspect.currentframe().f_lineno + 1
        return -torch.log(torch.softmax(logits * 1000.0, -1)).gather(1, y[:, None]).mean()
    return nn.functional.cross_entropy(logits, y)


def _run(policy, steps=40, explain=True):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    mon = Monitor(model, opt, policy=policy)
    reports = []
    for step in range(steps):
        opt.zero_grad()
        loss = planted_loss(model(x), y, step)
        loss.backward()
        opt.step()
        r = mon.post_step(loss, recompute=(lambda s=step: planted_loss(model(x), y, s)) if explain else None)
        reports.append(r)
        if r.should_stop:
            break
    mon.close()
    return mon, reports, model


@pytest.mark.slow
def test_log_of_zero_is_named_with_the_loss_functions_line(tmp_path):
    mon, reports, _ = _run({"recovery": {"enabled": True, "rollback": False}, "recorder": {"directory": str(tmp_path)}})
    crit = [a for r in reports for a in r.alerts if a.kind is AlertKind.NONFINITE and "cause" in a.details]
    assert mon.cause is not None and mon.cause.cause == "log_of_zero" and mon.cause.op == "aten::log"
    assert mon.cause.location.endswith(f"test_monitor_forensics.py:{LINE['log']}")
    assert crit and "log_of_zero" in crit[0].message and crit[0].details["cause"]["op"] == "aten::log"
    assert crit[0].hint == mon.cause.remedy


def test_healthy_training_is_bit_identical_with_forensics_on_and_off():
    _, _, on = _run({"forensics": {"enabled": True}}, steps=25)
    _, _, off = _run({"forensics": {"enabled": False}}, steps=25, explain=False)
    for a, b in zip(on.state_dict().values(), off.state_dict().values()):
        assert torch.equal(a, b)

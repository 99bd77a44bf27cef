"""The plain step's launch (`nummon/_stats/plain_step.py`) against the statistic families': the
same training run, monitored once with it and once without, gives the same records, alerts and
incidents, step for step. The runs cover what makes a step not plain: sampled statistics and
probes, clipping, a learning-rate schedule, a batch, a model that grows, gradients that go missing, a loss or gradients
in another dtype, a non-finite step and the close watch after it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nummon

STEPS = 260


class _Net(nn.Module):
    """A small MLP whose middle layer is too large to be one of the clip ratio's anchors; `grow()`
    adds a layer the forward uses from then on; `skip` leaves the middle layer out of some
    forwards (its gradients go missing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4)
        self.extra: nn.Linear | None = None
        self.skip = False

    def grow(self) -> nn.Linear:
        self.extra = nn.Linear(4, 4)
        return self.extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if not self.skip:
            h = torch.relu(self.b(h))
        out = self.c(h)
        return self.extra(out) if self.extra is not None else out


def _run(tmp_path, scenario: str, plain: bool) -> tuple[list, list, list, int]:
    torch.manual_seed(0)
    model = _Net()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if scenario == "sgd_dtypes"
        else torch.optim.Adam(model.parameters(), lr=3e-3)
    )
    policy: dict = {"sinks": {"console": False}, "alerts": {"stop_on_critical": False}}
    if scenario == "no_activations":  # the mechanism probes sample steps whose activations are not measured
        policy["sampling"] = {"activations": False, "params_every": 1000, "optimizer_every": 1000}
    mon = nummon.Monitor(model, opt, policy=policy, run_dir=tmp_path / ("plain" if plain else "families"))
    mon._stats.plain.enabled = plain
    schedule = torch.optim.lr_scheduler.StepLR(opt, 30, gamma=0.7) if scenario == "clipped" else None
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=g)  # a task the model learns: a healthy run
    records = []
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        y = (x @ teacher).argmax(1)
        if scenario == "nonfinite" and step == 180:
            x[0, 0] = math.inf  # a non-finite batch: the close watch, then every step measured for a while
        if scenario == "grow" and step == 120:
            opt.add_param_group({"params": list(model.grow().parameters())})
        model.skip = scenario == "grow" and 60 <= step < 80 and step % 3 == 0
        if scenario == "sgd_dtypes" and step == 130:
            model.bfloat16()  # gradients in another dtype (the loss stays float32)
        if scenario == "sgd_dtypes" and step >= 130:
            x = x.bfloat16()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        if scenario == "nonfinite" and step == 200:
            loss = loss * 1e30  # finite but extreme
        if scenario == "sgd_dtypes" and 40 <= step < 60:
            loss = loss.to(torch.float16)  # a loss in another dtype (its headroom is judged against it)
        loss.backward()
        clip_norm = None
        if scenario == "clipped":
            clip_norm = 0.5 if step % 4 else None
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if schedule is not None:
            schedule.step()  # the learning rate a record carries changes
        batch = (x, y) if scenario == "grow" and step % 7 == 0 else None
        report = mon.post_step(loss, batch, clip_norm=clip_norm)
        records.append(repr(report.record.to_dict()) if report.record is not None else None)
    alerts = [(a.step, a.kind, a.severity, a.message) for a in mon.alerts]
    incidents = [(e.step, e.state) for e in mon.incidents]
    launched = mon._stats.plain.launched
    mon.close()
    return records, alerts, incidents, launched


@pytest.mark.parametrize("scenario", ["default", "clipped", "grow", "sgd_dtypes", "nonfinite", "no_activations"])
def test_a_plain_steps_launch_gives_the_record_the_families_give(tmp_path, scenario):
    records, alerts, incidents, launched = _run(tmp_path, scenario, plain=True)
    records_f, alerts_f, incidents_f, launched_f = _run(tmp_path, scenario, plain=False)
    assert launched_f == 0
    assert launched > STEPS // 4  # the plain launch ran on many of the steps compared
    for step, (a, b) in enumerate(zip(records, records_f)):
        assert a == b, f"step {step}"
    assert alerts == alerts_f and incidents == incidents_f
    if scenario == "nonfinite":
        assert any(a[2].value == "critical" for a in alerts)  # the failure path was compared too


def test_a_step_with_something_due_is_launched_by_the_families(tmp_path):
    """Sampled statistics, a batch or a hooked probe are not plain: the plain launch declines them."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    policy = {"sinks": {"console": False}, "sampling": {"params_every": 5, "optimizer_every": 7}}
    mon = nummon.Monitor(model, opt, policy=policy, run_dir=tmp_path)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    taken = []
    for step in range(40):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        before = mon._stats.plain.launched
        report = mon.post_step(loss, (x, y) if step == 33 else None)
        if mon._stats.plain.launched > before:
            taken.append(step)
            assert mon._stats.preclip.last is None  # the backward's capture is handed over once
            rec = report.record
            assert rec.param_norm is None and rec.optim_state_norm is None and rec.activation_max is None
    mon.close()
    assert taken and not [s for s in taken if s % 5 == 0 or s % 7 == 0] and 33 not in taken


def _plain_run(tmp_path) -> tuple[_Net, torch.optim.SGD, nummon.Monitor, torch.Tensor, torch.Tensor]:
    """A model, SGD, and a Monitor under which every ordinary step is plain (no probe, no
    sampled statistic), with one batch to train on."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    policy = {
        "sinks": {"console": False},
        "mechanisms": {"enabled": False},
        "sampling": {"activations": False, "params_every": 1000, "optimizer_every": 1000},
    }
    mon = nummon.Monitor(model, opt, policy=policy, run_dir=tmp_path)
    return model, opt, mon, torch.randn(32, 16), torch.randint(0, 4, (32,))


def test_a_loss_or_gradients_in_another_dtype_are_judged_against_it_at_once(tmp_path):
    """The step after plain ones, whose loss (then gradients) come in another dtype, is not
    launched as they were: its headroom is judged against the new dtype."""
    model, opt, mon, x, y = _plain_run(tmp_path)
    dtypes = {}
    for step in range(50):
        if step == 40:
            model.bfloat16()
        opt.zero_grad(set_to_none=True)
        ce = nn.functional.cross_entropy(model(x.to(model.a.weight.dtype)).float(), y)
        loss = ce + ce.detach() * (1e-3 - 1)  # small next to its gradients: theirs is the headroom closest to a limit
        if step == 30:
            loss = loss.to(torch.float16)
        loss.backward()
        opt.step()
        before = mon._stats.plain.launched
        rec = mon.post_step(loss).record
        dtypes[step] = (rec.headroom_dtype, mon._stats.plain.launched > before)
    mon.close()
    assert dtypes[29] == ("float32", True)  # plain steps before
    assert dtypes[30] == ("float16", False)  # the loss's, closest to its dtype's limit in float16
    assert dtypes[39] == ("float32", True)
    assert dtypes[40] == ("bfloat16", False)  # the gradients', now in bfloat16
    assert dtypes[49][0] == "bfloat16"


def test_the_plain_launch_accounts_for_every_statistic_family():
    """A plain step skips the families' pass, so what each family does on such a step is written
    out in plain_step.py: the loss and the gradients packed, the optimizer's LR read, the others
    idle (nothing due, no probe measured, no batch). A new family fails this test until it is
    accounted for there."""
    from nummon._stats.families import FAMILIES

    assert [f.name for f in FAMILIES] == [
        "loss",
        "gradients",
        "parameters",
        "optimizer",
        "activations",
        "mechanisms",
        "inputs",
    ]


def test_a_float_loss_a_tensor_lr_or_narrow_gradients_are_launched_by_the_families(tmp_path):
    """After plain steps: a loss passed as a float, a learning rate set as a tensor, and gradients
    in float16 (whose max |g| is measured at every backward) each change what the step packs."""
    model, opt, mon, x, y = _plain_run(tmp_path)
    seen = {}
    for step in range(40):
        if step == 30:
            opt.param_groups[0]["lr"] = torch.tensor(0.02)
        if step == 35:
            model.half()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.to(model.a.weight.dtype)).float(), y)
        loss.backward()
        opt.step()
        before = mon._stats.plain.launched
        rec = mon.post_step(loss.item() if step == 25 else loss).record
        seen[step] = (mon._stats.plain.launched > before, rec.lr, rec.grad_max)
    mon.close()
    assert seen[24] == (True, 0.01, None)
    assert seen[25][0] is False  # a float loss
    assert seen[30][:2] == (False, pytest.approx(0.02))  # the LR rides in the packed vector
    assert seen[38][0] is False and seen[38][2] is not None  # float16 gradients: max |g| every step

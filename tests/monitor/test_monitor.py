"""Monitor on real models and optimizers."""

import json

import pytest
import torch
from helpers.models import CNN, MLP, data, train_step
from torch import nn

import nummon
from nummon import AlertKind, Health, MemorySink, Monitor, NummonError, Severity


def overflow_fc2(model):
    with torch.no_grad():
        model.fc2.weight.fill_(3e38)


@pytest.mark.slow
def test_fc2_overflow_is_localised_to_fc2_forward_and_healthy_steps_are_quiet(tmp_path):
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data()
    mem = MemorySink()
    mon = Monitor(model, opt, sinks=[mem], run_dir=tmp_path)
    reports = []
    for i in range(12):
        if i == 10:
            overflow_fc2(model)
        reports.append(mon.post_step(train_step(model, opt, x, y)))
    mon.close()
    for r in reports[:10]:
        assert r.health is Health.HEALTHY and not r.warned, r.alerts
        assert not r.should_stop
    crit = [a for a in reports[10].alerts if a.kind is AlertKind.NONFINITE]
    assert crit and crit[0].severity is Severity.CRITICAL
    assert crit[0].location == "output of `fc2` (forward)"
    assert "fc2" in crit[0].message and "forward" in crit[0].message
    assert reports[10].should_stop and reports[10].health is Health.NONFINITE
    # the flight recorder holds the finite trajectory leading to the failure
    fr = json.loads(open(crit[0].flight_record).read())
    assert [r["step"] for r in fr["records"]] == list(range(11))
    assert all(r["health"] == "healthy" for r in fr["records"][:10])
    assert mem.closed and len(mem.records) == 12


def test_statistics_match_a_direct_computation():
    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    mon = Monitor(model, opt)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    rec = mon.post_step(loss).record
    gnorm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert rec.grad_norm == pytest.approx(gnorm, rel=1e-5)
    assert rec.grad_max == pytest.approx(max(g.abs().max().item() for g in grads), rel=1e-6)
    pnorm = torch.sqrt(sum((p.detach().double() ** 2).sum() for p in model.parameters())).item()
    assert rec.param_norm == pytest.approx(pnorm, rel=1e-5)
    ea = [opt.state[p]["exp_avg"] for p in model.parameters()]
    assert rec.optim_state_norm == pytest.approx(torch.sqrt(sum((e.double() ** 2).sum() for e in ea)).item(), rel=1e-5)
    assert set(rec.layer_activation_max) == {"fc1", "fc2"}
    assert rec.loss == pytest.approx(loss.item())
    assert rec.headroom > 30 and rec.headroom_dtype == "float32"
    mon.close()


def test_loss_only_monitor_catches_a_runaway():
    mon = Monitor()
    losses = [2.0] * 20 + [2.0 * 8**k for k in range(1, 8)]
    kinds = set()
    for l in losses:
        kinds |= {a.kind for a in mon.post_step(l).alerts}
    assert AlertKind.RUNAWAY in kinds and mon.should_stop
    mon.close()


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("abc", "loss must be a float or a 0-d tensor, got str"),
        (torch.ones(3), "scalar"),
        (None, "got NoneType"),
        (True, "got bool"),
        (__import__("numpy").array([1.0, 2.0]), "single number"),
        (torch.tensor(1.0, device="meta"), "meta device"),
    ],
)
def test_bad_loss_is_rejected_and_the_monitor_keeps_working(bad, needle):
    mon = Monitor()
    mon.post_step(1.0)
    with pytest.raises(NummonError, match=needle) as e:
        mon.post_step(bad)
    assert "\n" not in str(e.value)
    assert mon.step == 1  # no state changed
    r = mon.post_step(torch.tensor(1.0))
    assert r.step == 1 and r.health is Health.HEALTHY
    mon.close()


def test_bad_constructor_arguments():
    with pytest.raises(NummonError, match="model must be a torch.nn.Module"):
        Monitor(model="resnet")
    with pytest.raises(nummon.PolicyError, match="unknown key"):
        Monitor(policy={"spike": {"factor": 3}})


def test_input_nan_is_named_as_input_not_a_layer():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    mon.post_step(train_step(model, opt, x, y), batch=(x, y))
    x2 = x.clone()
    x2[3, 5] = float("nan")
    r = mon.post_step(train_step(model, opt, x2, y), batch=(x2, y))
    nf = [a for a in r.alerts if a.kind is AlertKind.NONFINITE]
    assert nf and nf[0].location == "input batch" and "input" in nf[0].message
    mon.close()


def test_context_manager_removes_hooks():
    model = MLP()
    with Monitor(model) as mon:
        mon.post_step(1.0)
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(NummonError, match="closed"):
        mon.post_step(1.0)


class Shared(nn.Module):
    """One Linear applied twice per forward (weight sharing), and a bfloat16 branch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lowp = nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x):
        a = self.lin(x)
        b = self.lin(a * 10)
        return b + self.lowp(x.to(torch.bfloat16)).float()


def test_activation_max_covers_every_call_and_dtype():
    torch.manual_seed(0)
    model = Shared()
    mon = Monitor(model, policy={"sampling": {"activations_every": 1}})
    x = torch.randn(3, 4)
    with torch.no_grad():
        a = model.lin(x)
        b = model.lin(a * 10)
        h = model.lowp(x.to(torch.bfloat16))
    out = model(x)
    rec = mon.post_step(out.sum()).record
    assert rec.layer_activation_max["lin"] == pytest.approx(max(a.abs().max().item(), b.abs().max().item()), rel=1e-6)
    assert rec.layer_activation_max["lowp"] == pytest.approx(h.abs().max().float().item(), rel=1e-6)
    # the next step starts from a clean buffer
    small = model(x * 0)
    rec2 = mon.post_step(small.sum()).record
    assert rec2.layer_activation_max["lin"] < rec.layer_activation_max["lin"]
    mon.close()


def test_grad_scaler_overflow_is_info_not_critical():
    """Dynamic loss scaling overflows on purpose while it calibrates: no stop, no warning."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    x, y = torch.randn(8, 4) * 100, torch.randn(8, 2)
    mon = Monitor(model, opt, grad_scaler=scaler)
    skipped = []
    for _ in range(140):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        r = mon.post_step(loss)
        skipped.append(bool(r.record.scaler_skipped))
        assert not r.should_stop and r.health is not Health.NONFINITE
    assert skipped[0] and not skipped[-1]  # it calibrated, then trained
    assert all(a.severity is Severity.INFO for a in mon.alerts if a.kind is AlertKind.NONFINITE)
    assert any(a.location == "GradScaler" for a in mon.alerts)
    mon.close()
    # without the scaler the same overflow is the critical alert it would be in fp32 training
    mon2 = Monitor(nn.Linear(4, 2), None)
    lin = mon2._stats.watched.named[0][1]
    lin.grad = torch.full_like(lin, float("inf"))
    assert mon2.post_step(1.0).should_stop
    mon2.close()


def test_vanishing_gradients_on_a_dead_layer_of_a_real_model():
    """After 3 steps fc1's ReLU units all die: fc1 gets no gradient while fc2's bias still learns."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    mon = Monitor(model, opt, policy={"vanishing": {"patience": 20}})
    found = []
    for i in range(28):
        if i == 3:
            with torch.no_grad():
                model.fc1.bias.fill_(-1e3)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        found += [a for a in mon.post_step(loss).alerts if a.kind is AlertKind.VANISHING]
    mon.close()
    assert len(found) == 1  # one alert for every vanished layer of the step, naming them
    assert set(found[0].details["layers"]) == {"fc1.weight", "fc1.bias", "fc2.weight"}
    assert all(a.step == 22 and a.severity is Severity.WARNING for a in found)


class Mixed(nn.Module):
    """Every layout and dtype the CPU statistics take a different path for."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)  # dense, not contiguous
        self.wide = nn.Linear(8, 8).double()
        self.lowp = nn.Linear(8, 4).to(torch.bfloat16)

    def forward(self, x):
        h = self.conv(x).mean(dim=(2, 3))
        h = self.wide(h.double()).float()
        return self.lowp(h.to(torch.bfloat16)).float()


def test_statistics_are_exact_for_every_dtype_and_layout():
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mon = Monitor(
        model, opt, policy={"sampling": {"params_every": 1, "optimizer_every": 1, "activations_every": 1}}
    )  # every statistic, every step
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        rec = mon.post_step(loss).record
    mon.close()
    named = dict(model.named_parameters())
    for name, p in named.items():
        ref = p.grad.double().norm().item()
        assert rec.layer_grad_norms[name] == pytest.approx(ref, rel=1e-5), name
    assert rec.grad_max == pytest.approx(max(p.grad.double().abs().max().item() for p in named.values()), rel=1e-6)
    assert rec.param_norm == pytest.approx(
        sum(p.double().square().sum().item() for p in named.values()) ** 0.5, rel=1e-5
    )
    moms = [opt.state[p]["momentum_buffer"].double() for p in named.values()]
    assert rec.optim_state_norm == pytest.approx(sum(m.square().sum().item() for m in moms) ** 0.5, rel=1e-5)
    assert set(rec.layer_activation_max) == {"conv", "wide", "lowp"}
    assert mon._stats.kernels.buffers  # the CPU path wrote into its preallocated buffers


def test_a_module_whose_output_dtype_changes_between_steps():
    """Autocast on one step, off the next: each step reads the buffer its modules wrote to."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    mon = Monitor(model, policy={"sampling": {"activations_every": 1}})
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_bf16 = model(x)
    r1 = mon.post_step(out_bf16.float().sum()).record
    out = model(x * 1000)
    r2 = mon.post_step(out.sum()).record
    with torch.no_grad():
        ref = model[0](x * 1000).abs().max().item()
    mon.close()
    assert r1.layer_activation_max["2"] == pytest.approx(out_bf16.float().abs().max().item(), rel=1e-6)
    assert r2.layer_activation_max["0"] == pytest.approx(ref, rel=1e-6)  # not the stale bf16 value
    assert r2.layer_activation_max["0"] > 100 * r1.layer_activation_max["0"]


def test_nonfinite_bfloat16_output_is_located():
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 2).to(torch.bfloat16))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    mon = Monitor(model, policy={"recorder": {"write": False}})
    out = model(-torch.ones(3, 4, dtype=torch.bfloat16) * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.bfloat16))
    rec = mon.post_step(out.float().sum()).record
    mon.close()
    assert "activations" in rec.nonfinite_parts
    assert rec.nonfinite_location == "output of `1` (forward)"


def test_optimizer_state_is_reread_after_load_state_dict():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    mon = Monitor(model, opt, policy={"sampling": {"optimizer_every": 1}})
    for _ in range(3):
        before = mon.post_step(step()).record.optim_state_norm
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["momentum_buffer"] = st["momentum_buffer"] * 100  # new tensors, same count
    opt.load_state_dict(sd)
    after = mon.post_step(step()).record.optim_state_norm
    mon.close()
    expected = sum(opt.state[p]["momentum_buffer"].double().square().sum().item() for p in model.parameters()) ** 0.5
    assert after == pytest.approx(expected, rel=1e-5) and after > 10 * before


def test_activation_hooks_skip_excluded_modules():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 100))
    mon = Monitor(model, policy={"sampling": {"activations_exclude": ["3", "9*"]}})
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))  # the first module's output goes NaN...
    rec = mon.post_step(model(torch.randn(2, 4)).sum()).record
    mon.close()
    assert set(rec.layer_activation_max) == {"0", "2"}  # ...and "3" (the head) is not watched
    assert rec.nonfinite_location == "output of `0` (forward)"
    with pytest.raises(NummonError, match="activations_exclude"):
        Monitor(model, policy={"sampling": {"activations_exclude": "3"}})


def test_histograms_match_a_reference():
    """Counts, range and moments of every histogram, against numpy over the same edges."""
    import numpy as np

    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc1.bias.fill_(0.5)  # all values equal: one bin
        model.fc2.weight[0, 0] = float("nan")  # zeroed, as in the sinks
    x = torch.randn(8, 16)
    model(x).sum().backward()
    mon = Monitor(model)
    hist = mon._stats.histograms(bins=16)
    mon.close()
    for name, p in model.named_parameters():
        h = hist[f"params/{name}"]
        v = torch.nan_to_num(p.detach(), nan=0.0).double().reshape(-1).numpy()
        assert (h["min"], h["max"]) == pytest.approx((v.min(), v.max()))
        assert h["counts"].sum() == v.size == h["num"] == h["log10_counts"].sum()
        assert h["sum"] == pytest.approx(v.sum(), rel=1e-6, abs=1e-9)
        assert h["sum_squares"] == pytest.approx((v * v).sum(), rel=1e-6)
        if v.max() > v.min():
            ref, _ = np.histogram(v, bins=h["edges"])
            assert np.abs(h["counts"] - ref).sum() <= 2  # float32 rounding at bin edges
        else:
            assert h["counts"][0] == v.size
        ref_log, _ = np.histogram(np.log10(np.maximum(np.abs(v), 1e-30)), bins=h["log10_edges"])
        assert np.abs(h["log10_counts"] - ref_log).sum() <= 2
    assert torch.isnan(model.fc2.weight[0, 0])  # the model itself untouched by the in-place passes


def test_post_step_without_gradients_says_so_once_and_records_them_as_missing(caplog):
    import logging

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt)
    x = torch.randn(8, 16)
    with caplog.at_level(logging.WARNING, logger="nummon"):
        reports = [mon.post_step(model(x).pow(2).mean()) for _ in range(3)]  # no backward yet
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        with_grads = mon.post_step(loss)
    said = [r for r in caplog.records if "no gradients" in r.getMessage()]
    assert len(said) == 1 and "fc1.weight" in said[0].getMessage() and "step 0" in said[0].getMessage()
    for r in reports:  # missing, not zero
        assert r.record.grad_norm is None and r.record.grad_max is None and r.record.layer_grad_norms == {}
    assert with_grads.record.grad_norm > 0 and set(with_grads.record.layer_grad_norms) == {
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    }
    mon.close()


@pytest.mark.parametrize("last", [lambda: nn.Linear(8, 1), lambda: nn.LazyLinear(1)])
def test_lazy_parameters_are_watched_once_the_first_forward_made_them(last):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), last())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = Monitor(model, opt)  # before the first forward: the lazy parameters have no shape yet
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        rec = mon.post_step(loss).record
        assert set(rec.layer_grad_norms) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        assert rec.grad_norm == pytest.approx(float(expected), rel=1e-5)
    model[0].weight.data[0, 0] = float("nan")  # a NaN in the once-lazy layer is seen and named
    loss = model(x).pow(2).mean()
    loss.backward()
    r = mon.post_step(loss)
    assert r.health is Health.NONFINITE
    mon.close()

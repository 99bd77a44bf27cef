"""Diagnostics on models and data made to fail the way each one detects, and on healthy ones;
none of them may change the user's model or optimizer."""

import copy

import pytest
import torch
from helpers.models import MLP
from torch import nn

import nummon
from nummon import Monitor, NummonError
from nummon.diagnose import (
    Status,
    check_data,
    check_gradients,
    check_loader,
    check_weights,
    lr_range_test,
    overfit_one_batch,
    run_all,
)

CE = nn.functional.cross_entropy


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a loaded machine they contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.fixture
def user():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch()
    opt.zero_grad()
    CE(model(x), y).backward()
    opt.step()  # the optimizer has state the diagnostics must not touch
    snap = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    yield model, opt
    after = (model.state_dict(), opt.state_dict())
    for k, v in snap[0].items():
        assert torch.equal(v, after[0][k]), f"model tensor {k} changed"
    for pid, st in snap[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after[1]["state"][pid][k])), (
                "optimizer state changed"
            )


@pytest.mark.slow
def test_overfit_one_batch_fails_when_the_model_cannot_learn(user):
    model, _ = user
    frozen = copy.deepcopy(model)
    for p in frozen.parameters():
        p.requires_grad_(False)
    frozen.fc2.bias.requires_grad_(True)  # only a bias can move: it cannot fit per-sample labels
    rep = overfit_one_batch(frozen, batch(), CE, steps=100, lr=1e-2)
    assert rep.status is Status.FAIL and "likely causes" in str(rep)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)
        self.dead = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + 0 * self.dead(x).sum()


def test_check_gradients_names_unused_and_zero_layers(user):
    rep = check_gradients(WithUnused(), batch(), CE)
    assert rep.status is Status.FAIL
    text = str(rep)
    assert "unused.weight: no gradient" in text and "unused.bias: no gradient" in text
    assert "dead.weight: gradient exactly zero" in text
    healthy = check_gradients(user[0], batch(), CE)
    assert healthy.status is Status.PASS


def test_check_data_labels_nan_outliers_imbalance():
    x, y = batch(64)
    assert check_data(x, y, num_classes=4).status is Status.PASS
    bad_y = y.clone()
    bad_y[:3] = 7
    rep = check_data(x, bad_y, num_classes=4)
    assert rep.status is Status.FAIL and rep.numbers["labels_out_of_range"] == 3
    xn = x.clone()
    xn[0, 0] = float("nan")
    xn[1, 1] = float("inf")
    rep = check_data(xn, y)
    assert rep.status is Status.FAIL and (rep.numbers["nan"], rep.numbers["inf"]) == (1, 1)
    xo = x.clone()
    xo[5, 5] = 1e6
    xo[6] = 0
    rep = check_data(xo, torch.cat([torch.zeros(60, dtype=torch.long), torch.ones(4, dtype=torch.long)]), num_classes=4)
    assert rep.status is Status.WARN
    assert rep.numbers["outliers"] >= 1 and rep.numbers["all_zero_samples"] == 1
    assert rep.numbers["imbalance_ratio"] == 15 and rep.numbers["label_counts"] == [60, 4, 0, 0]


def test_check_loader_combines_batches():
    loader = [batch(8, s) for s in range(5)]
    rep = check_loader(loader, max_batches=3, num_classes=4)
    assert rep.numbers["batches"] == 3 and rep.numbers["samples"] == 24


def test_check_weights_constant_and_nonfinite(user):
    assert check_weights(user[0]).status is Status.PASS
    m = MLP()
    with torch.no_grad():
        m.fc1.weight.fill_(0.5)
    rep = check_weights(m)
    assert rep.status is Status.WARN and "fc1.weight: all weights (near) identical" in str(rep)
    with torch.no_grad():
        m.fc2.weight[0, 0] = float("nan")
    assert check_weights(m).status is Status.FAIL


def test_lr_range_test_finds_descent_and_divergence_and_plots_the_sweep(user, tmp_path):
    model, _ = user
    loader = [batch(32, s) for s in range(4)]
    mem = nummon.MemorySink()
    try:
        import matplotlib  # noqa: F401

        out = tmp_path / "lr.png"
    except ImportError:  # the plot needs matplotlib; the sweep does not
        out = None
    rep = lr_range_test(model, loader, CE, start=1e-4, end=1e3, steps=120, sinks=[mem], plot=out and str(out))
    assert rep.diverged_lr is not None and rep.suggested_lr is not None
    assert 1e-4 < rep.suggested_lr < rep.diverged_lr
    assert len(mem.records) == len(rep.losses) and mem.records[0].lr == pytest.approx(1e-4)
    assert rep.lrs == sorted(rep.lrs)
    if out is not None:
        assert rep.plot == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_all_stops_at_the_first_fail(user):
    model, _ = user
    bad_loader = [(torch.randn(8, 16), torch.full((8,), 9))]
    diag = run_all(model, bad_loader, CE, num_classes=4)
    assert diag.stopped_at == "check loader" and len(diag.reports) == 1 and diag.status is Status.FAIL
    # a run_all that passes everything: test_diagnose_verdicts.py::test_every_check_passes_a_healthy_model


def test_diagnostics_do_not_fire_the_users_monitor_hooks(user):
    model, opt = user
    mon = Monitor(model, opt)
    check_gradients(model, batch(), CE)
    overfit_one_batch(model, batch(), CE, steps=5)
    assert mon._stats.probes._order == []  # the copies carried no hooks back to the monitor
    mon.close()


@pytest.mark.parametrize("steps", [0, -3])
def test_overfit_one_batch_needs_at_least_one_step(user, steps):
    with pytest.raises(NummonError, match=r"^overfit_one_batch needs steps >= 1, got -?\d+$"):
        overfit_one_batch(user[0], batch(), CE, steps=steps)


@pytest.mark.slow
def test_diagnose_cli_prints_reports():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "nummon", "diagnose"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "[PASS] overfit one batch" in p.stdout and "check gradients" in p.stdout

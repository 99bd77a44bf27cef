"""Recovery: the gradient guard skips poisoned updates, rollbacks restore exact state."""

import datetime
import json
import math
import os

import pytest
import torch
from helpers.models import MLP
from helpers.ranks import free_port, start_ranks
from torch import nn

from nummon import Monitor, NummonError, load_policy

torch.set_num_threads(1)


def _policy(params_every=1, **recovery):
    """The `recover` preset; the parameters measured every step (a NaN weight is seen on the step
    its update made it) unless `params_every` says otherwise."""
    base = load_policy("recover").model_dump()
    base["recovery"].update(recovery)
    base["sampling"]["params_every"] = params_every
    return load_policy(base)


def _data(seed=0, n=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _setup(seed=0, adam=False, **recovery):
    torch.manual_seed(seed)
    model = MLP()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if adam
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    return model, opt


def _step(model, opt, mon, x, y, plant=None):
    """One plain-loop step; `plant(model)` runs between backward and optimizer.step."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if plant is not None:
        plant(model)
    opt.step()
    return mon.post_step(loss, batch=(x, y))


def _state(model, opt):
    """Exact copies of the weights and the optimizer state tensors."""
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    s = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items() if torch.is_tensor(v)}
    return w, s


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_recover_preset_turns_recovery_on_and_default_leaves_it_off():
    assert load_policy("recover").recovery.enabled
    assert not load_policy("default").recovery.enabled


def test_recovery_needs_model_and_optimizer(tmp_path):
    with pytest.raises(NummonError, match="needs Monitor\\(model, optimizer\\)"):
        Monitor(MLP(), None, policy="recover", run_dir=tmp_path)


def test_planted_nan_gradient_skips_the_update_leaving_weights_and_state_untouched(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy="recover", run_dir=tmp_path)
    x, y = _data()
    for _ in range(5):
        _step(model, opt, mon, x, y)
    before_w, before_s = _state(model, opt)

    def nan_grad(m):
        m.fc1.weight.grad[0, 0] = float("nan")

    report = _step(model, opt, mon, x, y, plant=nan_grad)
    after_w, after_s = _state(model, opt)
    _assert_same(before_w, after_w)
    _assert_same(before_s, after_s)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())  # gradients zeroed
    assert not report.should_stop
    skip = [a for a in report.alerts if a.details.get("recovery") == "skip"]
    assert skip and skip[0].severity.value == "info" and "skipped the update of step 5" in skip[0].message
    assert skip[0].details.get("batch_fingerprint") == report.record.fingerprint
    assert mon.skipped_batches == [report.record.fingerprint]
    assert [r["action"] for r in mon.recoveries] == ["skip"]
    # the next step trains again
    _step(model, opt, mon, x, y)
    assert not torch.equal(after_w["fc1.weight"], model.fc1.weight)
    mon.close()


def test_gradient_far_above_its_recent_range_is_skipped(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy="recover", run_dir=tmp_path)
    x, y = _data()
    for _ in range(12):
        _step(model, opt, mon, x, y)
    before_w, _ = _state(model, opt)

    def blow_up(m):
        for p in m.parameters():
            p.grad.mul_(1e4)

    report = _step(model, opt, mon, x, y, plant=blow_up)
    _assert_same(before_w, _state(model, opt)[0])
    assert mon.recoveries[-1]["action"] == "skip" and "recent median" in mon.recoveries[-1]["reason"]
    assert not report.should_stop
    mon.close()


def test_repeated_skips_escalate_to_a_warning_then_a_rollback(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy=_policy(max_skips=1, skip_window=10), run_dir=tmp_path)
    x, y = _data()
    for _ in range(3):
        _step(model, opt, mon, x, y)
    severities = []
    for _ in range(3):
        r = _step(model, opt, mon, x, y, plant=lambda m: m.fc2.bias.grad.fill_(float("inf")))
        severities.append([a.severity.value for a in r.alerts if a.details.get("recovery")])
    assert severities[0] == ["info"] and "warning" in severities[1]
    assert mon.recoveries[-1]["action"] == "rollback" and "3 updates skipped" in mon.recoveries[-1]["cause"]
    assert not mon.should_stop
    mon.close()


def _nan_weight(model, opt, mon, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")  # the update itself went non-finite: skipping cannot help
    return mon.post_step(loss, batch=(x, y))


@pytest.mark.parametrize("adam", [False, True])
def test_rollback_restores_exact_weights_and_optimizer_state_and_lowers_lr(tmp_path, adam):
    model, opt = _setup(adam=adam)
    lr0 = opt.param_groups[0]["lr"]
    mon = Monitor(model, opt, policy=_policy(snapshot_every=5), run_dir=tmp_path)
    x, y = _data()
    saved = None
    for step in range(9):
        _step(model, opt, mon, x, y)
        if step == 5:
            saved = _state(model, opt)
    report = _nan_weight(model, opt, mon, x, y)
    assert not report.should_stop
    rb = [a for a in report.alerts if a.details.get("recovery") == "rollback"]
    assert rb and rb[0].severity.value == "warning"
    assert rb[0].message.startswith(f"recovered: rolled back to step 5, lr {lr0:.4g} -> {lr0 / 2:.4g}")
    w, s = _state(model, opt)
    _assert_same(saved[0], w)
    _assert_same(saved[1], s)
    assert opt.param_groups[0]["lr"] == lr0 / 2
    assert mon.recoveries[-1]["suspect_batches"] == 4  # steps 6..9 were seen since the snapshot
    assert rb[0].flight_record and json.loads(open(rb[0].flight_record).read())["records"][-1]["step"] == 9
    # carries on: the detectors were re-baselined, the next steps are healthy and train
    for _ in range(3):
        r = _step(model, opt, mon, x, y)
        assert (
            r.health.value in ("healthy", "incident") and not r.should_stop
        )  # the incident stays open until its quiet period
    assert not torch.equal(w["fc1.weight"], model.fc1.weight)
    mon.close()


def test_off_their_cadence_a_nan_weight_is_rolled_back_at_the_next_step(tmp_path):
    """With the parameters measured every 10 steps, an update that left a NaN weight shows at the
    next step's forward; that failing step measures the parameters too, so recovery rolls back
    (skipping the batch could not help) instead of skipping batch after batch."""
    model, opt = _setup()
    mon = Monitor(model, opt, policy=_policy(params_every=10, snapshot_every=5), run_dir=tmp_path)
    x, y = _data()
    for _ in range(7):
        _step(model, opt, mon, x, y)
    silent = _nan_weight(model, opt, mon, x, y)  # step 7: parameters not due
    assert silent.record.param_norm is None and not silent.alerts
    report = _step(model, opt, mon, x, y)
    assert "parameters" in report.record.nonfinite_parts and not report.should_stop
    assert [r["action"] for r in mon.recoveries][-1] == "rollback"
    assert torch.isfinite(model.fc1.weight).all()
    mon.close()


def test_a_second_rollback_to_the_same_snapshot_is_exact_too(tmp_path):
    # the optimizer must not alias the snapshot's tensors (Adam's step count is updated in place)
    model, opt = _setup(adam=True)
    mon = Monitor(model, opt, policy=_policy(snapshot_every=100), run_dir=tmp_path)
    x, y = _data()
    start = _state(model, opt)
    for _ in range(2):
        for _ in range(3):
            _step(model, opt, mon, x, y)
        _nan_weight(model, opt, mon, x, y)
        _assert_same(start[0], _state(model, opt)[0])
        assert not opt.state  # back before the first step: no optimizer state yet
    assert [r["to_step"] for r in mon.recoveries] == [-1, -1]
    assert "rolled back to the start" in mon.alerts[-1].message or any(
        "rolled back to the start" in a.message for a in mon.alerts
    )
    mon.close()


def test_spent_retry_budget_stops_the_run(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy=_policy(max_rollbacks=1, snapshot_every=3), run_dir=tmp_path)
    x, y = _data()
    for _ in range(4):
        _step(model, opt, mon, x, y)
    first = _nan_weight(model, opt, mon, x, y)
    assert not first.should_stop
    for _ in range(2):
        _step(model, opt, mon, x, y)
    second = _nan_weight(model, opt, mon, x, y)
    assert second.should_stop and mon.should_stop
    gave_up = [a for a in second.alerts if a.details.get("recovery") == "gave_up"]
    assert (
        gave_up and gave_up[0].severity.value == "critical" and "budget of 1 rollbacks is spent" in gave_up[0].message
    )
    assert [r["action"] for r in mon.recoveries] == ["rollback", "gave_up"]
    mon.close()


def test_healthy_run_with_recovery_is_bit_identical_to_one_without(tmp_path):
    runs = []
    for policy in ("default", _policy(snapshot_every=7)):
        model, opt = _setup(seed=3)
        mon = Monitor(model, opt, policy=policy, run_dir=tmp_path)
        for step in range(30):
            x, y = _data(seed=step)
            _step(model, opt, mon, x, y)
        runs.append((_state(model, opt), mon))
        mon.close()
    (plain, _), (guarded, mon) = runs
    assert mon._steps.recovery.guard.checked == 30 and mon._steps.recovery.snapshots_taken > 1  # it really ran
    assert mon.recoveries == []
    _assert_same(plain[0], guarded[0])
    _assert_same(plain[1], guarded[1])


def test_close_gives_optimizer_step_back_and_lr_scheduler_still_steps(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy="recover", run_dir=tmp_path)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # wraps opt.step after the guard
    x, y = _data()
    for _ in range(4):
        _step(model, opt, mon, x, y)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)
    assert mon._steps.recovery.guard.checked == 4
    mon.close()
    before = model.fc1.weight.detach().clone()
    _step(model, opt, _Quiet(), x, y, plant=lambda m: m.fc1.weight.grad.fill_(float("nan")))
    assert torch.isnan(model.fc1.weight).all() and not torch.isnan(before).any()  # no longer guarded


def test_close_restores_the_optimizers_own_step(tmp_path):
    model, opt = _setup()
    mon = Monitor(model, opt, policy="recover", run_dir=tmp_path)
    assert "step" in vars(opt)
    mon.close()
    assert "step" not in vars(opt)


class _Quiet:
    def post_step(self, loss, batch=None):
        return None


# ---------------------------------------------------------------- torch.distributed, 2 gloo ranks
def _ddp_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MLP()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    mon = Monitor(ddp, opt, policy=_policy(snapshot_every=4), run_dir=out_dir)
    x, y = _data(seed=10 + rank, n=8)
    at_snapshot, skipped_w, restored = None, None, False
    for step in range(10):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if step == 6:
            skipped_w = model.fc1.weight.detach().clone()
            if rank == 1:  # after DDP's all-reduce: only rank 1 sees it
                model.fc2.weight.grad[0, 0] = float("nan")
        opt.step()
        if step == 6:
            assert torch.equal(skipped_w, model.fc1.weight)
        if step == 8 and rank == 1:
            with torch.no_grad():
                model.fc1.weight[0, 0] = float("nan")
        mon.post_step(loss)
        if step == 4:
            at_snapshot = model.fc1.weight.detach().clone()
        if step == 8:
            restored = bool(torch.equal(at_snapshot, model.fc1.weight))
    payload = {
        "recoveries": [{k: v for k, v in r.items() if k != "flight_record"} for r in mon.recoveries],
        "restored_exact": restored,
        "weights": model.fc1.weight.detach().flatten()[:8].tolist(),
        "lr": opt.param_groups[0]["lr"],
        "should_stop": mon.should_stop,
    }
    mon.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(payload, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_gloo_ranks_skip_and_restore_the_same_step(tmp_path):
    start_ranks(_ddp_worker, 2, (2, free_port(), str(tmp_path)))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert [(e["action"], e["step"]) for e in r["recoveries"]] == [("skip", 6), ("rollback", 8)]
        assert r["recoveries"][1]["to_step"] == 4 and r["restored_exact"]
        assert not r["should_stop"] and r["lr"] == pytest.approx(0.025)
    assert res[0]["recoveries"] == res[1]["recoveries"]
    assert res[0]["weights"] == res[1]["weights"] and all(map(math.isfinite, res[0]["weights"]))

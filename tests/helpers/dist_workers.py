"""Worker functions for the distributed tests (importable by spawned processes)."""

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def setup(rank, world, port, timeout_s=60):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def data_for(rank, world, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(world * n, 16, generator=g), torch.randint(0, 4, (world * n,), generator=g)
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n], x, y


class CountCollectives:
    """Counts nummon's gathers by wrapping the torch.distributed function it calls."""

    def __init__(self):
        self.n = 0
        self.name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self.real = getattr(dist, self.name)

    def _counting(self, *a, **k):
        self.n += 1
        return self.real(*a, **k)

    def __enter__(self):
        setattr(dist, self.name, self._counting)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self.real)


def teardown():
    # everyone done before the group goes: gloo aborts a process whose peers vanish mid-collective
    dist.barrier()
    dist.destroy_process_group()


def _out(out_dir, rank, payload):
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(payload, fh)


def _exit():
    # skip C++ destructors at interpreter exit: gloo's can abort ("terminate called without an
    # active exception") once a peer is gone, which would fail the spawn after the test's work
    os._exit(0)


def ddp_nan_on_one_rank(rank, world, port, out_dir):
    """DDP; rank 1's fc2 output is made non-finite at step 5 only on rank 1."""
    import nummon
    from nummon import JsonlSink, MemorySink

    setup(rank, world, port)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    mem = MemorySink()
    mon = nummon.Monitor(  # activations every step: the NaN's module is named at its own step
        ddp,
        opt,
        policy={"sampling": {"activations_every": 1}},
        sinks=[mem, JsonlSink(os.path.join(out_dir, "events-rank{rank}.jsonl"))],
    )
    calls = CountCollectives().__enter__()
    x, y, _, _ = data_for(rank, world)
    stopped_at, per_step_collectives = None, []
    for step in range(12):
        if step == 5 and rank == 1:
            hook = model.fc2.register_forward_hook(lambda m, i, o: o * float("inf"), prepend=True)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if step == 5 and rank == 1:
            hook.remove()
        before = calls.n
        r = mon.post_step(loss)
        per_step_collectives.append(calls.n - before)
        if r.should_stop:
            stopped_at = r.step
            break
    mon.close()
    calls.__exit__()
    _out(
        out_dir,
        rank,
        {
            "alerts": [a.to_dict() | {"rank": a.rank} for a in mon.alerts],
            "stopped_at": stopped_at,
            "collectives": per_step_collectives,
            "sink_records": len(mem.records),
            "sink_alerts": len(mem.alerts),
        },
    )
    del ddp
    teardown()
    _exit()


def runaway_on_one_rank(rank, world, port, out_dir):
    """Plain data parallel via DDP; only the last rank's data blows up (finite runaway)."""
    import nummon

    setup(rank, world, port)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mon = nummon.Monitor(ddp, opt, policy={"alerts": {"stop_on_critical": False}})
    x, y, _, _ = data_for(rank, world)
    alerts = []
    for step in range(30):
        scale = 3.0 ** max(0, step - 19) if rank == world - 1 else 1.0
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x * scale), y)
        loss.backward()
        opt.step()
        r = mon.post_step(loss)
        alerts += [(a.step, a.kind.value, a.severity.value) for a in r.alerts]
    mon.close()
    _out(out_dir, rank, {"alerts": alerts})
    del ddp
    teardown()
    _exit()


def _sharded_vs_reference(sharded, initial_state, make_opt, rank, world, steps=3):
    """Train `sharded` on this rank's shard and an unsharded model from the same initial state
    on the full batch; return nummon's norms and the reference's, per step."""
    import nummon

    ref = Net()
    ref.load_state_dict(initial_state)
    opt, ref_opt = make_opt(sharded.parameters()), make_opt(ref.parameters())
    mon = nummon.Monitor(sharded, opt, policy={"sampling": {"params_every": 1}})  # parameter norms every step
    calls = CountCollectives()
    x, y, xa, ya = data_for(rank, world)
    out = {"got": [], "want": [], "pnorm": [], "ref_pnorm": []}
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(sharded(x), y)
        loss.backward()
        opt.step()
        with calls:
            rec = mon.post_step(loss).record
        out["got"].append(rec.grad_norm)
        out["pnorm"].append(rec.param_norm)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(xa), ya).backward()
        out["want"].append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item())
        ref_opt.step()
        out["ref_pnorm"].append(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in ref.parameters())).item())
    mon.close()
    out["collectives"] = calls.n
    return out


def _net_and_state():
    model = Net()
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def fsdp2_grad_norm(rank, world, port, out_dir):
    """FSDP2 fully_shard on CPU/gloo: nummon's global grad norm vs the full-batch reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    setup(rank, world, port)
    model, init = _net_and_state()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    res = _sharded_vs_reference(model, init, lambda ps: torch.optim.Adam(ps, lr=1e-3), rank, world)
    _out(out_dir, rank, res)
    teardown()
    _exit()


def dead_rank(rank, world, port, out_dir):
    """Rank 1 never reaches post_step: rank 0 must get an error after the group's timeout."""
    import nummon

    setup(rank, world, port, timeout_s=5)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nummon.Monitor(model, opt)
    err = None
    if rank == 0:
        x, y, _, _ = data_for(rank, world)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        try:
            mon.post_step(loss)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
    else:  # alive but absent from the collective until rank 0 has given up (or 60 s)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "rank0.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
    _out(out_dir, rank, {"error": err})
    _exit()


def fsdp1_grad_norm(rank, world, port, out_dir):
    """FSDP1 (flat parameters) on CPU/gloo: global grad norm vs the full-batch reference."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    setup(rank, world, port)
    model, init = _net_and_state()
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
    res = _sharded_vs_reference(fsdp, init, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), rank, world)
    _out(out_dir, rank, res)
    teardown()
    _exit()


def ddp_finite_but_extreme(rank, world, port, out_dir):
    """DDP with weights near 1e20: every value finite, every float32 sum of squares overflows."""
    import nummon
    from helpers.models import train_step

    setup(rank, world, port)
    model = Net()
    with torch.no_grad():
        model.fc2.weight.mul_(1e21)  # random signs: the gradients reaching fc1 are ~1e20 too
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    mon = nummon.Monitor(ddp, opt, policy={"recorder": {"write": False}, "sampling": {"params_every": 1}})
    x, y, _, _ = data_for(rank, world)
    records = []
    for _ in range(2):
        r = mon.post_step(train_step(ddp, opt, x, y))
        records.append({"health": r.health.value, "grad_norm": r.record.grad_norm, "param_norm": r.record.param_norm})
    params = list(model.parameters())
    ref = {
        "grad_norm": sum(float(p.grad.double().square().sum()) for p in params) ** 0.5,
        "param_norm": sum(float(p.detach().double().square().sum()) for p in params) ** 0.5,
    }
    mon.close()
    _out(
        out_dir,
        rank,
        {"records": records, "ref": ref, "alerts": [(a.kind.value, a.severity.value) for a in mon.alerts]},
    )
    del ddp
    teardown()
    _exit()


def mismatched_batches(rank, world, port, out_dir, variant):
    """Rank 0 passes (x, y); rank 1 passes x alone, or no batch."""
    import nummon

    setup(rank, world, port, timeout_s=20)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mon = nummon.Monitor(ddp, opt, policy={"recorder": {"write": False}})
    x, y, _, _ = data_for(rank, world)
    batch = (x, y) if rank == 0 else {"x_only": x, "none": None}[variant]
    err = None
    try:
        mon.post_step(train_step_ddp(ddp, opt, x, y), batch=batch)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    _out(out_dir, rank, {"error": err})
    _exit()


def train_step_ddp(ddp, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    return loss


def one_rank_in_a_barrier(rank, world, port, out_dir):
    """Rank 0 calls post_step while rank 1 waits in a barrier: rank 0 gives up after the
    monitor's timeout (3 s), well inside the group's (20 s)."""
    import nummon

    setup(rank, world, port, timeout_s=20)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = nummon.Monitor(model, opt, policy={"recorder": {"write": False}})
    mon._dist.timeout_s = 3.0  # the reducer's bound (a policy value may set it later)
    err = None
    try:
        if rank == 0:
            x, y, _, _ = data_for(rank, world)
            mon.post_step(train_step_ddp(model, opt, x, y))
        else:
            dist.barrier()
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    _out(out_dir, rank, {"error": err})
    _exit()


def compiled_ddp_mechanisms(rank, world, port, out_dir):
    """DDP, compiled (aot_eager), a BatchNorm buffer DDP broadcasts on every forward: the
    forward's probes come from the eager replay, which joins no collective."""
    import torch._dynamo

    import nummon

    setup(rank, world, port)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    run = torch.compile(ddp, backend="aot_eager")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    mon = nummon.Monitor(run, opt, policy={"recorder": {"write": False}, "mechanisms": {"every": 2}})
    calls = CountCollectives().__enter__()
    x, y, _, _ = data_for(rank, world)
    records, per_step = [], []
    for _ in range(4):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        before = calls.n
        records.append(mon.post_step(loss).record.to_dict())
        per_step.append(calls.n - before)
    mon.close()
    calls.__exit__()
    _out(
        out_dir,
        rank,
        {
            "records": records,
            "collectives": per_step,
            "errors": mon._stats.mechanisms.errors,
            "weights": [float(p.detach().sum()) for p in model.parameters()],
        },
    )
    del run, ddp
    teardown()
    _exit()


def replica_faults(rank, world, port, out_dir, variant, steps, every, fault_step):
    """DDP on `world` ranks with replica checks every `every` steps; one fault on one rank at
    `fault_step`: `nudge` (a parameter changed after optimizer.step on rank 1), `grad` (rank 1's
    gradient changed after the all-reduce), `bitflip` (one exponent bit of a weight on rank 2),
    or none (`healthy`)."""
    import nummon

    setup(rank, world, port)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    pol = {"replicas": {"every": every}, "sinks": {"console": False}, "recorder": {"write": False}}
    mon = nummon.Monitor(ddp, opt, policy=pol)
    x, y, _, _ = data_for(rank, world)
    stopped_at = None
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        with torch.no_grad():
            if step == fault_step and variant == "grad" and rank == 1:
                model.fc1.weight.grad[3, 5] += 1e-3
            opt.step()
            if step == fault_step and variant == "nudge" and rank == 1:
                model.fc2.bias[0] += 1e-6
            if step == fault_step and variant == "bitflip" and rank == 2:
                model.fc1.weight.view(-1).view(torch.int32)[7] ^= 1 << 23  # the exponent's lowest bit: x2 or /2
        r = mon.post_step(loss)
        if r.should_stop:
            stopped_at = r.step
            break
    mon.close()
    replica = mon._stats.replicas
    _out(
        out_dir,
        rank,
        {
            "alerts": [a.to_dict() for a in mon.alerts if a.kind.value == "replica_mismatch"],
            "stopped_at": stopped_at,
            "checks": replica.checks if replica is not None else None,
        },
    )
    del ddp
    teardown()
    _exit()


class WiderNet(Net):
    """Net with one extra Linear: a rank whose model is not the others' (hand-written data parallelism)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(4, 4)

    def forward(self, x):
        return self.extra(super().forward(x))


def different_parameter_sets(rank, world, port, out_dir):
    """Hand-written data parallelism (gradients all-reduced by hand), rank 1's model one Linear wider."""
    import nummon

    setup(rank, world, port, timeout_s=20)
    model = WiderNet() if rank == 1 else Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    err, events = None, os.path.join(out_dir, f"events{rank}.jsonl")
    try:
        mon = nummon.Monitor(model, opt, sinks=[nummon.JsonlSink(events)], policy={"recorder": {"write": False}})
        x, y, _, _ = data_for(rank, world)
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            mon.post_step(loss)
        mon.close()
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    _out(out_dir, rank, {"error": err})
    _exit()

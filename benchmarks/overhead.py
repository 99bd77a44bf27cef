"""Overhead of monitoring every step, as a ratio to the bare training step, side by side.

One process, one model, one optimizer: each variant in turn attaches to them, trains a few
steps and detaches; variants run interleaved (A B C ... in a new order each round) for several
rounds after warm-up, and each variant's median step time is divided by the bare step's.
CPU by default (the demo CNN, batch 64); CUDA when available (a GPT-2-small-shaped transformer
in bf16 autocast with fused AdamW).

    python benchmarks/overhead.py [--device cpu|cuda] [--shape mlp|lm2|lm8|cnn] [--rounds N] [--steps K] [--json out.json]

`--shape` picks one of the four shapes of the host-cost bar (nummon's added time at most 1.5x the
per-parameter `.item()` monitor's added time + 0.25 ms), printed at the end with both added times.
One Monitor serves all of its variant's rounds, its hooks taken off the shared model and optimizer
between them (`MonitorHooks`), so the timed steps are those of a run in progress and its one-off
costs (the first sampled forward's discovery of the model, the kernels' plans) are paid once, as in
a run; `--monitor fresh` makes a new Monitor each round that resumes the last one's engine state
(every round pays those one-off costs), `--monitor cold` a new Monitor and a new run each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

# the checkout's own package first: a benchmark measures the code beside it (an editable install
# of another checkout, or an older installed version, would otherwise answer `import nummon`)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nummon  # noqa: E402
from nummon._stats.kernels import NormKernels  # noqa: E402
from nummon._tools.demo_model import DemoCNN  # noqa: E402

# ---------------------------------------------------------------- workloads


def cnn_workload(device):
    torch.manual_seed(0)
    model = DemoCNN().to(device)
    x = torch.randn(64, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def loss_fn(m):
        return nn.functional.cross_entropy(m(x), y)

    return model, make_opt, loss_fn, contextlib.nullcontext


def mlp_workload(device):
    """A 3-layer MLP with Adam: a launch-bound step, where per-step host work shows most. Its
    batch is one of 32 in turn: one fixed batch was memorised within ~500 steps, its gradients
    then fell below Adam's eps and nummon said so, and the timed steps measured an open incident."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    xs = torch.randn(32, 64, 64, device=device).unbind(0)
    ys = torch.randint(0, 10, (32, 64), device=device).unbind(0)
    turn = [0]

    def make_opt(m):
        return torch.optim.Adam(m.parameters(), lr=1e-3)

    def loss_fn(m):
        turn[0] = i = (turn[0] + 1) % len(xs)
        return nn.functional.cross_entropy(m(xs[i]), ys[i])

    return model, make_opt, loss_fn, contextlib.nullcontext


def lm_workload(device, layers: int):
    """A tiny pre-LN transformer LM (d 128, 4 heads, vocab 512, batch 8x64) with AdamW. Its batch
    is one of 32 in turn, as the MLP's: with one fixed batch the 8-block LM memorised it within
    ~1,600 steps of a long measurement and nummon warned (Adam's second moment): the steps timed
    after that were an incident's, not a healthy run's."""
    torch.manual_seed(0)
    model = GPT(vocab=512, d=128, layers=layers, heads=4, ctx=64).to(device)
    batches = torch.randint(0, 512, (32, 8, 65), device=device).unbind(0)
    turn = [0]

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    def loss_fn(m):
        turn[0] = i = (turn[0] + 1) % len(batches)
        idx = batches[i]
        logits = m(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    return model, make_opt, loss_fn, contextlib.nullcontext


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2-small shape: 12 layers, d=768, 12 heads, vocab 50257, context 1024."""

    def __init__(self, vocab=50257, d=768, layers=12, heads=12, ctx=1024):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), 1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def gpt_workload(device, batch=16, ctx=1024):
    torch.manual_seed(0)
    model = GPT(ctx=ctx).to(device)
    idx = torch.randint(0, 50257, (batch, ctx), device=device)

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def loss_fn(m):
        logits = m(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))

    return model, make_opt, loss_fn, lambda: torch.autocast("cuda", dtype=torch.bfloat16)


#: the shapes of the host-cost bar (--shape): name -> (workload(device), what it is)
SHAPES: dict[str, tuple[Callable, str]] = {
    "mlp": (mlp_workload, "3-layer MLP 64-256-256-10, batch 64, Adam"),
    "lm2": (lambda dev: lm_workload(dev, 2), "2-block transformer LM d128, batch 8x64, AdamW"),
    "lm8": (lambda dev: lm_workload(dev, 8), "8-block transformer LM d128, batch 8x64, AdamW"),
    "cnn": (cnn_workload, "DemoCNN 28x28, batch 64, SGD momentum 0.9"),
}
#: the bar for nummon on every shape: its added time at most this times the per-parameter
#: `.item()` monitor's added time, plus `BAR_MS` (ms)
BAR_FACTOR, BAR_MS = 1.5, 0.25
PEER = "per-parameter .item()"
#: the floor: every gradient's norm and the loss, one host read, nothing else
GRADIENT_READ = "gradient norms only"


def host_cost_bar(median_ms: dict[str, float], variant: str = "nummon default") -> dict | None:
    """nummon's and the peer's added ms over the bare step, and whether nummon meets the bar."""
    if not {"bare", variant, PEER} <= set(median_ms):
        return None
    added = median_ms[variant] - median_ms["bare"]
    peer = median_ms[PEER] - median_ms["bare"]
    limit = BAR_FACTOR * max(peer, 0.0) + BAR_MS
    return {"added_ms": added, "peer_added_ms": peer, "limit_ms": limit, "meets_bar": added <= limit}


def paired_bar(round_ms: dict[str, list[float]], variant: str = "nummon default", resamples: int = 2000) -> dict | None:
    """The bar again from each round's difference to the same round's bare step (drift between
    rounds cancels), with a 90% bootstrap interval over rounds for its margin (the limit minus
    nummon's added ms; positive: met). The verdict is "met" or "not met" only when the interval
    says so, else "within noise": one pass of a noisy machine decides nothing."""
    if not {"bare", variant, PEER} <= set(round_ms):
        return None
    bare = round_ms["bare"]
    added = [t - b for t, b in zip(round_ms[variant], bare)]
    peer = [t - b for t, b in zip(round_ms[PEER], bare)]

    def margin(rounds: list[int]) -> float:
        a = statistics.median(added[i] for i in rounds)
        p = statistics.median(peer[i] for i in rounds)
        return BAR_FACTOR * max(p, 0.0) + BAR_MS - a

    n = len(bare)
    rng = random.Random(0)  # a fixed seed: the same rounds give the same interval
    boot = sorted(margin([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    lo, hi = boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]
    res = {
        "added_ms": statistics.median(added),
        "peer_added_ms": statistics.median(peer),
        "margin_ms": margin(list(range(n))),
        "margin_90": [lo, hi],
        "verdict": "met" if lo > 0 else "not met" if hi < 0 else "within noise",
    }
    if GRADIENT_READ in round_ms:  # the floor: what reading the gradients alone adds, and each above it
        floor = [t - b for t, b in zip(round_ms[GRADIENT_READ], bare)]
        res["floor_added_ms"] = statistics.median(floor)
        res["above_floor_ms"] = statistics.median(a - f for a, f in zip(added, floor))
        res["peer_above_floor_ms"] = statistics.median(p - f for p, f in zip(peer, floor))
    return res


# ---------------------------------------------------------------- variants


def variants(tmp: str, device) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """Two phases of variants, each starting with the bare step. A variant attaches to the
    shared (model, optimizer) and returns (after_step(loss), detach())."""

    def bare(model, opt):
        return (lambda loss: None), (lambda: None)

    def monitor(policy, sinks=()):
        steps = [0]  # the step count carries over between rounds, so every-k work lands on schedule
        # ... and so does the health engine's state (a resumed run's, `engine_state()`): the
        # measured steps are those of a run in progress, not the first ten of a new one, whose
        # detectors are still warming up (the fast path for quiet steps starts after those)
        state: list = [None]
        kept: list = []  # MODE "kept": the one Monitor and the hooks it added

        def attach(model, opt):
            if MODE[0] == "kept" and kept:  # the same Monitor, its hooks put back
                mon, hooks = kept
                hooks.restore()
                return mon.post_step, hooks.stash
            before = MonitorHooks(model, opt)
            mon = nummon.Monitor(model, opt, policy=policy, sinks=list(sinks), start_step=steps[0])
            if MODE[0] == "kept":
                kept[:] = [mon, before]
                _CLEANUPS.append(lambda: (attach.alerts.extend(mon.alerts), mon.close()))
                return mon.post_step, before.stash
            if state[0] is not None and MODE[0] == "fresh":
                mon.load_engine_state(state[0])

            def detach():
                steps[0] = mon.step
                state[0] = mon.engine_state()
                attach.alerts.extend(mon.alerts)
                mon.close()

            return mon.post_step, detach

        # the alerts the variant's Monitors raised: a timed step of a run with an open incident
        # measures everything (not a quiet step), and a long measurement can train the shared
        # model into one (a fixed batch, memorised)
        attach.alerts = []
        return attach

    def per_param_item(model, opt):
        def after(loss):
            loss.item()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.norm().item()

        return after, (lambda: None)

    def gradient_read(model, opt):
        """The floor under any monitor that reads every gradient's norm each step: nummon's own
        norm kernels over the gradients and the loss, in one host read, and nothing else."""
        kernels = NormKernels()
        params = list(model.parameters())

        def after(loss):
            grads = [p.grad for p in params if p.grad is not None]
            torch.cat([loss.detach().reshape(1).float(), kernels.l2_norms(grads, key="floor")]).tolist()

        return after, (lambda: None)

    main = {
        "bare": bare,
        # the A/A control: the bare step again, as a variant; its ratio is the run's noise floor
        "bare (A/A)": bare,
        "nummon default": monitor("default"),
        "nummon + histograms/100": monitor({"sampling": {"histogram_every": 100}}, [_NullHistSink()]),
        # the short-step setting: gradients every step, parameters / optimizer state every 10
        "nummon params/state every 10": monitor({"sampling": {"params_every": 10, "optimizer_every": 10}}),
        "nummon without activation hooks": monitor({"sampling": {"activations": False}}),
        "nummon without mechanism probes": monitor({"mechanisms": {"enabled": False}}),
        # the mechanism probes' cadence halved: what their sampled step costs a small model
        "nummon mechanism probes every 20": monitor({"mechanisms": {"every": 20}}),
        # the probes never sparser on a calm run: what the calm cadence (every 20 past step 100) saves
        "nummon mechanism probes never sparser": monitor({"mechanisms": {"calm_multiple": 1}}),
        "per-parameter .item()": per_param_item,
        GRADIENT_READ: gradient_read,
    }
    if torch.device(device).type == "cuda":  # the GPT's vocabulary head: 1.6 of the 2.4 GB the hooks read
        main["nummon, hooks except the head"] = monitor({"sampling": {"activations_exclude": ["head"]}})
    try:
        from lightning.pytorch.utilities import grad_norm  # type: ignore

        def lightning(model, opt):
            def after(loss):
                loss.item()
                for v in grad_norm(model, norm_type=2).values():
                    float(v)

            return after, (lambda: None)

        main["lightning grad_norm"] = lightning
    except ImportError:
        pass
    background = {"bare": bare}
    try:
        import wandb

        runs = []

        def wandb_watch(model, opt):
            if not runs:  # one offline run for the whole benchmark; watch / unwatch per round
                os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp, WANDB_CONSOLE="off")
                runs.append(wandb.init(project="nummon-bench"))
            run = runs[0]
            run.watch(model, log="all", log_freq=1)

            def after(loss):
                run.log({"loss": loss.item()})

            return after, (lambda: run.unwatch(model))

        background["wandb.watch(log=all, freq=1)"] = wandb_watch
        _CLEANUPS.append(lambda: runs and runs[0].finish())
    except ImportError:
        pass
    return main, background


_CLEANUPS: list[Callable] = []  # run after the measurement (e.g. finish the wandb run)
#: how a nummon variant attaches: "kept" (one Monitor for the whole run, its hooks taken off the
#: shared model and optimizer between its rounds: the timed steps are those of a run in progress,
#: its one-off costs paid once, as in a run), "fresh" (a new Monitor each round resuming the last
#: one's engine state: every round pays the one-off costs of a new Monitor, such as its first
#: sampled forward's discovery of the model) or "cold" (a new Monitor and a new run each round)
MODE = ["kept"]

#: the hook tables of a module a Monitor may write into
_MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


class MonitorHooks:
    """The hook tables of a model and optimizer as they were before a Monitor attached: `stash()`
    takes off the hooks added since, `restore()` puts them back (the same objects, in the same
    tables), so a kept Monitor does not run during the other variants' rounds."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt
        self.before = {id(t): set(t) for t in self._tables()}
        self.stashed: list[tuple[dict, object, object]] = []

    def _tables(self) -> list[dict]:
        from torch.nn.modules import module as _module

        tables = [getattr(m, name) for m in self.model.modules() for name in _MODULE_HOOKS if hasattr(m, name)]
        tables += [p._post_accumulate_grad_hooks for p in self.model.parameters() if p._post_accumulate_grad_hooks]
        tables += [self.opt._optimizer_step_pre_hooks, self.opt._optimizer_step_post_hooks]
        tables += [_module._global_forward_pre_hooks, _module._global_forward_hooks]
        return tables

    def stash(self) -> None:
        for t in self._tables():
            for k in [k for k in t if k not in self.before.get(id(t), ())]:
                self.stashed.append((t, k, t.pop(k)))

    def restore(self) -> None:
        for t, k, v in self.stashed:
            t[k] = v
        self.stashed.clear()


class _NullHistSink(nummon.BaseSink):
    wants_histograms = True


def measure(
    device: str,
    rounds: int,
    steps: int,
    warmup: int,
    only: set[str] | None = None,
    probe_hooks: bool = False,
    shape: str | None = None,
) -> dict:
    """Every variant trains the same model with the same optimizer, in turn.

    Separate model copies per variant looked fair and were not: on the 2-core VM three
    identical bare copies differed by up to 5% (where each copy's tensors landed in memory),
    more than the effect measured. So one model and one optimizer are shared; each round
    attaches a variant (a Monitor, hooks), runs one untimed step and `steps` timed
    ones, and detaches it. Variants that leave work running in other processes
    (wandb's service) are measured in a second phase, so they cannot slow the others.
    """
    dev = torch.device(device)
    if shape is None:
        workload, described = (
            (gpt_workload, "GPT-2-small bf16 autocast, batch 16x1024, fused AdamW")
            if dev.type == "cuda"
            else SHAPES["cnn"]
        )
    else:
        workload, described = SHAPES[shape]
    model, make_opt, loss_fn, autocast = workload(dev)
    opt = make_opt(model)
    tmp = tempfile.mkdtemp()
    main_phase, background_phase = variants(tmp, dev)
    if only is not None:
        unknown = only - set(main_phase) - set(background_phase)
        if unknown:
            raise SystemExit(
                f"unknown variant(s): {', '.join(sorted(unknown))}; known: {', '.join([*main_phase, *background_phase])}"
            )
        main_phase = {k: v for k, v in main_phase.items() if k in only}
        background_phase = {k: v for k, v in background_phase.items() if k in only}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(after, n):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(model)
            loss.backward()
            opt.step()
            after(loss)
        sync()
        return (time.perf_counter() - t0) / n

    run(lambda loss: None, warmup)
    times: dict[str, list[float]] = {}
    paired: dict[str, float] = {}
    mean_ratio: dict[str, float] = {}
    rng = random.Random(0)
    for phase in (main_phase, background_phase):
        if len(phase) < 2:
            continue
        phase_times: dict[str, list[float]] = {name: [] for name in phase}
        order = list(phase)
        for _ in range(rounds):
            rng.shuffle(order)  # a new order each round: drift and position hit every variant alike
            for name in order:
                after, close = phase[name](model, opt)
                run(after, 1)  # untimed: the first step after attaching allocates buffers
                phase_times[name].append(run(after, steps))
                close()
        bare_times = phase_times["bare"]
        for name, ts in phase_times.items():
            # paired: each round's ratio to the bare step of the same round (drift cancels)
            paired[name] = statistics.median(t / b for t, b in zip(ts, bare_times))
            # periodic work (histograms every 100 steps) lands in few rounds: medians skip it, means do not
            mean_ratio[name] = statistics.fmean(ts) / statistics.fmean(bare_times)
            if name == "bare" and "bare" in times:
                continue
            times[name] = ts
    while _CLEANUPS:
        _CLEANUPS.pop()()
    alerts = {
        name: sorted({f"{a.kind.value} {a.severity.value} at step {a.step}" for a in fn.alerts})
        for name, fn in main_phase.items()
        if getattr(fn, "alerts", None)
    }
    med = {k: statistics.median(v) for k, v in times.items()}
    bare = med["bare"]
    res_bw = stats_bandwidth(model, opt, loss_fn, dev) if dev.type == "cuda" else None
    probe = hook_reductions(model, loss_fn, autocast, dev) if probe_hooks else None
    return {
        "paired_ratio": paired,
        "stats_bandwidth": res_bw,
        "hook_reductions": probe,
        "device": str(dev),
        "workload": described,
        "shape": shape,
        "host_cost_bar": host_cost_bar({k: v * 1e3 for k, v in med.items()}),
        "paired_bar": paired_bar({k: [t * 1e3 for t in v] for k, v in times.items()}),
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "rounds": rounds,
        "steps_per_round": steps,
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "ratio_to_bare": {k: v / bare for k, v in med.items()},
        "mean_ratio": mean_ratio,
        "alerts": alerts,
        "round_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
    }


def hook_reductions(model, loss_fn, autocast, dev, reps: int = 5) -> dict:
    """Ways to get max |output| of every module a Monitor hooks, timed over one forward's real
    outputs, and whether each propagates NaN. Answers which reduction the hooks should use on
    this device (aminmax into a buffer of the output's dtype is what they use now)."""
    outs = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: outs.append(o.detach()) if isinstance(o, torch.Tensor) else None)
        for name, m in model.named_modules()
        if name and any(True for _ in m.parameters(recurse=False))
    ]
    with torch.no_grad(), autocast():
        loss_fn(model)
    for h in hooks:
        h.remove()
    outs = [o for o in outs if o.is_floating_point() and o.numel()]
    nbytes = sum(o.numel() * o.element_size() for o in outs)

    def rows(dtype_of):  # one preallocated (min, max) row per output, as the hooks keep them
        bufs = {}
        for o in outs:
            bufs.setdefault(dtype_of(o), [])
        tables = {dt: torch.zeros(len(outs), 2, dtype=dt, device=dev) for dt in bufs}
        return [tables[dtype_of(o)][i] for i, o in enumerate(outs)]

    def copy_pair(r, pair):
        r[0].copy_(pair[0])
        r[1].copy_(pair[1])

    methods = {  # name: (reduction writing into a (min, max) row, the row's dtype)
        "aminmax into own dtype": (lambda o, r: torch.aminmax(o, out=(r[0], r[1])), lambda o: o.dtype),
        # what the hooks did before: a float32 buffer, two converting copies
        "aminmax + 2 copies": (lambda o, r: copy_pair(r, torch.aminmax(o)), lambda o: torch.float32),
        "inf-norm to float32": (
            lambda o, r: torch.linalg.vector_norm(o, float("inf"), dtype=torch.float32, out=r[1]),
            lambda o: torch.float32,
        ),
        "amax + amin": (
            lambda o, r: (torch.amin(o, dim=(), out=r[0]), torch.amax(o, dim=(), out=r[1])),
            lambda o: o.dtype,
        ),
    }

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    nan_probe = torch.tensor([1.0, float("nan"), -3.0], device=dev)
    res = {"outputs": len(outs), "bytes": nbytes, "methods": {}}
    for name, (fn, dtype_of) in methods.items():
        rs = rows(dtype_of)
        for o, r in zip(outs, rs):
            fn(o, r)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            for o, r in zip(outs, rs):
                fn(o, r)
        sync()
        ms = (time.perf_counter() - t0) / reps * 1e3
        r = torch.zeros(2, device=dev)
        fn(nan_probe, r)
        res["methods"][name] = {
            "ms_per_step": ms,
            "GBps": nbytes / ms / 1e6,
            "propagates_nan": bool(torch.isnan(r).any()),
        }
    return res


def stats_bandwidth(model, opt, loss_fn, dev) -> dict:
    """CUDA: the statistics pass alone (bytes it reads / time) against a device copy's bandwidth."""
    mon = nummon.Monitor(model, opt, policy={"sampling": {"activations": False}})
    loss = loss_fn(model)
    loss.backward()
    opt.step()
    ts = (
        [p.grad for p in model.parameters() if p.grad is not None]
        + list(model.parameters())
        + mon._stats.optim.state_tensors()
    )
    nbytes = sum(t.numel() * t.element_size() for t in ts) + sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    for _ in range(3):
        mon._stats.launch(0, loss)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        mon._stats.launch(0, loss)
    end.record()
    torch.cuda.synchronize()
    stats_s = start.elapsed_time(end) / 10 / 1e3
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    start.record()
    for _ in range(10):
        dst.copy_(buf)
    end.record()
    torch.cuda.synchronize()
    copy_s = start.elapsed_time(end) / 10 / 1e3
    mon.close()
    stats_gbs = nbytes / stats_s / 1e9
    copy_gbs = 2 * nbytes / copy_s / 1e9  # a copy reads and writes every byte
    return {
        "bytes_read": nbytes,
        "stats_ms": stats_s * 1e3,
        "stats_GBps": stats_gbs,
        "copy_GBps": copy_gbs,
        "fraction_of_copy": stats_gbs / copy_gbs,
    }


def steady_allocator() -> bool:
    """Keep freed memory in glibc's heap instead of returning it to the kernel on every step.

    With the defaults, the multi-MB gradients and activations of each step are mmap'ed and
    unmapped again, and every step pays fresh page faults. In this VM that added ~25% system
    time and made identical bare copies differ by up to 5%, more than the effect measured.
    tcmalloc and jemalloc behave like this out of the box. Applies to every variant alike.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=None, help="default: 60 on CPU, 7 on CUDA")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round; default: 5 on CPU, 10 on CUDA")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help="the workload (default: the CNN on CPU, GPT-2-small on CUDA); each is one shape of the host-cost bar",
    )
    ap.add_argument("--system-malloc", action="store_true", help="leave glibc's allocator thresholds alone (noisier)")
    ap.add_argument(
        "--monitor",
        choices=("kept", "fresh", "cold"),
        default="kept",
        help="kept (default): one Monitor for the run, its hooks off between its rounds; fresh: a new Monitor "
        "each round resuming the last one's engine state; cold: a new Monitor and run each round",
    )
    ap.add_argument(
        "--probe-hooks",
        action="store_true",
        help="also time ways of reducing the hooked outputs (on by default on CUDA)",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated variant names to run (the bare step and its A/A control always run)",
    )
    a = ap.parse_args(argv)
    MODE[0] = a.monitor
    steady = False if a.system_malloc else steady_allocator()
    cuda = a.device.startswith("cuda")
    rounds = a.rounds or (7 if cuda else 60)
    steps = a.steps or (10 if cuda else 5)
    only = {v.strip() for v in a.only.split(",")} | {"bare", "bare (A/A)"} if a.only else None
    res = measure(a.device, rounds, steps, a.warmup, only, probe_hooks=a.probe_hooks or cuda, shape=a.shape)
    res["steady_allocator"] = steady
    res["monitor"] = {
        "kept": "kept (one Monitor, detached between its rounds)",
        "fresh": "a new Monitor each round, resuming engine_state()",
        "cold": "cold (a new Monitor and run each round)",
    }[a.monitor]
    print(
        f"{res['workload']} on {res['device']} ({res['machine']}, torch {res['torch']}, "
        f"{'steady' if steady else 'default'} allocator, {rounds} rounds x {steps} steps, monitor {res['monitor']})"
    )
    print(f"{'variant':32s} {'median ms':>10s} {'ratio':>7s} {'paired':>7s} {'mean':>7s}")
    for k, r in res["ratio_to_bare"].items():
        print(
            f"{k:32s} {res['median_step_ms'][k]:10.2f} {r:7.3f} {res['paired_ratio'][k]:7.3f} {res['mean_ratio'][k]:7.3f}"
        )
    for name, said in res["alerts"].items():
        print(
            f"note: {name} raised {len(said)} alert(s) while measured ({'; '.join(said[:3])}): its steps after them "
            "are not a healthy run's (fewer rounds or steps keep the shared model from memorising its batch)"
        )
    if res["host_cost_bar"]:
        b = res["host_cost_bar"]
        print(
            f"nummon adds {b['added_ms']:+.3f} ms, the peer {b['peer_added_ms']:+.3f} ms; bar "
            f"{BAR_FACTOR} x peer + {BAR_MS} ms = {b['limit_ms']:.3f} ms: {'met' if b['meets_bar'] else 'NOT met'}"
        )
    if res["paired_bar"]:
        b = res["paired_bar"]
        lo, hi = b["margin_90"]
        print(
            f"paired by round: nummon adds {b['added_ms']:+.3f} ms, the peer {b['peer_added_ms']:+.3f} ms; margin "
            f"{b['margin_ms']:+.3f} ms (90% interval {lo:+.3f} to {hi:+.3f}): {b['verdict']}"
        )
        if "floor_added_ms" in b:
            print(
                f"reading the gradients alone ({GRADIENT_READ!r}) adds {b['floor_added_ms']:+.3f} ms; above it, "
                f"nummon adds {b['above_floor_ms']:+.3f} ms and the peer {b['peer_above_floor_ms']:+.3f} ms"
            )
    if res["stats_bandwidth"]:
        b = res["stats_bandwidth"]
        print(
            f"statistics pass: {b['bytes_read'] / 1e9:.2f} GB in {b['stats_ms']:.2f} ms = {b['stats_GBps']:.0f} GB/s; "
            f"device copy {b['copy_GBps']:.0f} GB/s; {b['fraction_of_copy']:.0%} of copy bandwidth"
        )
    if res["hook_reductions"]:
        h = res["hook_reductions"]
        print(f"max |output| of {h['outputs']} hooked outputs ({h['bytes'] / 1e9:.2f} GB):")
        for name, m in h["methods"].items():
            print(
                f"  {name:26s} {m['ms_per_step']:8.2f} ms {m['GBps']:8.0f} GB/s  NaN propagates: {m['propagates_nan']}"
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

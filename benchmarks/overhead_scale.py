"""How the Monitor's cost scales with the number of tensors: monitored vs bare, side by side.

Workloads (CPU by default, CUDA with --device cuda):
- `tiny-N`: N parameter tensors of tiny size (N/2 `Linear(8, 8)` layers in a chain, AdamW), so
  the bare step is mostly framework overhead and any per-tensor host work shows;
- `lm12`: a 12-block pre-LN transformer language model (d=128, 4 heads, vocab 512, batch 8x64);
- `cnn`: the demo CNN (batch 64, SGD momentum), the model of `benchmarks/overhead.py`;
- `gptL` (GPU): GPT-2-small's shape with L blocks, bf16 autocast, fused AdamW.

Per workload, one process: every variant (a Monitor, or nothing) trains its own copy of the
model (same seed, same data) and keeps its Monitor for the whole run; on CPU the variants take
turns step by step in a new order each step, and each round's mean step is divided by the bare
variant's of the same round (paired), so a change in the machine's speed cancels in the ratio.
`bare (A/A)` is a second bare variant: its ratio shows the harness's own noise. Medians over
rounds.

    python benchmarks/overhead_scale.py [--device cpu|cuda] [--rounds N] [--steps K]
        [--workloads tiny-20,tiny-100,tiny-1000,tiny-2000,lm12,cnn] [--json out.json]
        [--profile tiny-1000]    # where the extra time goes, in us per tensor

On a GPU, `gpt12` and `gpt48` (GPT-2-small's shape with 12 / 48 blocks, bf16) are workloads too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

# the checkout's own package first: a benchmark measures the code beside it (an editable install
# of another checkout, or an older installed version, would otherwise answer `import nummon`)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nummon  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from overhead import GPT, steady_allocator  # noqa: E402
from overhead import cnn_workload as overhead_cnn  # noqa: E402
from overhead import lm_workload as overhead_lm  # noqa: E402
from overhead import mlp_workload as overhead_mlp  # noqa: E402

#: the clock of a timed block (wall time; --cpu-time: this thread's CPU time)
CLOCK = time.perf_counter


# ---------------------------------------------------------------- workloads


def tiny_workload(n_tensors: int, dev: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n_tensors // 2)]).to(dev)
    x = torch.randn(4, 8, device=dev)

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    def loss_fn(m):
        return m(x).square().mean()

    return model, make_opt, loss_fn


def lm_workload(dev: torch.device, layers: int = 12):
    """overhead.py's tiny transformer LM (d 128, 4 heads, vocab 512, batch 8x64, AdamW)."""
    return overhead_lm(dev, layers)[:3]


def cnn_workload(dev: torch.device):
    """overhead.py's demo CNN (batch 64, SGD with momentum), without its autocast context."""
    model, make_opt, loss_fn, _ = overhead_cnn(dev)
    return model, make_opt, loss_fn


def proxy_workload(dev: torch.device):
    """The tiny pre-LN LM of the mechanism proxies (benchmarks/proxies/lm.py: d 128, 2 blocks,
    hand-written attention, batch 16x64, AdamW with weight decay groups)."""
    from proxies.lm import Corpus, ProxyConfig, TinyLM

    c = ProxyConfig(lr=0.01)
    torch.manual_seed(0)
    model = TinyLM(c).to(dev)
    x, y = (t.to(dev) for t in Corpus(c).batch())

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    def loss_fn(m):
        return nn.functional.cross_entropy(m(x).reshape(-1, c.vocab), y.reshape(-1))

    return model, make_opt, loss_fn


def gpt_workload(dev: torch.device, layers: int):
    """GPT-2-small's shape (d=768, 12 heads, vocab 50257) with `layers` blocks, bf16 autocast,
    fused AdamW, batch 8x1024 (CUDA)."""
    torch.manual_seed(0)
    model = GPT(layers=layers).to(dev)
    idx = torch.randint(0, 50257, (8, 1024), device=dev)

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4, fused=dev.type == "cuda")

    def loss_fn(m):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = m(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))

    return model, make_opt, loss_fn


def workload(name: str, dev: torch.device):
    if name.startswith("gpt"):
        return gpt_workload(dev, int(name[3:] or 12))
    if name.startswith("tiny-"):
        return tiny_workload(int(name.split("-", 1)[1]), dev)
    if name.startswith("lm"):
        return lm_workload(dev, int(name[2:] or 12))
    if name == "cnn":
        return cnn_workload(dev)
    if name == "mlp":  # the host-cost bar's launch-bound shape (overhead.py --shape mlp)
        return overhead_mlp(dev)[:3]
    if name == "proxy":
        return proxy_workload(dev)
    raise SystemExit(f"unknown workload {name!r}")


# ---------------------------------------------------------------- variants


def attach_monitor(policy):
    """A variant: a Monitor with this policy on the variant's own model and optimizer."""

    def attach(model, opt):
        mon = nummon.Monitor(model, opt, policy=policy)
        return mon.post_step, mon.close

    return attach


def bare(model, opt):
    return (lambda loss: None), (lambda: None)


def variants() -> dict[str, Callable]:
    return {
        "bare": bare,
        "bare (A/A)": bare,
        "nummon default": attach_monitor("default"),
        "nummon without activation hooks": attach_monitor({"sampling": {"activations": False}}),
        "nummon, mechanism probes off": attach_monitor({"mechanisms": {"enabled": False}}),
        "nummon, every statistic every step": attach_monitor({"sampling": {"params_every": 1, "optimizer_every": 1}}),
    }


def measure(
    name: str, dev: torch.device, rounds: int, steps: int, warmup: int, phase: dict[str, Callable] | None = None
) -> dict:
    """Every variant trains its own copy of the workload (same seed: the same weights, data and
    work) with its attachment kept for the whole run, as in a real run: the sampled steps, the
    first-call and discovery costs land as often as they do in training. On CPU the variants
    take turns step by step (a new order each step), so a change in the machine's speed hits
    them all alike; on CUDA in blocks of `steps` (a sync per step would hide the lagged copy).
    A round is `steps` steps of every variant; its mean step time is divided by the bare
    variant's of the same round (paired), and the ratio is the median over rounds."""
    phase = phase or variants()
    names = list(phase)
    runs = {}
    for v in names:
        model, make_opt, loss_fn = workload(name, dev)
        opt = make_opt(model)
        after, close = phase[v](model, opt)
        runs[v] = (model, opt, loss_fn, after, close)
    model = runs[names[0]][0]
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    n_modules = sum(1 for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False)))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(v, n):
        model, opt, loss_fn, after, _ = runs[v]
        sync()
        t0 = CLOCK()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model)
            loss.backward()
            opt.step()
            after(loss)
        sync()
        return CLOCK() - t0

    for v in names:  # untimed: first calls allocate buffers
        run(v, warmup)
    times: dict[str, list[float]] = {k: [] for k in names}
    rng = random.Random(0)
    block = steps if dev.type == "cuda" else 1
    for _ in range(rounds):
        acc = dict.fromkeys(names, 0.0)
        for _ in range(steps // block):
            rng.shuffle(names)
            for v in names:
                acc[v] += run(v, block)
        for v in names:
            times[v].append(acc[v] / steps)
    for v in runs:
        runs[v][4]()
    bare = times["bare"]
    res = {"tensors": n_tensors, "modules": n_modules, "bare_ms": statistics.median(bare) * 1e3, "variants": {}}
    for v in phase:
        ts = times[v]
        ratio = statistics.median(t / b for t, b in zip(ts, bare))
        extra_us = statistics.median((t - b) for t, b in zip(ts, bare)) * 1e6
        res["variants"][v] = {
            "median_ms": statistics.median(ts) * 1e3,
            "paired_ratio": ratio,
            "extra_us_per_tensor": extra_us / n_tensors,
        }
    return res


def profile(name: str, dev: torch.device, steps: int, rounds: int) -> dict:
    """Where the monitored step's extra time goes, in us per parameter tensor: wall time inside
    each part (timers wrapped around the Monitor's methods and hooks), paired with bare rounds."""
    import functools

    from nummon._engine.engine import HealthEngine
    from nummon._stats import collector as stats_collector

    model, make_opt, loss_fn = workload(name, dev)
    opt = make_opt(model)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    spent: dict[str, float] = {}

    def timed(label, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        return wrapper

    patches = [
        (stats_collector.StatsCollector, "launch", "statistics launch (kernels, packing, copy)"),
        (stats_collector.StatsCollector, "resolve", "decode (values -> StepRecord)"),
        (HealthEngine, "step", "health engine (detectors, incidents)"),
    ]
    try:
        from nummon._stats import preclip

        patches.append((preclip.PreClipCapture, "_end_of_backward", "pre-clip end-of-backward pass"))
        patches.append((preclip.PreClipCapture, "_on_grad", "pre-clip gradient hooks"))
    except ImportError:
        pass
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in patches]
    for cls, attr, label in patches:
        setattr(cls, attr, timed(label, getattr(cls, attr)))
    from nummon._stats import probes

    make_hook = probes.ActivationProbes._make_hook
    probes.ActivationProbes._make_hook = lambda self, idx: timed("activation hooks", make_hook(self, idx))
    try:

        def run(after, k):
            t0 = time.perf_counter()
            for _ in range(k):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model)
                loss.backward()
                opt.step()
                after(loss)
            return time.perf_counter() - t0

        run(lambda loss: None, 3)
        bare_t, mon_t, timed_parts = [], [], {}
        for r in range(rounds):  # bare and monitored in turn; the parts timed in the monitored steps
            bare_t.append(run(lambda loss: None, steps))
            mon = nummon.Monitor(model, opt, start_step=r * (steps + 1))
            run(mon.post_step, 1)
            spent.clear()
            mon_t.append(run(mon.post_step, steps))
            for label, t in spent.items():
                timed_parts[label] = timed_parts.get(label, 0.0) + t
            mon.close()
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
        probes.ActivationProbes._make_hook = make_hook
    k = steps * rounds
    extra = statistics.median(m - b for m, b in zip(mon_t, bare_t)) / steps
    parts = {label: t / k / n * 1e6 for label, t in timed_parts.items()}
    parts["the rest of post_step and the timers"] = extra / n * 1e6 - sum(parts.values())
    return {
        "workload": name,
        "tensors": n,
        "bare_ms": statistics.median(bare_t) / steps * 1e3,
        "extra_us_per_tensor": extra / n * 1e6,
        "parts_us_per_tensor": parts,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default: ~0.2 s of bare steps)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workloads", default="tiny-20,tiny-100,tiny-1000,tiny-2000,lm12,cnn")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU: one torch thread, timed by this thread's CPU time (time.thread_time): other "
        "processes on a shared machine then add little but cache and memory contention",
    )
    ap.add_argument("--profile", default=None, help="a workload to profile: us per tensor in each part of the step")
    a = ap.parse_args(argv)
    steady = steady_allocator()
    dev = torch.device(a.device)
    global CLOCK
    if a.cpu_time and dev.type == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.thread_time
    if a.profile:
        r = profile(a.profile, dev, a.steps or 4, a.rounds)
        print(
            f"{r['workload']}: {r['tensors']} tensors, bare {r['bare_ms']:.2f} ms, monitored +{r['extra_us_per_tensor']:.2f} us per tensor"
        )
        for label, us in r["parts_us_per_tensor"].items():
            print(f"  {label:45s} {us:6.2f} us per tensor")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(r, fh, indent=1)
        return 0
    # a multiple of the default cadences (10 steps: parameter norms, max |g|, mechanism probes), so
    # every round holds the same number of sampled steps
    default_steps = {"tiny-20": 60, "tiny-100": 20, "tiny-1000": 10, "tiny-2000": 10, "lm12": 10, "cnn": 10}
    if dev.type == "cuda":  # short steps: more of them per round
        default_steps = {k: 4 * v for k, v in default_steps.items()} | {"gpt12": 10, "gpt48": 10}
    out = {
        "device": str(dev),
        "torch": torch.__version__,
        "steady_allocator": steady,
        "rounds": a.rounds,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "clock": "thread CPU time" if CLOCK is time.thread_time else "wall",
        "workloads": {},
    }
    if dev.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(dev)
    print(f"{out['machine']}, torch {out['torch']}, {a.rounds} rounds, paired medians")
    print(
        f"{'workload':10s} {'tensors':>7s} {'modules':>7s} {'bare ms':>8s} | {'variant':32s} {'ratio':>6s} {'us/tensor':>9s}"
    )
    for w in a.workloads.split(","):
        steps = a.steps or default_steps.get(w, 5)
        r = measure(w, dev, a.rounds, steps, a.warmup)
        out["workloads"][w] = r
        for i, (v, m) in enumerate(r["variants"].items()):
            if v == "bare":
                continue
            head = f"{w:10s} {r['tensors']:7d} {r['modules']:7d} {r['bare_ms']:8.2f}" if i == 1 else " " * 35
            print(f"{head} | {v:32s} {m['paired_ratio']:6.3f} {m['extra_us_per_tensor']:9.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

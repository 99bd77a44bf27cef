"""How the Monitor's cost scales with the number of tensors: monitored vs bare, side by side.

Workloads (CPU by default, CUDA with --device cuda):
- `tiny-N`: N parameter tensors of tiny size (N/2 `Linear(8, 8)` layers in a chain, AdamW), so
  the bare step is mostly framework overhead and any per-tensor host work shows;
- `lm12`: a 12-block pre-LN transformer language model (d=128, 4 heads, vocab 512, batch 8x64);
- `cnn`: the demo CNN (batch 64, SGD momentum), the model of `benchmarks/overhead.py`;
- `gptL` (GPU): GPT-2-small's shape with L blocks, bf16 autocast, fused AdamW.

Per workload, one process, one model and one optimizer: each variant in turn attaches (a
Monitor, or nothing), trains one untimed and `steps` timed steps, and detaches; the variants
run interleaved in a new order each round, and each round's time is divided by the bare time
of the same round (paired), so load from other processes cancels in the ratio. `bare (A/A)` is
a second bare variant: its ratio shows the harness's own noise. Medians over rounds.

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
from typing import Callable

import torch
from torch import nn

try:
    import nummon
except ImportError:  # a bare checkout
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import nummon
sys.path.insert(0, os.path.dirname(__file__))
from overhead import GPT, steady_allocator  # noqa: E402

from nummon._demo_model import DemoCNN  # noqa: E402


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
    torch.manual_seed(0)
    model = GPT(vocab=512, d=128, layers=layers, heads=4, ctx=64).to(dev)  # the GPT of overhead.py, small
    idx = torch.randint(0, 512, (8, 65), device=dev)

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    def loss_fn(m):
        logits = m(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    return model, make_opt, loss_fn


def cnn_workload(dev: torch.device):
    torch.manual_seed(0)
    model = DemoCNN().to(dev)
    x = torch.randn(64, 1, 28, 28, device=dev)
    y = torch.randint(0, 10, (64,), device=dev)

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def loss_fn(m):
        return nn.functional.cross_entropy(m(x), y)

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
    raise SystemExit(f"unknown workload {name!r}")


# ---------------------------------------------------------------- variants

def variants() -> dict[str, Callable]:
    def bare(model, opt):
        return (lambda loss: None), (lambda: None)

    def monitor(policy):
        steps = [0]  # the step count carries over between rounds, so every-k work lands on schedule

        def attach(model, opt):
            mon = nummon.Monitor(model, opt, policy=policy, start_step=steps[0])

            def detach():
                steps[0] = mon.step
                mon.close()

            return mon.post_step, detach
        return attach

    return {
        "bare": bare,
        "bare (A/A)": bare,
        "nummon default": monitor("default"),
        "nummon without activation hooks": monitor({"sampling": {"activations": False}}),
        "nummon, mechanism probes off": monitor({"mechanisms": {"enabled": False}}),
        "nummon, every statistic every step": monitor({"sampling": {"params_every": 1, "optimizer_every": 1}}),
    }


def measure(name: str, dev: torch.device, rounds: int, steps: int, warmup: int) -> dict:
    model, make_opt, loss_fn = workload(name, dev)
    opt = make_opt(model)
    n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    n_modules = sum(1 for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False)))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(after, n):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model)
            loss.backward()
            opt.step()
            after(loss)
        sync()
        return (time.perf_counter() - t0) / n

    run(lambda loss: None, warmup)
    phase = variants()
    times: dict[str, list[float]] = {k: [] for k in phase}
    order = list(phase)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            after, close = phase[v](model, opt)
            run(after, 1)  # untimed: the first step after attaching allocates buffers
            times[v].append(run(after, steps))
            close()
    bare = times["bare"]
    res = {"tensors": n_tensors, "modules": n_modules, "bare_ms": statistics.median(bare) * 1e3, "variants": {}}
    for v, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, bare))
        extra_us = statistics.median((t - b) for t, b in zip(ts, bare)) * 1e6
        res["variants"][v] = {"median_ms": statistics.median(ts) * 1e3, "paired_ratio": ratio,
                              "extra_us_per_tensor": extra_us / n_tensors}
    return res


def profile(name: str, dev: torch.device, steps: int, rounds: int) -> dict:
    """Where the monitored step's extra time goes, in us per parameter tensor: wall time inside
    each part (timers wrapped around the Monitor's methods and hooks), paired with bare rounds."""
    import functools
    from nummon._engine import HealthEngine
    from nummon._stats import engine as stats_engine

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

    patches = [(stats_engine.StatsEngine, "launch", "statistics launch (kernels, packing, copy)"),
               (stats_engine.StatsEngine, "resolve", "decode (values -> StepRecord)"),
               (HealthEngine, "step", "health engine (detectors, incidents)")]
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
    return {"workload": name, "tensors": n, "bare_ms": statistics.median(bare_t) / steps * 1e3,
            "extra_us_per_tensor": extra / n * 1e6, "parts_us_per_tensor": parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default: ~0.2 s of bare steps)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workloads", default="tiny-20,tiny-100,tiny-1000,tiny-2000,lm12,cnn")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="a workload to profile: us per tensor in each part of the step")
    a = ap.parse_args(argv)
    steady = steady_allocator()
    dev = torch.device(a.device)
    if a.profile:
        r = profile(a.profile, dev, a.steps or 4, a.rounds)
        print(f"{r['workload']}: {r['tensors']} tensors, bare {r['bare_ms']:.2f} ms, monitored +{r['extra_us_per_tensor']:.2f} us per tensor")
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
    out = {"device": str(dev), "torch": torch.__version__, "steady_allocator": steady, "rounds": a.rounds,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
           "date": time.strftime("%Y-%m-%d %H:%M"), "workloads": {}}
    if dev.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(dev)
    print(f"{out['machine']}, torch {out['torch']}, {a.rounds} rounds, paired medians")
    print(f"{'workload':10s} {'tensors':>7s} {'modules':>7s} {'bare ms':>8s} | {'variant':32s} {'ratio':>6s} {'us/tensor':>9s}")
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

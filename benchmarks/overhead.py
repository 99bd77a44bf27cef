"""Overhead of monitoring every step, as a ratio to the bare training step, side by side.

One process; every variant trains its own copy of the same model; variants run interleaved
(A B C ... A B C ...) for several rounds after warm-up, and each variant's median step time is
divided by the bare step's. CPU by default (the demo CNN, batch 64); CUDA when available (a
GPT-2-small-shaped transformer in bf16 autocast with fused AdamW).

    python benchmarks/overhead.py [--device cpu|cuda] [--rounds 7] [--steps 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
from torch import nn

try:  # the installed package (its configs/ and integrations/ are mapped into nummon.*)
    import nummon
except ImportError:  # a bare checkout: run from the source tree
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import nummon
from nummon._demo import DemoCNN  # noqa: E402


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


# ---------------------------------------------------------------- variants

def variants(tmp: str, device) -> dict[str, Callable]:
    """Each returns (after_step(loss), close()) for its own model and optimizer."""

    def bare(model, opt):
        return (lambda loss: None), (lambda: None)

    def nummon_default(model, opt):
        mon = nummon.Monitor(model, opt, policy="default")
        return mon.post_step, mon.close

    def nummon_hist100(model, opt):
        mon = nummon.Monitor(model, opt, policy={"sampling": {"histogram_every": 100}}, sinks=[_NullHistSink()])
        return mon.post_step, mon.close

    def nummon_sampled(model, opt):
        # the short-step setting: gradients every step, parameters / optimizer state every 10
        mon = nummon.Monitor(model, opt, policy={"sampling": {"params_every": 10, "optimizer_every": 10}})
        return mon.post_step, mon.close

    def nummon_no_activations(model, opt):
        mon = nummon.Monitor(model, opt, policy={"sampling": {"activations": False}})
        return mon.post_step, mon.close

    def per_param_item(model, opt):
        def after(loss):
            loss.item()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.norm().item()
        return after, (lambda: None)

    out = {"bare": bare, "nummon default": nummon_default, "nummon + histograms/100": nummon_hist100,
           "nummon params/state every 10": nummon_sampled, "nummon without activation hooks": nummon_no_activations,
           "per-parameter .item()": per_param_item}
    try:
        from lightning.pytorch.utilities import grad_norm  # type: ignore

        def lightning(model, opt):
            def after(loss):
                loss.item()
                for v in grad_norm(model, norm_type=2).values():
                    float(v)
            return after, (lambda: None)

        out["lightning grad_norm"] = lightning
    except ImportError:
        pass
    try:
        import wandb  # noqa: F401

        def wandb_watch(model, opt):
            import wandb

            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp, WANDB_CONSOLE="off")
            run = wandb.init(project="nummon-bench")
            run.watch(model, log="all", log_freq=1)
            step = {"i": 0}

            def after(loss):
                step["i"] += 1
                run.log({"loss": loss.item()})

            def close():
                run.unwatch(model)
                run.finish()

            return after, close

        out["wandb.watch(log=all, freq=1)"] = wandb_watch
    except ImportError:
        pass
    return out


class _NullHistSink(nummon.BaseSink):
    wants_histograms = True


def measure(device: str, rounds: int, steps: int, warmup: int) -> dict:
    dev = torch.device(device)
    workload = gpt_workload if dev.type == "cuda" else cnn_workload
    base_model, make_opt, loss_fn, autocast = workload(dev)
    tmp = tempfile.mkdtemp()
    vs = variants(tmp, dev)
    state = {}
    for name, make in vs.items():
        m = copy.deepcopy(base_model)
        opt = make_opt(m)
        after, close = make(m, opt)
        state[name] = (m, opt, after, close)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(name, n):
        m, opt, after, _ = state[name]
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(m)
            loss.backward()
            opt.step()
            after(loss)
        sync()
        return (time.perf_counter() - t0) / n

    for name in vs:
        run(name, warmup)
    times = {name: [] for name in vs}
    order = list(vs)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)  # interleaved in a new order each round: drift and position hit every variant alike
        for name in order:
            times[name].append(run(name, steps))
    for name in vs:
        state[name][3]()
    med = {k: statistics.median(v) for k, v in times.items()}
    bare = med["bare"]
    # paired: each round's ratio to the bare step of the same round (drift cancels)
    paired = {k: statistics.median(t / b for t, b in zip(v, times["bare"])) for k, v in times.items()}
    res_bw = stats_bandwidth(state["nummon default"][0], state["nummon default"][1], loss_fn, dev) if dev.type == "cuda" else None
    return {
        "paired_ratio": paired,
        "stats_bandwidth": res_bw,
        "device": str(dev),
        "workload": "GPT-2-small bf16 autocast, batch 16x1024, fused AdamW" if dev.type == "cuda" else "DemoCNN 28x28, batch 64, SGD momentum 0.9",
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "rounds": rounds,
        "steps_per_round": steps,
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "ratio_to_bare": {k: v / bare for k, v in med.items()},
    }


def stats_bandwidth(model, opt, loss_fn, dev) -> dict:
    """CUDA: the statistics pass alone (bytes it reads / time) against a device copy's bandwidth."""
    mon = nummon.Monitor(model, opt, policy={"sampling": {"activations": False}})
    loss = loss_fn(model)
    loss.backward()
    opt.step()
    ts = [p.grad for p in model.parameters() if p.grad is not None] + list(model.parameters()) + mon.stats._state_tensors()
    nbytes = sum(t.numel() * t.element_size() for t in ts) + sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    for _ in range(3):
        mon.stats.launch(0, loss)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        mon.stats.launch(0, loss)
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
    return {"bytes_read": nbytes, "stats_ms": stats_s * 1e3, "stats_GBps": stats_gbs, "copy_GBps": copy_gbs,
            "fraction_of_copy": stats_gbs / copy_gbs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    res = measure(a.device, a.rounds, a.steps, a.warmup)
    print(f"{res['workload']} on {res['device']} ({res['machine']}, torch {res['torch']})")
    print(f"{'variant':32s} {'median ms':>10s} {'ratio':>7s} {'paired':>7s}")
    for k, r in res["ratio_to_bare"].items():
        print(f"{k:32s} {res['median_step_ms'][k]:10.2f} {r:7.3f} {res['paired_ratio'][k]:7.3f}")
    if res["stats_bandwidth"]:
        b = res["stats_bandwidth"]
        print(f"statistics pass: {b['bytes_read'] / 1e9:.2f} GB in {b['stats_ms']:.2f} ms = {b['stats_GBps']:.0f} GB/s; "
              f"device copy {b['copy_GBps']:.0f} GB/s; {b['fraction_of_copy']:.0%} of copy bandwidth")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

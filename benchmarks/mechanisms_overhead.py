"""Cost of the sampled mechanism probes on the CPU proxy LM (benchmarks/proxies/lm.py, d 128,
2 blocks, 4 heads, batch 16 x 64 tokens, AdamW), as ratios side by side in one process.

Variants run interleaved in short blocks (a new order each round; a block is `every` steps, so
it holds exactly one sampled step at the default cadence): the bare training step; nummon with
the probes off; with the probes at the default cadence; and each probe alone at every step (its
cost per sampled step). Time is this thread's CPU time (`time.thread_time`, torch on one
thread), so the other processes on a shared machine add little noise; each variant's median
block time is divided by the bare step's.

    flock /work/bench.lock .venv/bin/python -m benchmarks.mechanisms_overhead [--rounds N] [--steps K]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import nummon
from benchmarks.proxies.lm import Corpus, ProxyConfig, TinyLM

OFF = {"attention": False, "output": False, "adam": False, "linear_rms": False}


def variants(every: int) -> dict[str, dict | None]:
    base = {"alerts": {"stop_on_critical": False}, "recorder": {"write": False}}
    out: dict[str, dict | None] = {"bare": None, "nummon, probes off": {**base, "mechanisms": {"enabled": False}},
                                   f"nummon, probes every {every} (default)": {**base, "mechanisms": {"every": every}},
                                   "nummon, all probes every step": {**base, "mechanisms": {"every": 1}}}
    for probe in OFF:
        out[f"nummon + {probe} only, every step"] = {**base, "mechanisms": {**OFF, probe: True, "every": 1}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = ProxyConfig(lr=0.01)
    torch.manual_seed(0)
    model = TinyLM(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Corpus(c)
    batches = [data.batch() for _ in range(8)]
    every = nummon.Policy().mechanisms.every
    vs = variants(every)
    times: dict[str, list[float]] = {k: [] for k in vs}

    def run(policy: dict | None, steps: int) -> float:
        mon = nummon.Monitor(model, opt, policy=policy) if policy is not None else None
        t = []
        for i in range(steps):
            x, y = batches[i % len(batches)]
            t0 = time.thread_time()
            loss = F.cross_entropy(model(x).reshape(-1, c.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.post_step(loss)
            t.append(time.thread_time() - t0)
        if mon is not None:
            mon.close()
        return statistics.fmean(t)  # the mean: a sampled step is one in `every`

    for name, pol in vs.items():  # warm-up
        run(pol, every)
    for _ in range(args.rounds):
        order = list(vs)
        random.shuffle(order)
        for name in order:
            times[name].append(run(vs[name], every))
    bare = statistics.median(times["bare"])
    print(f"bare step: {bare * 1e3:.2f} ms CPU (median of {args.rounds} blocks of {every} steps, 1 thread)")
    print("| variant | step / bare step | vs probes off (% of a bare step) |")
    print("|---|---|---|")
    off = statistics.median(times["nummon, probes off"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m / bare:.4f} | {(m - off) / bare * 100:+.2f}% |")


if __name__ == "__main__":
    main()

"""Cost of the sampled mechanism probes, as ratios side by side in one process: on the CPU
proxy LM (benchmarks/proxies/lm.py: d 128, 2 blocks, 4 heads, batch 16 x 64 tokens, AdamW) by
default, or any workload of `overhead_scale.py` (`--workload lm12`).

The variants: the bare training step; nummon with the probes off; with the probes at the
default cadence; all probes at every step; and each probe alone at every step (its cost per
sampled step, with the capture's own). Each trains its own copy of the model with its Monitor
kept for the whole run, the variants taking turns step by step (`overhead_scale.measure`);
time is this thread's CPU time (torch on one thread), so other processes add little but
contention. "vs probes off" is the difference in percent of a bare step.

    flock /work/bench.lock .venv/bin/python -m benchmarks.mechanisms_overhead [--rounds N] [--workload W] [--no-single]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import overhead_scale  # noqa: E402

import nummon  # noqa: E402

OFF = {"attention": False, "output": False, "adam": False, "linear_rms": False}


def variants(every: int) -> dict:
    base = {"alerts": {"stop_on_critical": False}, "recorder": {"write": False}}
    mon = overhead_scale.attach_monitor
    out = {
        "bare": overhead_scale.bare,
        "bare (A/A)": overhead_scale.bare,
        "nummon, probes off": mon({**base, "mechanisms": {"enabled": False}}),
        f"nummon, probes every {every} (default)": mon({**base, "mechanisms": {"every": every}}),
        "nummon, all probes every step": mon({**base, "mechanisms": {"every": 1}}),
    }
    for probe in OFF:
        out[f"nummon + {probe} only, every step"] = mon({**base, "mechanisms": {**OFF, probe: True, "every": 1}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="steps per round (a multiple of the cadence)")
    ap.add_argument("--workload", default="proxy")
    ap.add_argument(
        "--no-single", action="store_true", help="leave out the one-probe-only variants (more rounds in the same time)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    overhead_scale.CLOCK = time.thread_time
    every = nummon.Policy().mechanisms.every
    vs = variants(every)
    if args.no_single:
        vs = {k: v for k, v in vs.items() if " only, " not in k}
    r = overhead_scale.measure(args.workload, torch.device("cpu"), args.rounds, args.steps, 5, vs)
    print(
        f"{args.workload}: bare step {r['bare_ms']:.2f} ms CPU (paired medians of {args.rounds} rounds of "
        f"{args.steps} steps, variants in turn step by step, 1 thread)"
    )
    print("| variant | step / bare step | vs probes off (% of a bare step) |")
    print("|---|---|---|")
    off = r["variants"]["nummon, probes off"]["paired_ratio"]
    for name, v in r["variants"].items():
        print(f"| {name} | {v['paired_ratio']:.4f} | {(v['paired_ratio'] - off) * 100:+.2f}% |")


if __name__ == "__main__":
    main()

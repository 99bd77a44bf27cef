"""What the activation probes' forward hooks cost, per hooked module, on the host-cost shapes.

Times one training forward+backward of each shape (CPU, medians of interleaved rounds, each
variant a copy of the same model): bare; with a no-op forward hook on each module nummon hooks
on a measuring step (the cost of being called); with nummon's probes as a Monitor hooks them on a
measuring step (every `activations_every` steps: every watched module while a model has at most
`FULL_LIMIT`, else the block boundaries); and with the probes limited to the block boundaries
whatever the model's size. Reports ms per step and µs per hooked module.

    python benchmarks/hook_cost.py [--shapes mlp,lm2,lm8,cnn] [--rounds 15] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from overhead import steady_allocator  # noqa: E402
from overhead_scale import workload  # noqa: E402

from nummon._stats import probes as probes_module  # noqa: E402
from nummon._stats.probes import ActivationProbes  # noqa: E402


def _probes(model: torch.nn.Module, full_limit: int | None) -> ActivationProbes:
    saved = probes_module.FULL_LIMIT
    if full_limit is not None:
        probes_module.FULL_LIMIT = full_limit
    try:
        p = ActivationProbes()
        p.install(model)
        p.arm(True, False)  # hooked as on a measuring step (a Monitor: every `activations_every` steps)
    finally:
        probes_module.FULL_LIMIT = saved
    return p


def _noop_hooks(model: torch.nn.Module, like: ActivationProbes) -> int:
    """A do-nothing forward hook on each module of `model` that `like` hooks every step."""
    by_name = dict(model.named_modules())
    hooked = [n for i, n in enumerate(like.names) if like._always is None or i in like._always]
    for n in hooked:
        by_name[n].register_forward_hook(lambda _m, _i, _o: None)
    return len(hooked)


def measure(shape: str, rounds: int, steps: int) -> dict[str, tuple[float, int]]:
    """{variant: (paired ratio to the bare step, hooks called a step)}; also printed."""
    torch.manual_seed(0)
    base, _, loss_fn = workload(shape, torch.device("cpu"))
    variants: dict[str, tuple[torch.nn.Module, int]] = {"bare": (base, 0)}
    m_probes = copy.deepcopy(base)
    p_default = _probes(m_probes, None)
    n_default = len(p_default._hooks)
    m_noop = copy.deepcopy(base)
    n_noop = _noop_hooks(m_noop, p_default)
    m_bounds = copy.deepcopy(base)
    p_bounds = _probes(m_bounds, 0)
    variants.update(
        {
            "no-op hooks": (m_noop, n_noop),
            "probes (as installed)": (m_probes, n_default),
            "probes, boundaries only": (m_bounds, len(p_bounds._hooks)),
        }
    )
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):
        for name, (model, _) in variants.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                loss_fn(model).backward()
                model.zero_grad(set_to_none=True)
            if r:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / steps * 1e3)
            for p in (p_default, p_bounds):
                p.take(False)  # the probes' per-step reset, as the collector does
    bare = statistics.median(times["bare"])
    out = {}
    for name, (_, hooks) in variants.items():
        # paired: each round's time over the bare step of the same round, then the median
        ratio = statistics.median(t / b for t, b in zip(times[name], times["bare"]))
        per = (ratio - 1) * bare * 1e3 / hooks if hooks else 0.0
        out[name] = (ratio, hooks)
        print(
            f"{shape:4} {name:26} {bare * ratio:8.3f} ms  paired {ratio:6.3f}  {hooks:3d} hooks  {per:7.1f} µs a hook"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mlp,lm2,lm8,cnn")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    steady_allocator()  # glibc's thresholds fixed, as overhead.py does: big tensors reuse memory
    for shape in a.shapes.split(","):
        measure(shape, a.rounds, a.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

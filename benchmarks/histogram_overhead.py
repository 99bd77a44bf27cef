"""What default histograms cost, and the cadence that keeps them inside the CPU budget.

On the demo CNN (batch 64, SGD momentum, CPU) it measures, interleaved round by round:
- the bare training step (forward, backward, optimizer step);
- the monitored step without histograms (`Monitor.post_step`, every-step statistics);
- one histogram pass: `StatsCollector.histograms()` (weights, gradients, activations, log10|x|)
  plus `TensorBoardSink.on_histograms` writing them (the sink's thread shares the CPU).
Then the smallest cadence N with monitored + pass/N <= 1.05 x bare, and the ratio at
`DEFAULT_HISTOGRAM_EVERY`.

    python benchmarks/histogram_overhead.py [--rounds 20] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the checkout's own package first: a benchmark measures the code beside it (an editable install
# of another checkout, or an older installed version, would otherwise answer `import nummon`)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from overhead import steady_allocator  # noqa: E402

import nummon  # noqa: E402
from nummon._sinks.layout import DEFAULT_HISTOGRAM_EVERY  # noqa: E402
from nummon._tools.demo_model import DemoCNN  # noqa: E402
from nummon.integrations.tensorboard import TensorBoardSink  # noqa: E402

BUDGET = 1.05  # the CPU budget: monitored step with histograms / bare step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    steady_allocator()
    torch.manual_seed(0)
    model = DemoCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    with tempfile.TemporaryDirectory() as tmp:
        sink = TensorBoardSink(os.path.join(tmp, "tb"), histogram_every=1)
        mon = nummon.Monitor(model, opt, policy={"sampling": {"histogram_every": 0}}, run_dir=tmp)
        bare, monitored, passes = [], [], []
        for r in range(args.rounds + 1):  # round 0 warms up
            for _ in range(args.steps):
                t = time.perf_counter()
                train_step()
                if r:
                    bare.append(time.perf_counter() - t)
            for _ in range(args.steps):
                t = time.perf_counter()
                mon.post_step(train_step())
                if r:
                    monitored.append(time.perf_counter() - t)
            mon._stats.want_activation_histograms(True)  # the next forward keeps its outputs
            mon.post_step(train_step())
            t = time.perf_counter()
            sink.on_histograms(r, mon._stats.histograms())
            if r:
                passes.append(time.perf_counter() - t)
            mon._stats.want_activation_histograms(False)
        mon.close()
        sink.close()
    b, m, h = (statistics.median(v) for v in (bare, monitored, passes))
    room = BUDGET * b - m  # what the budget leaves for histograms, per step
    n_min = math.ceil(h / room) if room > 0 else None
    out = {
        "bare_step_ms": round(b * 1e3, 2),
        "monitored_step_ms": round(m * 1e3, 2),
        "monitored_ratio": round(m / b, 4),
        "histogram_pass_ms": round(h * 1e3, 2),
        "histogram_pass_in_steps": round(h / b, 2),
        "min_cadence_for_budget": n_min,
        "default_cadence": DEFAULT_HISTOGRAM_EVERY,
        "ratio_at_default_cadence": round((m + h / DEFAULT_HISTOGRAM_EVERY) / b, 4),
        "histogram_share_at_default": round(h / DEFAULT_HISTOGRAM_EVERY / b, 5),
        "rounds": args.rounds,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

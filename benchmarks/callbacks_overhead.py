"""Overhead of the Lightning and Hugging Face callbacks, as a ratio to the same Trainer step
without them, side by side (issue 14; the issue-5 budget is <= 1.05 on the demo CNN).

Each round fits the demo CNN (batch 64, SGD momentum 0.9, CPU) once without and once with
the framework's nummon callback (`NummonLightningCallback`, `NummonTrainerCallback`), in a new order each round; a timing callback takes the wall time between
consecutive optimizer steps after `--warmup` steps, and each variant's median over all rounds
is divided by the bare one's.

    python benchmarks/callbacks_overhead.py [--framework lightning|transformers|both]
        [--rounds N] [--steps K] [--warmup W] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch import nn

# the checkout's own package first: a benchmark measures the code beside it (an editable install
# of another checkout, or an older installed version, would otherwise answer `import nummon`)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nummon._tools.demo_model import DemoCNN  # noqa: E402

__all__ = ["main"]

BATCH = 64


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


# ---------------------------------------------------------------- Lightning


def lightning_step_times(steps: int, warmup: int, monitored: bool, root: str) -> list[float]:
    import lightning.pytorch as pl

    from nummon.integrations.lightning import NummonLightningCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = DemoCNN()

        def training_step(self, batch, _idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Timer(pl.Callback):
        def __init__(self):
            self.stamps: list[float] = []

        def on_train_batch_end(self, *args, **kwargs):
            self.stamps.append(time.perf_counter())

    torch.manual_seed(0)
    timer = Timer()
    callbacks = [timer] + ([NummonLightningCallback(follow_loggers=False)] if monitored else [])
    x, y = _images(BATCH * (steps + warmup))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps + warmup,
        logger=False,
        callbacks=callbacks,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data)
    return _intervals(timer.stamps, warmup)


# ---------------------------------------------------------------- Hugging Face


def transformers_step_times(steps: int, warmup: int, monitored: bool, root: str) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nummon.integrations.transformers import NummonTrainerCallback

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = DemoCNN()

        def forward(self, pixel_values, labels):
            logits = self.net(pixel_values)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Images(torch.utils.data.Dataset):
        def __init__(self, n):
            self.x, self.y = _images(n)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"pixel_values": self.x[i], "labels": self.y[i]}

    class Timer(TrainerCallback):
        def __init__(self):
            self.stamps: list[float] = []

        def on_step_end(self, *args, **kwargs):
            self.stamps.append(time.perf_counter())

    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    timer = Timer()
    callbacks = [timer] + ([NummonTrainerCallback(follow_report_to=False)] if monitored else [])
    args = TrainingArguments(
        output_dir=root,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_steps=steps + warmup,
        per_device_train_batch_size=BATCH,
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    Trainer(
        model=model,
        args=args,
        train_dataset=Images(BATCH * (steps + warmup)),
        optimizers=(opt, sched),
        callbacks=callbacks,
    ).train()
    return _intervals(timer.stamps, warmup)


def _intervals(stamps: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]


RUNNERS = {"lightning": lightning_step_times, "transformers": transformers_step_times}


def measure(framework: str, rounds: int, steps: int, warmup: int) -> dict:
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = [False, True]
            random.Random(r).shuffle(order)
            for monitored in order:
                times[monitored] += RUNNERS[framework](steps, warmup, monitored, os.path.join(tmp, f"r{r}{monitored}"))
    bare, mon = statistics.median(times[False]), statistics.median(times[True])
    return {
        "framework": framework,
        "bare_step_ms": bare * 1e3,
        "nummon_step_ms": mon * 1e3,
        "ratio": mon / bare,
        "steps_timed_each": len(times[False]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["lightning", "transformers", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "nummon"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    frameworks = ["lightning", "transformers"] if a.framework == "both" else [a.framework]
    results = [measure(f, a.rounds, a.steps, a.warmup) for f in frameworks]
    print(f"{'framework':<14}{'bare ms/step':>14}{'nummon ms/step':>16}{'ratio':>8}")
    for r in results:
        print(f"{r['framework']:<14}{r['bare_step_ms']:>14.2f}{r['nummon_step_ms']:>16.2f}{r['ratio']:>8.3f}")
    if a.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "workload": f"DemoCNN 28x28, batch {BATCH}, SGD momentum 0.9, CPU",
            "rounds": a.rounds,
            "steps": a.steps,
            "warmup": a.warmup,
        }
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

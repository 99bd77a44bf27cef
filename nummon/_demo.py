"""`nummon demo`: reproduce the motivating failure on synthetic data, with every sink attached.

A small CNN (two conv layers, fc1, fc2, LeakyReLU 0.01, no normalisation) trained with SGD and
momentum 0.9 on five of ten synthetic classes, then switched to the other five, recorded by a
sensor with three times the contrast (a domain switch). At the default learning rate the switch
starts a runaway that ends in a NaN some 20 steps later; nummon warns at the switch. With
`--healthy` the same model trains at a safe learning rate on all ten classes, with no switch.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._errors import NummonError

DEFAULT_STEPS = 120
SWITCH_STEP = 60
RUNAWAY_LR = 0.02  # runs away after the switch for every seed tried (0.015..0.03 all do)
HEALTHY_LR = 0.005
DOMAIN_B_GAIN = 3.0
BATCH = 64


class DemoCNN(nn.Module):
    """Two conv layers (32, 64 channels) on 28x28 inputs, max-pool, fc1 12544->128, fc2 128->10."""

    def __init__(self, width: int = 32, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * 14 * 14, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(x))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc2(x)


class SyntheticDigits:
    """Ten classes of 28x28 images: a shared pattern plus a weaker pattern per class plus noise
    (learnable, not trivially), made on the fly from a seeded CPU generator (the same bytes on
    every machine and torch version)."""

    def __init__(self, seed: int = 0, noise: float = 1.0, separation: float = 0.6) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.rand(1, 1, 7, 7, generator=g)
        per_class = torch.rand(10, 1, 7, 7, generator=g)
        # nearest-neighbour upsampling by 4 is a pure repeat: identical on every backend
        coarse = base + separation * per_class
        self.prototypes = coarse.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)
        self.noise = noise
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, classes: range, size: int = BATCH, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of `size` images of the given classes; `gain` scales the images (contrast)."""
        lo, n = classes.start, len(classes)
        y = torch.randint(0, n, (size,), generator=self.gen) + lo
        x = self.prototypes[y] + self.noise * torch.randn(size, 1, 28, 28, generator=self.gen)
        return x * gain, y

    def stream(self, step: int, healthy: bool = False, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
        """The demo's batch at `step`: domain A (classes 0-4) then domain B (5-9, 3x contrast)."""
        if healthy:
            return self.batch(range(0, 10), size)
        if step < SWITCH_STEP:
            return self.batch(range(0, 5), size)
        return self.batch(range(5, 10), size, gain=DOMAIN_B_GAIN)


def _default_out() -> Path:
    return Path("nummon-runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


class _Progress:
    """A one-line progress bar with the current health state (plain lines when not a tty)."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = -1

    def update(self, step: int, loss: float, health: str) -> None:
        width = 30
        done = int(width * (step + 1) / self.total)
        line = f"[{'#' * done}{'.' * (width - done)}] step {step + 1:4d}/{self.total}  loss {loss:10.4g}  {health}"
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif step // 20 != self.last:
            self.last = step // 20
            self.stream.write(line + "\n")

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def run_demo(args: Any) -> int:
    """The CLI entry: train, monitor, print the closing table and the commands to look further."""
    from ._format import records_table
    from ._monitor import Monitor
    from ._policy import load_policy
    from ._sinks import ConsoleSink, JsonlSink
    from ._types import Health, Severity

    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if steps < 1:
        raise NummonError(f"--steps must be >= 1, got {steps}")
    lr = args.lr if args.lr is not None else (HEALTHY_LR if args.healthy else RUNAWAY_LR)
    if not (lr > 0 and math.isfinite(lr)):
        raise NummonError(f"--lr must be a positive number, got {lr}")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except Exception as e:
        raise NummonError(f"--device {args.device!r} is not usable here ({str(e).splitlines()[0]})") from None
    out = Path(args.out) if args.out else _default_out()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NummonError(f"cannot create the output folder {out}: {e.strerror}") from None

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)
    model = DemoCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = SyntheticDigits(args.seed)

    sinks: list[Any] = [ConsoleSink(min_severity=Severity.WARNING), JsonlSink(out / "events.jsonl")]
    notes: list[str] = []
    if not args.no_tensorboard:
        try:
            from .integrations.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(out / "tensorboard"))
            notes.append(f"tensorboard --logdir {out / 'tensorboard'}")
        except ImportError as e:
            print(f"(TensorBoard sink skipped: {e})", file=sys.stderr)
    wandb_sink = None
    if not args.no_wandb:
        try:
            from .integrations.wandb import WandbSink

            os.environ.setdefault("WANDB_SILENT", "true")
            os.environ.setdefault("WANDB_CONSOLE", "off")
            wandb_sink = WandbSink(project="nummon-demo", dir=str(out), config={"lr": lr, "seed": args.seed, "steps": steps})
            sinks.append(wandb_sink)
        except ImportError as e:
            print(f"(W&B sink skipped: {e})", file=sys.stderr)

    policy = load_policy(args.policy)
    if not policy.sampling.histogram_every:  # the demo shows histograms unless the policy says otherwise
        policy = policy.model_copy(update={"sampling": policy.sampling.model_copy(update={"histogram_every": 20})})
    mon = Monitor(model, opt, policy=policy, sinks=sinks, run_dir=out)
    mode = "healthy" if args.healthy else "runaway"
    story = "all 10 classes, no switch" if args.healthy else f"classes 0-4, then 5-9 at 3x contrast from step {SWITCH_STEP}"
    print(f"nummon demo ({mode}): DemoCNN, SGD lr={lr:g} momentum=0.9, {story}, {steps} steps on {device}; output in {out}")
    bar = _Progress(steps)
    first_nonfinite = None
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            x, y = data.stream(step, healthy=args.healthy)
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            report = mon.post_step(loss, batch=(x, y))
            bar.update(step, float(loss.detach()), report.health.value)
            if report.health is Health.NONFINITE:
                first_nonfinite = report.step
                break
            if args.stop_at_critical and report.should_stop:
                break
        final = mon.flush()
        if final is not None and final.health is Health.NONFINITE and first_nonfinite is None:
            first_nonfinite = final.step
    finally:
        bar.done()
        mon.close()
    elapsed = time.perf_counter() - t0

    alerts = [a for a in mon.alerts if not a.cleared]
    warned = [a for a in alerts if a.severity.rank >= Severity.WARNING.rank]
    crit = [a for a in alerts if a.severity is Severity.CRITICAL]
    first_warn = min((a.step for a in warned), default=None)
    first_crit = min((a.step for a in crit), default=None)
    records = mon.recent()
    print()
    print(records_table(_closing_rows(records, first_warn, first_crit, first_nonfinite)))
    print()
    if first_warn is None:
        print(f"no warning in {len(records) and records[-1]['step'] + 1} steps: the run stayed healthy.")
    else:
        parts = [f"warned at step {first_warn}"]
        parts.append(f"critical at step {first_crit}" if first_crit is not None else "no critical alert")
        if first_nonfinite is not None:
            parts.append(f"first non-finite at step {first_nonfinite}")
            sentence = ", ".join(parts) + f" — {first_nonfinite - first_warn} steps of warning."
        else:
            sentence = ", ".join(parts) + " — no non-finite value."
        print(sentence)
        nf = next((a for a in alerts if a.kind.value == "nonfinite"), None)
        if nf is not None:
            print(f"The first NaN appeared in: {nf.location}.")
        first = next(a for a in warned if a.step == first_warn)
        print(f"First warning: {first.kind.value} — {first.message}")
    print(f"({elapsed:.1f} s; events: {out / 'events.jsonl'}"
          + (f"; flight record: {mon.flight_record}" if mon.flight_record else "") + ")")
    for n in notes:
        print(f"View in TensorBoard:  {n}")
    if wandb_sink is not None and wandb_sink.run_dir:
        if wandb_sink.offline:
            print(f"Upload to W&B:        wandb sync {wandb_sink.run_dir}")
        else:
            print(f"W&B run:              {getattr(wandb_sink.run, 'url', '')}")
    return 0


def _closing_rows(records: list[dict], warn: int | None, crit: int | None, nonfinite: int | None) -> list[dict]:
    """Rows around the event: two before the first warning to two after, then the last steps."""
    end = nonfinite if nonfinite is not None else crit
    if end is None or warn is None:
        return records[-8:]
    head = [r for r in records if warn - 2 <= r["step"] <= warn + 2]
    tail = [r for r in records if max(warn + 3, end - 8) <= r["step"] <= end]
    gap = tail and head and tail[0]["step"] > head[-1]["step"] + 1
    return head + ([{"step": "..."}] if gap else []) + tail

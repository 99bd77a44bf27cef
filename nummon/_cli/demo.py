"""`nummon demo`: reproduce a runaway on synthetic data with every sink, then print the closing
table and the commands to look further. Every option is checked before anything is created."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import pickle
import sys
from typing import IO, Any, TextIO

from .._core.alert_text import records_table
from .._core.text import clean_text
from .._engine.outcome import rollback_message
from .._tools.demo_config import DEFAULT_STEPS, DOMAIN_B_GAIN, HEALTHY_LR, RUNAWAY_LR, SWITCH_STEP
from ._common import non_empty, note, seed

__all__ = ["Progress", "add_parser", "run"]

PROGRESS_EVERY = 20  # steps between progress lines when stderr is not a terminal


def add_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="reproduce a runaway on synthetic data, with every sink")
    d.add_argument(
        "--out",
        default=None,
        type=non_empty("a folder path"),
        help="output folder (default: ./nummon-runs/<timestamp>)",
    )
    d.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default: {DEFAULT_STEPS})")
    d.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (default: runaway {RUNAWAY_LR:g}, --healthy {HEALTHY_LR:g})",
    )
    d.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of the model, the data and the batches, from 0 to 2**63 - 1 (default: 0)",
    )
    d.add_argument(
        "--device",
        default="cpu",
        type=non_empty("a torch device"),
        help="torch device to train on, e.g. cpu, cuda, cuda:1 (default: cpu)",
    )
    d.add_argument("--healthy", action="store_true", help="a safe learning rate: must end with no warning")
    d.add_argument("--stop-at-critical", action="store_true", help="stop at the first critical alert")
    d.add_argument("--no-wandb", action="store_true", help="skip the W&B sink")
    d.add_argument("--no-tensorboard", action="store_true", help="skip the TensorBoard sink")
    d.add_argument(
        "--policy", default="default", help="a preset (default, strict, recover) or a policy file (default: default)"
    )
    d.add_argument(
        "--recover",
        action="store_true",
        help="opt-in recovery: skip poisoned updates, roll back a runaway and lower the LR",
    )
    d.set_defaults(run=run)


class Progress:
    """A one-line progress bar with the current health state (plain lines when not a tty).
    Steps count from 0, as in the table and the alerts: the last of 120 steps is step 119."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = -1

    def line(self, step: int, loss: float, health: str) -> str:
        width = 30
        done = int(width * (step + 1) / self.total)
        return (
            f"[{'#' * done}{'.' * (width - done)}] step {step:4d} (last {self.total - 1})  loss {loss:10.4g}  {health}"
        )

    def update(self, step: int, loss: float, health: str) -> None:
        line = self.line(step, loss, health)
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif step // PROGRESS_EVERY != self.last:
            self.last = step // PROGRESS_EVERY
            self.stream.write(line + "\n")

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._tools import demo as _demo
    from .._tools.demo_config import DemoConfig
    from .policy import load_policy_with_hints

    load_policy_with_hints(args.policy)  # an invalid file's error carries the "did you mean" hints

    config = DemoConfig(
        out=args.out,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        healthy=args.healthy,
        stop_at_critical=args.stop_at_critical,
        wandb=not args.no_wandb,
        tensorboard=not args.no_tensorboard,
        policy=args.policy,
        recover=args.recover,
    )
    plan = _demo.prepare(config)  # every check first: bad input creates nothing
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    mode = ("healthy" if args.healthy else "runaway") + (", with recovery" if plan.policy.recovery.enabled else "")
    story = (
        "all 10 classes, no switch"
        if args.healthy
        else f"classes 0-4, then 5-9 at {DOMAIN_B_GAIN:g}x contrast from step {SWITCH_STEP}"
    )
    print(
        f"nummon demo ({mode}): DemoCNN, SGD lr={plan.lr:g} momentum=0.9, {story}, steps 0-{config.steps - 1} "
        f"on {plan.device}; output in {plan.out}",
        flush=True,
    )
    bar = Progress(config.steps)
    try:
        result = _demo.run(plan, on_step=bar.update)
    finally:
        bar.done()
    for n in result.notes:
        note(n)
    _print_summary(result)
    return 0


def _print_summary(result: Any) -> None:
    print()
    print(records_table(result.closing_rows()))
    print()
    if result.first_warning is None:
        print(f"no warning in {result.steps_run} steps: the run stayed healthy.")
    else:
        parts = [f"warned at step {result.first_warning}"]
        parts.append(
            f"critical at step {result.first_critical}" if result.first_critical is not None else "no critical alert"
        )
        if result.first_nonfinite is not None:
            parts.append(f"first non-finite at step {result.first_nonfinite}")
            print(", ".join(parts) + f" — {result.first_nonfinite - result.first_warning} steps of warning.")
        else:
            print(", ".join(parts) + " — no non-finite value.")
        if result.nonfinite_location is not None:
            print(clean_text(f"The first NaN appeared in: {result.nonfinite_location}."))
        if result.cause is not None:
            c = result.cause
            print(clean_text(f"Why: {c.headline()}"))
            print(clean_text(f"Try: {c.remedy}"))
        first = result.first_warning_alert
        if first is not None:
            print(clean_text(f"First warning: {first.kind.value} — {first.message}"))
    for r in result.recoveries:
        if r.get("action") in ("rollback", "gave_up"):
            print(
                clean_text(
                    f"Recovery at step {r['step']}: "
                    + (rollback_message(r).removeprefix("recovered: ") if r.get("action") == "rollback" else "gave up")
                )
            )
    skips = sum(1 for r in result.recoveries if r.get("action") == "skip")
    if skips:
        print(f"Recovery skipped {skips} poisoned update(s).")
    print(
        f"({result.elapsed_s:.1f} s; events: {result.events_path}"
        + (f"; flight record: {result.flight_record}" if result.flight_record else "")
        + ")"
    )
    if result.tensorboard_dir is not None:
        print(f"View in TensorBoard:  tensorboard --logdir {result.tensorboard_dir}")
    if result.wandb_run_dir:
        if result.wandb_offline:
            print(f"Upload to W&B:        wandb sync {result.wandb_run_dir}")
        else:
            print(f"W&B run:              {result.wandb_url or ''}")


def skipped(e: BaseException) -> str:
    """The one-line note for a W&B sink that could not start."""
    if isinstance(e, ImportError):
        return f"W&B sink skipped: {e}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"W&B sink skipped: {type(e).__name__}: {first[:200]}"


def wandb_child(calls: IO[bytes], out: TextIO) -> dict[str, Any]:
    """The demo's W&B process (`nummon._tools.demo._WandbProcess`): read pickled sink calls from
    `calls` (the first: the `WandbSink` arguments) and hand them to a real `WandbSink` in order
    until the parent closes the pipe; finish the run; write the outcome to `out` as one JSON line
    (run_dir, offline, url; or error). A failing call is logged once, like the Monitor's
    dispatcher does, and the others go on."""
    result: dict[str, Any]
    try:
        _, (init_kwargs,) = pickle.load(calls)
        from ..integrations.wandb import WandbSink

        sink = WandbSink(**init_kwargs)
        WandbSink.warm_imports()  # this process idles while the demo trains: the pictures come at its end
        failed = False
        while True:
            try:
                method, args = pickle.load(calls)
            except EOFError:
                break
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                if not failed:
                    logging.getLogger("nummon").warning(
                        "nummon: sink WandbSink failed in %s (%s: %s)", method, type(e).__name__, e
                    )
                failed = True
        sink.close()
        result = {"run_dir": sink.run_dir, "offline": sink.offline, "url": getattr(sink.run, "url", None)}
    except Exception as e:  # W&B did not start: the demo goes on without it and says why
        result = {"error": skipped(e)}
    out.write(json.dumps(result) + "\n")
    out.flush()
    return result


def wandb_child_main() -> None:
    """The W&B process's entry point: sink calls on stdin, the outcome on stdout, W&B's and
    nummon's messages on stderr (the demo's own)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    wandb_child(sys.stdin.buffer, sys.stdout)
    gc.freeze()  # the run is finished and its files closed: skip the final collections the demo waits for

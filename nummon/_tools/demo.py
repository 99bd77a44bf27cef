"""The demo run: reproduce the motivating failure on synthetic data, with every sink attached.

A small CNN (`_demo_model.DemoCNN`, narrow: `_demo_config`) trained with SGD and momentum 0.9
on five of ten synthetic classes, then switched to the other five, recorded by a sensor with
four times the contrast (a domain switch). At the default learning rate the switch starts a
runaway that ends in a NaN some 11 steps later; nummon warns at the switch. With `healthy` the same model trains at a safe
learning rate on all ten classes, with no switch.

`prepare` checks every input and creates nothing; `run` trains and returns a `DemoResult`.
Printing is the CLI's job (`nummon._cli.demo`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError
from .._core.events import IncidentEvent
from .._core.types import Alert, Health, Severity, StepRecord
from .._policy.policy import Policy, load_policy
from .._sinks.builtin import BaseSink, RunContext
from .demo_config import DEMO_BATCH, HEALTHY_LR, HIDDEN, IMAGE_SIDE, RUNAWAY_LR, WIDTH, DemoConfig
from .demo_model import DemoCNN, SyntheticDigits

__all__ = ["DemoConfig", "DemoPlan", "DemoResult", "StepCallback", "prepare", "run"]

#: W&B's run modes (`wandb.init(mode=...)`); "online", "run" and "shared" need credentials.
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
_ONLINE = ("online", "run", "shared")
HISTOGRAM_EVERY = 20  # steps between histograms, unless the policy asks for them

#: Called after each step with (step, loss, health name); steps count from 0.
StepCallback = Callable[[int, float, str], None]


@dataclass
class DemoPlan:
    """A checked configuration: nothing is created until `run`."""

    config: DemoConfig
    out: Path
    lr: float
    device: torch.device
    policy: Policy
    wandb_mode: str | None  # the WANDB_MODE the W&B sink will see (None: W&B decides)
    notes: list[str] = field(default_factory=list)  # one-line remarks for the user


@dataclass
class DemoResult:
    """What happened: the records, the alerts and the first step of each severity."""

    plan: DemoPlan
    steps_run: int
    elapsed_s: float
    records: list[dict]  # the flight recorder's last steps
    alerts: list[Alert]  # raised (not cleared) alerts, in order
    first_warning: int | None
    first_critical: int | None
    first_nonfinite: int | None
    flight_record: str | None
    cause: Any  # a NonfiniteReport: why the first non-finite loss happened (None: no NaN)
    recoveries: list[dict]  # what recovery did (empty when off)
    tensorboard_dir: Path | None
    wandb_run_dir: str | None
    wandb_offline: bool
    wandb_url: str | None
    notes: list[str]

    @property
    def events_path(self) -> Path:
        return self.plan.out / "events.jsonl"

    @property
    def first_warning_alert(self) -> Alert | None:
        return next(
            (a for a in self.alerts if a.step == self.first_warning and a.severity.rank >= Severity.WARNING.rank), None
        )

    @property
    def nonfinite_location(self) -> str | None:
        return next((a.location for a in self.alerts if a.kind.value == "nonfinite"), None)

    def closing_rows(self) -> list[dict]:
        """Rows around the event: two before the first warning to two after, then the last
        steps up to the first non-finite (or critical) step; a {"step": "..."} row marks a gap."""
        warn = self.first_warning
        end = self.first_nonfinite if self.first_nonfinite is not None else self.first_critical
        if end is None or warn is None:
            return self.records[-8:]
        head = [r for r in self.records if warn - 2 <= r["step"] <= warn + 2]
        tail = [r for r in self.records if max(warn + 3, end - 8) <= r["step"] <= end]
        gap = tail and head and tail[0]["step"] > head[-1]["step"] + 1
        return head + ([{"step": "..."}] if gap else []) + tail


def _default_out() -> Path:
    return Path("nummon-runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _wandb_mode(notes: list[str]) -> str | None:
    """WANDB_MODE checked before anything starts: an unknown mode is an error; an online mode
    without credentials falls back to offline with a note."""
    raw = os.environ.get("WANDB_MODE")
    if raw is None or not raw.strip():
        return None
    mode = raw.strip().lower()
    if mode not in WANDB_MODES:
        raise NummonError(
            f"WANDB_MODE={raw!r} is not a W&B mode (one of {', '.join(WANDB_MODES)}); fix it or pass --no-wandb"
        )
    if mode in _ONLINE:
        from ..integrations.wandb import WandbSink

        if not WandbSink.has_credentials():
            notes.append(
                f"W&B: WANDB_MODE={raw} but no API key is set: logging offline instead (sync later with `wandb sync`)"
            )
            return "offline"
    return mode


def prepare(config: DemoConfig) -> DemoPlan:
    """Check every input (steps, lr, device, policy, W&B mode); raise NummonError on the first
    bad one. Creates no file or folder."""
    if config.steps < 1:
        raise NummonError(f"--steps must be >= 1, got {config.steps}")
    lr = config.lr if config.lr is not None else (HEALTHY_LR if config.healthy else RUNAWAY_LR)
    if not (lr > 0 and math.isfinite(lr)):
        raise NummonError(f"--lr must be a positive number, got {lr}")
    try:
        device = torch.device(config.device)
        torch.empty(0, device=device)
    except Exception as e:
        raise NummonError(
            f"--device {config.device!r} is not usable here ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    policy = load_policy(config.policy)
    if config.recover and not policy.recovery.enabled:
        policy = policy.model_copy(update={"recovery": load_policy("recover").recovery})
    if not policy.sampling.histogram_every:  # the demo shows histograms unless the policy says otherwise
        policy = policy.model_copy(
            update={"sampling": policy.sampling.model_copy(update={"histogram_every": HISTOGRAM_EVERY})}
        )
    notes: list[str] = []
    wandb_mode = _wandb_mode(notes) if config.wandb else None
    out = Path(config.out) if config.out else _default_out()
    if out.exists() and not out.is_dir():
        raise NummonError(f"cannot use the output folder {out}: a file of that name exists")
    return DemoPlan(config, out, lr, device, policy, wandb_mode, notes)


class _WandbProcess(BaseSink):
    """The demo's `WandbSink`, run in a child process (`nummon._cli.demo.wandb_child`).

    The W&B client's start is some 3 s of Python, not of waiting: importing wandb, and
    `wandb.init` (which imports W&B's launch and artifact models and lists the installed
    packages; slower with torch loaded). In this process it would hold the interpreter lock the
    training needs; in the child it runs on the second core while this process imports torch and
    trains. Each sink call is pickled to the child, which hands it to a real `WandbSink` in the
    order the Monitor sent it; `close` waits for the child's run to finish. In your own script,
    pass `WandbSink(...)` to the Monitor: its start then precedes training by those seconds.
    `result` holds the child's outcome: the run folder, whether offline, the URL, or `error`."""

    wants_histograms = True
    histogram_every = None  # WandbSink's own default: every histogram the Monitor takes

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        # the child imports this very nummon: its folder goes first on the child's path unless
        # it is there already (an installed nummon's site-packages must not shadow the stdlib)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (
            f"import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r); "
            "from nummon._cli.demo import wandb_child_main; wandb_child_main()"
        )
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._gone = False
        self.result: dict[str, Any] = {}
        self._send("init", init_kwargs)

    def _send(self, method: str, *args: Any) -> None:
        if self._gone:
            return
        try:
            assert self._proc.stdin is not None
            pickle.dump((method, args), self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()
        except OSError:  # the child has ended (W&B did not start): its result says why
            self._gone = True

    def bind(self, context: RunContext) -> None:
        self._send("bind", context)

    def on_step(self, record: StepRecord, health: Health) -> None:
        self._send("on_step", record, health)

    def on_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        self._send("on_histograms", step, histograms)

    def on_alert(self, alert: Alert) -> None:
        self._send("on_alert", alert)

    def on_incident(self, event: IncidentEvent) -> None:
        self._send("on_incident", event)

    def close(self) -> None:
        """Let the child log what it was sent and finish its run; read its outcome."""
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        assert self._proc.stdout is not None
        lines = self._proc.stdout.read().decode(errors="replace").strip().splitlines()
        self._proc.wait()
        if lines[:-1]:  # W&B's own output, when WANDB_SILENT is off: the user's to read
            print("\n".join(lines[:-1]), flush=True)
        try:
            self.result = json.loads(lines[-1])
        except (ValueError, IndexError):
            self.result = {"error": f"W&B sink skipped: its process ended with exit status {self._proc.returncode}"}


def _make_sinks(plan: DemoPlan, notes: list[str]) -> tuple[list[Any], Path | None, _WandbProcess | None]:
    """Console, JSONL, and TensorBoard / W&B when asked for and installed (else a note). W&B
    runs in a child process (`_WandbProcess`): a failure to start is a note after the run."""
    from .._sinks.builtin import ConsoleSink, JsonlSink

    out, cfg = plan.out, plan.config
    sinks: list[Any] = [ConsoleSink(min_severity=Severity.WARNING), JsonlSink(out / "events.jsonl")]
    wandb_sink = None
    if cfg.wandb and plan.wandb_mode != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        if plan.wandb_mode is not None:
            os.environ["WANDB_MODE"] = plan.wandb_mode  # the sink reads the mode from the environment
        wandb_sink = _WandbProcess(  # first: its start overlaps everything that follows
            {"project": "nummon-demo", "dir": str(out), "config": {"lr": plan.lr, "seed": cfg.seed, "steps": cfg.steps}}
        )
        sinks.append(wandb_sink)
    tb_dir = None
    if cfg.tensorboard:
        try:
            from ..integrations.tensorboard import TensorBoardSink

            tb_dir = out / "tensorboard"
            # a run folder of its own under the suggested --logdir: TensorBoard names the run by it, not "."
            run_name = f"{'healthy' if cfg.healthy else 'runaway'}-lr{plan.lr:g}-seed{cfg.seed}"
            sinks.append(TensorBoardSink(tb_dir / run_name))
        except ImportError as e:
            notes.append(f"TensorBoard sink skipped: {e}")
    return sinks, tb_dir, wandb_sink


def run(plan: DemoPlan, on_step: StepCallback | None = None) -> DemoResult:
    """Create the output folder and sinks, train, monitor; the result holds what happened."""
    try:
        plan.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NummonError(f"cannot create the output folder {plan.out}: {e.strerror}") from None
    notes = list(plan.notes)
    threads = torch.get_num_threads()
    if plan.device.type == "cpu":
        # the demo's ops are too small to gain from intra-op threads, and OpenMP threads that
        # spin-wait for a busy core made it 3-7x slower on a shared 2-core machine
        torch.set_num_threads(1)
    try:
        return _train(plan, notes, on_step)
    finally:
        torch.set_num_threads(threads)


def _train(plan: DemoPlan, notes: list[str], on_step: StepCallback | None) -> DemoResult:
    from .._monitor.monitor import Monitor

    cfg = plan.config
    sinks, tb_dir, wandb = _make_sinks(plan, notes)  # first: W&B starts while the rest sets up
    torch.manual_seed(cfg.seed)
    model = DemoCNN(width=WIDTH, hidden=HIDDEN, side=IMAGE_SIDE).to(plan.device)
    opt = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=0.9)
    data = SyntheticDigits(cfg.seed, side=IMAGE_SIDE)
    mon = Monitor(model, opt, policy=plan.policy, sinks=sinks, run_dir=plan.out)
    if tb_dir is not None:  # after torch.optim's import of torch._dynamo, which it would slow
        from ..integrations.tensorboard import TensorBoardSink

        TensorBoardSink.warm_imports()
    first_nonfinite = None
    steps_run = 0
    t0 = time.perf_counter()
    try:
        for step in range(cfg.steps):
            x, y = data.stream(step, healthy=cfg.healthy, size=DEMO_BATCH)
            x, y = x.to(plan.device), y.to(plan.device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            # with a way to re-run the loss: on the first non-finite step the Monitor explains it
            # on the weights that failed, into the alert and the incident event. Those are the
            # weights before the update, or after it under recovery (its guard on optimizer.step
            # skips a poisoned update, and it restores snapshots after the step)
            recompute = lambda x=x, y=y: nn.functional.cross_entropy(model(x), y)  # noqa: E731
            if plan.policy.recovery.enabled:
                opt.step()
                report = mon.post_step(loss, batch=(x, y), recompute=recompute)
            else:
                report = mon.post_step(loss, batch=(x, y), recompute=recompute)
                opt.step()
            steps_run = step + 1
            if on_step is not None:
                on_step(step, float(loss.detach()), report.health.value if report.health is not None else "pending")
            if report.health is Health.NONFINITE and first_nonfinite is None:
                first_nonfinite = report.step
                if not plan.policy.recovery.enabled:
                    break
            if report.should_stop and (cfg.stop_at_critical or plan.policy.recovery.enabled):
                break
        final = mon.flush()
        if final is not None and final.health is Health.NONFINITE and first_nonfinite is None:
            first_nonfinite = final.step
    finally:
        mon.close()
    return _result(plan, mon, (tb_dir, wandb), notes, steps_run, time.perf_counter() - t0, first_nonfinite)


def _result(
    plan: DemoPlan,
    mon: Any,
    outputs: tuple[Any, Any],
    notes: list[str],
    steps_run: int,
    elapsed: float,
    first_nonfinite: int | None,
) -> DemoResult:
    """What the run showed: its steps, alerts and files (`outputs`: the TensorBoard folder and the
    W&B process), read from the closed Monitor; `elapsed` in seconds."""
    tb_dir, wandb = outputs
    wandb_result = wandb.result if wandb is not None else {}
    if wandb_result.get("error"):
        notes.append(wandb_result["error"])
    alerts = [a for a in mon.alerts if not a.cleared]
    warned = [a.step for a in alerts if a.severity.rank >= Severity.WARNING.rank]
    crit = [a.step for a in alerts if a.severity is Severity.CRITICAL]
    return DemoResult(
        plan=plan,
        steps_run=steps_run,
        elapsed_s=elapsed,
        records=mon.recent(),
        alerts=alerts,
        first_warning=min(warned, default=None),
        first_critical=min(crit, default=None),
        first_nonfinite=first_nonfinite,
        flight_record=str(mon.flight_record) if mon.flight_record is not None else None,
        cause=mon.cause,
        recoveries=mon.recoveries,
        tensorboard_dir=tb_dir,
        wandb_run_dir=wandb_result.get("run_dir"),
        wandb_offline=bool(wandb_result.get("offline")),
        wandb_url=wandb_result.get("url"),
        notes=notes,
    )

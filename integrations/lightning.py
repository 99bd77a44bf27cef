"""Lightning callback: `Trainer(callbacks=[NummonLightningCallback()])` watches every optimizer step.

Needs `lightning` (``pip install 'nummon[lightning]'``). Where the hooks run (Lightning 2.x):
`on_before_backward` gets each micro-batch's loss (divided by `accumulate_grad_batches`, and
multiplied by the GradScaler's scale under ``precision="16-mixed"``); `on_before_optimizer_step`
runs after the gradients are accumulated and unscaled and *before* Lightning clips them, so
nummon's gradient statistics are the unclipped ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from nummon import StepReport
from nummon._support import PolicyLike, clip_ratio, require

from ._callback_common import (
    StepAsMetric,
    StepLoss,
    console_log,
    console_sinks,
    events_sink,
    loss_of,
    resolve_policy,
    restore_engine,
    saved_state,
    start_line,
    stop_line,
    summary_line,
    take_per_sample,
)

pl: Any = require("lightning.pytorch", "lightning")  # Any: loaded by name, mypy sees no classes in it

__all__ = ["NummonLightningCallback"]

log = logging.getLogger("nummon")
RESTORED_FROM = "the checkpoint's nummon state"


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside a `LightningOptimizer`."""
    return getattr(optimizer, "_optimizer", optimizer)


class NummonLightningCallback(pl.Callback):
    """Runs a `nummon.Monitor` on the LightningModule and its (first) optimizer.

    `policy`: a preset name, a YAML path or a `Policy`. `sinks`: extra sinks; the trainer's own
    `TensorBoardLogger` and `WandbLogger` get nummon's scalars, histograms and alerts unless
    `follow_loggers=False`. The event log (`nummon-events.jsonl`) and flight records go to
    `run_dir`, else `trainer.log_dir`. `trainer.should_stop` is set after a critical alert when
    the policy's `alerts.stop_on_critical` says so (default: yes); `stop_on_critical` overrides it.
    `console`: a start line (what is watched, where the files go), one line per incident event
    and an end-of-run summary (incidents, the worst moment, the files) on the "nummon" logger,
    each on a line of its own beside the progress bar (False: none of them).
    Under DDP every rank reaches the same decision (the Monitor gathers the statistics).
    A `training_step` that sets `self.nummon_per_sample_loss = per_sample_losses` gets the worst
    samples of the step named in its record, alerts and flight record.
    """

    def __init__(
        self,
        policy: PolicyLike = "default",
        sinks: Iterable[Any] = (),
        stop_on_critical: bool | None = None,
        *,
        follow_loggers: bool = True,
        console: bool = True,
        run_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.policy = resolve_policy(policy, stop_on_critical)
        self.extra_sinks = list(sinks)
        self.console = console  # one console line per incident event (opened, escalated, resolved)
        self.follow_loggers = follow_loggers
        self.run_dir = run_dir
        self.monitor: Any = None
        self.last_report: StepReport | None = None
        self.last_clip_ratio: float | None = None  # min(1, gradient_clip_val / unclipped norm)
        self.stopped_at: int | None = None  # the step whose report stopped training
        self._optimizer: Any = None
        self._loss = StepLoss()
        # every micro-batch of the optimizer step so far, to re-run a failing step (forensics)
        self._batches: list[tuple[Any, int]] = []
        self._warned_no_loss = False
        self._restored: Any = None  # the engine's state and next step from a checkpoint (checked at fit start)
        self._summary_due = False  # a start line was printed: the end-of-run summary is owed
        self._first_step = 0
        self._events_path: Any = None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The health engine's state (incident, re-warming records), saved in the trainer's
        checkpoint so a resumed run does not start its detectors cold. Plain data only."""
        if self.monitor is not None:
            return {"engine": self.monitor.engine_state(), "step": self.monitor.step}
        return dict(self._restored) if isinstance(self._restored, dict) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning before `on_fit_start` when a fit resumes from a checkpoint (the
        trainer's own step is restored only after `on_fit_start`, so the step comes from here). A state
        that is not one is warned about at `on_fit_start`, and the engine starts cold."""
        if isinstance(state_dict, dict):
            self._restored = dict(state_dict) if state_dict.get("engine") else None
        else:
            self._restored = state_dict or None

    # ------------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from nummon import Monitor

        if self.monitor is not None:  # a second fit() with the same callback: a fresh run
            self.monitor.close()
        run_dir = self.run_dir or trainer.log_dir or trainer.default_root_dir  # log_dir: on every rank
        optimizers = trainer.optimizers
        self._optimizer = _unwrap(optimizers[0]) if optimizers else None
        distributed = trainer.world_size > 1
        sinks = self.extra_sinks + (self._logger_sinks(trainer) if self.follow_loggers else [])
        sinks += console_sinks(self.console, self.policy)
        events = events_sink(run_dir, self.policy, distributed)
        sinks.append(events)
        restored = saved_state(self._restored, RESTORED_FROM)
        self._restored = None
        self.monitor = Monitor(
            pl_module,
            self._optimizer,
            self.policy,
            sinks,
            run_dir=run_dir,
            grad_scaler=self._scaler(trainer),
            start_step=restored["step"] if restored else trainer.global_step,
        )
        restore_engine(self.monitor, restored, RESTORED_FROM, cold_step=trainer.global_step)
        self._first_step, self._events_path = self.monitor.step, events.path
        self._summary_due = self.console and trainer.global_rank == 0
        if self._summary_due:
            console_log.warning("%s", start_line(pl_module, self.policy, events.path, run_dir))
        self._loss.reset()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()  # before the loggers finalize (close) the writers nummon shares

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            if self._summary_due:  # once per fit (on_train_end, on_exception and teardown all close)
                self._summary_due = False
                console_log.warning("%s", summary_line(self.monitor, self._first_step, self._events_path))

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self._batches) >= max(1, trainer.accumulate_grad_batches):  # a step that reached no post_step
            self._batches = []
        self._batches.append((batch, batch_idx))

    def _recompute(self, pl_module: Any) -> Any:
        """A way to re-run the step's loss, every micro-batch of it, on the weights before the
        update (forensics): their mean, the gradient accumulated as Lightning did."""
        from nummon import MicroBatches

        batches, self._batches = self._batches, []
        if not batches or not pl_module.automatic_optimization:  # a manual step would step the optimizer again
            return None
        # built before the call: inside MicroBatches(...) mypy cannot type a lambda with default arguments
        parts = [lambda b=b, i=i: loss_of(pl_module.training_step(b, i)) for b, i in batches]
        return MicroBatches(parts)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.monitor is None or not pl_module.training:
            return
        scaler = self._scaler(trainer)
        if scaler is not None:  # 16-mixed: the loss arrives multiplied by the scale
            scale = getattr(scaler, "_scale", None)
            loss = loss.detach() / (scale if scale is not None else scaler.get_scale())
        if pl_module.automatic_optimization:
            loss = loss.detach() * trainer.accumulate_grad_batches  # undo Lightning's division
        self._loss.add(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is None or _unwrap(optimizer) is not self._optimizer:
            return
        if self._loss.empty:  # e.g. training_step returned None and backward was skipped
            if not self._warned_no_loss:
                console_log.warning(
                    "nummon: no loss reached backward before optimizer step %d; that step is not monitored",
                    trainer.global_step,
                )
                self._warned_no_loss = True
            return
        # before the optimizer's update: a failing step can be re-run on the weights that failed
        report = self.monitor.post_step(
            self._loss.take(),
            recompute=self._recompute(pl_module),
            clip_norm=self._clip_norm(trainer),
            per_sample_loss=take_per_sample(pl_module),
        )
        self.last_report = report
        self._report_clip_ratio(trainer, pl_module, report)
        if report.should_stop and not trainer.should_stop:
            trainer.should_stop = True  # the same decision on every rank: the records are gathered
            self.stopped_at = report.step
            console_log.warning("%s", stop_line(report))

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _clip_norm(trainer: Any) -> float | None:
        """The max gradient norm Lightning clips to (None: no norm clipping)."""
        clip = trainer.gradient_clip_val
        algorithm = str(trainer.gradient_clip_algorithm or "norm").lower()
        return float(clip) if clip and "norm" in algorithm else None

    def _report_clip_ratio(self, trainer: Any, pl_module: Any, report: StepReport) -> None:
        clip = self._clip_norm(trainer)
        rec = report.record
        if rec is None or clip is None:
            return
        # Lightning clips after this hook: the ratio is computed from the unclipped norm
        ratio = clip_ratio(rec.grad_norm, clip)
        self.last_clip_ratio = ratio
        if ratio is not None and trainer.loggers:  # through Lightning's own logging: every logger, at its cadence
            pl_module.log("nummon/clip_ratio", ratio, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    @staticmethod
    def _scaler(trainer: Any) -> Any:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    @staticmethod
    def _logger_sinks(trainer: Any) -> list[Any]:
        """Sinks into the trainer's own TensorBoard and W&B loggers (which live on rank 0 only)."""
        if trainer.global_rank != 0:
            return []
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        from .tensorboard import TensorBoardSink
        from .wandb import WandbSink

        sinks: list[Any] = []
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                sinks.append(TensorBoardSink(writer=logger.experiment))
            elif isinstance(logger, WandbLogger):
                sinks.append(WandbSink(run=StepAsMetric(logger.experiment)))
        return sinks


def __getattr__(name: str) -> object:
    # the old name, kept for one release: both frameworks' callbacks were called NummonCallback
    if name == "NummonCallback":
        import warnings

        warnings.warn(
            "nummon.integrations.lightning.NummonCallback is renamed NummonLightningCallback; the old name goes in 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return NummonLightningCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

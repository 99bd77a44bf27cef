"""Hugging Face `Trainer` callback: `Trainer(..., callbacks=[NummonTrainerCallback()])`.

Needs `transformers` (``pip install 'nummon[transformers]'``). Where things happen
(transformers 4.40-5.x): the loss of every micro-batch is read from the model's own output by a
forward hook (the Trainer's logged loss is an average over `logging_steps` with non-finite steps
replaced by that average); `post_step` runs in `on_pre_optimizer_step`, before `optimizer.step()` and
before `model.zero_grad()` (which comes before `on_step_end` and would leave no gradients).
The Trainer clips before `on_pre_optimizer_step`: the unclipped gradient statistics come from
the Monitor's own gradient hooks where it has them.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable
from typing import Any

from nummon import StepReport
from nummon._support import PolicyLike, clip_ratio, require, untraced

from ._callback_common import (
    StepAsMetric,
    StepLoss,
    console_log,
    console_sinks,
    events_sink,
    resolve_policy,
    restore_engine,
    saved_state,
    start_line,
    stop_line,
    summary_line,
    take_per_sample,
    with_class_count,
)

transformers: Any = require("transformers", "transformers")  # Any: loaded by name, mypy sees no classes in it

__all__ = ["NummonTrainerCallback"]

log = logging.getLogger("nummon")
RESTORED_FROM = "the checkpoint's nummon state"


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer`."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def _output_loss(output: Any) -> Any:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss


def _trainer_callbacks() -> list[Any]:
    """The Trainer's callbacks, found on the `CallbackHandler` that is calling us (callbacks are
    not given the handler): used to write into the folder the TensorBoard callback chose."""
    handler_cls = transformers.trainer_callback.CallbackHandler
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if isinstance(owner, handler_cls):
                return list(owner.callbacks)
    finally:
        del frame
    return []


def classification_classes(model: Any) -> int | None:
    """The class count of a single-label sequence/token/image classification model (its
    `config.num_labels`), None for any other task (a language model's vocabulary is no chance level)."""
    config = getattr(model, "config", None)
    arch = " ".join(getattr(config, "architectures", None) or [type(model).__name__])
    if (
        config is None
        or "ForSequenceClassification" not in arch
        and "ForImageClassification" not in arch
        and "ForTokenClassification" not in arch
    ):
        return None
    if getattr(config, "problem_type", None) not in (None, "single_label_classification"):
        return None
    n = getattr(config, "num_labels", None)
    return int(n) if isinstance(n, int) and n >= 2 else None


def tensorboard_dir(args: Any) -> str:
    """The folder the Trainer's TensorBoard callback writes to (`TENSORBOARD_LOGGING_DIR`, else
    `args.logging_dir` in 4.x, else `output_dir/runs/<date>_<host>`)."""
    for cb in _trainer_callbacks():
        if type(cb).__name__ == "TensorBoardCallback":
            folder = getattr(cb, "logging_dir", None) or getattr(getattr(cb, "tb_writer", None), "log_dir", None)
            if folder:
                return os.fspath(folder)
    env = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if env:
        return os.path.expanduser(env)
    if getattr(args, "logging_dir", None):
        return os.fspath(args.logging_dir)
    from transformers.integrations.integration_utils import default_logdir

    return os.path.join(args.output_dir, default_logdir())


# transformers >= 4.41 saves the `state()` of an `ExportableState` callback in each checkpoint's
# trainer_state.json (`stateful_callbacks`); older versions save nothing
_ExportableState: Any = getattr(transformers.trainer_callback, "ExportableState", None) or type(
    "_NotExportable", (), {}
)


class NummonTrainerCallback(transformers.TrainerCallback, _ExportableState):
    """Runs a `nummon.Monitor` on the Trainer's model and optimizer, one `post_step` per
    optimizer step with that step's true loss.

    `policy`: a preset name, a YAML path or a `Policy`. `sinks`: extra sinks; `args.report_to`
    adds TensorBoard (same run folder as the Trainer's TensorBoard callback) and W&B (the active
    run) unless `follow_report_to=False`. The event log (`nummon-events.jsonl`) and flight records
    go to `args.output_dir`. `control.should_training_stop` is set after a critical alert when the
    policy's `alerts.stop_on_critical` says so (default: yes); `stop_on_critical` overrides it.
    `console`: a start line (what is watched, where the files go), one line per incident event
    and an end-of-run summary (incidents, the worst moment, the files) on the "nummon" logger,
    each on a line of its own beside the Trainer's progress bar (False: none of them).
    The health engine's state rides in every checkpoint the Trainer saves, and a run resumed from
    one (`train(resume_from_checkpoint=...)`) starts its detectors warm. Leave the Trainer's
    `restore_callback_states_from_checkpoint` off: it replaces callbacks with fresh copies that
    lose their sinks (nummon restores its state without it).
    """

    def __init__(
        self,
        policy: PolicyLike = "default",
        sinks: Iterable[Any] = (),
        stop_on_critical: bool | None = None,
        *,
        follow_report_to: bool = True,
        console: bool = True,
    ) -> None:
        self.policy = resolve_policy(policy, stop_on_critical)
        self.extra_sinks = list(sinks)
        self.console = console  # one console line per incident event (opened, escalated, resolved)
        self.follow_report_to = follow_report_to
        self.monitor: Any = None
        self.last_report: StepReport | None = None
        self.last_clip_ratio: float | None = None  # min(1, max_grad_norm / unclipped norm)
        self.stopped_at: int | None = None
        self._loss = StepLoss()
        self._loss_hook: Any = None
        # every micro-batch of the step so far, as the model got it (forensics re-runs them all)
        self._inputs: list[tuple[Any, Any, dict[str, Any]]] = []
        self._shared = False  # the micro-batch losses are shares of the step's loss (summed)
        self._rerunning = False
        self._share_scale = 1.0
        self._warned_no_loss = False
        self._restored: Any = None  # the engine's state and next step, from load_state_dict (checked at train begin)
        self._summary_due = False  # a start line was printed: the end-of-run summary is owed
        self._first_step = 0
        self._events_path: Any = None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The health engine's state (incident, re-warming records) and the next step. Plain data."""
        if self.monitor is not None:
            return {"engine": self.monitor.engine_state(), "step": self.monitor.step}
        return dict(self._restored) if isinstance(self._restored, dict) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()` at the next `on_train_begin` (as Lightning's stateful callbacks do);
        a state that is not one is warned about there, and the engine starts cold."""
        if isinstance(state_dict, dict):
            self._restored = dict(state_dict) if state_dict.get("engine") else None
        else:
            self._restored = state_dict or None

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into a checkpoint's trainer_state.json (`ExportableState`): the
        engine's state under "nummon", which the Trainer's own restore ignores (no constructor
        arguments: sinks cannot be written to JSON)."""
        return {"args": {}, "attributes": {}, "nummon": self.state_dict()}

    def _checkpoint_state(self, state: Any) -> Any:
        """The nummon entry saved with the checkpoint this run resumes from (unchecked: `saved_state`
        checks it), else None. A fresh run (global step 0) and a state saved at another step (the
        callback's own, from an earlier `train()`) are not resumed from."""
        if not state.global_step:
            return None
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(saved, list):  # several nummon callbacks on one Trainer: whose is whose is not recorded
            log.warning(
                "nummon: several NummonTrainerCallbacks on one Trainer; none resumes its state from the checkpoint"
            )
            return None
        if not isinstance(saved, dict):
            return saved  # None (a checkpoint from before nummon), or not an entry of ours
        engine_state = saved.get("nummon")
        if isinstance(engine_state, dict):
            step = engine_state.get("step")
            if not engine_state.get("engine") or isinstance(step, int) and step != state.global_step:
                return None
        return engine_state

    def _add_checkpoint_entry(self, state: Any) -> None:
        """Give this callback its entry in `state.stateful_callbacks`: the Trainer's save looks it up
        by class name (KeyError on a run resumed from a checkpoint written without nummon)."""
        entries = getattr(state, "stateful_callbacks", None)
        if isinstance(entries, dict):
            entries.setdefault(type(self).__name__, self.state())

    # ------------------------------------------------------------------ lifecycle
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        from nummon import Monitor

        self._close()
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        sinks = self.extra_sinks + (self._report_to_sinks(args, state) if self.follow_report_to else [])
        sinks += console_sinks(self.console, self.policy)
        events = events_sink(args.output_dir, self.policy, distributed)
        sinks.append(events)
        raw = self._restored if self._restored is not None else self._checkpoint_state(state)
        self._restored = None
        restored = saved_state(raw, RESTORED_FROM)
        start = restored["step"] if restored else state.global_step
        # a classifier's task names its chance level (stall.chance_loss), unless the policy does
        policy = with_class_count(self.policy, classification_classes(model))
        self.monitor = Monitor(
            model,
            _unwrap_optimizer(optimizer) if optimizer is not None else None,
            policy,
            sinks,
            run_dir=args.output_dir,
            start_step=start,
        )
        restore_engine(self.monitor, restored, RESTORED_FROM, cold_step=state.global_step)
        self._add_checkpoint_entry(state)
        self._first_step, self._events_path = self.monitor.step, events.path
        self._summary_due = self.console and state.is_world_process_zero
        if self._summary_due:
            console_log.warning("%s", start_line(model, policy, events.path, args.output_dir))
        # with `average_tokens_across_devices` the Trainer multiplies each rank's share by the world size
        self._share_scale = (
            float(dist.get_world_size())
            if distributed and getattr(args, "average_tokens_across_devices", False)
            else 1.0
        )
        self._loss.reset()
        # untraced: under TrainingArguments(torch_compile=True) the step's loss count would be a
        # guard, recompiling the forward at every micro-batch of an accumulated step
        self._loss_hook = model.register_forward_hook(untraced(self._capture_loss), with_kwargs=True)
        self._model = model  # a model that sets `nummon_per_sample_loss` in forward names its worst samples

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self.monitor is not None:
            self.monitor.close()
            if self._summary_due:  # once per train(), after the last records are in
                self._summary_due = False
                console_log.warning("%s", summary_line(self.monitor, self._first_step, self._events_path))

    # ------------------------------------------------------------------ per step
    def _capture_loss(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or self._rerunning:
            return
        loss = _output_loss(output)
        if loss is None:
            return
        self._inputs.append((module, args, kwargs))
        # a model given `num_items_in_batch` returns its share of the step's loss (sum / all tokens)
        share = self._shared = kwargs.get("num_items_in_batch") is not None
        self._loss.add(loss * self._share_scale if share and self._share_scale != 1.0 else loss, share=share)

    def _recompute(self) -> Any:
        """A way to re-run the step's loss, every micro-batch of it, on the weights before the
        update (a `MicroBatches`: the losses combined and the gradients accumulated as the step's)."""
        from nummon import MicroBatches

        inputs, self._inputs = self._inputs, []
        if not inputs:
            return None

        def micro_batch(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
            def loss() -> Any:
                self._rerunning = True
                try:
                    return _output_loss(module(*args, **kwargs))
                finally:
                    self._rerunning = False

            return loss

        return MicroBatches([micro_batch(*i) for i in inputs], share=self._shared, scale=self._share_scale)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # before the update (the gradient statistics are from before clipping all the same): a
        # failing step can be re-run on the weights that failed
        self._monitor_step(args, control)

    def _monitor_step(self, args: Any, control: Any) -> None:
        if self.monitor is None:
            return
        if self._loss.empty:  # the loss is computed outside the model (custom compute_loss)
            if not self._warned_no_loss:
                console_log.warning(
                    "nummon: the model returned no `loss` during training (pass `labels` so the model "
                    "computes it); steps are not monitored"
                )
                self._warned_no_loss = True
            return
        report = self.monitor.post_step(
            self._loss.take(),
            recompute=self._recompute(),
            per_sample_loss=take_per_sample(getattr(self, "_model", None)),
        )
        self.last_report = report
        if report.record is not None and args.max_grad_norm:
            self.last_clip_ratio = clip_ratio(report.record.grad_norm, float(args.max_grad_norm))
        if report.should_stop and not control.should_training_stop:
            control.should_training_stop = True
            self.stopped_at = report.step
            console_log.warning("%s", stop_line(report))

    # ------------------------------------------------------------------ helpers
    def _report_to_sinks(self, args: Any, state: Any) -> list[Any]:
        """Sinks for the loggers named in `args.report_to` (on the main process, like them)."""
        if not state.is_world_process_zero:
            return []
        report_to = args.report_to or []
        if isinstance(report_to, str):
            report_to = [report_to]
        sinks: list[Any] = []
        if "tensorboard" in report_to or "all" in report_to:
            from .tensorboard import TensorBoardSink

            # a writer of our own in the same folder: TensorBoard reads every event file in a run
            # folder, and the Trainer's writer is closed in its on_train_end, before ours
            sinks.append(TensorBoardSink(log_dir=tensorboard_dir(args)))
        if "wandb" in report_to or "all" in report_to:
            wandb = require("wandb", "wandb")
            if wandb.run is not None:
                from .wandb import WandbSink

                sinks.append(WandbSink(run=StepAsMetric(wandb.run)))
        return sinks


def __getattr__(name: str) -> object:
    # the old name, kept for one release: both frameworks' callbacks were called NummonCallback
    if name == "NummonCallback":
        import warnings

        warnings.warn(
            "nummon.integrations.transformers.NummonCallback is renamed NummonTrainerCallback; the old name goes in 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return NummonTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Monitor: the one object a training loop touches."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from ._engine import HealthEngine
from ._errors import NummonError
from ._policy import PolicyLike, load_policy
from ._sinks import ConsoleSink, JsonlSink, SinkDispatcher
from ._stats import Pending, StatsEngine
from ._types import Alert, Health, Severity, StepRecord, StepReport

__all__ = ["Monitor"]

log = logging.getLogger("nummon")


class FlightRecorder:
    """A ring buffer of the last N steps' statistics, dumped to JSON on the first critical alert."""

    def __init__(self, steps: int) -> None:
        # records are kept as they are and turned into dicts only when read (rarely)
        self._ring: deque[tuple[StepRecord, Health]] = deque(maxlen=steps)

    def add(self, rec: StepRecord, health: Health) -> None:
        self._ring.append((rec, health))

    @property
    def records(self) -> list[dict[str, Any]]:
        """The kept steps, oldest first, as plain dicts."""
        return [{**rec.to_dict(), "health": health.value} for rec, health in self._ring]

    def dump(self, path: Path, alert: Alert) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"alert": alert.to_dict(), "records": self.records}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)
        return path


def _check_loss(loss: Any) -> Any:
    """A python number or a one-element tensor; anything else is rejected without side effects."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise NummonError(f"loss must be a scalar (0-d or one-element) tensor, got shape {tuple(loss.shape)}")
        if loss.dtype == torch.bool or loss.is_complex():
            raise NummonError(f"loss tensor must be numeric, got dtype {loss.dtype}")
        return loss
    # python and numpy numbers (anything with __float__), but not bools or strings
    if isinstance(loss, (bool, str, bytes)) or not hasattr(loss, "__float__"):
        raise NummonError(f"loss must be a float or a 0-d tensor, got {type(loss).__name__} {loss!r:.40}")
    try:
        return float(loss)
    except (TypeError, ValueError) as e:  # e.g. a numpy array with several elements
        raise NummonError(f"loss must be a single number, got {type(loss).__name__} ({e})") from None


class Monitor:
    """Watches a training run's numerical health, one `post_step` per optimizer step.

    >>> mon = Monitor(model, optimizer=opt, policy="default", sinks=[JsonlSink("run.jsonl")])
    >>> report = mon.post_step(loss)        # after optimizer.step()
    >>> if report.should_stop: ...

    With AMP, pass `grad_scaler=scaler` (and call `post_step` after `scaler.step` / `update`):
    a step the scaler skipped for overflowing gradients is an info alert, not a critical one.

    On CUDA (policy.sampling.lag_one_step) the statistics of step t are read at step t+1 with a
    non-blocking copy, so the GPU never waits; alerts keep their true step; `flush()` forces.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        policy: PolicyLike = "default",
        sinks: Iterable[Any] = (),
        *,
        process_group: Any = None,
        grad_scaler: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
        start_step: int = 0,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise NummonError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise NummonError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.policy = load_policy(policy)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._dist = None
        if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            from ._distributed import DistributedReducer

            self._dist = DistributedReducer(process_group)
        self.rank = self._dist.rank if self._dist else 0
        self.stats = StatsEngine(model, optimizer, self.policy, dist=self._dist, grad_scaler=grad_scaler)
        self.engine = HealthEngine(self.policy, context={"optimizer": self.stats.optimizer_kind()})
        self.recorder = FlightRecorder(self.policy.recorder.steps)
        sink_list = list(sinks)
        if self._dist is not None and self.policy.sinks.rank0_only and self.rank != 0:
            sink_list = []  # sinks run on rank 0 only (the decisions are identical everywhere)
        else:
            if self.policy.sinks.jsonl:
                sink_list.append(JsonlSink(self.policy.sinks.jsonl))
            if self.policy.sinks.console:
                sink_list.append(ConsoleSink())
        self._sinks = SinkDispatcher(sink_list, self.policy.sinks.queue_size, block=self.policy.sinks.when_full == "block")
        self.alerts: list[Alert] = []
        self.step = start_step  # the step the next post_step is for
        self.flight_record: Path | None = None
        self._pending: Pending | None = None
        self._closed = False
        self._stop = False
        # histogram cadences: the policy's, and any sink's own (e.g. TensorBoardSink(histogram_every=50))
        cadences = [self.policy.sampling.histogram_every] + [getattr(s, "histogram_every", None) or 0 for s in sink_list]
        self._hist_every = sorted({c for c in cadences if c > 0}) if self._sinks.wants_histograms else []
        if self._hist_every:
            self.stats.want_activation_histograms(self._hist_due(self.step))

    # ------------------------------------------------------------------ public
    def post_step(self, loss: Any, batch: Any = None) -> StepReport:
        """Record one optimizer step (call after `optimizer.step()`); returns this step's report.

        `loss` is a python float or a one-element tensor on any device. `batch` (optional: a
        tensor, tuple/list/dict of tensors) is checked for non-finite inputs and fingerprinted.
        """
        if self._closed:
            raise NummonError("post_step on a closed Monitor")
        loss = _check_loss(loss)
        s = self.step
        sp = self.policy.sampling
        pending = self.stats.launch(
            s, loss, batch, params_due=s % sp.params_every == 0, optim_due=s % sp.optimizer_every == 0
        )
        hist = None
        if self._hist_every and self._hist_due(s):
            hist = self.stats.histograms()
        self.step += 1
        if self._hist_every:
            self.stats.want_activation_histograms(self._hist_due(self.step))
        if hist:
            self._sinks.histograms(s, hist)
        # lag only when the copy is asynchronous (CUDA); decided per step, so a model moved to
        # the GPU after the Monitor was made is handled too
        if self.policy.sampling.lag_one_step and pending.event is not None:
            previous, self._pending = self._pending, pending
            if previous is None:
                return StepReport(step=s, health=Health.HEALTHY, should_stop=self._stop)
            return self._evaluate(previous)
        return self._evaluate(pending)

    def flush(self) -> StepReport | None:
        """Evaluate a step still in flight (lagged mode) and flush the sinks."""
        report = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            report = self._evaluate(pending)
        self._sinks.flush(timeout=5.0)
        return report

    def close(self) -> None:
        """Evaluate what is in flight, flush and close every sink, remove the hooks."""
        if self._closed:
            return
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._evaluate(pending)
        self._closed = True
        self.stats.remove_hooks()
        self._sinks.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def should_stop(self) -> bool:
        return self._stop

    @property
    def sink_stats(self) -> dict[str, dict[str, int]]:
        """Errors and dropped step records per sink."""
        return self._sinks.stats()

    # ------------------------------------------------------------------ internals
    def _hist_due(self, step: int) -> bool:
        return any(step % k == 0 for k in self._hist_every)

    def _evaluate(self, pending: Pending) -> StepReport:
        rec = self.stats.resolve(pending)
        alerts, health = self.engine.process(rec)
        self.recorder.add(rec, health)
        routed = []
        for a in alerts:
            if a.severity is Severity.CRITICAL and self.flight_record is None and self.policy.recorder.write:
                a = self._dump_flight_record(a)
            if a.severity is Severity.CRITICAL and self.policy.alerts.stop_on_critical:
                self._stop = True
            if self._dist is not None and a.rank is None and rec.rank is not None:
                a = dataclasses.replace(a, rank=rec.rank)
            if rec.fingerprint and not a.cleared:  # "failed again with identical inputs" is evidence
                a = dataclasses.replace(a, details={**a.details, "batch_fingerprint": rec.fingerprint})
            routed.append(a)
            self.alerts.append(a)
            self._sinks.alert(a)
        self._sinks.step(rec, health)
        report = StepReport(step=rec.step, health=health, alerts=tuple(routed), should_stop=self._stop, record=rec)
        return report

    def _dump_flight_record(self, alert: Alert) -> Alert:
        folder = self.policy.recorder.directory or self.run_dir or Path.cwd()
        name = f"nummon-flight-record-step{alert.step}" + (f"-rank{self.rank}" if self._dist else "") + ".json"
        try:
            path = self.recorder.dump(Path(folder) / name, alert)
        except OSError as e:
            log.warning("nummon: could not write the flight record: %s", e)
            return alert
        self.flight_record = path
        details = dict(alert.details)
        details["flight_record_steps"] = [r["step"] for r in self.recorder.records]
        details["recent"] = self.recent(8)  # plain dicts, so sinks can show the trajectory
        return dataclasses.replace(alert, flight_record=str(path), details=details)

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The flight recorder's last `n` step records (plain dicts)."""
        recs = self.recorder.records
        return recs if n is None else recs[-n:]

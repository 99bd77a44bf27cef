"""The Monitor's sinks: the user's and the policy's own, behind one dispatcher bound to the
run, and the steps the histogram-drawing sinks are fed at."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._policy.policy import Policy
from .._sinks.builtin import ConsoleSink, JsonlSink, RunContext, Sink, as_sink
from .._sinks.dispatch import SinkDispatcher

__all__ = ["HistogramSteps", "histogram_steps", "policy_sinks", "sink_dispatcher"]


def policy_sinks(policy: Policy, sinks: Iterable[Any]) -> list[Sink]:
    """The user's sinks as complete `Sink`s, and the policy's own (`sinks.jsonl`, `sinks.console`)."""
    sp = policy.sinks
    sink_list = [as_sink(s) for s in sinks]
    if sp.jsonl:
        sink_list.append(JsonlSink(sp.jsonl))
    if sp.console:
        sink_list.append(ConsoleSink())
    return sink_list


def sink_dispatcher(
    policy: Policy, sink_list: list[Sink], dist: Any, rank: int, run_dir: Path | None
) -> SinkDispatcher:
    """The dispatcher of `sink_list`, bound to the run; `dist` is the distributed reducer (None
    when single-process): under `sinks.rank0_only` the other ranks get no sinks."""
    sp = policy.sinks
    if dist is not None and sp.rank0_only and rank != 0:
        sink_list = []  # sinks run on rank 0 only (the decisions are identical everywhere)
    dispatcher = SinkDispatcher(
        sink_list, sp.queue_size, block_timeout_s=sp.block_timeout_s if sp.when_full == "block" else None
    )
    world = dist.world if dist else 1
    dispatcher.bind(RunContext(rank=rank, world_size=world, run_dir=run_dir, flush_every_steps=sp.flush_every_steps))
    return dispatcher


#: With the default cadence, histograms at these early steps too: a short run and its start are visible
EARLY_HISTOGRAM_STEPS = frozenset({0, 1, 2, 5, 10, 20, 50, 100, 200, 500})


@dataclass(frozen=True)
class HistogramSteps:
    """The steps histograms are taken at: the multiples of each of `every` (none: no sink wants
    histograms), and the log-spaced early steps too when `early`."""

    every: list[int]
    early: bool = False

    def due(self, step: int) -> bool:
        if self.early and step in EARLY_HISTOGRAM_STEPS:
            return True
        return any(step % k == 0 for k in self.every)


def histogram_steps(policy: Policy, sink_list: list[Sink], wanted: bool) -> HistogramSteps:
    """The steps histograms are taken at: the policy's cadence and any sink's own (e.g.
    TensorBoardSink(histogram_every=50)); when neither sets one, the default of the sinks that
    draw them (cost bounded: nummon/_sinks/layout.py) and log-spaced early steps as well. No
    steps when no sink wants histograms (`wanted` False)."""
    if not wanted:
        return HistogramSteps([])
    cadences = [policy.sampling.histogram_every] + [getattr(s, "histogram_every", None) or 0 for s in sink_list]
    early = not any(cadences)  # the default cadence: log-spaced early steps as well
    if early:
        cadences = [getattr(s, "default_histogram_every", 0) or 0 for s in sink_list]
    return HistogramSteps(sorted({c for c in cadences if c > 0}), early)

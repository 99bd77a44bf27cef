"""The Monitor's sinks: the user's and the policy's own, behind one dispatcher bound to the
run, and the steps the histogram-drawing sinks are fed at."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._policy.policy import Policy
from .._sinks.builtin import ConsoleSink, JsonlSink, RunContext, Sink, as_sink
from .._sinks.dispatch import SinkDispatcher

__all__ = ["histogram_cadences", "policy_sinks", "sink_dispatcher"]


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


def histogram_cadences(policy: Policy, sink_list: list[Sink], wanted: bool) -> tuple[list[int], bool]:
    """(the steps histograms are taken at, whether early steps are added): the policy's cadence
    and any sink's own (e.g. TensorBoardSink(histogram_every=50)); when neither sets one, the
    default of the sinks that draw them (cost bounded: nummon/_sinks/layout.py) and log-spaced early
    steps as well. ([], False) when no sink wants histograms (`wanted` False)."""
    if not wanted:
        return [], False
    cadences = [policy.sampling.histogram_every] + [getattr(s, "histogram_every", None) or 0 for s in sink_list]
    early = not any(cadences)  # the default cadence: log-spaced early steps as well
    if early:
        cadences = [getattr(s, "default_histogram_every", 0) or 0 for s in sink_list]
    return sorted({c for c in cadences if c > 0}), early

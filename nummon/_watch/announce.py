"""What the watcher says about the runs it finds: the opening lines, each run picked up, the
runs it forgets. Pure text: the watcher says the lines."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._core.text import plural, printable
from .._logs.discovery import RunSpec
from .runpaths import run_name, under

__all__ = ["LISTED", "forgot_line", "pending_line", "started_lines", "stopped_line", "watching_lines"]

LISTED = 20  # runs named one per line at the start (a root with thousands of runs: the rest counted)


def watching_lines(
    specs: dict[str, RunSpec], roots: list[str], targets: Iterable[Any], bad: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """(the opening lines, the roots with no run yet): what is watched and notified, then one
    line per root where nothing was found (and no problem was said about it)."""
    formats = sorted({s.format for s in specs.values() if s.format})
    shown = ", ".join(t.shown for t in targets)
    lines = [
        f"watching {plural(len(specs), 'run')} under {', '.join(roots)}"
        f"{' (' + ', '.join(formats) + ')' if formats else ''}; notifying {shown}"
    ]
    empty = [
        root
        for root in roots
        if not any(under(rid, root) for rid in specs) and root not in bad and not any(root in b for b in bad)
    ]
    lines += [
        f"{root}: no runs yet (looking for TensorBoard event files, trainer_state.json, metrics.csv, "
        f"run-*.wandb and nummon *.jsonl logs); new ones are picked up as they appear"
        for root in empty
    ]
    return lines, empty


def started_lines(started: list[tuple[RunSpec, bool]], roots: list[str], first: bool) -> list[str]:
    """One line per run picked up (spec, revived): those found at the start (the first LISTED of
    them, the rest counted), a run that appears later, a retired run that writes again."""
    lines = []
    for i, (spec, revived) in enumerate(started):
        if first and i == LISTED and len(started) > LISTED + 1:
            lines.append(f"  … and {plural(len(started) - LISTED, 'more run')}")
            break
        name = printable(run_name(spec.id, roots))
        fmt = _source(spec)
        if first:
            lines.append(f"  run {name} ({fmt})")
        elif revived:
            lines.append(f"run {name}: written again; watched again")
        else:
            lines.append(f"new run {name} ({fmt}): watched from now on")
    return lines


def _source(spec: RunSpec) -> str:
    """The run's format, and where the same run's other logs lie beside it, which one is read."""
    beside = getattr(spec, "beside", None)
    if not beside:
        return spec.format or "detected when read"
    others = " and ".join(sorted(beside))
    return f"{spec.format}: nummon's own log, read in place of the same run's {others} logs in its folder"


def forgot_line(forgotten: list[str], forget_after_s: float, roots: list[str]) -> str:
    """The one line for the runs forgotten in a pass (their files gone `forget_after_s` or more)."""
    hours = forget_after_s / 3600
    return (
        f"forgot {plural(len(forgotten), 'run')} whose files are gone for {hours:g} h or more "
        f"(e.g. {printable(run_name(forgotten[0], roots))}); read from the start if they come back"
    )


def pending_line(pending: int, state_path: str | None) -> str:
    """What becomes of the notifications still undelivered at the stop: kept in the state file, or lost."""
    if state_path:
        return f"{plural(pending, 'notification')} not delivered yet: kept in {state_path}, sent at the next start"
    return f"{plural(pending, 'notification')} not delivered and lost (no --state to keep them)"


def stopped_line(why: str, runs: int, records: int, fates: str) -> str:
    """The watcher's last line: why it stops and what it did in this session."""
    return f"stopped ({why}): {plural(runs, 'run')} watched, {plural(records, 'record')} read, {fates}"

"""`nummon replay`: the detectors over recorded logs, alerts printed as they are found.

nummon JSONL traces, TensorBoard event files or folders, Hugging Face trainer_state.json,
Lightning metrics.csv and W&B offline run files are read (detected, or `--input-format`).

Unreadable lines (a torn line, a corrupt record) are skipped as the watcher skips them, with
one warning per file naming the first one's file:line and the count; a step that goes
backwards (a new segment) is a one-line warning. A missing extra (tensorboard, wandb) is a one-line hint, exit 2.
A log from which no step record was read is said in one line and the exit is 2: nothing read is
never "no alerts". Alerts below --min-severity are counted where "no alerts" would stand.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import EXIT_ERROR, error, non_empty, warn
from .policy import load_policy_with_hints

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser(
        "replay", help="run the detectors over recorded logs (JSONL, TensorBoard, HF, Lightning CSV, W&B)"
    )
    r.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        type=non_empty("a log file or run folder"),
        help="log files or run folders (a folder of *.jsonl means each of them), or an MLflow run: "
        "mlflow:<tracking-uri>#<run-id>",
    )
    r.add_argument(
        "--input-format",
        choices=("jsonl", "tensorboard", "hf", "csv", "wandb", "mlflow"),
        default=None,
        help="force the log format, one of %(choices)s (default: detected from the name and first bytes)",
    )
    r.add_argument("--policy", default="default", help="preset name or policy file (default: default)")
    r.add_argument(
        "--format",
        choices=("text", "jsonl"),
        default="text",
        help="how alerts are printed: text (one line per alert, then a count; the default) or jsonl "
        "(one JSON object per alert: source, step, kind, severity, message)",
    )
    r.add_argument(
        "--min-severity",
        choices=("info", "warning", "critical"),
        default="info",
        help="print only alerts at or above this severity, one of %(choices)s (default: info)",
    )
    r.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._core.text import clean_text
    from .._logs.discovery import find_runs

    policy = load_policy_with_hints(args.policy)
    runs, _ = find_runs(args.paths, args.input_format)  # a path that does not exist: TraceError, one line
    n_alerts, unread = 0, 0
    for run in runs:
        path = run.id
        tally = _Tally(args.min_severity)
        for a in _alerts(path, run.format, policy, tally):
            if not tally.shown(a):
                continue
            if args.format == "jsonl":
                print(json.dumps({"source": path, **a.to_dict()}, allow_nan=False), flush=True)
            else:
                print(clean_text(f"{path}: {a}"), flush=True)
        n_alerts += tally.n_shown
        if not tally.records:  # nothing was checked: never read as healthy
            unread += 1
            error(f"{path}: no step records read (an empty log, or none nummon reads in it); nothing was checked")
        elif args.format == "text" and not tally.n_shown:
            print(clean_text(f"{path}: {tally.no_alerts()}"))
    if args.format == "text":
        empty = f"; {unread} with no step records" if unread else ""
        print(f"{len(runs)} trace(s), {n_alerts} alert(s){empty}")
    return EXIT_ERROR if unread else 0


class _Tally:
    """One log's count of records read, of alerts shown, and of alerts below the shown severity."""

    def __init__(self, min_severity: str) -> None:
        from .._core.types import Severity

        self.floor = Severity(min_severity)
        self.records = self.n_shown = 0
        self.hidden: dict[Any, int] = {}

    def count(self, _rec: Any) -> None:
        self.records += 1

    def shown(self, alert: Any) -> bool:
        if alert.severity.rank < self.floor.rank:
            self.hidden[alert.severity] = self.hidden.get(alert.severity, 0) + 1
            return False
        self.n_shown += 1
        return True

    def no_alerts(self) -> str:
        """'no alerts', or, when alerts below the shown severity were left out, how many."""
        from .._core.text import plural

        if not self.hidden:
            return "no alerts"
        below = sorted(self.hidden.items(), key=lambda kv: -kv[0].rank)
        words = {"warning": ("warning", "warnings"), "info": ("info alert", "info alerts")}
        counts = ", ".join(plural(n, *words.get(sev.value, (sev.value, sev.value + "s"))) for sev, n in below)
        return f"no alerts at or above {self.floor.value} ({counts})"


def _alerts(path: str, format: str | None, policy: Any, tally: _Tally) -> Any:
    """The alerts over one run's log (`format` None: detected from the log now)."""
    from .._logs.readers import detect_format, read_records
    from .._tools.replay import iter_replay, iter_replay_records

    fmt = format or detect_format(path)
    if fmt == "jsonl":
        return iter_replay(path, policy, warn=warn, on_record=tally.count)
    records = read_records(path, fmt, warn=warn)
    return iter_replay_records(records, policy, warn=warn, source=path, on_record=tally.count)

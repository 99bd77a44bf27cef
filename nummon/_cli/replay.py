"""`nummon replay`: the detectors over recorded logs, alerts printed as they are found.

nummon JSONL traces, TensorBoard event files or folders, Hugging Face trainer_state.json,
Lightning metrics.csv and W&B offline run files are read (detected, or `--input-format`).

Unreadable lines (a torn line, a corrupt record) are skipped as the watcher skips them, with
one warning per file naming the first one's file:line and the count; a step that goes
backwards (a new segment) is a one-line warning. A missing extra (tensorboard, wandb) is a one-line hint, exit 2.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import non_empty, warn
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
    from .._format import clean_text
    from .._replay import iter_replay, iter_replay_records
    from .._types import Severity
    from .._watch.readers import read_records

    policy = load_policy_with_hints(args.policy)
    paths = _expand(args.paths, args.input_format)
    floor = Severity(args.min_severity).rank
    n_alerts = 0
    for path in paths:
        shown = 0
        fmt = args.input_format or _format_of(path)
        alerts = (
            iter_replay(path, policy, warn=warn)
            if fmt == "jsonl"
            else iter_replay_records(read_records(str(path), fmt, warn=warn), policy, warn=warn, source=str(path))
        )
        for a in alerts:
            if a.severity.rank < floor:
                continue
            shown += 1
            if args.format == "jsonl":
                print(json.dumps({"source": str(path), **a.to_dict()}, allow_nan=False), flush=True)
            else:
                print(clean_text(f"{path}: {a}"), flush=True)
        n_alerts += shown
        if args.format == "text" and not shown:
            print(clean_text(f"{path}: no alerts"))
    if args.format == "text":
        print(f"{len(paths)} trace(s), {n_alerts} alert(s)")
    return 0


def _format_of(path: Any) -> str:
    from .._watch.readers import detect_format

    return detect_format(str(path))


def _expand(paths: list[str], forced: str | None) -> list[Any]:
    """Files and run folders as given; a folder holding *.jsonl traces means each of them, and a
    TensorBoard logdir whose runs are its subfolders (`tensorboard --logdir` style) each run."""
    from pathlib import Path

    from .._trace import TraceError, expand_paths
    from .._watch.read_tb import is_event_file

    out: list[Any] = []
    for p in paths:
        if p.startswith("mlflow:"):  # a run on an MLflow tracking server: mlflow:<uri>#<run-id>
            out.append(p)
            continue
        path = Path(p)
        if path.is_dir() and forced in (None, "jsonl") and any(path.glob("*.jsonl")):
            out.extend(expand_paths([p]))
        elif (
            path.is_dir()
            and forced in (None, "tensorboard")
            and not any(is_event_file(str(f)) for f in path.iterdir())
            and (
                runs := sorted(
                    d for d in path.iterdir() if d.is_dir() and any(is_event_file(str(f)) for f in d.iterdir())
                )
            )
        ):
            out.extend(runs)
        elif path.exists():
            out.append(path)
        else:
            raise TraceError(f"trace not found: {path}")
    return out

"""`nummon replay`: the detectors over recorded JSONL traces, alerts printed as they are found.

Alerts found before a broken line are printed before the error; a torn last line and a step
that goes backwards (a new segment) are one-line warnings.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from ._common import warn

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("replay", help="run the detectors over recorded JSONL traces")
    r.add_argument("paths", nargs="+", metavar="PATH", help="trace files, or directories of *.jsonl")
    r.add_argument("--policy", default="default", help="preset name or policy file (default: default)")
    r.add_argument("--format", choices=("text", "jsonl"), default="text")
    r.add_argument("--min-severity", choices=("info", "warning", "critical"), default="info",
                   help="print only alerts at or above this severity (default: info)")
    r.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._format import clean_text
    from .._policy import load_policy
    from .._replay import iter_replay
    from .._trace import expand_paths
    from .._types import Severity

    policy = load_policy(args.policy)
    paths = expand_paths(args.paths)
    floor = Severity(args.min_severity).rank
    n_alerts = 0
    for path in paths:
        shown = 0
        for a in iter_replay(path, policy, warn=warn):
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

"""`nummon report`: one self-contained HTML page telling a run's incidents at a glance (the
curves around each, the first non-finite tensor and its cause, the countdown said vs left,
what to do, the layers that left the pack), or saying that the run was healthy.

PATH is a Monitor run folder (events.jsonl, flight records) or any log `replay` reads. The
page's path is printed; bad input is one line, exit 2. No torch, no plotting extra needed.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._core.text import printable
from ._common import warn

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("report", help="write a self-contained HTML incident report of a run folder or log")
    r.add_argument(
        "path", metavar="PATH", help="a Monitor run folder (events.jsonl, flight records) or any log replay reads"
    )
    r.add_argument(
        "-o",
        "--out",
        default=None,
        help="the HTML file to write (default: nummon-report.html in the run folder, or next to the log)",
    )
    r.add_argument(
        "--input-format",
        choices=("jsonl", "tensorboard", "hf", "csv", "wandb", "mlflow"),
        default=None,
        help="force the log format, one of %(choices)s (default: detected from the name and first bytes)",
    )
    r.add_argument(
        "--policy", default="default", help="preset name or policy file, for logs without alerts (default: default)"
    )
    r.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from .._policy.policy import load_policy
    from .._report import ReportError, write_report

    policy = load_policy(args.policy)
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise ReportError(f"{out}: is a folder (give the HTML file to write, e.g. {out / 'report.html'})")
        if not out.parent.is_dir():
            raise ReportError(f"{out.parent}: no such folder for the report")
    path = write_report(args.path, args.out, args.input_format, policy, warn=warn)
    print(printable(str(path)))  # a byte that is not UTF-8 as \xff, as every message says it
    return 0

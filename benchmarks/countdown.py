"""The countdown against what happened: for every runaway that reached a non-finite value, the
steps to overflow its first critical alert announced vs the steps that were really left.

    .venv/bin/python benchmarks/countdown.py [--no-runs]

Traces: the README table (tests/data/batch39_46.jsonl), every trace of the real-log set
(tests/data/real) and of the dev corpus (/work/shared/corpus/dev, when present) that reaches a
non-finite loss after a critical runaway alert, and (unless --no-runs) the demo and the two
callback examples driven to blow up (benchmarks/countdown_runs.py), trained here. The bound it
checks: 1 <= estimate <= 1.5 x real + 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from nummon._core.types import Severity  # noqa: E402
from nummon._engine.engine import HealthEngine  # noqa: E402
from nummon._logs.trace import read_trace  # noqa: E402
from nummon._policy.policy import load_policy  # noqa: E402

__all__ = ["Row", "measure", "within_bound"]

DEV = Path("/work/shared/corpus/dev")


class Row(tuple):
    """(run, alert step, metric, estimate, real steps left, rising)"""


def within_bound(estimate: float, real: int) -> bool:
    """The countdown promise: never below 1, never more than 1.5x the real number + 2."""
    return 1 <= estimate <= 1.5 * real + 2


def measure(name: str, path: Path) -> tuple | None:
    """(name, step, metric, estimate, real, rising) of the trace's first critical alert with a
    countdown, or None when the trace never has one followed by a non-finite record."""
    engine = HealthEngine(load_policy("default"))
    alert = None
    for rec in read_trace(path, warn=lambda m: None):
        got = engine.step(rec)
        if alert is None:
            for a in got.alerts:
                left = (a.details or {}).get("steps_to_overflow")
                if a.severity is Severity.CRITICAL and isinstance(left, (int, float)) and math.isfinite(left):
                    alert = a
                    break
        if alert is not None and not rec.is_finite():
            d = alert.details
            return (
                name,
                alert.step,
                alert.metric,
                d["steps_to_overflow"],
                rec.step - alert.step,
                bool(d.get("overflow_bound")),
            )
    return None


def _traces(runs: bool, tmp: Path) -> Iterable[tuple[str, Path]]:
    yield "README table (batch39_46.jsonl)", ROOT / "tests/data/batch39_46.jsonl"
    # the real-log set's tuning part only: its blind part is scored once, by the coordinator
    from real_split import split

    tune = {name for name, part in split().items() if part == "tune"}
    for p in sorted((ROOT / "tests/data/real").glob("*.jsonl")):
        if p.stem in tune:
            yield f"real: {p.stem}", p
    if DEV.is_dir():
        for p in sorted(DEV.glob("*.jsonl")):
            yield f"dev: {p.stem}", p
    if runs:
        from countdown_runs import RUNS

        for i, (name, fn) in enumerate(RUNS.items()):
            with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its log dicts
                path = fn(tmp / f"run{i}")
            yield name, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-runs", action="store_true", help="only the trace files (no training)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _traces(not args.no_runs, Path(tmp)):
            row = measure(name, path)
            if row is not None:
                rows.append(row)
    print("| run | first critical alert | metric | estimate | real steps left | bound 1.5x+2 | holds |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for name, step, metric, est, real, rising in rows:
        good = within_bound(est, real)
        ok &= good
        shown = f"at most ~{est:.0f}" if rising else f"~{est:.0f}"
        print(
            f"| {name} | step {step} | `{metric}` | {shown} | {real} | {1.5 * real + 2:g} | {'yes' if good else 'NO'} |"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`nummon report`: one self-contained HTML page per run that tells its incidents at a glance
(the curves around each, the first non-finite tensor and its cause, the countdown said vs what
was left, what to do, the layers that left the pack), or says the run was healthy.

The page is inline CSS and inline SVG, no script and nothing fetched: it opens offline and
survives being e-mailed or attached to a ticket. The SVG is written here in plain Python rather
than with a plotting library (matplotlib's SVG backend, a JavaScript library inlined): it needs
no extra, imports in milliseconds, keeps the page small (a 100,000-step run well under 2 MB)
and fast to make (a 10,000-record log in a few seconds), and draws exactly the few chart kinds a
report needs (log-scale panels on one step axis, marked steps, small multiples). No torch.

May import: `_core`, `_policy`, `_engine`, `_logs`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .._core.files import write_atomic
from .._core.text import printable
from .load import EVENT_LOG, FLIGHT_GLOB, ReportError, RunData, from_monitor, load_run
from .page import render
from .story import IncidentView, incidents_of

__all__ = [
    "REPORT_NAME",
    "ReportError",
    "RunData",
    "IncidentView",
    "build_report",
    "incidents_of",
    "load_run",
    "from_monitor",
    "render",
    "write_report",
    "write_html",
    "refuse_input",
    "EVENT_LOG",
    "FLIGHT_GLOB",
]

REPORT_NAME = "nummon-report.html"  # the report's name in a run folder


def build_report(
    path: str | os.PathLike[str], format: str | None = None, policy=None, warn: Callable[[str], None] | None = None
) -> str:
    """The HTML report of the run at `path` (a Monitor run folder or any log replay reads).
    ReportError when nothing was read from it: a page saying nothing reads as a healthy run."""
    run = load_run(path, format, policy, warn)
    if not (run.n_records or run.alerts or run.incidents or run.flight_records):
        raise ReportError(
            f"{printable(os.fspath(path))}: no step records read (an empty log, or none nummon reads in it); "
            "nothing was checked, no report written"
        )
    return render(run, version=_version())


def write_html(html: str, out: str | os.PathLike[str]) -> Path:
    """Write `html` to `out` whole (a temporary file of an unpredictable name, created without
    following a link, renamed over it: a reader never sees half, a planted link is never written)."""
    out = Path(out)
    try:
        write_atomic(out, html)
    except OSError as e:
        raise ReportError(f"{printable(str(out))}: cannot write the report ({e.strerror or e})") from None
    return out


def write_report(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    format: str | None = None,
    policy=None,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Write the report of the run at `path` to `out` (default: nummon-report.html in the run
    folder, or next to the log); returns its path."""
    if out is None:
        p = Path(path)
        out = (p if p.is_dir() else p.parent) / REPORT_NAME
    refuse_input(path, out)
    html = build_report(path, format, policy, warn)
    return write_html(html, out)


def refuse_input(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """ReportError when writing `out` would replace what the report reads: the log `path` itself
    (the same file by identity: a hard link, a link, another spelling), or any file but an HTML
    page inside the run folder `path`."""
    text = os.fspath(path)
    if text.startswith("mlflow:"):
        return
    src, dst = Path(text), Path(out)
    try:
        if not dst.exists():
            return
        same = src.is_file() and os.path.samefile(src, dst)
        inside = src.is_dir() and dst.suffix.lower() not in (".html", ".htm") and _under(dst, src)
    except OSError:
        return  # nothing there to lose: the write itself says what is wrong
    if same or inside:
        raise ReportError(
            f"{printable(str(dst))}: is {'the log' if same else 'a file of the run folder'} the report reads "
            "(give another file to write)"
        )


def _under(f: Path, folder: Path) -> bool:
    """`f` is `folder` or lies inside it (paths resolved; also the same file under another name)."""
    real, top = f.resolve(), folder.resolve()
    return real == top or top in real.parents or any(os.path.samefile(top, p) for p in real.parents if p.exists())


def _version() -> str:
    """ "nummon X.Y.Z" as installed (the package root is not imported: it sits above this layer)."""
    from importlib import metadata

    try:
        return f"nummon {metadata.version('nummon')}"
    except metadata.PackageNotFoundError:  # a source checkout that was never installed
        return ""

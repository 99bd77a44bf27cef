"""Find runs: the one place that turns the paths given to `replay`, `report` and `watch` into
runs (one event folder, one trainer_state.json lineage, one metrics CSV, one W&B run, one MLflow
run or one nummon JSONL log each). See `find_runs`."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._core.errors import TraceError
from .._core.text import printable
from . import fs
from .read_hf import STATE_NAME, lineage_root
from .read_mlflow import MLFLOW_PREFIX, MlflowError, MlflowServer, is_mlflow_source, parse_source, safe_uri
from .read_tb import is_event_file
from .read_wandb import is_wandb_file, wandb_run_files
from .readers import detect_format

__all__ = ["RunSpec", "find_runs", "root_is_here"]


@dataclass
class RunSpec:
    """A run found: its id (path of its folder or file, or its MLflow source), format (None: not
    known yet, detected when the run is read) and files."""

    id: str
    format: str | None
    files: list[str] = field(default_factory=list)
    beside: list[str] = field(default_factory=list)  # formats of the same run's other logs, not read
    covered: list[str] = field(default_factory=list)  # those logs' run ids


def _kind(path: str) -> tuple[str, str] | None:
    """(format, run id) of a file found under a root, or None for files that are not logs."""
    name = fs.basename(path)
    if is_event_file(path):
        return "tensorboard", fs.dirname(path)
    if name == STATE_NAME:
        return "hf", lineage_root(path)
    if is_wandb_file(path):
        return "wandb", path
    if name == "metrics.csv":  # Lightning's name; other CSVs under a root are usually data
        return "csv", path
    if name.endswith(".jsonl") and _looks_like_steps(path):
        return "jsonl", path
    return None


_not_steps: dict[str, object] = {}  # JSONL files under roots that hold no step records (datasets)


def _looks_like_steps(path: str) -> bool:
    """True when the first line of a JSONL file is a step record (or empty yet): a dataset's
    `{"text": ...}` lines under a watch root are not a run."""
    st = fs.stat(path)
    if _not_steps.get(path) == st:
        return False
    head = fs.read_bytes(path, 0, fs.HEAD_BYTES).split(b"\n", 1)[0].strip()
    if not head or b'"step"' in head or b'"type"' in head:
        return True
    _not_steps[path] = st
    return False


def _norm(path: str) -> str:
    return path if fs.is_url(path) else os.path.abspath(path)


_answered: dict[str, bool] = {}  # MLflow roots: whether the server answered the last search


def root_is_here(root: str) -> bool:
    """The root exists (a folder, a file, or an MLflow server that answered its last search): a
    run missing under it is gone, not away."""
    if is_mlflow_source(root):
        return _answered.get(root, False)
    return fs.is_dir(root) or fs.stat(root) is not None


def _mlflow_runs(root: str, runs: dict[str, RunSpec], problems: list[str], ask: Any = None) -> None:
    """An MLflow root: one run (``mlflow:<uri>#<run-id>``), or the server's RUNNING runs
    (``mlflow:<uri>``, ``?experiment=NAME`` for one experiment). A server that cannot be asked is
    a problem line (said once by the watcher) and the root counts as away. With `ask` (a
    remote.BackgroundAsk) the search runs on its own thread and its last answer is used."""
    try:
        uri, run_id, query = parse_source(root)
        if run_id is not None:
            spec_id = f"{MLFLOW_PREFIX}{safe_uri(uri)}#{run_id}"
            runs.setdefault(spec_id, RunSpec(spec_id, "mlflow", [spec_id]))
            _answered[root] = True
            return
        search = lambda: MlflowServer(uri).search_runs(query.get("experiment"))  # noqa: E731
        found, error = ask.latest(root, search) if ask is not None else (search(), None)
        if error is not None:
            raise error
        if found is None:  # not answered yet: the root counts as away
            _answered[root] = False
            return
        for info in found:
            rid = str(info.get("run_id") or info.get("run_uuid") or "")
            if rid:
                spec_id = f"{MLFLOW_PREFIX}{safe_uri(uri)}#{rid}"  # credentials come from MLflow's variables
                runs.setdefault(spec_id, RunSpec(spec_id, "mlflow", [spec_id]))
        _answered[root] = True
    except MlflowError as e:
        _answered[root] = False
        problems.append(f"{e}; asked again at each poll")


def find_runs(
    paths: Sequence[str],
    format: str | None = None,
    *,
    roots: bool = False,
    exclude: Collection[str] = frozenset(),
    ask: Any = None,
) -> tuple[list[RunSpec], list[str]]:
    """The runs `paths` hold, in order, and one line per problem found (`format` forces one).

    Named logs (``roots=False``: `replay`, `report`, read once, now): each path is one run as
    given (its name kept), a file of any name whose format is detected when it is read, unless it
    is a folder whose top holds several runs (see `_named_runs`). An MLflow source is one run. A
    path that does not exist is a TraceError ("trace not found: PATH"); there are no problem lines.

    Watch roots (``roots=True``: `watch`, searched at each poll): a folder is searched 8 levels
    deep and each log found goes to its run (the logs of one run are one run: see
    `_one_source_per_run_folder`); a file is one run, its format detected now; an MLflow root is
    asked for its runs (on `ask`'s threads when given: see `_mlflow_runs`). Ids are absolute
    paths; files in `exclude` are never runs. A root that does not exist, a file that cannot be
    read or is not a log, a server that cannot be asked: a problem line each, never an error
    (a root may appear later)."""
    if not roots:
        return [spec for path in paths for spec in _named_runs(path, format)], []
    return _runs_under_roots(paths, format, exclude, ask)


def _named_runs(path: str, format: str | None) -> list[RunSpec]:
    """The runs of one path named by a person: the path itself, or, for a folder holding several
    runs at its top, each of them: its *.jsonl logs (each a trace, whatever else the folder
    holds), else the run folders of a TensorBoard logdir (`tensorboard --logdir` style: no event
    file of its own, event files one level down), else the runs of a W&B folder
    (`wandb/offline-run-*/run-*.wandb`, when there are several). `format` keeps only the rule of
    that format."""
    if is_mlflow_source(path):  # a run on an MLflow tracking server: mlflow:<uri>#<run-id>
        return [RunSpec(path, format, [path])]
    path = str(Path(path))  # as pathlib spells it: `./a/` is `a`, as every message names it
    if fs.is_dir(path):
        files = list(fs.walk_files(path, max_depth=2, follow_links=True, only_regular=False))
        top = {f for f in files if os.path.dirname(f) == path}
        if format in (None, "jsonl") and (logs := [f for f in files if f in top and f.endswith(".jsonl")]):
            return [RunSpec(f, "jsonl", [f]) for f in logs]
        events = [f for f in files if f not in top and is_event_file(f)]
        if format in (None, "tensorboard") and events and not any(is_event_file(f) for f in top):
            runs = sorted({fs.dirname(f) for f in events})
            return [RunSpec(d, "tensorboard", [f for f in events if fs.dirname(f) == d]) for d in runs]
        if format in (None, "wandb") and len(run_files := wandb_run_files(path)) > 1:
            return [RunSpec(f, "wandb", [f]) for f in run_files]
    if not os.path.exists(path):
        raise TraceError(f"trace not found: {path}")
    return [RunSpec(path, format, [path])]


def _runs_under_roots(
    roots: Sequence[str], format: str | None, exclude: Collection[str], ask: Any
) -> tuple[list[RunSpec], list[str]]:
    """`find_runs` over watch roots."""
    runs: dict[str, RunSpec] = {}
    problems: list[str] = []
    for root in roots:
        if is_mlflow_source(root):
            _mlflow_runs(root, runs, problems, ask)
            continue
        root = _norm(root)
        if fs.stat(root) is None and not fs.is_dir(root):
            problems.append(f"{root}: not found")
            continue
        if not fs.is_dir(root):
            try:
                fmt = format or detect_format(root)
            except Exception as e:  # NotALogError: named in its message
                problems.append(str(e))
                continue
            runs.setdefault(root, RunSpec(root, fmt, [root]))
            continue
        _search(root, format, exclude, runs, problems)
    return list(_one_source_per_run_folder(_one_run_per_output_dir(runs)).values()), problems


def _search(
    root: str, format: str | None, exclude: Collection[str], runs: dict[str, RunSpec], problems: list[str]
) -> None:
    """Each log under the folder `root` (8 levels deep), added to its run in `runs`."""
    for f in fs.walk_files(root):
        if _norm(f) in exclude:
            continue
        try:
            kind = _kind(f)
        except OSError as e:  # unreadable (a chmod 000 file): that file's problem, said once
            problems.append(f"{printable(f)}: cannot be read ({e.strerror or e}); skipped, tried again at each poll")
            continue
        if kind is None or (format and kind[0] != format):
            continue
        fmt, run_id = kind
        spec = runs.setdefault(run_id, RunSpec(run_id, fmt))
        spec.files.append(f)


def _one_run_per_output_dir(runs: dict[str, RunSpec]) -> dict[str, RunSpec]:
    """A Hugging Face output folder holding event folders (`runs/<date>_<host>/`) besides its
    trainer_state.json lineage is one run, not two: the event folder is read (per step, and with
    nummon's callback its own unfiltered tags) and the lineage is left out."""
    tb_ids = [rid for rid, s in runs.items() if s.format == "tensorboard"]
    out = {}
    for rid, spec in runs.items():
        if spec.format == "hf":
            prefix = rid.rstrip("/").rstrip(os.sep)
            if any(t.startswith(prefix + os.sep) or t.startswith(prefix + "/") for t in tb_ids):
                continue
        out[rid] = spec
    return out


def _own_log(spec: RunSpec) -> bool:
    """A Monitor's event log (JsonlSink's `events.jsonl`, or a first line typed `"step"`): the
    richest log of its run."""
    if spec.format != "jsonl":
        return False
    if fs.basename(spec.id) == "events.jsonl":
        return True
    try:
        head = fs.read_bytes(spec.id, 0, 64).lstrip()
    except OSError:
        return False
    return head.startswith((b'{"type": "step"', b'{"type":"step"'))  # how JsonlSink opens every step line


def _one_source_per_run_folder(runs: dict[str, RunSpec]) -> dict[str, RunSpec]:
    """The logs of one run in one folder are one run: where a folder holds nummon's own event log,
    the TensorBoard, W&B, CSV and trainer-state logs under that folder (the same run written by
    the Monitor's other sinks, as the demo writes them) are not read again; the event log names
    their formats (`beside`)."""
    folders = {fs.dirname(rid): spec for rid, spec in runs.items() if _own_log(spec)}
    if not folders:
        return runs
    out = {}
    for rid, spec in runs.items():
        owner = None if spec.format == "jsonl" else _owner(rid, folders)
        if owner is None:
            out[rid] = spec
            continue
        owner.covered.append(rid)
        if spec.format and spec.format not in owner.beside:
            owner.beside.append(spec.format)
    return out


def _owner(run_id: str, folders: dict[str, RunSpec]) -> RunSpec | None:
    """The event log whose folder `run_id` lies in, if any (the nearest folder)."""
    best = None
    for folder, spec in folders.items():
        prefix = folder.rstrip("/").rstrip(os.sep)
        if run_id.startswith(prefix + os.sep) or run_id.startswith(prefix + "/"):
            if best is None or len(folder) > len(best[0]):
                best = (folder, spec)
    return best[1] if best else None

"""Where a watched run lives: whether it is under a watch root, its short name below the root,
the signature of its files (a retired or unhealthy run wakes up when it changes), and since
when a saved run's files have been gone."""

from __future__ import annotations

import os
from typing import Any

from .._core.errors import NummonError
from .._logs import fs
from .._logs.discovery import RunSpec
from .._logs.read_mlflow import MLFLOW_PREFIX, is_mlflow_source, parse_source, safe_uri

__all__ = ["gone_since", "under", "run_name", "signature"]


def gone_since(saved_runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The saved runs whose files were not found, and since when (wall-clock seconds)."""
    return {
        rid: float(d["gone_since"])
        for rid, d in saved_runs.items()
        if isinstance(d.get("gone_since"), (int, float)) and not isinstance(d.get("gone_since"), bool)
    }


def under(run_id: str, root: str) -> bool:
    if is_mlflow_source(root):  # mlflow:<uri>[?experiment=...] holds mlflow:<uri>#<run-id>
        try:
            uri, one, _ = parse_source(root)
        except NummonError:
            return False
        return (
            run_id == f"{MLFLOW_PREFIX}{safe_uri(uri)}#{one}"
            if one
            else run_id.startswith(f"{MLFLOW_PREFIX}{safe_uri(uri)}#")
        )
    root = os.path.abspath(root) if "://" not in root else root
    return (
        run_id == root
        or run_id.startswith(root.rstrip("/").rstrip(os.sep) + os.sep)
        or run_id.startswith(root.rstrip("/") + "/")
    )


def run_name(run_id: str, roots: list[str]) -> str:
    """A run's short name: its path below the watch root that holds it (or its last parts)."""
    if run_id.startswith("mlflow:") and "#" in run_id:
        return "mlflow run " + run_id.rsplit("#", 1)[1]
    for root in roots:
        r = os.path.abspath(root) if "://" not in root else root
        if under(run_id, r) and run_id != r:
            return run_id[len(r.rstrip("/").rstrip(os.sep)) + 1 :]
    parts = run_id.rstrip("/").replace(os.sep, "/").split("/")
    return "/".join(parts[-2:])


def signature(spec: RunSpec | None) -> tuple:
    """Sizes, mtimes and identities of a run's files: a retired or unhealthy run wakes up when they change."""

    if spec is None:
        return ()
    if spec.format == "mlflow":
        return ()  # a server's run has no files: never "untouched since" (asked again at each discovery)
    return tuple((f, fs.stat(f)) for f in sorted(spec.files))

"""Files on the local disk or behind an fsspec URL (``memory://``, ``s3://``...), through one
small interface. fsspec is optional: URLs need it, local paths never import it."""
from __future__ import annotations

import os
from typing import Iterator

from .._errors import NummonError

__all__ = ["is_url", "Stat", "stat", "read_bytes", "walk_files", "is_dir", "join", "basename", "dirname"]


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _fs(path: str):
    try:
        import fsspec
    except ImportError:
        raise NummonError(f"{path}: URLs need the fsspec package (pip install fsspec)") from None
    try:
        return fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as e:
        raise NummonError(f"{path}: {e}") from None


class Stat(tuple):
    """(size in bytes, modification time in seconds or None)."""

    @property
    def size(self) -> int:
        return self[0]

    @property
    def mtime(self) -> float | None:
        return self[1]


def stat(path: str) -> Stat | None:
    """Size and mtime, or None when the path is gone."""
    if not is_url(path):
        try:
            st = os.stat(_local(path))
        except OSError:
            return None
        return Stat((st.st_size, st.st_mtime))
    fs, p = _fs(path)
    try:
        info = fs.info(p)
    except (FileNotFoundError, OSError):
        return None
    m = info.get("mtime") or info.get("LastModified") or info.get("created")
    try:
        m = float(m.timestamp()) if hasattr(m, "timestamp") else (float(m) if m is not None else None)
    except (TypeError, ValueError):
        m = None
    return Stat((int(info.get("size") or 0), m))


def read_bytes(path: str, offset: int = 0, length: int = -1) -> bytes:
    """`length` bytes of a file from `offset` (default: to its current end)."""
    if not is_url(path):
        with open(_local(path), "rb") as fh:
            fh.seek(offset)
            return fh.read(length)
    fs, p = _fs(path)
    with fs.open(p, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def is_dir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(_local(path))
    fs, p = _fs(path)
    return fs.isdir(p)


def walk_files(root: str, max_depth: int = 8) -> Iterator[str]:
    """Every file under `root` (as paths of the same kind as `root`), skipping hidden folders."""
    if not is_url(root):
        base = _local(root)
        depth0 = base.rstrip(os.sep).count(os.sep)
        for d, dirs, files in os.walk(base):
            if d.count(os.sep) - depth0 >= max_depth - 1:
                dirs[:] = []
            dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
            for f in sorted(files):
                yield os.path.join(d, f)
        return
    fs, p = _fs(root)
    proto = root.split("://", 1)[0]
    for d, _dirs, files in fs.walk(p, maxdepth=max_depth):
        for f in sorted(files):
            full = f"{d.rstrip('/')}/{f}"
            yield full if "://" in full else f"{proto}://{full.lstrip('/') if proto != 'memory' else full}"


def join(a: str, *parts: str) -> str:
    return "/".join([a.rstrip("/")] + list(parts)) if is_url(a) else os.path.join(_local(a), *parts)


def basename(p: str) -> str:
    return p.rstrip("/").rsplit("/", 1)[-1] if is_url(p) else os.path.basename(p.rstrip(os.sep))


def dirname(p: str) -> str:
    return p.rstrip("/").rsplit("/", 1)[0] if is_url(p) else os.path.dirname(_local(p).rstrip(os.sep))

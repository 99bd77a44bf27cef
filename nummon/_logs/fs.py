"""Files on the local disk or behind an fsspec URL (``memory://``, ``s3://``...), through one
small interface. fsspec is optional: URLs need it, local paths never import it."""

from __future__ import annotations

import os
import stat as _stat
from collections.abc import Iterator

from .._core.errors import NummonError

__all__ = [
    "is_url",
    "NotAFileError",
    "MAX_READ",
    "Stat",
    "stat",
    "read_bytes",
    "digest",
    "walk_files",
    "is_dir",
    "join",
    "basename",
    "dirname",
]


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _fs(path: str):
    try:
        import fsspec
    except ImportError:
        raise NummonError(f"{path}: URLs need the fsspec package (pip install fsspec)") from None
    try:
        return fsspec.core.url_to_fs(path)
    except (ValueError, ImportError) as e:
        raise NummonError(f"{path}: {e}") from None


class NotAFileError(NummonError):
    """A path that is not a regular file (a FIFO, a device, a socket): never opened for reading."""


#: The most one read returns: every read of a log is bounded, whatever the file's size.
MAX_READ = 256 * 1024 * 1024
#: The bytes read from a file's start to tell its format (and to mark which file it is).
HEAD_BYTES = 4096


class Stat(tuple):
    """(size in bytes, modification time in ns or None, device, inode): a file's identity is its
    (device, inode); a change of size or mtime says it was written."""

    @property
    def size(self) -> int:
        return self[0]

    @property
    def mtime(self) -> float | None:
        return None if self[1] is None else self[1] / 1e9

    @property
    def identity(self) -> tuple:
        return (self[2], self[3])


def stat(path: str) -> Stat | None:
    """Size, mtime and identity of a regular file, or None when the path is gone or is not a
    regular file (a FIFO or device under a watch root is not a log)."""
    if not is_url(path):
        try:
            st = os.stat(_local(path))
        except (OSError, ValueError):
            return None
        if not _stat.S_ISREG(st.st_mode):
            return None
        return Stat((st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino))
    fs, p = _fs(path)
    try:
        info = fs.info(p)
    except (FileNotFoundError, OSError):
        return None
    if info.get("type") == "directory":
        return None
    m = info.get("mtime") or info.get("LastModified") or info.get("created")
    try:
        m = float(m.timestamp()) if hasattr(m, "timestamp") else (float(m) if m is not None else None)
    except (TypeError, ValueError):
        m = None
    return Stat((int(info.get("size") or 0), None if m is None else int(m * 1e9), None, None))


def read_bytes(path: str, offset: int = 0, length: int = MAX_READ) -> bytes:
    """At most `length` bytes (and never more than MAX_READ) of a regular file from `offset`.

    Local files are opened non-blocking and checked to be regular files before any read, so a
    FIFO or a device named like a log can never block or flood the reader (NotAFileError)."""
    length = MAX_READ if length is None or length < 0 else min(length, MAX_READ)
    if not is_url(path):
        fd = os.open(_local(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            if not _stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotAFileError(f"{path}: not a regular file (a FIFO, device or socket is never read)")
            chunks = []
            while length > 0:
                b = os.pread(fd, min(length, 1 << 20), offset)
                if not b:
                    break
                chunks.append(b)
                offset += len(b)
                length -= len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)
    fs, p = _fs(path)
    with fs.open(p, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def digest(path: str, offset: int, length: int) -> str:
    """A short hash of `length` bytes at `offset` (what a saved position checks the file by)."""
    import hashlib

    if length <= 0:
        return ""
    return hashlib.blake2b(read_bytes(path, offset, length), digest_size=8).hexdigest()


def is_dir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(_local(path))
    fs, p = _fs(path)
    return fs.isdir(p)


def walk_files(root: str, max_depth: int = 8, follow_links: bool = False, only_regular: bool = True) -> Iterator[str]:
    """Every regular file under `root` (as paths of the same kind as `root`), `max_depth` levels
    deep, skipping hidden folders. For a shallow look at a folder a person named, `follow_links`
    enters folders that are links (a run folder linked in, never a loop that deep) and
    `only_regular=False` keeps every entry that is no folder (a FIFO named like a log is then
    named to its reader, which refuses it in one line, rather than passed over)."""
    if not is_url(root):
        base = _local(root)
        depth0 = base.rstrip(os.sep).count(os.sep)
        for d, dirs, files in os.walk(base, followlinks=follow_links):
            if d.count(os.sep) - depth0 >= max_depth - 1:
                dirs[:] = []
            dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
            for f in sorted(files):
                full = os.path.join(d, f)
                if not only_regular or stat(full) is not None:  # a FIFO under a root is never a log
                    yield full
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

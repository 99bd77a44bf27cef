"""Files written whole: a temporary file with an unpredictable name, created exclusively in the
target's folder (never following a link planted there), then renamed over the target, so a
reader never sees half a file and nobody can point the write at another file.

Every atomic writer of the package goes through `write_atomic`: the flight records, the
watcher's state file, the HTML reports.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]

_MODE = 0o644  # a new file's permissions (mkstemp's own 0600 would hide a report from its readers)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, durable: bool = False) -> Path:
    """Write `data` (text as UTF-8) to `path` whole. The temporary file is made by
    `tempfile.mkstemp` (O_CREAT | O_EXCL | O_NOFOLLOW, a random name) in the same folder and
    renamed over `path`; an existing target keeps its permissions. `durable`: fsync before the
    rename. On any failure the temporary file is removed and the error raised (OSError)."""
    path = Path(path)
    blob = data.encode("utf-8", "replace") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{_stem(path.name)}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, _mode_of(path))
            fh.write(blob)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # the folder went away: nothing is left behind either way
        raise
    return path


def _mode_of(path: Path) -> int:
    """The permissions of the file `path` names now (not of a link's target), else 0644."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return _MODE
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else _MODE


def _stem(name: str) -> str:
    """A short, plain prefix for the temporary file's name (the target's name, cut; any byte that
    is not printable ASCII as `_`)."""
    return "".join(ch if " " < ch < "\x7f" and ch != "/" else "_" for ch in name[:40]) or "file"

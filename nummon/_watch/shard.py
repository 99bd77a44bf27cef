"""`nummon watch ROOT --shard I/N`: N watchers split one shared root without overlap or gaps.

A run belongs to shard ``sha256(key) mod N``, where the key is the run's path relative to the
root it was found under (its bytes, so a name that is not UTF-8 has a shard too): stable across processes, restarts and hosts (the same share mounted
at different paths gives the same shards). Changing N moves runs between shards."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import TypeVar

from .._core.errors import NummonError
from .._core.text import raw_bytes

__all__ = ["Shard", "parse_shard", "shard_of", "run_key"]

T = TypeVar("T")


def run_key(run_id: str, roots: list[str]) -> str:
    """The run's path relative to the deepest root that holds it (its id when none does)."""
    best = None
    for root in roots:
        r = root if "://" in root else os.path.abspath(root)
        r = r.rstrip("/")
        if run_id == r or run_id.startswith(r + "/"):
            if best is None or len(r) > len(best):
                best = r
    if best is None:
        return run_id
    rel = run_id[len(best) :].lstrip("/")
    return rel or os.path.basename(best)


def shard_of(key: str, count: int) -> int:
    """The shard (0-based) of a key among `count`."""
    digest = hashlib.sha256(raw_bytes(key)).digest()  # a name that is not UTF-8: its bytes
    return int.from_bytes(digest[:8], "big") % count


class Shard:
    """Shard `index` (0-based) of `count`."""

    def __init__(self, index: int, count: int) -> None:
        if count < 1 or not 0 <= index < count:
            raise NummonError(f"--shard {index}/{count}: expected I/N with 0 <= I < N")
        self.index, self.count = index, count

    def owns(self, run_id: str, roots: list[str]) -> bool:
        return self.count == 1 or shard_of(run_key(run_id, roots), self.count) == self.index

    def select(self, specs: Mapping[str, T], roots: list[str]) -> dict[str, T]:
        """The runs of this shard, from all those found."""
        return {rid: s for rid, s in specs.items() if self.owns(rid, roots)}

    def __repr__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(spec: str) -> Shard:
    """`I/N` (0-based I) as a Shard; NummonError naming a bad one."""
    i, sep, n = spec.partition("/")
    try:
        if not sep:
            raise ValueError
        index, count = int(i), int(n)
    except ValueError:
        raise NummonError(f"--shard {spec!r}: expected I/N, e.g. 0/4 (shards are numbered from 0)") from None
    return Shard(index, count)

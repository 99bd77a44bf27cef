#!/usr/bin/env python3
"""The fixed split of the real-log set (tests/data/real) into a tuning part and a blind part.

Traces are grouped by their source (the repository, issue or index file named in SOURCES.md; rows
that say "same file" / "same repo" / "same README" belong to the row above), and a source is blind
when the first 8 hex digits of sha256(source) are 0 modulo 3: about a third of the sources, fixed
for every later round. Rules are tuned on the tuning part only; the blind part is scored once,
before an issue is resolved.

usage:
  python benchmarks/real_split.py list [tune|blind]          the traces of a part, one a line
  python benchmarks/real_split.py score tune|blind [-v]      score.py over that part only
  python benchmarks/real_split.py alarms tune|blind          false alarms per 1,000 healthy records
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "real"
SCORER = REAL.parent / "score.py"
_ROW = re.compile(r"^\|\s*`([^`]+)\.jsonl`\s*\|\s*([^|]*)\|")


def sources() -> dict[str, str]:
    """{trace name: source key} from SOURCES.md."""
    out: dict[str, str] = {}
    last = ""
    for line in (REAL / "SOURCES.md").read_text().splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, cell = m.group(1), m.group(2).strip()
        if cell.lower().startswith("same"):
            key = last
        elif cell.lower().startswith("index file id"):
            key = "index:" + cell.split()[3].rstrip(";,")
        else:
            key = re.split(r"[,\s]", cell, maxsplit=1)[0]
        out[name] = last = key
    return out


def part_of_source(source: str) -> str:
    """'blind' for about a third of the sources (a fixed hash), else 'tune'."""
    return "blind" if int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) % 3 == 0 else "tune"


def split() -> dict[str, str]:
    """{trace name: 'tune' | 'blind'} for every labelled trace."""
    src = sources()
    labels = json.loads((REAL / "labels.json").read_text())
    missing = sorted(set(labels) - set(src))
    if missing:
        raise SystemExit(f"real_split: no SOURCES.md row for {missing}")
    return {name: part_of_source(src[name]) for name in sorted(labels)}


def score(part: str, verbose: bool) -> int:
    """Run score.py over one part in a temporary corpus folder; its exit status."""
    labels = json.loads((REAL / "labels.json").read_text())
    names = [n for n, p in split().items() if p == part]
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            shutil.copy(REAL / f"{n}.jsonl", Path(tmp) / f"{n}.jsonl")
        (Path(tmp) / "labels.json").write_text(json.dumps({n: labels[n] for n in names}))
        cmd = [sys.executable, str(SCORER), tmp, "--cmd", f"{sys.executable} -m nummon replay"] + (
            ["-v"] if verbose else []
        )
        return subprocess.run(cmd).returncode


def false_alarms(part: str) -> tuple[int, int, int]:
    """(loud alerts on healthy traces, healthy records, healthy traces) of one part: a loud alert is
    a warning or critical of any kind, what score.py counts as a false alarm on a healthy run."""
    labels = json.loads((REAL / "labels.json").read_text())
    names = [n for n, p in split().items() if p == part and labels[n]["label"] == "healthy"]
    paths = [str(REAL / f"{n}.jsonl") for n in names]
    out = subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "--format", "jsonl", *paths],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    loud = sum(
        1
        for line in out.splitlines()
        if line.startswith("{") and json.loads(line).get("severity") in ("warning", "critical")
    )
    records = sum(sum(1 for line in (REAL / f"{n}.jsonl").read_text().splitlines() if line.strip()) for n in names)
    return loud, records, len(names)


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        parts = split()
        for n, p in parts.items():
            if len(argv) < 2 or argv[1] == p:
                print(n if len(argv) >= 2 else f"{p:5s} {n}")
        return 0
    if argv[:1] == ["score"] and len(argv) >= 2 and argv[1] in ("tune", "blind"):
        return score(argv[1], "-v" in argv)
    if argv[:1] == ["alarms"] and len(argv) >= 2 and argv[1] in ("tune", "blind"):
        loud, records, traces = false_alarms(argv[1])
        print(
            f"{argv[1]}: {loud} loud alerts on {traces} healthy traces, {records} records: "
            f"{1000 * loud / max(records, 1):.2f} per 1,000 healthy records"
        )
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

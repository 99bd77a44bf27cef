"""The checkout's folders and the CLI as a subprocess command."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
CORPUS = DATA / "corpus"


def nummon_cmd():
    """The CLI as a subprocess command (the installed console script's module)."""
    return [sys.executable, "-m", "nummon"]

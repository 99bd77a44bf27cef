"""What every command shares: the argument parser that fails in one line, and stderr output
with control characters escaped (a message may quote a file's bytes)."""
from __future__ import annotations

import argparse
import sys

from .._format import clean_text

__all__ = ["EXIT_ERROR", "Parser", "error", "note", "warn"]

EXIT_ERROR = 2  # bad input: one line on stderr, no traceback


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_ERROR, f"nummon: error: {clean_text(message)}\n")


def error(message: str) -> None:
    """The one-line error of a failed command."""
    print(f"nummon: error: {clean_text(message)}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """A one-line warning; the command goes on."""
    print(f"nummon: warning: {clean_text(message)}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A one-line remark in parentheses (a sink skipped, a fallback taken)."""
    print(f"({clean_text(message)})", file=sys.stderr, flush=True)

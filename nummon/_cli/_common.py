"""What every command shares: the argument parser that fails in one line, and stderr output
with control characters escaped (a message may quote a file's bytes)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from .._core.text import clean_text

__all__ = ["EXIT_ERROR", "MAX_SEED", "Parser", "error", "non_empty", "note", "seconds", "seed", "warn"]

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


MAX_SEED = 2**63 - 1  # torch.manual_seed takes 64 bits; the demo also seeds with seed + 1


def seconds(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in [low, high] (nan, inf, 0 and negatives
    are refused: argparse names the option, this the value and the range)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low <= value <= high):  # false for nan too
            raise argparse.ArgumentTypeError(f"expected a number of seconds from {low:g} to {high:g}, got {text!r}")
        return value

    return parse


def seed(text: str) -> int:
    """An argparse type: a seed torch accepts, an integer from 0 to 2**63 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63 - 1, got {clean_text(text[:40])!r}")
    return value


def non_empty(expected: str) -> Callable[[str], str]:
    """An argparse type: any text but the empty one (an empty --state or --metrics was ignored
    silently; an empty PATH would mean the current folder)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected {expected}, got an empty value")
        return text

    return parse

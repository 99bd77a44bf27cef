"""`nummon watch PATH...`: follow runs' logs from outside the training process and notify
incidents (the command itself lives in nummon._watch.command)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from .._watch.command import add_arguments

    w = sub.add_parser(
        "watch", help="follow TensorBoard / HF / Lightning / W&B / nummon logs and notify incidents live"
    )
    add_arguments(w)
    w.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._watch.command import run as watch

    return watch(args)

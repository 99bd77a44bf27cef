"""The `nummon` command line: replay, watch, demo, audit, policy, diagnose, report (one module per command).

Commands parse arguments, call the library (which returns data) and print. Bad input exits 2
with one line on stderr and no traceback. Commands that need torch import it only when they
run, so `nummon replay` works without torch.
"""
from __future__ import annotations

import sys
from typing import Sequence

from .._errors import NummonError
from . import audit, demo, diagnose, policy, replay, report, watch
from ._common import EXIT_ERROR, Parser, error

__all__ = ["build_parser", "main"]

_COMMANDS = (replay, watch, demo, audit, policy, diagnose, report)


def build_parser() -> Parser:
    from .. import __version__

    p = Parser(prog="nummon", description="Numerical-health monitor for PyTorch training.")
    p.add_argument("--version", action="version", version=f"nummon {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in _COMMANDS:
        command.add_parser(sub)
    # every command's --help opens with a description line: its own, else its one-line help
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        if not parser.description and helps.get(name):
            parser.description = helps[name][:1].upper() + helps[name][1:] + "."
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status: 0 fine, 1 a finding (audit: NaN/Inf), 2 bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args, parser)
    except NummonError as e:
        error(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("nummon: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0

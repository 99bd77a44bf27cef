"""The `nummon` command line: replay, watch, demo, audit, policy, diagnose, report (one module per command).

Commands parse arguments, call the library (which returns data) and print. Bad input exits 2
with one line on stderr and no traceback. Commands that need torch import it only when they
run, so `nummon replay` works without torch.

May import: `_core`, `_policy`, `_logs`, `_sinks`, `_stats`, `_engine`, `_forensics`, `_report`, `_monitor`, `_watch`, `_support`, `integrations`, `_tools`, `diagnose`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence

from .._core.errors import NummonError
from . import audit, demo, diagnose, policy, replay, report, watch
from ._common import EXIT_ERROR, Parser, error

__all__ = ["build_parser", "commands_text", "entry", "main"]

_COMMANDS = (replay, watch, demo, audit, policy, diagnose, report)


def build_parser() -> Parser:
    from .._core.version import __version__

    p = Parser(prog="nummon", description="Numerical-health monitor for PyTorch training.")
    p.add_argument("--version", action="version", version=f"nummon {__version__}")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=Parser)
    for command in _COMMANDS:
        command.add_parser(sub)
    # every command's --help opens with a description line: its own, else its one-line help
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        line = helps.get(name)
        if not parser.description and line:
            parser.description = line[:1].upper() + line[1:] + "."
    return p


def commands_text(parser: Parser) -> str:
    """What bare `nummon` prints: the usage, then every command with its one-line help (one line
    each, unwrapped), then where to look further."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    width = max(len(a.dest) for a in sub._choices_actions)
    lines = [parser.format_usage().rstrip(), "", str(parser.description), "", "commands:"]
    lines += [f"  {a.dest.ljust(width)}  {a.help}" for a in sub._choices_actions]
    lines += ["", "Run `nummon COMMAND --help` for a command's options, `nummon --help` for the global ones."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status: 0 fine, 1 a finding (audit: NaN/Inf), 2 bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(commands_text(parser), file=sys.stderr, end="")
        return EXIT_ERROR  # no command is a usage error, as argparse's own: a script with an empty command fails
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


def entry() -> None:
    """The `nummon` executable: run `main`, then exit with its status. Before the exit every
    object is frozen out of the garbage collector: the command has closed what it opened, and the
    interpreter's final collections over torch's and torch._dynamo's objects only cost time
    (1.3-1.9 s after `nummon demo` on one core; nothing is left to finalise that matters)."""
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(status)

"""`nummon policy show|validate`: print a policy as commented YAML, or check a policy file."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .._format import clean_text
from ._common import EXIT_ERROR

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    po = sub.add_parser("policy", help="show or validate a policy")
    po.add_argument("action", choices=("show", "validate"))
    po.add_argument("source", nargs="?", metavar="NAME|FILE")
    po.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._policy import load_policy, policy_yaml, validate_policy_file

    if args.action == "show":
        print(policy_yaml(load_policy(args.source or "default")), end="")
        return 0
    if not args.source:
        parser.error("policy validate needs a FILE")
    errors = validate_policy_file(args.source)
    if errors:
        for e in errors:
            print(clean_text(f"{args.source}: {e}"), file=sys.stderr)
        return EXIT_ERROR
    print(f"{args.source}: valid")
    return 0

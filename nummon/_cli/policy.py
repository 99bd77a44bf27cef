"""`nummon policy show|validate`: print a policy as commented YAML, or check a policy file."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any

from .._core.text import clean_text
from ._common import EXIT_ERROR

__all__ = ["add_parser", "load_policy_with_hints", "run", "with_suggestion"]


def add_parser(sub: Any) -> None:
    po = sub.add_parser(
        "policy",
        help="show or validate a policy",
        description="Print a policy (a preset or a file) as commented YAML, or check a policy file: "
        "every error names its field, exit 2 when there is one.",
    )
    po.add_argument("action", choices=("show", "validate"), help="show: print as YAML; validate: check a file")
    po.add_argument(
        "source",
        nargs="?",
        metavar="NAME|FILE",
        help="a preset (default, strict, recover) or a YAML/TOML/JSON file (show: default when left out)",
    )
    po.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._policy.policy import load_policy, policy_yaml, validate_policy_file

    if args.action == "show":
        print(policy_yaml(load_policy(args.source or "default")), end="")
        return 0
    if not args.source:
        parser.error("policy validate needs a FILE")
    errors = validate_policy_file(args.source)
    if errors:
        for e in errors:
            print(clean_text(f"{args.source}: {with_suggestion(e)}"), file=sys.stderr)
        return EXIT_ERROR
    print(f"{args.source}: valid")
    return 0


def load_policy_with_hints(source: str) -> Any:
    """`load_policy` for a command's --policy: an invalid file's one-line error carries the same
    "did you mean" hints as `nummon policy validate`."""
    from .._policy.policy import PolicyError, load_policy, validate_policy_file

    try:
        return load_policy(source)
    except PolicyError as e:
        try:
            problems = validate_policy_file(source)
        except PolicyError:  # unreadable or unparsable: the message is already the whole story
            raise e from None
        listed = "; ".join(problems)
        if not problems or not str(e).endswith(listed):
            raise
        head = str(e)[: len(str(e)) - len(listed)]  # "invalid policy FILE: "
        raise PolicyError(head + "; ".join(with_suggestion(m) for m in problems)) from None


_UNKNOWN = re.compile(r"^(?P<path>[\w.]+): unknown key$")


def with_suggestion(message: str) -> str:
    """An "unknown key" error with the closest known key of its section: "spike.grad_factr:
    unknown key (did you mean grad_factor?)"."""
    m = _UNKNOWN.match(message)
    if not m:
        return message
    from .._policy.policy import Policy

    *section, key = m.group("path").split(".")
    model: Any = Policy
    for part in section:
        field = getattr(model, "model_fields", {}).get(part)
        model = getattr(field, "annotation", None) if field is not None else None
        if model is None or not hasattr(model, "model_fields"):
            return message
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f"{message} (did you mean {close[0]}?)" if close else message

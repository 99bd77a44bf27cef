"""The `nummon` command line: replay, demo, audit, policy, diagnose.

Bad input exits 2 with one line on stderr and no traceback. Subcommands that need torch import
it only when they run, so `nummon replay` works without torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ._errors import NummonError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + message)
        self.exit(2, f"nummon: error: {message}\n")


def _cmd_replay(args: argparse.Namespace) -> int:
    from ._policy import load_policy
    from ._replay import replay
    from ._trace import expand_paths

    from ._types import Severity

    policy = load_policy(args.policy)
    paths = expand_paths(args.paths)
    floor = Severity(args.min_severity).rank
    n_alerts = 0
    for path in paths:
        alerts = [a for a in replay(path, policy) if a.severity.rank >= floor]
        for a in alerts:
            n_alerts += 1
            if args.format == "jsonl":
                print(json.dumps({"source": str(path), **a.to_dict()}, allow_nan=False))
            else:
                print(f"{path}: {a}")
        if args.format == "text" and not alerts:
            print(f"{path}: no alerts")
    if args.format == "text":
        print(f"{len(paths)} trace(s), {n_alerts} alert(s)")
    return 0


def _cmd_policy(args: argparse.Namespace) -> int:
    from ._policy import load_policy, policy_yaml, validate_policy_file

    if args.action == "show":
        print(policy_yaml(load_policy(args.source or "default")), end="")
        return 0
    errors = validate_policy_file(args.source)
    if errors:
        for e in errors:
            print(f"{args.source}: {e}", file=sys.stderr)
        return 2
    print(f"{args.source}: valid")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(args)


def _cmd_audit(args: argparse.Namespace) -> int:
    from ._audit import run_audit

    return run_audit(args)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .diagnose import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nummon", description="Numerical-health monitor for PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("replay", help="run the detectors over recorded JSONL traces")
    r.add_argument("paths", nargs="+", metavar="PATH", help="trace files, or directories of *.jsonl")
    r.add_argument("--policy", default="default", help="preset name or policy file (default: default)")
    r.add_argument("--format", choices=("text", "jsonl"), default="text")
    r.add_argument("--min-severity", choices=("info", "warning", "critical"), default="info",
                   help="print only alerts at or above this severity (default: info)")
    r.set_defaults(func=_cmd_replay)

    d = sub.add_parser("demo", help="reproduce a runaway on synthetic data, with every sink")
    d.add_argument("--out", default=None, help="output folder (default: ./nummon-runs/<timestamp>)")
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 160)")
    d.add_argument("--lr", type=float, default=None, help="learning rate (default: runaway 0.05, --healthy 0.005)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.add_argument("--healthy", action="store_true", help="a safe learning rate: must end with no warning")
    d.add_argument("--stop-at-critical", action="store_true", help="stop at the first critical alert")
    d.add_argument("--no-wandb", action="store_true", help="skip the W&B sink")
    d.add_argument("--no-tensorboard", action="store_true", help="skip the TensorBoard sink")
    d.add_argument("--policy", default="default")
    d.set_defaults(func=_cmd_demo)

    a = sub.add_parser("audit", help="check checkpoints for NaN/Inf and compare two")
    a.add_argument("ckpt", metavar="CKPT")
    a.add_argument("ckpt2", metavar="CKPT2", nargs="?")
    a.add_argument("--format", choices=("text", "json"), default="text")
    a.add_argument("--trust", action="store_true", help="allow pickled code (only for checkpoints you trust)")
    a.set_defaults(func=_cmd_audit)

    po = sub.add_parser("policy", help="show or validate a policy")
    po.add_argument("action", choices=("show", "validate"))
    po.add_argument("source", nargs="?", metavar="NAME|FILE")
    po.set_defaults(func=_cmd_policy)

    dg = sub.add_parser("diagnose", help="run the debugging checklist on the demo model and data")
    dg.add_argument("--seed", type=int, default=0)
    dg.set_defaults(func=_cmd_diagnose)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "policy" and args.action == "validate" and not args.source:
        parser.error("policy validate needs a FILE")
    try:
        return args.func(args)
    except NummonError as e:
        print(f"nummon: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nummon: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""`nummon watch PATH...`: follow training runs' logs from outside the training process and
notify their incidents (--notify: the console by default), until SIGINT or SIGTERM, or after one
pass with --once.

Each PATH is a log file, a run folder or a root holding many runs (found anew at each poll):
TensorBoard, Hugging Face trainer_state.json, Lightning metrics.csv, W&B offline runs, MLflow
and nummon JSONL logs. Exit status: 0 fine; 2 bad input (one line on stderr), or with --once a
run that could not be read; 1 with --once when a notification was lost.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from .._core.errors import NummonError
from .._logs import fs
from .._logs.keymap import KeyMap
from .._logs.readers import FORMATS
from .._watch.output import Target
from .._watch.settings import IDLE_TIMEOUT_S, INTERVAL_S, WatchSettings
from .._watch.targets import TARGET_SPECS, parse_target
from .._watch.watcher import Watcher
from ._common import non_empty, seconds

__all__ = ["add_parser", "run"]

#: Polls more often than every 10 ms spin a core for nothing; a day is the longest wait that means
#: anything (and Event.wait overflows far beyond it).
INTERVAL_RANGE_S = (0.01, 86400.0)
#: A run is retired after at least a second of quiet and at most ~30 years (never, in practice).
IDLE_TIMEOUT_RANGE_S = (1.0, 1e9)


def add_parser(sub: Any) -> None:
    w = sub.add_parser(
        "watch", help="follow TensorBoard / HF / Lightning / W&B / MLflow / nummon logs and notify incidents live"
    )
    _add_arguments(w)
    w.set_defaults(run=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        type=non_empty("a path or URL"),
        help="log files, run folders, roots with many runs, MLflow runs or servers (mlflow:URI#RUN_ID, mlflow:URI), or fsspec URLs (when fsspec is installed)",
    )
    parser.add_argument("--policy", default="default", help="preset name or policy file (default: default)")
    parser.add_argument(
        "--notify",
        action="append",
        metavar="TARGET",
        default=None,
        help=f"where incident events go, repeatable: {TARGET_SPECS} (default: console)",
    )
    parser.add_argument(
        "--interval",
        type=seconds(*INTERVAL_RANGE_S),
        default=INTERVAL_S,
        metavar="SECONDS",
        help="seconds between polls, from {:g} to {:g} (default: {:g})".format(*INTERVAL_RANGE_S, INTERVAL_S),
    )
    parser.add_argument("--once", action="store_true", help="read what is there, notify, and exit")
    parser.add_argument(
        "--state",
        default=None,
        metavar="FILE",
        type=non_empty("a state file path"),
        help="state file: read positions and incident state survive a restart",
    )
    parser.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default=None,
        help="force one log format, one of %(choices)s (default: detected for each run)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=seconds(*IDLE_TIMEOUT_RANGE_S),
        default=IDLE_TIMEOUT_S,
        metavar="S",
        help="retire a run after this many seconds without new records, from {:g} to {:g} (default: {:g})".format(
            *IDLE_TIMEOUT_RANGE_S, IDLE_TIMEOUT_S
        ),
    )
    _add_fleet_arguments(parser)


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a watcher that follows many runs: extra keys, metrics, sharding."""
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="TAG=FIELD",
        help="extra key map entry, e.g. my/loss=loss (repeatable)",
    )
    parser.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        type=non_empty("HOST:PORT"),
        help="serve Prometheus metrics of every watched run at http://HOST:PORT/metrics (needs nummon[prometheus])",
    )
    parser.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        type=non_empty("I/N"),
        help="follow only the runs of shard I of N (0-based, by a stable hash of each run's path under its root)",
    )


def _keymap(pairs: list[str]) -> KeyMap:
    """The default key map with the --key TAG=FIELD entries."""
    extra = {}
    for p in pairs:
        tag, sep, field = p.rpartition("=")
        if not sep or not tag:
            raise NummonError(f"--key {p!r}: expected TAG=FIELD")
        extra[tag] = field
    try:
        return KeyMap(extra)
    except ValueError as e:
        raise NummonError(f"--key: {e}") from None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Watch until SIGINT/SIGTERM (or one pass with --once); the exit status."""
    from .policy import load_policy_with_hints

    _check_args(args)
    policy = load_policy_with_hints(args.policy)
    keymap = _keymap(args.key)
    shard = None
    if getattr(args, "shard", None) is not None:
        from .._watch.shard import parse_shard

        shard = parse_shard(args.shard)
    targets = _targets(args.notify)
    exclude = {os.path.abspath(s.split(":", 1)[1]) for s in (args.notify or []) if s.startswith("jsonl:")}
    observer, server = _serve_metrics(getattr(args, "metrics", None), targets)
    try:
        watcher = _watcher(args, policy, targets, keymap, exclude, observer, shard)
    except BaseException:
        _close_all(targets)
        if server is not None:
            server.close()
        raise
    previous = _stop_on_signals(watcher)
    try:
        watcher.run(interval_s=args.interval, once=args.once)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None:
            server.close()
    if args.once and watcher.lost:
        return 1
    if args.once and watcher.bad:
        return 2
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """NummonError naming the first bad value (the parser checks most of them too; this is for
    callers with a Namespace of their own)."""
    for option, value, (low, high) in (
        ("--interval", args.interval, INTERVAL_RANGE_S),
        ("--idle-timeout", args.idle_timeout, IDLE_TIMEOUT_RANGE_S),
    ):
        if not (low <= value <= high):
            raise NummonError(f"{option} must be a number of seconds from {low:g} to {high:g}, got {value}")
    for option, value in (
        ("--state", args.state),
        ("--metrics", getattr(args, "metrics", None)),
        ("--shard", getattr(args, "shard", None)),
    ):
        if value is not None and not str(value).strip():
            raise NummonError(f"{option}: an empty value")
    for p in args.paths:
        if not fs.is_url(p) and not os.path.lexists(p):
            raise NummonError(f"{p}: not found")
        if not fs.is_url(p) and not os.path.isdir(p) and fs.stat(p) is None:
            raise NummonError(f"{p}: not a regular file or folder (a FIFO or device is never read)")


def _targets(specs: list[str] | None) -> list[Target]:
    """The --notify targets (console by default); those made are closed when one is refused."""
    targets: list[Target] = []
    try:
        for spec in specs or ["console"]:
            targets.append(parse_target(spec, wandb_sink=_wandb_sink))
    except BaseException:
        _close_all(targets)
        raise
    return targets


def _close_all(targets: list[Target]) -> None:
    for t in targets:
        t.close()


def _serve_metrics(listen: str | None, targets: list[Target]) -> tuple[Any, Any]:
    """--metrics: (the watcher's metrics observer, the server), or (None, None) without it."""
    if listen is None:
        return None, None
    from .._watch.metrics import FleetMetrics, MetricsObserver

    try:
        from nummon.integrations.prometheus import serve_metrics

        fleet = FleetMetrics()
        fleet.targets = targets
        server = serve_metrics(fleet, listen)
    except (ImportError, NummonError) as e:
        _close_all(targets)
        raise NummonError(f"--metrics: {e}") from None
    print(f"nummon watch: serving metrics at {server.url}", file=sys.stderr, flush=True)
    return MetricsObserver(fleet), server


def _watcher(
    args: argparse.Namespace,
    policy: Any,
    targets: list[Target],
    keymap: Any,
    exclude: set[str],
    observer: Any,
    shard: Any,
) -> Watcher:
    return Watcher(
        args.paths,
        policy,
        targets,
        settings=WatchSettings(
            format=args.format,
            keymap=keymap,
            state_path=args.state,
            idle_timeout_s=args.idle_timeout,
            exclude=frozenset(exclude),
            shard=shard,
        ),
        observer=observer,
    )


def _stop_on_signals(watcher: Watcher) -> dict[signal.Signals, Any]:
    """SIGINT and SIGTERM stop the watcher within one interval; the handlers they replace."""
    previous: dict[signal.Signals, Any] = {}

    def _stop(signum, frame):  # the loop waits on this event
        watcher.stop_reason = signal.Signals(signum).name  # named in the watcher's last line
        watcher.stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, _stop)
        except ValueError:  # not the main thread: the caller stops us through watcher.stop
            pass
    return previous


def _wandb_sink(**kwargs: Any) -> Any:
    """The W&B sink, from the integrations layer (imported only for --notify wandb)."""
    from ..integrations.wandb import WandbSink

    return WandbSink(**kwargs)

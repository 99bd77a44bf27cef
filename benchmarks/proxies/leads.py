"""Score the proxies: per run, the step the loss leaves its band, nummon's first warning with and
without the mechanism probes (replayed at the default cadence, sparser while the run is calm, every step while an incident is
open, exactly as the live Monitor samples), the kind it names, and the peers' rules.

    .venv/bin/python -m benchmarks.proxies.leads TRACE_DIR [--every N]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from nummon._core.types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, Severity, StepRecord
from nummon._engine.engine import HealthEngine
from nummon._logs.trace import read_trace
from nummon._policy.policy import Policy

from .peers import PEERS, loss_band_exit

__all__ = ["MECHANISM_KINDS", "first_warning", "first_warnings", "score_trace"]

_BLANK = {f: None for f in MECHANISM_FIELDS} | {f: {} for f in MECHANISM_LAYER_FIELDS} | {"sample_loss_top": ()}


def _without(rec: StepRecord) -> StepRecord:
    return dataclasses.replace(rec, **_BLANK)


MECHANISM_KINDS = ("attention_logits", "output_logits", "adam_second_moment")


def first_warnings(records: list[StepRecord], every: int | None, policy: Policy | None = None) -> dict[str, int]:
    """The first step each alert kind reached warning or critical; `every=None`: without the probes."""
    pol = policy or Policy()
    eng = HealthEngine(pol)
    cadence = pol.mechanisms.model_copy(update={"every": every}) if every is not None else None
    first: dict[str, int] = {}
    for rec in records:  # sampled exactly as StepPipeline.arm_mechanisms decides
        sampled = cadence is not None and (
            eng.wants_sample() or eng.incident_state.active or cadence.due(rec.step, eng.calm)
        )
        got = eng.step(rec if sampled else _without(rec))
        for a in got.alerts:
            if a.severity.rank >= Severity.WARNING.rank:
                first.setdefault(a.kind.value, rec.step)
    return first


def first_warning(
    records: list[StepRecord], every: int | None, policy: Policy | None = None
) -> tuple[int | None, str | None]:
    """(step, kinds) of the first warning or critical alert (every kind raised at that step,
    joined by "+"); `every=None`: without the probes."""
    return _first(first_warnings(records, every, policy))


def _first(first: dict[str, int]) -> tuple[int | None, str | None]:
    if not first:
        return None, None
    step = min(first.values())
    return step, "+".join(k for k, v in first.items() if v == step)


def score_trace(path: Path, every: int) -> dict:
    recs = list(read_trace(path))
    if not recs:
        return {}
    loss = [r.loss for r in recs]
    gn = [r.grad_norm for r in recs]
    exit_ = loss_band_exit(loss)
    with_all = first_warnings(recs, every)
    with_step, with_kind = _first(with_all)
    without_step, without_kind = first_warning(recs, None)
    mechanism = _first({k: v for k, v in with_all.items() if k in MECHANISM_KINDS})
    peers = {name: rule(loss, gn) for name, rule in PEERS.items()}
    return {
        "run": path.stem,
        "exit": exit_,
        "with": (with_step, with_kind),
        "without": (without_step, without_kind),
        "mechanism": mechanism,
        "peers": peers,
        "peak_logit": max((r.attention_logit_max or 0) for r in recs),
        "log_z": _log_z(recs, exit_),
    }


def _log_z(recs: list[StepRecord], exit_: int | None) -> str:
    """Mean log Z: its first sample, at the step the loss leaves its band, and its peak (nats)."""
    z = {r.step: r.output_logsumexp_mean for r in recs if r.output_logsumexp_mean is not None}
    if not z:
        return "—"
    at = f" → {z[exit_]:.3g} at exit" if exit_ in z else ""
    return f"{next(iter(z.values())):.3g}{at} → peak {max(z.values()):.3g}"


def _lead(exit_: int | None, step: int | None) -> str:
    if step is None:
        return "none" if exit_ is not None else "quiet"
    if exit_ is None:
        return f"warned at {step}"
    return str(exit_ - step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces")
    ap.add_argument("--every", type=int, default=Policy().mechanisms.every)
    args = ap.parse_args()
    rows = [r for p in sorted(Path(args.traces).glob("*.jsonl")) if (r := score_trace(p, args.every))]
    names = list(PEERS)
    print(
        "| run | loss leaves band | peak attention logit | log Z | nummon with probes (kind) | first mechanism warning | nummon without | "
        + " | ".join(names)
        + " |"
    )
    print("|---" * (7 + len(names)) + "|")
    for r in rows:
        e = r["exit"]
        w = _lead(e, r["with"][0]) + (f" ({r['with'][1]})" if r["with"][1] else "")
        m = _lead(e, r["mechanism"][0]) + (f" ({r['mechanism'][1]})" if r["mechanism"][1] else "")
        wo = _lead(e, r["without"][0]) + (f" ({r['without'][1]})" if r["without"][1] else "")
        peers = " | ".join(_lead(e, r["peers"][n]) for n in names)
        print(
            f"| {r['run']} | {e if e is not None else '—'} | {r['peak_logit']:.3g} | {r['log_z']} | {w} | {m} | {wo} | {peers} |"
        )


if __name__ == "__main__":
    main()

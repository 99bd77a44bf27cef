"""Score the proxies: per run, the step the loss leaves its band, nummon's first warning with and
without the mechanism probes (replayed at the default cadence, every step while an incident is
open, exactly as the live Monitor samples), the kind it names, and the peers' rules.

    .venv/bin/python -m benchmarks.proxies.leads TRACE_DIR [--every N]
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from nummon._engine import HealthEngine
from nummon._policy import Policy
from nummon._trace import read_trace
from nummon._types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, Severity, StepRecord

from .peers import PEERS, loss_band_exit

__all__ = ["first_warning", "score_trace"]

_BLANK = {f: None for f in MECHANISM_FIELDS} | {f: {} for f in MECHANISM_LAYER_FIELDS} | {"sample_loss_top": ()}


def _without(rec: StepRecord) -> StepRecord:
    return dataclasses.replace(rec, **_BLANK)


def first_warning(records: list[StepRecord], every: int | None, policy: Policy | None = None) -> tuple[int | None, str | None]:
    """(step, kind) of the first warning or critical alert; `every=None`: without the probes."""
    eng = HealthEngine(policy or Policy())
    for rec in records:  # sampled exactly as Monitor._arm_mechanisms decides
        sampled = every is not None and (rec.step % every == 0 or eng.wants_sample() or eng.incident_state.active)
        got = eng.step(rec if sampled else _without(rec))
        for a in got.alerts:
            if a.severity.rank >= Severity.WARNING.rank:
                return rec.step, a.kind.value
    return None, None


def score_trace(path: Path, every: int) -> dict:
    recs = list(read_trace(path))
    if not recs:
        return {}
    loss = [r.loss for r in recs]
    gn = [r.grad_norm for r in recs]
    exit_ = loss_band_exit(loss)
    with_step, with_kind = first_warning(recs, every)
    without_step, without_kind = first_warning(recs, None)
    peers = {name: rule(loss, gn) for name, rule in PEERS.items()}
    return {"run": path.stem, "exit": exit_, "with": (with_step, with_kind), "without": (without_step, without_kind),
            "peers": peers, "peak_logit": max((r.attention_logit_max or 0) for r in recs)}


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
    print(f"| run | loss leaves band | peak attention logit | nummon with probes (kind) | nummon without | "
          + " | ".join(names) + " |")
    print("|---" * (5 + len(names)) + "|")
    for r in rows:
        e = r["exit"]
        w = _lead(e, r["with"][0]) + (f" ({r['with'][1]})" if r["with"][1] else "")
        wo = _lead(e, r["without"][0]) + (f" ({r['without'][1]})" if r["without"][1] else "")
        peers = " | ".join(_lead(e, r["peers"][n]) for n in names)
        print(f"| {r['run']} | {e if e is not None else '—'} | {r['peak_logit']:.3g} | {w} | {wo} | {peers} |")


if __name__ == "__main__":
    main()

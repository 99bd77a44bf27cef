"""The fast path for quiet records (nummon/_engine/quiet.py) decides exactly what the full path
decides: the same health, alerts and incident events at every step, and the same state after,
on generated families of runs (healthy, noisy, stalled, oscillating, diverging, spiking, running
away, vanishing, non-finite, frozen, at chance, sparse and sampled logs) and on every real log
and labelled trace the project scores. Each family is also checked to take the fast path at all
where it is quiet (an equality that never skipped a detector would prove nothing)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import pytest
from helpers.detector_tester import unit_noise
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import StepRecord
from nummon._engine.engine import HealthEngine
from nummon._logs.trace import iter_steps
from nummon._policy.policy import Policy, load_policy

ROOT = Path(__file__).resolve().parents[2]
REAL = sorted((ROOT / "tests" / "data" / "real").glob("*.jsonl"))
DEV = sorted((ROOT.parent / "shared" / "corpus" / "dev").glob("*.jsonl"))


def outcomes(
    records: Iterable[dict | StepRecord], quiet_path: bool, policy: Policy | None = None
) -> tuple[list, dict, int]:
    """(per record: step, health, alerts, incident events; the engine's saved state; records that
    took the fast path). A step that goes backwards starts a new engine, as replay does."""
    pol = policy or Policy()
    engine, last, fast = HealthEngine(pol, quiet_path=quiet_path), None, 0
    out: list[tuple] = []
    for d in records:
        rec = StepRecord.from_dict(d) if isinstance(d, dict) else d
        if last is not None and rec.step <= last:
            engine = HealthEngine(pol, quiet_path=quiet_path)
        last = rec.step
        booked = len(engine._quiet.booked)
        got = engine.step(rec)
        fast += len(engine._quiet.booked) > booked
        out.append(
            (
                got.step,
                got.health.value,
                [json.dumps(a.to_dict(), sort_keys=True, default=str) for a in got.alerts],
                [json.dumps(e.to_dict(), sort_keys=True, default=str) for e in got.incidents],
            )
        )
    out.append(("closed", [e.to_dict() for e in engine.close(last or 0)]))
    return out, engine.state_dict(), fast


def assert_same(records: list, policy: Policy | None = None) -> int:
    """The fast path's outcomes equal the full path's, record for record; how many were fast."""
    full, full_state, none = outcomes(records, quiet_path=False, policy=policy)
    fast, fast_state, n = outcomes(records, quiet_path=True, policy=policy)
    assert none == 0
    for a, b in zip(full, fast):
        assert a == b, f"first difference at {a[0]}"
    assert full_state == fast_state
    return n


FAMILIES = (
    "falling",
    "plateau",
    "oscillating",
    "diverging",
    "spikes",
    "runaway",
    "vanishing",
    "nonfinite",
    "frozen",
    "binary_chance",
    "rebound",
    "extreme",
    "slow_rise",
    "settling",
    "skipped",
)

#: policies whose bars bind before the band's own width does (the default's rarely do): each
#: proof must hold for the thresholds the policy sets, not only for the defaults
POLICIES = (
    Policy(),
    load_policy({"spike": {"loss_factor": 1.1, "grad_factor": 1.3, "window": 10, "robust_z": 0.5}}),
    load_policy({"divergence": {"warning_factor": 1.3, "patience": 2, "rebound_factor": 1.05, "noise_multiple": 0.0}}),
    load_policy(
        {
            "stall": {"frozen_records": 4, "frozen_tolerance": 0.01, "min_records": 5},
            "trend": {"min_span": 20, "min_records": 5},
        }
    ),
    load_policy({"runaway": {"min_growth": 1.02, "warning_steps": 2, "warning_total_factor": 1.1, "short_history": 1}}),
    load_policy({"vanishing": {"patience": 3, "ratio": 0.3}}),
    load_policy({"headroom": {"warning_decades": {"float32": 36.5}, "critical_decades": {"float32": 36.0}}}),
    load_policy(
        {"oscillation": {"min_spread": 0.01, "high_fraction": 0.01}, "trend": {"min_span": 10, "min_records": 5}}
    ),
)


@st.composite
def runs(draw) -> tuple[str, list[dict]]:
    """One generated run: a family, its length, logging cadence, noise and sampled fields."""
    family = draw(st.sampled_from(FAMILIES))
    n = draw(st.integers(30, 400))
    every = draw(st.sampled_from([1, 1, 1, 5, 50]))
    noise = draw(st.sampled_from([0.0, 0.002, 0.02, 0.1, 0.4]))
    start = draw(st.sampled_from([0.05, 0.6931, 2.3, 10.9]))
    sampled = draw(st.sampled_from([1, 10, 0]))  # parameter norms every k records (0: never)
    at = draw(st.integers(5, max(6, n - 5)))  # where the family's event starts
    rate = draw(st.sampled_from([0.003, 0.01, 0.03, 0.1]))  # slow_rise: growth per record
    amplitude, period = draw(st.sampled_from([0.03, 0.1, 0.4])), draw(st.sampled_from([2, 6, 15]))
    own_headroom = draw(st.booleans())  # the Monitor's records carry their own headroom (decades)
    u = unit_noise(draw(st.integers(0, 2**30)), 4 * n)
    rows = []
    for i in range(n):
        loss = start * (0.3 + 0.7 * math.exp(-i / max(n / 3, 1)))
        grad = 1.0 + 0.3 * math.exp(-i / 50)
        layers = {"a": grad * 0.5, "b": grad * 0.8, "c": grad * 1e-3}
        act = 5.0
        k = i - at
        if family == "plateau":
            loss = start
        elif family == "oscillating":
            loss = start * (1 + amplitude * math.sin(i / period))
        elif family == "diverging" and k >= 0:
            loss *= 1.05**k
        elif family == "spikes" and 0 <= k < 3:
            loss, grad = loss * 6, grad * 40
        elif family == "runaway" and k >= 0:
            grad *= 1.7**k
            act *= 1.3**k
        elif family == "vanishing" and k >= 0:
            layers["a"] = 0.0
        elif family == "nonfinite" and 0 <= k < 2:
            loss = math.nan
        elif family == "frozen" and k >= 0:
            loss = round(start * 0.9, 4)
        elif family == "binary_chance" and k >= 0:
            loss = math.log(2) * (1 + 0.002 * u[i])
        elif family == "rebound" and k >= 0:
            loss = start * 0.3 * (1 + min(k, 30) / 10)
        elif family == "extreme" and k >= 0:
            act = 1e25 * 10.0 ** min(k, 12)
        elif family == "slow_rise" and k >= 0:
            loss *= (1 + rate) ** k  # crosses every loss bar at some record, quiet or not
            grad *= (1 + rate) ** k
            act *= (1 + rate) ** k
        elif family == "skipped" and k >= 0:
            grad = math.nan if k == 0 else grad  # a loss scaler's skipped step in a log, then the loss shifts
            loss *= 1 if k == 0 else 1 + rate * 30
        elif family == "settling" and k >= 0:
            loss = start * 0.5 * (1 + 0.01 * u[i] * 0.7**k)  # its noise dies out: frozen at some record
        row = {
            "step": i * every,
            "loss": loss * (1 + noise * u[i])
            if family not in ("frozen", "binary_chance", "settling") or k < 0
            else loss,
            "grad_norm": grad * (1 + noise * u[n + i]),
            "activation_max": act * (1 + 0.1 * noise * u[2 * n + i]),
            "layer_grad_norms": {key: v * (1 + noise * u[3 * n + i]) for key, v in layers.items()},
            "lr": 1e-3,
        }
        if sampled and i % sampled == 0:
            row["param_norm"] = 30.0 + i * 0.01
            row["grad_max"] = grad * 0.05
        if own_headroom:
            top = max(abs(v) for k, v in row.items() if k in ("loss", "grad_norm", "activation_max", "param_norm"))
            # (from the largest element, which no scalar of the record shows: here 10x the largest one)
            row["headroom"], row["headroom_dtype"] = math.log10(3.4028234663852886e38) - math.log10(10 * top), "float32"
        rows.append(row)
    return family, rows


@settings(max_examples=300, deadline=None)
@given(runs(), st.sampled_from(POLICIES))
def test_the_fast_path_decides_as_the_full_path_on_generated_runs(run, policy):
    family, rows = run
    assert_same(rows, policy)


@pytest.mark.parametrize("family", ["falling", "plateau", "spikes", "vanishing"])
def test_the_fast_path_is_taken_where_a_run_is_quiet(family):
    # a long, per-step, lightly noisy run of each family: its quiet records skip the detectors
    # (the plateau's stall and the vanishing layer stay open once found: those are judged in full)
    u = unit_noise(7, 2000)
    rows = []
    for i in range(500):
        loss = 2.3 * (0.3 + 0.7 * math.exp(-i / 150)) * (1 + 0.01 * u[i])
        if family == "plateau":
            loss = 2.3 * (1 + 0.01 * u[i])
        if family == "spikes" and i in (300, 301):
            loss *= 6
        grad = 1.0 + 0.02 * u[500 + i]
        layers = {"a": 0.0 if family == "vanishing" and i > 200 else grad * 0.5, "b": grad}
        rows.append({"step": i, "loss": loss, "grad_norm": grad, "layer_grad_norms": layers})
    fast = assert_same(rows)
    assert fast >= {"falling": 0.7, "plateau": 0.1, "spikes": 0.6, "vanishing": 0.3}[family] * len(rows), fast


def test_a_record_crossing_its_band_is_judged_in_full():
    u = unit_noise(11, 200)
    rows = [{"step": i, "loss": 2.0 * math.exp(-i / 300) * (1 + 0.01 * u[i]), "grad_norm": 1.0} for i in range(200)]
    rows[150]["loss"] = 2.0 * 50  # far outside the band: the spike rule must see it at its own step
    full, _, _ = outcomes(rows, quiet_path=False)
    fast, _, n = outcomes(rows, quiet_path=True)
    assert fast == full and n > 100
    assert any(row[2] for row in fast if row[0] == 150), "the spike is announced at its step"


@pytest.mark.parametrize("low", [0.6, 0.7, 0.8])
def test_a_runaway_that_starts_from_a_low_value_is_counted_from_it(low):
    # the band is made around the recent level (~1.0), not the last value: a low last value (the
    # record before the run away) sits under the band, and the first record inside the band may
    # already grow min_growth x from it. The runaway rule must count that record's growth, so
    # the streak (and the warning) is the full path's to the record
    u = unit_noise(5, 200)
    grads = [1.0 + 0.02 * u[i] for i in range(80)] + [low] + [1.1 * 1.65**k for k in range(12)]
    rows = [{"step": i, "loss": 2.0 * (1 + 0.01 * u[100 + i]), "grad_norm": g} for i, g in enumerate(grads)]
    full, _, _ = outcomes(rows, quiet_path=False)
    assert_same(rows)
    warned = [row[0] for row in full[:-1] if any('"kind": "runaway"' in a for a in row[2])]
    assert warned, "the run away is announced"


@pytest.mark.parametrize("frozen_at", [0.5213847, 0.4913847])
def test_a_loss_that_freezes_just_above_half_its_start_is_called_frozen_at_its_record(frozen_at):
    # under half its start (the bar a frozen loss must stand above) no window can be frozen, and
    # a quiet region need not stop every 8 records for it; a loss that then freezes inside the
    # band but above the bar (0.52 of a start of 1.0) is frozen, at the full path's record. At
    # 0.49 it is not
    # (a long run: the loss trend is then recomputed rarely enough for regions of 9 records and more)
    u = unit_noise(9, 5000)
    losses = [1.0 + 0.01 * u[i] for i in range(30)] + [0.45 * (1 + 0.02 * u[30 + i]) for i in range(2000)]
    losses += [frozen_at] * 40
    rows = [{"step": i, "loss": v, "grad_norm": 1.0 + 0.01 * u[2500 + i]} for i, v in enumerate(losses)]
    full, _, _ = outcomes(rows, quiet_path=False)
    assert assert_same(rows) > 100
    frozen = [row[0] for row in full[:-1] if any("stayed at" in a for a in row[2])]
    assert bool(frozen) == (frozen_at > 0.5), frozen


@pytest.mark.parametrize("path", REAL + DEV, ids=lambda p: p.stem)
def test_the_fast_path_decides_as_the_full_path_on_real_logs(path):
    records = [rec for _, rec in iter_steps(path, warn=lambda _msg: None)]
    assert_same(records)


def test_the_fast_path_holds_under_other_policies():
    # tighter and looser thresholds, short windows: the proofs read the policy, not constants
    policies = [
        load_policy({"spike": {"loss_factor": 1.5, "grad_factor": 2.0, "window": 10}}),
        load_policy({"stall": {"frozen_records": 4, "min_records": 5}, "trend": {"min_span": 20, "min_records": 5}}),
        load_policy({"runaway": {"min_growth": 1.05, "warning_steps": 3}, "vanishing": {"patience": 3}}),
        load_policy({"divergence": {"warning_factor": 1.2, "patience": 2, "rebound_factor": 1.1}}),
        load_policy({"headroom": {"warning_decades": {"float32": 30.0}}}),
    ]
    u = unit_noise(3, 3000)
    rows = [
        {
            "step": i,
            "loss": 2.0 * (0.5 + 0.5 * math.exp(-i / 200)) * (1 + 0.03 * u[i]) * (1.6 if 400 <= i < 404 else 1),
            "grad_norm": (1.0 + 0.05 * u[1000 + i]) * (1.08 ** max(0, i - 700) if i < 760 else 1),
            "activation_max": 1e8 * (1 + 0.01 * u[2000 + i]),
            "layer_grad_norms": {"a": 0.5, "b": 1e-9 if i > 500 else 0.4},
        }
        for i in range(1000)
    ]
    for pol in policies:
        assert_same(rows, pol)


def test_a_run_with_minibatch_noise_stays_in_its_bands():
    # loss and gradient norm 0.77-1.3x around their level from record to record (a small model
    # fed batches in turn): the bands (1.4x each side of the level, the loss's lower end raised
    # where the spike rule would otherwise pull its top down) hold ~73% of the records; at
    # 1.2x each side 39%, without the raised lower end 65%
    u = unit_noise(13, 2000)
    rows = [
        {"step": i, "loss": 2.3 * (0.4 + 0.6 * math.exp(-i / 300)) * 1.3 ** u[i], "grad_norm": 0.8 * 1.3 ** u[1000 + i]}
        for i in range(1000)
    ]
    assert assert_same(rows) >= 690


def test_a_growth_streak_that_starts_inside_the_band_is_counted_from_its_start():
    # the band (about 0.71-1.4x the level) holds one growth of 1.5x: a streak may start on a quiet
    # record (0.75 -> 1.15) and run away from there; the warning comes at the full path's record,
    # its growth and streak counted from 0.75 (19.6x over 7 steps, not 12.8x over 6)
    u = unit_noise(17, 200)
    grads = [1.0 + 0.02 * u[i] for i in range(80)] + [0.75 * 1.53**k for k in range(10)]
    rows = [{"step": i, "loss": 2.0 * (1 + 0.01 * u[100 + i]), "grad_norm": g} for i, g in enumerate(grads)]
    full, _, _ = outcomes(rows, quiet_path=False)
    assert assert_same(rows) > 50
    warned = [row for row in full[:-1] if any('"kind": "runaway"' in a for a in row[2])]
    assert warned and warned[0][0] == 87, [row[0] for row in warned]
    runaway = json.loads(next(a for a in warned[0][2] if '"kind": "runaway"' in a))
    assert runaway["details"]["streak"] == 7 and runaway["details"]["growth"] == pytest.approx(14.7 / 0.75, rel=0.01)

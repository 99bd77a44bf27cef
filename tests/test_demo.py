"""`nummon demo` end to end (real training, real sinks, a real subprocess)."""
import contextlib
import io
import json
import math
import os
import re
import subprocess

import pytest

from conftest import nummon_cmd
from nummon import _demo
from nummon._cli import main
from nummon._demo_config import DEFAULT_STEPS, HEALTHY_LR, RUNAWAY_LR, DemoConfig


def cli(*args, env=None, timeout=300):
    return subprocess.run(nummon_cmd() + list(args), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def demo_env(wandb_env):
    return dict(os.environ)


def test_demo_warns_well_before_the_first_nan_and_logs_everywhere(tmp_path, demo_env):
    out = tmp_path / "run"
    p = cli("demo", "--out", str(out), env=demo_env)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"warned at step (\d+), critical at step (\d+), first non-finite at step (\d+) — (\d+) steps of warning", p.stdout)
    assert m, p.stdout[-3000:]
    warn, crit, nf, lead = map(int, m.groups())
    assert warn <= crit <= nf and lead == nf - warn and lead >= 3
    assert "The first NaN appeared in: output of `" in p.stdout and "(forward)" in p.stdout
    # the closing table: header and the first non-finite row
    assert re.search(r"step\s+loss\s+grad_norm\s+activation_max\s+optim_state_norm\s+health", p.stdout)
    assert re.search(rf"^\s*{nf}\s+nan\s+.*nonfinite$", p.stdout, re.M)
    assert f"tensorboard --logdir {out / 'tensorboard'}" in p.stdout
    assert "wandb sync " in p.stdout
    events = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "alert" and e["severity"] == "critical" for e in events)
    assert [p.parent.name for p in (out / "tensorboard").glob("*/events.out.tfevents.*")] == ["runaway-lr0.02-seed0"]
    # why the NaN happened: the operator, the module, the demo's own line, the cause
    assert re.search(r"^Why: overflow in `aten::\w+` \(forward\) inside `\w+` at .*_demo_model\.py:\d+", p.stdout, re.M), p.stdout[-2000:]
    # the explanation travels with the critical alert and the incident event (event log, W&B text)
    lost = [e for e in events if e["type"] == "incident" and e["state"] == "nonfinite"]
    assert lost and re.search(r"overflow in `aten::\w+` \(forward\) inside `\w+` at .*_demo_model\.py:\d+",
                              lost[0].get("explanation") or ""), lost
    assert any(e["type"] == "alert" and e["kind"] == "nonfinite" and "why: overflow in aten::" in e["message"] for e in events)
    # the countdown of the first critical runaway alert promises no steps that were not there (an
    # earlier critical alert of another kind, e.g. output logits, has no countdown)
    crit_alert = next(e for e in events if e["type"] == "alert" and e["severity"] == "critical" and e["kind"] == "runaway")
    left = nf - crit_alert["step"]
    assert 1 <= crit_alert["details"]["steps_to_overflow"] <= 1.5 * left + 2, (crit_alert["message"], left)
    # one notification per incident event, at most 4: opened, escalated (critical), non-finite
    from wandb_reader import alerts as wandb_alerts, find_run_file, read_records

    sent = wandb_alerts(read_records(find_run_file(out)))
    assert [a.level for a in sent] == ["WARN", "ERROR", "ERROR"], [(a.title, a.level) for a in sent]
    assert "why: overflow in `aten::" in sent[-1].text, sent[-1].text
    console = [l for l in p.stderr.splitlines() if l.startswith("nummon: run ")]
    assert console == [a.title for a in sent], console
    # the progress lines count from 0, like the table and the alerts (one line per 20 steps)
    shown = [int(n) for n in re.findall(r"\] step\s+(\d+)", p.stderr)]
    assert shown[:4] == [0, 20, 40, 60] and all(n <= nf for n in shown)


def test_demo_healthy_ends_with_no_warning(tmp_path, demo_env):
    p = cli("demo", "--healthy", "--out", str(tmp_path / "h"), env=demo_env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no warning in 120 steps: the run stayed healthy." in p.stdout
    from wandb_reader import alerts as wandb_alerts, find_run_file, read_records

    assert wandb_alerts(read_records(find_run_file(tmp_path / "h"))) == []  # no notification at all
    assert not [l for l in p.stderr.splitlines() if l.startswith("nummon: run ")]
    events = [json.loads(l) for l in (tmp_path / "h" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["type"] == "alert" and e["severity"] != "info"]
    assert len([e for e in events if e["type"] == "step"]) == 120


def run_main(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # --help
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args,needle,in_subprocess", [
    (["demo", "--steps", "0"], "--steps must be >= 1", False),
    (["demo", "--lr", "-1"], "--lr must be a positive number", False),
    (["demo", "--device", "tpu:9"], "--device 'tpu:9' is not usable", True),  # torch's own error, in a real process
    (["demo", "--steps", "abc"], "invalid int value", False),
])
def test_demo_bad_options(args, needle, in_subprocess, tmp_path):
    if in_subprocess:
        p = cli(*args, "--out", str(tmp_path / "x"))
        rc, err = p.returncode, p.stderr
    else:
        rc, _, err = run_main(*args, "--out", tmp_path / "x")
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_demo_help_states_the_defaults_it_runs():
    rc, out, _ = run_main("demo", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert f"(default: {DEFAULT_STEPS})" in text and f"runaway {RUNAWAY_LR:g}, --healthy {HEALTHY_LR:g}" in text
    assert _demo.prepare(DemoConfig(wandb=False)).lr == RUNAWAY_LR and DemoConfig().steps == DEFAULT_STEPS


@pytest.mark.parametrize("env,needle", [
    ({}, "unknown policy preset 'typo'"),
    ({"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus' is not a W&B mode"),
])
def test_bad_input_creates_nothing(tmp_path, monkeypatch, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "d"
    rc, stdout, err = run_main("demo", "--policy", "typo", "--out", out) if not env else run_main("demo", "--out", out)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not stdout


def test_bad_policy_file_creates_nothing(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("spike: {grad_factr: 3}\n")
    rc, _, err = run_main("demo", "--policy", bad, "--out", tmp_path / "d")
    assert rc == 2 and "grad_factr" in err and not (tmp_path / "d").exists()


def test_demo_run_returns_its_result(tmp_path):
    plan = _demo.prepare(DemoConfig(out=tmp_path / "r", steps=4, wandb=False, tensorboard=False))
    assert not plan.out.exists()  # prepare creates nothing
    seen = []
    result = _demo.run(plan, on_step=lambda step, loss, health: seen.append(step))
    assert seen == [0, 1, 2, 3] and result.steps_run == 4 and [r["step"] for r in result.records] == [0, 1, 2, 3]
    assert result.first_warning is None and result.events_path.exists() and result.closing_rows() == result.records


def test_demo_stop_at_critical_and_wandb_online_without_a_key_falls_back_to_offline(tmp_path, demo_env):
    """--stop-at-critical stops on the first critical step, before any non-finite value; and
    WANDB_MODE=online without a key logs offline. At --lr 1 the demo warns at step 1, goes
    critical at step 3 and would be non-finite at step 5 (at the default lr the critical step
    comes after some 75 steps of training, which this flag's test does not need)."""
    env = dict(demo_env, WANDB_MODE="online")
    env.pop("WANDB_API_KEY", None)
    env["NETRC"] = str(tmp_path / "no-netrc")
    out = tmp_path / "s"
    p = cli("demo", "--stop-at-critical", "--lr", "1", "--no-tensorboard", "--out", str(out), env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"warned at step (\d+), critical at step (\d+) — no non-finite value\.", p.stdout)
    assert m, p.stdout[-3000:]
    warn, crit = map(int, m.groups())
    assert warn < crit  # it did not stop at the warning
    events = [json.loads(l) for l in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(crit + 1))  # stopped on it
    assert not any(e["type"] == "step" and e["health"] == "nonfinite" for e in events)
    assert "WANDB_MODE=online but no API key is set: logging offline instead" in p.stderr
    assert "wandb sync " in p.stdout and "Traceback" not in p.stderr


def test_demo_with_recovery_stays_finite_and_learns(tmp_path):
    """Issue 17: every step finite, the new classes learned (median loss of the last 10 <= 1.0,
    chance is 2.3), one or two rollbacks, each in the event log."""
    import statistics

    plan = _demo.prepare(DemoConfig(out=tmp_path / "r", recover=True, wandb=False, tensorboard=False))
    losses = []
    result = _demo.run(plan, on_step=lambda step, loss, health: losses.append(loss))
    assert len(losses) == DEFAULT_STEPS and all(map(math.isfinite, losses))
    assert statistics.median(losses[-10:]) <= 1.0
    rollbacks = [r for r in result.recoveries if r["action"] == "rollback"]
    assert 1 <= len(rollbacks) <= 2
    events = [json.loads(l) for l in result.events_path.read_text().splitlines()]
    logged = [e for e in events if e["type"] == "alert" and (e.get("details") or {}).get("recovery") == "rollback"]
    assert [e["step"] for e in logged] == [r["step"] for r in rollbacks]
    assert any(e["type"] == "incident" and e.get("action", "").startswith("recovered: rolled back") for e in events)

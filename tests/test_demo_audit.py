"""`nummon demo` end to end, and `nummon audit` on real checkpoints."""
import fractions
import json
import os
import re
import subprocess

import pytest
import torch
from torch import nn

from conftest import nummon_cmd


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
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert list(out.rglob("run-*.wandb"))


def test_demo_healthy_ends_with_no_warning(tmp_path, demo_env):
    p = cli("demo", "--healthy", "--no-wandb", "--out", str(tmp_path / "h"), env=demo_env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no warning in 120 steps: the run stayed healthy." in p.stdout
    events = [json.loads(l) for l in (tmp_path / "h" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["type"] == "alert" and e["severity"] != "info"]
    assert len([e for e in events if e["type"] == "step"]) == 120


def test_demo_stop_at_critical(tmp_path, demo_env):
    p = cli("demo", "--stop-at-critical", "--no-wandb", "--no-tensorboard", "--out", str(tmp_path / "s"), env=demo_env)
    assert p.returncode == 0
    assert "critical at step" in p.stdout and "no non-finite value" in p.stdout


@pytest.mark.parametrize("args,needle", [
    (["demo", "--steps", "0"], "--steps must be >= 1"),
    (["demo", "--lr", "-1"], "--lr must be a positive number"),
    (["demo", "--device", "tpu:9"], "--device 'tpu:9' is not usable"),
    (["demo", "--steps", "abc"], "invalid int value"),
])
def test_demo_bad_options(args, needle, tmp_path):
    p = cli(*args, "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------------------------ audit

@pytest.fixture
def ckpts(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(6, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 6)).sum().backward()
    opt.step()
    good = {"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}
    torch.save(good, tmp_path / "a.pt")
    torch.save(good, tmp_path / "a_copy.pt")
    bad_sd = {k: v.clone() for k, v in m.state_dict().items()}
    bad_sd["weight"][0, :3] = float("nan")
    bad_sd["weight"][1, 0] = float("inf")
    bad_sd["bias"][:2] = -float("inf")
    torch.save({"model": bad_sd, "optimizer": opt.state_dict(), "epoch": 3}, tmp_path / "b.pt")
    moved = {k: v + 0.5 for k, v in m.state_dict().items()}
    moved["extra"] = torch.zeros(2)
    torch.save({"model": moved}, tmp_path / "c.pt")
    return tmp_path


def test_audit_counts_injected_nan_inf_exactly(ckpts):
    p = cli("audit", str(ckpts / "b.pt"), "--format", "json")
    assert p.returncode == 1
    data = json.loads(p.stdout)
    by = {t["key"]: t for t in data["tensors"]}
    assert (by["model.weight"]["nan"], by["model.weight"]["posinf"], by["model.weight"]["neginf"]) == (3, 1, 0)
    assert (by["model.bias"]["nan"], by["model.bias"]["posinf"], by["model.bias"]["neginf"]) == (0, 0, 2)
    assert by["optimizer.state.0.momentum_buffer"]["nan"] == 0
    assert data["summary"]["nonfinite_tensors"] == 2 and data["summary"]["nan"] == 3
    text = cli("audit", str(ckpts / "b.pt"))
    assert text.returncode == 1 and "2 with non-finite values (3 NaN, 1 +Inf, 2 -Inf)" in text.stdout


def test_audit_clean_checkpoint_exit_0(ckpts):
    p = cli("audit", str(ckpts / "a.pt"))
    assert p.returncode == 0 and "0 with non-finite values" in p.stdout


def test_audit_compares_identical_and_different(ckpts):
    same = cli("audit", str(ckpts / "a.pt"), str(ckpts / "a_copy.pt"), "--format", "json")
    assert same.returncode == 0 and json.loads(same.stdout)["comparison"]["identical"] is True
    diff = json.loads(cli("audit", str(ckpts / "a.pt"), str(ckpts / "c.pt"), "--format", "json").stdout)["comparison"]
    assert diff["identical"] is False
    assert "model.extra" in diff["only_in_b"] and "optimizer.state.0.momentum_buffer" in diff["only_in_a"]
    assert {d["key"]: d["max_abs_diff"] for d in diff["different"]}["model.weight"] == pytest.approx(0.5)
    nf = json.loads(cli("audit", str(ckpts / "a.pt"), str(ckpts / "b.pt"), "--format", "json").stdout)["comparison"]
    assert {n["key"] for n in nf["nonfinite_in_one_only"]} == {"model.weight", "model.bias"}


def test_audit_refuses_pickled_code_unless_trusted(tmp_path):
    torch.save({"w": torch.ones(2), "frac": fractions.Fraction(1, 3)}, tmp_path / "p.pt")
    p = cli("audit", str(tmp_path / "p.pt"))
    assert p.returncode == 2 and "needs pickled code" in p.stderr and "--trust" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    ok = cli("audit", str(tmp_path / "p.pt"), "--trust")
    assert ok.returncode == 0 and "w " in ok.stdout


def test_audit_truncated_and_missing_files(ckpts):
    data = (ckpts / "a.pt").read_bytes()
    (ckpts / "t.pt").write_bytes(data[: len(data) // 2])
    for path, needle in ((ckpts / "t.pt", "truncated"), (ckpts / "nope.pt", "checkpoint not found")):
        p = cli("audit", str(path))
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_audit_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = torch.ones(3, 3)
    t[0, 0] = float("nan")
    st.save_file({"w": t}, str(tmp_path / "m.safetensors"))
    p = cli("audit", str(tmp_path / "m.safetensors"), "--format", "json")
    assert p.returncode == 1 and json.loads(p.stdout)["tensors"][0]["nan"] == 1

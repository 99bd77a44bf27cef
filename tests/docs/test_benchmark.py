"""The overhead benchmark keeps running: one tiny round of two variants on the CPU."""

import json
import math
import os
import sys

import pytest
from helpers.checkout import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import overhead  # noqa: E402


@pytest.mark.slow
def test_overhead_benchmark_runs_and_reports_every_ratio(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        overhead.main(
            [
                "--device",
                "cpu",
                "--rounds",
                "2",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--only",
                "nummon default",
                "--system-malloc",
                "--probe-hooks",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    for key in ("ratio_to_bare", "paired_ratio", "mean_ratio"):
        # the A/A control (the bare step as a variant) runs with every --only
        assert set(res[key]) == {"bare", "bare (A/A)", "nummon default"} and res[key]["bare"] == 1.0
        for name in ("bare (A/A)", "nummon default"):
            assert math.isfinite(res[key][name]) and res[key][name] > 0  # a ratio, not a speed claim
    assert "nummon default" in capsys.readouterr().out
    probe = res["hook_reductions"]
    assert probe["outputs"] == 4  # conv1, conv2, fc1, fc2 of the demo CNN
    # what the hooks use must see a NaN (a max kernel that skipped NaN would hide the first one)
    assert probe["methods"]["aminmax into own dtype"]["propagates_nan"]


def test_overhead_benchmark_rejects_an_unknown_variant():
    with pytest.raises(SystemExit, match="unknown variant"):
        overhead.main(
            ["--device", "cpu", "--rounds", "1", "--steps", "1", "--warmup", "1", "--only", "nope", "--system-malloc"]
        )


def test_scale_benchmark_runs_and_reports_the_ratio_per_tensor(tmp_path, capsys):
    import overhead_scale

    out = tmp_path / "s.json"
    assert (
        overhead_scale.main(
            ["--workloads", "tiny-20", "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())["workloads"]["tiny-20"]
    assert res["tensors"] == 20 and set(res["variants"]) >= {"bare", "bare (A/A)", "nummon default"}
    ratio = res["variants"]["nummon default"]["paired_ratio"]
    assert math.isfinite(ratio) and ratio > 0  # reported; its size is the benchmark's business, not a test's
    assert "us/tensor" in capsys.readouterr().out


@pytest.mark.parametrize("shape", ["mlp", "lm2"])
def test_overhead_benchmark_measures_each_shape_against_the_host_cost_bar(tmp_path, shape):
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--shape", shape, "--rounds", "1", "--steps", "1", "--warmup", "1"]
    assert overhead.main([*argv, "--only", "nummon default,per-parameter .item()", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    bar = res["host_cost_bar"]
    ms = res["median_step_ms"]
    # the bar's numbers are the medians' differences, and its verdict follows from them
    assert bar["added_ms"] == pytest.approx(ms["nummon default"] - ms["bare"])
    assert bar["peer_added_ms"] == pytest.approx(ms["per-parameter .item()"] - ms["bare"])
    assert bar["limit_ms"] == pytest.approx(1.5 * max(bar["peer_added_ms"], 0.0) + 0.25)
    assert bar["meets_bar"] == (bar["added_ms"] <= bar["limit_ms"])
    paired, rounds = res["paired_bar"], res["round_ms"]  # the same bar, each round against its own bare step
    assert paired["added_ms"] == pytest.approx(rounds["nummon default"][0] - rounds["bare"][0])
    assert paired["verdict"] in {"met", "not met", "within noise"}
    assert res["shape"] == shape and res["workload"] == overhead.SHAPES[shape][1]


def test_the_paired_bar_says_met_or_not_only_when_its_interval_does():
    noise = [((i * 7919) % 13 - 6) * 0.05 for i in range(40)]  # +-0.3 ms, the same in every variant
    bare = [20.0 + 0.01 * i for i in range(40)]  # drift: cancels within each round
    peer = [b + 0.4 for b in bare]  # limit 1.5 x 0.4 + 0.25 = 0.85 ms

    def bar(added: float, spread: float) -> dict:
        nummon = [b + added + spread * e for b, e in zip(bare, noise)]
        return overhead.paired_bar({"bare": bare, "nummon default": nummon, "per-parameter .item()": peer})

    clear, over, close = bar(0.3, 1.0), bar(1.5, 1.0), bar(0.85, 8.0)
    assert clear["verdict"] == "met" and clear["margin_ms"] == pytest.approx(0.85 - 0.3, abs=0.06)
    assert clear["peer_added_ms"] == pytest.approx(0.4) and clear["margin_90"][0] > 0
    assert over["verdict"] == "not met" and over["margin_90"][1] < 0
    assert close["verdict"] == "within noise" and close["margin_90"][0] < 0 < close["margin_90"][1]
    assert overhead.paired_bar({"bare": bare, "nummon default": bare}) is None


def test_the_paired_bar_says_what_each_adds_above_reading_the_gradients():
    bare = [20.0 + 0.01 * i for i in range(10)]
    floor = [b + 0.2 + 0.01 * (i % 3) for i, b in enumerate(bare)]
    rounds = {
        "bare": bare,
        "nummon default": [f + 0.3 for f in floor],
        "per-parameter .item()": [f + 0.05 for f in floor],
    }
    assert "floor_added_ms" not in overhead.paired_bar(rounds)  # only where the floor was measured
    b = overhead.paired_bar({**rounds, overhead.GRADIENT_READ: floor})
    assert b["floor_added_ms"] == pytest.approx(0.21)
    assert b["above_floor_ms"] == pytest.approx(0.3) and b["peer_above_floor_ms"] == pytest.approx(0.05)


def test_the_floor_variant_reads_every_gradient_and_the_loss_in_one_read():
    import torch

    model, make_opt, loss_fn, _ = overhead.SHAPES["cnn"][0](torch.device("cpu"))
    opt = make_opt(model)
    after, detach = overhead.variants(str(ROOT), torch.device("cpu"))[0][overhead.GRADIENT_READ](model, opt)
    loss = loss_fn(model)
    loss.backward()
    reads = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: reads.append(real(t)) or reads[-1]
    try:
        after(loss)
    finally:
        torch.Tensor.tolist = real
        detach()
    expected = [loss.item()] + [p.grad.double().norm().item() for p in model.parameters()]
    # (float32 sums over 1.6M elements: a few parts in 1e5 from the float64 norm)
    assert len(reads) == 1 and reads[0] == pytest.approx(expected, rel=1e-4)


def test_the_host_cost_bar_is_absent_without_the_peer():
    assert overhead.host_cost_bar({"bare": 1.0, "nummon default": 1.2}) is None
    assert overhead.host_cost_bar({"bare": 1.0, "nummon default": 1.3, "per-parameter .item()": 1.1})["meets_bar"]
    assert not overhead.host_cost_bar({"bare": 1.0, "nummon default": 1.5, "per-parameter .item()": 1.1})["meets_bar"]


def test_the_hook_cost_benchmark_compares_like_with_like():
    """benchmarks/hook_cost.py: the no-op hooks sit on exactly the modules the probes hook."""
    import hook_cost

    res = hook_cost.measure("mlp", rounds=1, steps=1)
    assert set(res) == {"bare", "no-op hooks", "probes (as installed)", "probes, boundaries only"}
    assert res["bare"] == (1.0, 0)
    assert res["no-op hooks"][1] == res["probes (as installed)"][1] > 0
    assert all(math.isfinite(ratio) and ratio > 0 for ratio, _ in res.values())


def test_a_kept_monitor_runs_in_its_own_rounds_only():
    # the default harness keeps one Monitor per variant and takes its hooks off the shared model and
    # optimizer between its rounds: a step of another variant runs no nummon code at all, and the
    # Monitor's next round runs it again, its step count carried on
    import torch

    model, make_opt, loss_fn, _ = overhead.SHAPES["lm2"][0](torch.device("cpu"))
    opt = make_opt(model)
    attach = overhead.variants(str(ROOT), torch.device("cpu"))[0]["nummon default"]
    import nummon

    package = os.path.dirname(nummon.__file__) + os.sep  # (by folder: a clone named nummon holds torch too)
    calls = [0]

    def count(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1

    def step(after):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        return after(loss)

    try:
        seen = []
        for _ in range(2):
            after, detach = attach(model, opt)
            for _ in range(11):  # a sampled step among them: every hook kind registered once
                seen.append(step(after).record.step)
            detach()
            sys.setprofile(count)
            try:
                step(lambda loss: None)
            finally:
                sys.setprofile(None)
            assert calls[0] == 0
        assert seen == list(range(22))
    finally:
        while overhead._CLEANUPS:
            overhead._CLEANUPS.pop()()


def test_a_benchmark_measures_the_checkout_it_lives_in(tmp_path):
    # an old and a new checkout are compared by running each one's benchmarks: each must import
    # its own nummon, not whatever the environment installed (an editable install of another one)
    import shutil
    import subprocess

    checkout = tmp_path / "checkout"
    for part in ("nummon", "integrations", "configs", "benchmarks"):
        shutil.copytree(ROOT / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    scripts = ("overhead", "overhead_scale", "step_budget")
    code = f"import sys; sys.path.insert(0, {str(checkout / 'benchmarks')!r}); " + "; ".join(
        f"import {s}; print({s}.nummon.__file__)" for s in scripts
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(checkout / "nummon" / "__init__.py")] * len(scripts)

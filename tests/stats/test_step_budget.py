"""The host work of an ordinary monitored step, pinned by counts (no timing): Python calls per
stage, torch (aten) ops per stage, Python-level hook calls and host reads. A change that adds
per-step work fails here; raise a budget only with the reason (and in benchmarks/RESULTS.md).

Counts come from benchmarks/step_budget.py (sys.setprofile and a TorchDispatchMode) on the
README's demo CNN (batch 8: the counts do not depend on the batch) and a 40-tensor chain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_budget  # noqa: E402

from nummon._tools.demo_model import DemoCNN  # noqa: E402

pytestmark = pytest.mark.slow  # a profiled run of a few steps: seconds on a busy machine

NO_ACTIVATIONS = {"sampling": {"activations": False}}

#: per stage, the most Python function calls (nummon's and the torch Python they call) an
#: ordinary demo-CNN step may make: the counts of this release plus ~20% headroom
CNN_CALLS = {
    "forward_hooks": 0,  # the activation hooks are registered only for the sampled forwards
    "probes": 26,  # the mechanism probes' unarmed pre-hook / forward hook / optimizer hooks
    "end_of_backward": 23,  # 19: the pre-clip hooks and the callback, grad mode switched in C
    "launch": 50,  # 42: a packing plan per segment signature, C-level pickers
    "read_decode": 40,  # 33: the record built as a draft (no guard call per field)
    # in a run's first 10 records the start-of-run climb rules book each value (climb.py); a full
    # evaluation also tries to make the next quiet region (engine/quiet.py)
    "detectors": 140,
    "dispatch": 3,
    "post_step": 42,  # 35: no begin/end without forensics, one shared safe point
    "other": 0,  # nummon code outside the stages above (a new kind of hook): none
}
#: per stage, the most aten ops an ordinary demo-CNN step may dispatch (exact: one more op is
#: one more launch per step on a GPU)
CNN_OPS = {
    "forward_hooks": 0,  # none hooked (a sampled step: detach, aminmax per module)
    "probes": 0,
    "end_of_backward": 8,  # results written in place (out=): no cat of parts, no views
    "launch": 9,
    "read_decode": 0,
    "detectors": 0,
    "dispatch": 0,
    "post_step": 0,
    "other": 0,
}


def _cnn():
    model = DemoCNN()
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    return (
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        lambda m: nn.functional.cross_entropy(m(x), y),
    )


def _chain(n_tensors: int):
    def make():
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n_tensors // 2)])
        x = torch.randn(4, 8)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), lambda m: m(x).square().mean()

    return make


@pytest.fixture(scope="module")
def cnn_counts():
    # (a run's first records measure the activations at the next step too, while the detectors
    # warm up: without the hooks those steps are ordinary, judged in full)
    return step_budget.count_workload(_cnn, steps=4, warmup=2, policy=NO_ACTIVATIONS)["ordinary"]


@pytest.mark.parametrize("stage", list(CNN_CALLS))
def test_an_ordinary_demo_cnn_step_keeps_each_stage_within_its_python_call_budget(cnn_counts, stage):
    assert cnn_counts["calls_max"].get(stage, 0) <= CNN_CALLS[stage], (
        stage,
        {k: v for k, v in cnn_counts["calls_by_module"].items() if k.startswith(stage + ":")},
    )


@pytest.mark.parametrize("stage", list(CNN_OPS))
def test_an_ordinary_demo_cnn_step_dispatches_no_more_torch_ops_per_stage_than_its_budget(cnn_counts, stage):
    assert cnn_counts["ops_max"].get(stage, 0) <= CNN_OPS[stage], (
        stage,
        {k: v for k, v in cnn_counts["ops_by_name"].items() if k.startswith(stage + ":")},
    )


#: per stage, the most Python calls of a quiet demo-CNN step: an ordinary step whose record the
#: engine's fast path took (this release plus ~20%); the detectors' stage is the region check.
#: Its launch is the plain step's (nummon/_stats/plain_step.py): no pass over the families
QUIET_CALLS = {**CNN_CALLS, "detectors": 30, "launch": 27}  # launch 22


@pytest.fixture(scope="module")
def cnn_quiet():
    # (the demo CNN memorises its batch: its loss settles into the fast path's bands by step ~40)
    return step_budget.count_workload(_cnn, steps=6, warmup=45)["quiet"]


@pytest.mark.parametrize("stage", list(QUIET_CALLS))
def test_a_quiet_demo_cnn_step_keeps_each_stage_within_its_python_call_budget(cnn_quiet, stage):
    assert cnn_quiet["steps"] > 0
    assert cnn_quiet["calls_max"].get(stage, 0) <= QUIET_CALLS[stage], (
        stage,
        {k: v for k, v in cnn_quiet["calls_by_module"].items() if k.startswith(stage + ":")},
    )


def test_a_quiet_step_runs_no_detector(cnn_quiet):
    # the region check only: no detector's update, no lifecycle, no incident tracker
    ran = [k for k in cnn_quiet["calls_by_module"] if k.startswith("detectors:_engine/detectors/")]
    assert ran == []
    assert cnn_quiet["ops_max"].get("detectors", 0) == 0 and cnn_quiet["reads_max"] == {"read_decode": 1}


def test_an_ordinary_step_reads_the_host_once_and_only_where_the_record_is_built(cnn_counts):
    # one device->host copy per step: the packed vector's tolist(); no item() per parameter
    assert cnn_counts["reads_max"] == {"read_decode": 1}


def test_an_ordinary_step_calls_no_activation_hook(cnn_counts):
    # the hooks are registered for the sampled forwards only: an ordinary one has none to call
    assert not [k for k in cnn_counts["calls_by_module"] if k.startswith("forward_hooks:")]
    assert cnn_counts["steps"] > 0


def _mlp(n_layers: int):
    def make():
        layers: list[nn.Module] = []
        for _ in range(n_layers):
            layers += [nn.Linear(16, 16), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        x = torch.randn(4, 16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), lambda m: m(x).square().mean()

    return make


def test_the_python_calls_of_a_quiet_step_do_not_grow_with_the_number_of_modules():
    # 4 vs 24 Linear layers (24 vs 4 hooked modules on a sampled step): a quiet step calls no
    # forward hook and no detector, and its stages make (nearly) the same calls (this release:
    # 176 vs 174: the 4-layer model's mixed shapes take one picker more)
    small = step_budget.count_workload(_mlp(4), steps=4, warmup=12)["quiet"]
    large = step_budget.count_workload(_mlp(24), steps=4, warmup=12)["quiet"]
    assert small["steps"] == large["steps"] == 4
    assert small["calls_max"].get("forward_hooks", 0) == large["calls_max"].get("forward_hooks", 0) == 0
    assert small["ops_max"].get("forward_hooks", 0) == large["ops_max"].get("forward_hooks", 0) == 0
    assert small["calls_max"]["detectors"] == large["calls_max"]["detectors"]
    assert abs(large["calls_total"] - small["calls_total"]) < 0.05 * small["calls_total"]


def test_the_host_work_of_a_quiet_step_does_not_grow_with_the_number_of_tensors():
    # 20 vs 60 parameter tensors in one shape group each: every stage makes the same Python calls
    # and dispatches the same ops; a per-tensor Python loop or op shows as a difference here
    small = step_budget.count_workload(_chain(20), steps=4, warmup=12)["quiet"]
    large = step_budget.count_workload(_chain(60), steps=4, warmup=12)["quiet"]
    assert small["steps"] == large["steps"] == 4
    for stage in ("end_of_backward", "launch", "read_decode", "detectors", "dispatch", "post_step"):
        assert large["calls_max"].get(stage, 0) == small["calls_max"].get(stage, 0), stage
        assert large["ops_max"].get(stage, 0) == small["ops_max"].get(stage, 0), stage
    assert large["reads_max"] == small["reads_max"] == {"read_decode": 1}


def test_the_host_work_of_an_ordinary_step_does_not_grow_with_the_number_of_tensors():
    # the same, for a step judged in full (a run's first records)
    small = step_budget.count_workload(_chain(20), steps=3, warmup=2, policy=NO_ACTIVATIONS)["ordinary"]
    large = step_budget.count_workload(_chain(60), steps=3, warmup=2, policy=NO_ACTIVATIONS)["ordinary"]
    for stage in ("end_of_backward", "launch", "read_decode", "detectors", "dispatch", "post_step"):
        assert large["calls_max"].get(stage, 0) == small["calls_max"].get(stage, 0), stage
        assert large["ops_max"].get(stage, 0) == small["ops_max"].get(stage, 0), stage
    assert large["reads_max"] == small["reads_max"] == {"read_decode": 1}


@pytest.mark.parametrize(
    "path",
    [
        "/home/me/nummon/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
        "/srv/nummon/build/lib/nummon_helpers/x.py",
        "/opt/nummon/site-packages/numpy/core/fromnumeric.py",
    ],
)
def test_code_outside_nummons_sources_is_not_counted_as_nummons_even_under_a_folder_named_nummon(path):
    # the README's clone is a folder named nummon with .venv inside: torch lives under ".../nummon/..."
    code = compile("def f():\n    pass\n", path, "exec")
    assert step_budget._entry_stage(code) is None


def test_nummons_own_files_are_found_by_their_folder():
    import nummon._engine.engine

    code = compile("def g():\n    pass\n", nummon._engine.engine.__file__.replace("engine.py", "new_hook.py"), "exec")
    assert step_budget._entry_stage(code) == "other"

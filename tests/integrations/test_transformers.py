"""What only the Hugging Face callback has, on a real Trainer (CPU, a tiny GPT-2 built from a
config): its health engine's state saved in the Trainer's checkpoints (trainer_state.json) and
restored on resume, and a classifier's chance level. The scenarios both framework callbacks share are in
test_framework_callbacks.py; the tiny runs are in helpers/transformers_runs.py.
"""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.transformers_runs import RandomTokens, optimizers, tiny_gpt2, training_args  # noqa: E402
from transformers import Trainer  # noqa: E402

from nummon.integrations.transformers import NummonTrainerCallback  # noqa: E402


def resumable_trainer(out_dir, cb, steps, save_steps=6):
    model = tiny_gpt2()
    args = training_args(out_dir, steps=steps, save_strategy="steps", save_steps=save_steps)
    return Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        optimizers=optimizers(model, False),
        callbacks=[cb] if cb is not None else [],
    )


def saved_nummon_state(ckpt):
    return json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"].get("NummonTrainerCallback")


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_saved_without_nummon_saves_its_state(tmp_path):
    """A checkpoint written before nummon was added has no NummonTrainerCallback entry;
    the resumed run's first save used to die with KeyError('NummonTrainerCallback')."""
    resumable_trainer(tmp_path, None, steps=6).train()
    ckpt = tmp_path / "checkpoint-6"
    assert saved_nummon_state(ckpt) is None

    cb = NummonTrainerCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path, cb, steps=8, save_steps=2).train(resume_from_checkpoint=str(ckpt))
    saved = saved_nummon_state(tmp_path / "checkpoint-8")
    assert saved["nummon"]["step"] == 8
    assert [r["step"] for r in saved["nummon"]["engine"]["first"]] == [6, 7]  # a cold start at 6


@pytest.fixture(scope="module")
def nummon_checkpoint(tmp_path_factory):
    """A 6-step run's checkpoint-6 with nummon's state in it."""
    root = tmp_path_factory.mktemp("ckpt")
    resumable_trainer(root, NummonTrainerCallback(follow_report_to=False, console=False), steps=6).train()
    return root / "checkpoint-6"


CORRUPTIONS = {
    "a string": lambda engine: "garbage",
    "nummon a string": lambda engine: {"args": {}, "attributes": {}, "nummon": "garbage"},
    "engine a string": lambda engine: {"args": {}, "attributes": {}, "nummon": {"engine": "garbage", "step": 6}},
    "records broken": lambda engine: {
        "args": {},
        "attributes": {},
        "nummon": {"engine": {**engine, "first": [{"step": "x"}]}, "step": 6},
    },
    "incident broken": lambda engine: {
        "args": {},
        "attributes": {},
        "nummon": {"engine": {**engine, "incident": {"state": "on fire"}}, "step": 6},
    },
    "step a string": lambda engine: {"args": {}, "attributes": {}, "nummon": {"engine": engine, "step": "six"}},
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_nummon_state_in_the_checkpoint_warns_once_and_starts_cold(
    tmp_path, nummon_checkpoint, corruption, caplog
):
    """A checkpoint whose nummon entry is not a saved state (edited, truncated, or
    from another tool) used to kill the resume with AttributeError / StateError."""
    import logging
    import shutil

    ckpt = tmp_path / "checkpoint-6"
    shutil.copytree(nummon_checkpoint, ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    engine = state["stateful_callbacks"]["NummonTrainerCallback"]["nummon"]["engine"]
    state["stateful_callbacks"]["NummonTrainerCallback"] = CORRUPTIONS[corruption](engine)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))

    cb = NummonTrainerCallback(follow_report_to=False, console=False)
    with caplog.at_level(logging.WARNING, logger="nummon"):
        resumable_trainer(tmp_path, cb, steps=8, save_steps=2).train(resume_from_checkpoint=str(ckpt))
    warned = [r.getMessage() for r in caplog.records if r.name == "nummon" and "starts cold" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert [r["step"] for r in cb.monitor.engine_state()["first"]] == [6, 7] and cb.monitor.step == 8
    assert saved_nummon_state(tmp_path / "checkpoint-8")["nummon"]["step"] == 8  # and saves a good one


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_resumes_the_health_engine_warm(tmp_path):
    """The engine's incident and re-warming records ride in the checkpoint's trainer_state.json; a
    run resumed from it starts its detectors where the first one left them, a fresh run cold."""
    first = NummonTrainerCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path, first, steps=6).train()
    ckpt = tmp_path / "checkpoint-6"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["NummonTrainerCallback"]
    assert saved["nummon"]["step"] == 6
    assert [r["step"] for r in saved["nummon"]["engine"]["first"]] == list(range(6))

    resumed = NummonTrainerCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path, resumed, steps=8).train(resume_from_checkpoint=str(ckpt))
    steps = [r["step"] for r in resumed.monitor.engine_state()["first"]]
    assert steps == list(range(8))  # 0..5 from the checkpoint, then 6 and 7: not a cold start at 6
    assert resumed.monitor.step == 8

    # the same callback object trained again from scratch starts cold (its own old state is not a checkpoint's)
    resumable_trainer(tmp_path / "fresh", resumed, steps=2).train()
    assert [r["step"] for r in resumed.monitor.engine_state()["first"]] == [0, 1]


def test_state_dict_round_trips_through_load_state_dict(tmp_path):
    """state_dict()/load_state_dict(), as on the Lightning callback: a state loaded before train()
    is where the engine starts."""
    first = NummonTrainerCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path / "a", first, steps=3).train()
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # strict JSON
    assert state["step"] == 3

    later = NummonTrainerCallback(follow_report_to=False, console=False)
    later.load_state_dict(state)
    assert later.state_dict() == state  # held until the run starts
    resumable_trainer(tmp_path / "b", later, steps=2).train()
    assert [r["step"] for r in later.monitor.engine_state()["first"]] == [0, 1, 2, 3, 4]


def test_a_classifier_names_its_chance_level_and_a_language_model_does_not():
    """The task's class count (config.num_labels of a sequence classifier) sets stall.chance_loss;
    a language model's vocabulary is no chance level."""
    from transformers import BertConfig, BertForSequenceClassification

    from nummon import load_policy
    from nummon.integrations._callback_common import with_class_count
    from nummon.integrations.transformers import classification_classes

    clf = BertForSequenceClassification(
        BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=6,
        )
    )
    assert classification_classes(clf) == 6
    assert classification_classes(tiny_gpt2()) is None
    policy = with_class_count(load_policy("default"), 6)
    assert policy.stall.chance_loss == pytest.approx(math.log(6))
    assert with_class_count(load_policy("default"), None).stall.chance_loss is None


def screen_lines(raw):
    """The lines a terminal shows for `raw`: each line with its carriage-return rewrites applied."""
    shown_lines = []
    for line in raw.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        shown_lines.append(shown.rstrip())
    return shown_lines


@pytest.mark.slow
def test_console_lines_start_on_their_own_line_beside_the_trainers_progress_bar(tmp_path):
    """With the Trainer's tqdm bar open, nummon's line used to be glued to the
    bar (`...[00:02<02:06, 2.57s/it]nummon: run lost...`)."""
    import os
    import subprocess
    import sys

    from helpers.checkout import ROOT

    here = ROOT / "tests"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(here / "helpers" / "transformers_runs.py"), "progress-bar", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "it/s]" in proc.stderr or "s/it]" in proc.stderr, proc.stderr[-2000:]  # the bar was drawn
    screen = screen_lines(proc.stderr)
    ours = [line for line in screen if "nummon:" in line]
    assert any(line.startswith("nummon: run ") for line in ours), screen[-40:]
    assert [line for line in ours if not line.startswith("nummon:")] == []

"""What only the Hugging Face callback has, on a real Trainer (CPU, a tiny GPT-2 built from a
config): its health engine's state saved in the Trainer's checkpoints (trainer_state.json) and
restored on resume, and a classifier's chance level. The scenarios both framework callbacks share are in
test_framework_callbacks.py; the tiny runs are in transformers_runs.py.
"""
import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer  # noqa: E402

from nummon.integrations.transformers import NummonCallback  # noqa: E402

from transformers_runs import RandomTokens, optimizers, tiny_gpt2, training_args  # noqa: E402


def resumable_trainer(out_dir, cb, steps):
    model = tiny_gpt2()
    args = training_args(out_dir, steps=steps, save_strategy="steps", save_steps=6)
    return Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=optimizers(model, False),
                   callbacks=[cb])


def test_a_run_resumed_from_a_checkpoint_resumes_the_health_engine_warm(tmp_path):
    """The engine's incident and re-warming records ride in the checkpoint's trainer_state.json; a
    run resumed from it starts its detectors where the first one left them, a fresh run cold."""
    first = NummonCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path, first, steps=6).train()
    ckpt = tmp_path / "checkpoint-6"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["NummonCallback"]
    assert saved["nummon"]["step"] == 6
    assert [r["step"] for r in saved["nummon"]["engine"]["first"]] == list(range(6))

    resumed = NummonCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path, resumed, steps=8).train(resume_from_checkpoint=str(ckpt))
    steps = [r["step"] for r in resumed.monitor.engine.state_dict()["first"]]
    assert steps == list(range(8))  # 0..5 from the checkpoint, then 6 and 7: not a cold start at 6
    assert resumed.monitor.step == 8

    # the same callback object trained again from scratch starts cold (its own old state is not a checkpoint's)
    resumable_trainer(tmp_path / "fresh", resumed, steps=2).train()
    assert [r["step"] for r in resumed.monitor.engine.state_dict()["first"]] == [0, 1]


def test_state_dict_round_trips_through_load_state_dict(tmp_path):
    """state_dict()/load_state_dict(), as on the Lightning callback: a state loaded before train()
    is where the engine starts."""
    first = NummonCallback(follow_report_to=False, console=False)
    resumable_trainer(tmp_path / "a", first, steps=3).train()
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # strict JSON
    assert state["step"] == 3

    later = NummonCallback(follow_report_to=False, console=False)
    later.load_state_dict(state)
    assert later.state_dict() == state  # held until the run starts
    resumable_trainer(tmp_path / "b", later, steps=2).train()
    assert [r["step"] for r in later.monitor.engine.state_dict()["first"]] == [0, 1, 2, 3, 4]


def test_a_classifier_names_its_chance_level_and_a_language_model_does_not():
    """The task's class count (config.num_labels of a sequence classifier) sets stall.chance_loss;
    a language model's vocabulary is no chance level."""
    from transformers import BertConfig, BertForSequenceClassification

    from nummon._policy import load_policy
    from nummon.integrations._callback_common import with_class_count
    from nummon.integrations.transformers import classification_classes

    clf = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, num_labels=6))
    assert classification_classes(clf) == 6
    assert classification_classes(tiny_gpt2()) is None
    policy = with_class_count(load_policy("default"), 6)
    assert policy.stall.chance_loss == pytest.approx(math.log(6))
    assert with_class_count(load_policy("default"), None).stall.chance_loss is None

"""The Hugging Face Trainer callback on a real Trainer: a tiny GPT-2 built from a config (never
downloaded), random token ids, CPU.

The runaway: SGD whose learning rate doubles every step (a warmup to a peak far too high), with
the Trainer clipping gradients at 1.0. Without nummon the loss reaches NaN within ~30 steps.
"""
import logging
import math
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from nummon import MemorySink, Severity  # noqa: E402
from nummon.integrations.transformers import NummonCallback  # noqa: E402

from wandb_reader import find_run_file, nummon_alert_titles_and_steps, read_records  # noqa: E402

transformers.utils.logging.set_verbosity_error()

RUNAWAY_STEPS = 32
FP16_MAX = 65504.0  # "blown up": a loss that half precision could no longer even represent


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, length: int = 16):
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LogRecorder(TrainerCallback):
    """What the Trainer itself logs: (global_step, logs)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs or {})))


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))


def run_trainer(out_dir, callbacks, *, runaway, steps, report_to=(), batch=8, accumulation=1, max_grad_norm=1.0):
    """Train; returns (trainer, LogRecorder). `runaway`: SGD with lr 1.0 doubling each step."""
    model = tiny_gpt2()
    if runaway:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 2.0**s)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    recorder = LogRecorder()
    args = TrainingArguments(
        output_dir=str(out_dir), report_to=list(report_to), use_cpu=True, save_strategy="no", max_steps=steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, max_grad_norm=max_grad_norm,
        logging_steps=1, logging_nan_inf_filter=False, disable_tqdm=True, seed=0, data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=(opt, sched),
                      callbacks=[recorder, *callbacks])
    trainer.train()
    return trainer, recorder


def train_losses(recorder):
    """Per-step training loss as the Trainer logged it (logging_steps=1, no NaN filter): {global_step: loss}."""
    return {step: float(logs["loss"]) for step, logs in recorder.logs if "loss" in logs}


@pytest.fixture(scope="module")
def unmonitored_runaway(tmp_path_factory):
    """The runaway without nummon: {global_step: loss} and the first step that is lost."""
    _, recorder = run_trainer(tmp_path_factory.mktemp("plain"), [], runaway=True, steps=RUNAWAY_STEPS)
    losses = train_losses(recorder)
    first_bad = min(s for s, v in losses.items() if not math.isfinite(v) or v > FP16_MAX)
    return losses, first_bad


def test_runaway_without_nummon_is_lost(unmonitored_runaway):
    losses, first_bad = unmonitored_runaway
    # NaN within the 32 steps with one CPU thread; with two the same run tops out near 1e17 (the
    # summation order changes): either way it is lost, far beyond what any precision can train on
    assert any(math.isnan(v) or v > 1e15 for v in losses.values()), losses
    assert first_bad >= 8, "the run must stay healthy long enough for a warning to mean something"


def test_runaway_is_warned_early_stopped_and_logged_to_tensorboard_and_wandb(tmp_path, wandb_env, unmonitored_runaway):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, first_bad = unmonitored_runaway
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    out = tmp_path / "out"
    trainer, recorder = run_trainer(out, [cb], runaway=True, steps=RUNAWAY_STEPS, report_to=["tensorboard", "wandb"])
    wandb.finish()
    wandb.teardown()  # the W&B singleton keeps this test's directories otherwise

    # nummon step s is the optimizer step the Trainer counts as global_step s + 1
    warnings = [a for a in cb.monitor.alerts if a.severity.rank >= Severity.WARNING.rank]
    assert warnings, "no warning at all"
    first_warning = min(a.step for a in warnings) + 1
    assert first_warning <= first_bad - 3, (first_warning, first_bad)
    # stopped by the callback at the critical alert, long before the NaN and before max_steps
    critical = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL]
    assert critical and cb.stopped_at == critical[0].step
    assert trainer.state.global_step == cb.stopped_at + 1 < first_bad
    assert all(math.isfinite(v) for v in train_losses(recorder).values())
    # the loss nummon saw is the Trainer's own per-step loss (logging_steps=1: no averaging)
    logged = train_losses(recorder)
    for rec in memory.records:
        assert rec.loss == pytest.approx(logged[rec.step + 1], rel=1e-5)

    # the event log and flight record in output_dir
    assert (out / "nummon-events.jsonl").is_file()
    assert cb.monitor.flight_record is not None and cb.monitor.flight_record.parent == out

    # nummon's scalars and alerts in the Trainer's own TensorBoard run folder
    (run_dir,) = (out / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "train/loss" in scalars  # the Trainer's own TensorBoard callback writes here too
    for tag in ("nummon/loss", "nummon/grad_norm", "nummon/activation_max", "nummon/health"):
        assert tag in scalars, tag
    nm_loss = {e.step: e.value for e in acc.Scalars("nummon/loss")}
    assert set(nm_loss) == {r.step for r in memory.records}
    assert any(t.startswith("nummon_2_alerts/") for t in acc.Tags()["tensors"])

    # the alerts in the offline W&B run file the Trainer's W&B callback opened
    records = read_records(find_run_file(os.environ["WANDB_DIR"]))
    titles, logged_steps = nummon_alert_titles_and_steps(records)
    assert any(t.startswith("nummon:") for t in titles), titles
    # and every step's scalars, charted against nummon/step (the framework logs without step=)
    assert logged_steps == [r.step for r in memory.records]


def test_healthy_run_gets_no_warning(tmp_path):
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    trainer, _ = run_trainer(tmp_path, [cb], runaway=False, steps=20)
    assert trainer.state.global_step == 20 and cb.stopped_at is None
    assert len(memory.records) == 20
    assert [a for a in cb.monitor.alerts if a.severity.rank >= Severity.WARNING.rank] == []


def test_accumulation_and_clipping_report_the_unclipped_norm(tmp_path):
    """With 4 micro-batches per step and clipping at 0.1 (active on every step), nummon's
    grad_norm is the pre-clip norm the Trainer logs, and its loss the step's mean loss."""
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    _, recorder = run_trainer(tmp_path, [cb], runaway=False, steps=6, batch=2, accumulation=4, max_grad_norm=0.1)
    logged = {s: logs for s, logs in recorder.logs if "grad_norm" in logs}
    assert len(memory.records) == 6
    for rec in memory.records:
        assert rec.loss == pytest.approx(float(logged[rec.step + 1]["loss"]), rel=1e-5)
    for rec in memory.records:
        trainer_norm = float(logged[rec.step + 1]["grad_norm"])
        assert trainer_norm > 0.1  # clipping really scaled this step down
        assert rec.grad_norm == pytest.approx(trainer_norm, rel=1e-5), (rec.step, rec.grad_norm, trainer_norm)
    assert cb.last_clip_ratio == pytest.approx(0.1 / memory.records[-1].grad_norm, rel=1e-5)




def test_missing_transformers_gives_an_install_hint(tmp_path):
    # a stub package that fails to import stands in for an environment without transformers
    stub = tmp_path / "transformers"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('No module named transformers')\n")
    code = "import nummon.integrations.transformers"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "pip install 'nummon[transformers]'" in proc.stderr.strip().splitlines()[-1]



class PlantedLogOfZero(torch.nn.Module):
    """A tiny GPT-2 whose loss, once `planted`, is the log of a softmax that underflowed to 0."""

    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt2()
        self.planted = False

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = self.gpt(input_ids=input_ids, labels=labels)
        if self.planted:
            probs = torch.softmax(out.logits * 1000.0, -1)
            out.loss = -torch.log(probs).mean()  # LOG_OF_ZERO_LINE
        return out


class PlantAt(TrainerCallback):
    def __init__(self, model, step):
        self.model, self.step = model, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.model.planted = state.global_step >= self.step


def test_planted_log_of_zero_is_explained_in_the_critical_alert(tmp_path):
    import inspect

    src, first = inspect.getsourcelines(PlantedLogOfZero)
    line = first + next(i for i, l in enumerate(src) if "LOG_OF_ZERO_LINE" in l)
    model = PlantedLogOfZero()
    cb = NummonCallback()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_steps=40,
                             per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True, seed=0, learning_rate=1e-3)
    Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[PlantAt(model, 30), cb]).train()
    crit = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL and a.kind.value == "nonfinite"]
    assert crit and crit[0].step == 30 and cb.stopped_at == 30
    assert "log_of_zero" in crit[0].message and f"test_transformers.py:{line}" in crit[0].message
    assert crit[0].details["cause"]["op"] == "aten::log"


class Transcript(TrainerCallback):
    """The order of what reaches the terminal: the Trainer's log lines and nummon's lines."""

    def __init__(self):
        self.lines = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(("nummon", record.getMessage()))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.lines.append(("trainer", state.global_step))


def readme_blow_up(out_dir, console):
    """The README's Hugging Face example driven to blow up: SGD lr 20, no clipping."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (256, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    memory, transcript = MemorySink(), Transcript()
    cb = NummonCallback(sinks=[memory], stop_on_critical=False, console=console)
    args = TrainingArguments(output_dir=str(out_dir), report_to=[], max_steps=10, use_cpu=True, save_strategy="no",
                             per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=0.0,
                             logging_steps=1, disable_tqdm=True)
    logging.getLogger("nummon").addHandler(transcript.handler)
    try:
        Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched), callbacks=[transcript, cb]).train()
    finally:
        logging.getLogger("nummon").removeHandler(transcript.handler)
    first_bad = next(r.step for r in memory.records if not r.is_finite())
    return cb, transcript.lines, first_bad


def test_the_readme_example_driven_to_blow_up_prints_incident_lines_before_the_first_nonfinite_step(tmp_path):
    cb, lines, first_bad = readme_blow_up(tmp_path, console=True)
    # nummon step s is the Trainer's global_step s + 1: its log line of the first non-finite step
    bad_log = lines.index(("trainer", first_bad + 1))
    first_line = next(i for i, (who, text) in enumerate(lines) if who == "nummon" and str(text).startswith("nummon: run "))
    assert first_line < bad_log, lines
    # every incident line comes before the Trainer's log line of its step
    for i, (who, text) in enumerate(lines):
        if who == "nummon" and str(text).startswith("nummon: run "):
            step = int(re.search(r"at step (\d+)", text).group(1))
            assert i < lines.index(("trainer", step + 1)), (text, lines)
    assert not any("**" in str(t) for who, t in lines if who == "nummon")
    crit = next(a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL)
    left = first_bad - crit.step
    assert 1 <= crit.details["steps_to_overflow"] <= 1.5 * left + 2, (crit.message, left)


def test_console_false_keeps_the_callback_quiet(tmp_path):
    _, lines, _ = readme_blow_up(tmp_path, console=False)
    assert not [t for who, t in lines if who == "nummon" and str(t).startswith("nummon: run ")]


def test_a_classifier_names_its_chance_level_and_a_language_model_does_not():
    """The task's class count (config.num_labels of a sequence classifier) sets stall.chance_loss;
    a language model's vocabulary is no chance level."""
    from transformers import BertConfig, BertForSequenceClassification

    from nummon.integrations.transformers import classification_classes
    from nummon.integrations._callback_common import with_class_count
    from nummon._policy import load_policy

    clf = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32, num_labels=6))
    assert classification_classes(clf) == 6
    assert classification_classes(tiny_gpt2()) is None
    policy = with_class_count(load_policy("default"), 6)
    assert policy.stall.chance_loss == pytest.approx(math.log(6))
    assert with_class_count(load_policy("default"), None).stall.chance_loss is None

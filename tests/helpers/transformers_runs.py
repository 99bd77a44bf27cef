"""Tiny Hugging Face Trainer runs for the framework suites (test_framework_callbacks.py,
test_transformers.py): a GPT-2 built from a config (never downloaded), random token ids, CPU.

The runaway: SGD whose learning rate doubles every step (a warmup to a peak far too high), with
the Trainer clipping gradients at 1.0. Without nummon the loss is lost (NaN or past 1e15) within 32 steps.
"""

import logging
import os

import accelerate  # noqa: F401  (the Trainer needs it)
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from helpers.framework_run import Run
from nummon.integrations.transformers import NummonTrainerCallback

transformers.utils.logging.set_verbosity_error()

NAME = "transformers"
EXTRA, MODULE = "transformers", "transformers"
RUNAWAY_STEPS = 32
MIN_HEALTHY_STEPS = 7  # the runaway stays healthy this long without nummon (global steps 1..7)
HEALTHY_STEPS = 20
STOP_MARGIN = 1  # nummon stops the runaway at least one step before its loss passes FP16_MAX
CLIP = 0.1
TB_TAGS = ("train/loss",)  # the Trainer's own TensorBoard callback writes into the same run folder


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


def training_args(
    out_dir,
    *,
    steps,
    report_to=(),
    batch=8,
    accumulation=1,
    max_grad_norm=1.0,
    save_strategy="no",
    disable_tqdm=True,
    **kwargs,
):
    return TrainingArguments(
        output_dir=str(out_dir),
        report_to=list(report_to),
        use_cpu=True,
        save_strategy=save_strategy,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        logging_nan_inf_filter=False,
        disable_tqdm=disable_tqdm,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **kwargs,
    )


def optimizers(model, runaway):
    """`runaway`: SGD with lr 1.0 doubling each step; else AdamW at 1e-3."""
    if runaway:
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 2.0**s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def run_trainer(out_dir, callbacks, *, runaway, steps, report_to=(), batch=8, accumulation=1, max_grad_norm=1.0):
    """Train; returns (trainer, LogRecorder)."""
    model = tiny_gpt2()
    recorder = LogRecorder()
    args = training_args(
        out_dir, steps=steps, report_to=report_to, batch=batch, accumulation=accumulation, max_grad_norm=max_grad_norm
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        optimizers=optimizers(model, runaway),
        callbacks=[recorder, *callbacks],
    )
    trainer.train()
    return trainer, recorder


def _logged(recorder, key):
    """{nummon step: the Trainer's logged `key`} (logging_steps=1, no NaN filter: each step's own
    value; nummon step s is the Trainer's global_step s + 1)."""
    return {step - 1: float(logs[key]) for step, logs in recorder.logs if key in logs}


def runaway(root, cb=None, *, loggers=False):
    out = root / "out"
    trainer, recorder = run_trainer(
        out,
        [cb] if cb else [],
        runaway=True,
        steps=RUNAWAY_STEPS,
        report_to=["tensorboard", "wandb"] if loggers else (),
    )
    run = Run(trainer_steps=trainer.state.global_step, losses=_logged(recorder, "loss"))
    if loggers:
        run.events_dir = out
        (run.tb_dir,) = (out / "runs").iterdir()
        run.wandb_root = os.environ["WANDB_DIR"]
    return run


def healthy(root, cb):
    trainer, recorder = run_trainer(root, [cb], runaway=False, steps=HEALTHY_STEPS)
    return Run(trainer_steps=trainer.state.global_step, losses=_logged(recorder, "loss"))


def accumulated_and_clipped(root, cb):
    """6 steps of 4 micro-batches of 2, clipping at CLIP: the loss and the pre-clip norm the Trainer logs."""
    trainer, recorder = run_trainer(root, [cb], runaway=False, steps=6, batch=2, accumulation=4, max_grad_norm=CLIP)
    return Run(
        trainer_steps=trainer.state.global_step,
        losses=_logged(recorder, "loss"),
        grad_norms=_logged(recorder, "grad_norm"),
    )


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


def planted_log_of_zero(root, cb):
    """40 healthy steps whose loss becomes a log of 0 at step 30; returns the planted class."""
    model = PlantedLogOfZero()
    args = TrainingArguments(
        output_dir=str(root),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_steps=40,
        per_device_train_batch_size=4,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
    )
    Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[PlantAt(model, 30), cb]).train()
    return PlantedLogOfZero


class StepLog(TrainerCallback):
    """The "nummon" logger's lines, each with the step the Trainer was in when it was written."""

    def __init__(self):
        self.lines = []
        self.step = None
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append((self.step, record.getMessage()))

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step  # during nummon step s the Trainer's global_step is s

    def on_step_end(self, args, state, control, **kwargs):
        self.step = None  # the Trainer logs step s as global_step s + 1 after this


def readme_blow_up(root, cb):
    """The README's Hugging Face example driven to blow up: SGD lr 20, no clipping, 10 steps of 2
    micro-batches. The nummon lines as (step, text)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (256, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    steplog = StepLog()
    args = TrainingArguments(
        output_dir=str(root),
        report_to=[],
        max_steps=10,
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=0.0,
        logging_steps=1,
        disable_tqdm=True,
    )
    logging.getLogger("nummon").addHandler(steplog.handler)
    try:
        Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched), callbacks=[steplog, cb]).train()
    finally:
        logging.getLogger("nummon").removeHandler(steplog.handler)
    return steplog.lines


def callback(sinks=(), **kwargs):
    return NummonTrainerCallback(sinks=list(sinks), **kwargs)


def runaway_with_progress_bar(root):
    """The runaway as a user runs it: the Trainer's own tqdm bar on stderr, nummon's console on."""
    model = tiny_gpt2()
    args = training_args(root, steps=RUNAWAY_STEPS, disable_tqdm=False)
    Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        optimizers=optimizers(model, True),
        callbacks=[NummonTrainerCallback(follow_report_to=False)],
    ).train()


if (
    __name__ == "__main__"
):  # python tests/helpers/transformers_runs.py progress-bar DIR (tests/ on PYTHONPATH) (a real process: its stderr is read)
    import sys

    assert sys.argv[1] == "progress-bar", sys.argv
    runaway_with_progress_bar(sys.argv[2])

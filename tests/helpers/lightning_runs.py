"""Tiny Lightning runs for the framework suites (test_framework_callbacks.py, test_lightning.py): a
pre-norm residual MLP on synthetic data, CPU.

The runaway: SGD whose learning rate doubles every step (a warmup to a peak far too high), with
Lightning clipping gradients at 1.0. Without nummon the loss reaches NaN within ~25 steps.
"""

import logging
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.framework_run import Run
from nummon.integrations.lightning import NummonLightningCallback

NAME = "lightning"
EXTRA, MODULE = "lightning", "lightning"  # the install extra and the package it needs
RUNAWAY_STEPS = 28
MIN_HEALTHY_STEPS = 6  # the runaway stays healthy this long without nummon
HEALTHY_STEPS = 30
STOP_MARGIN = 0  # nummon stops the runaway by the step its loss passes FP16_MAX
CLIP = 0.05  # the accumulation scenario's clipping threshold: below every step's norm
TB_TAGS = ("nummon/clip_ratio",)  # scalars only this framework's callback writes

for _name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)
warnings.filterwarnings("ignore", module="lightning")


class Block(nn.Module):
    """Pre-norm residual MLP block (the shape of a transformer's feed-forward half)."""

    def __init__(self, width=32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyRegressor(pl.LightningModule):
    def __init__(self, lr, growth=1.0, optimizer="sgd"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), Block(), Block(), nn.LayerNorm(32), nn.Linear(32, 1))
        self.lr, self.growth, self.optimizer_name = lr, growth, optimizer
        self.losses = []  # every micro-batch's loss, as training_step computed it, taken at its backward

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_backward(self, loss):
        # here, not in training_step: nummon's re-run of a critical step calls training_step again
        self.losses.append(loss.detach().float().item() * self.trainer.accumulate_grad_batches)

    def configure_optimizers(self):
        cls = torch.optim.SGD if self.optimizer_name == "sgd" else torch.optim.AdamW
        opt = cls(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: self.growth**k)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PreClipNorm(pl.Callback):
    """The unclipped gradient norm of each optimizer step, as clip_grad_norm_ would return it."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def synthetic_data(batch=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.3), batch_size=batch)


def trainer_for(root, callbacks, *, steps, loggers=False, accumulate=1, clip=1.0, precision="32-true"):
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=loggers,
        callbacks=callbacks,
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        precision=precision,
        log_every_n_steps=1,
    )


def fit(root, callbacks, *, runaway, steps, loggers=False, accumulate=1, clip=1.0, precision="32-true", batch=16):
    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(1.0, 2.0) if runaway else TinyRegressor(1e-3, optimizer="adamw")
    trainer = trainer_for(
        root, callbacks, steps=steps, loggers=loggers, accumulate=accumulate, clip=clip, precision=precision
    )
    trainer.fit(model, synthetic_data(batch))
    return trainer, model


def _per_step(losses, accumulate=1):
    """{nummon step: the mean of its micro-batch losses}."""
    return {
        s: sum(losses[accumulate * s : accumulate * s + accumulate]) / accumulate
        for s in range(len(losses) // accumulate)
    }


def runaway(root, cb=None, *, loggers=False):
    """The runaway, with `cb` (None: without nummon); with `loggers` through TensorBoard and W&B."""
    tb = wb = None
    if loggers:
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        tb = TensorBoardLogger(str(root / "tb"))
        wb = WandbLogger(offline=True, save_dir=str(root / "wb"), project="nummon-test")
    trainer, model = fit(
        root, [cb] if cb else [], runaway=True, steps=RUNAWAY_STEPS, loggers=[tb, wb] if loggers else False
    )
    run = Run(trainer_steps=trainer.global_step, losses=_per_step(model.losses))
    if loggers:
        run.events_dir = run.tb_dir = tb.log_dir
        run.wandb_root = root / "wb"
    return run


def healthy(root, cb):
    trainer, model = fit(root, [cb], runaway=False, steps=HEALTHY_STEPS)
    return Run(trainer_steps=trainer.global_step, losses=_per_step(model.losses))


def accumulated_and_clipped(root, cb):
    """6 steps of 4 micro-batches of 16, clipping at CLIP: the loss and unclipped norm of every step."""
    preclip = PreClipNorm()
    trainer, model = fit(root, [cb, preclip], runaway=False, steps=6, accumulate=4, clip=CLIP)
    return Run(
        trainer_steps=trainer.global_step, losses=_per_step(model.losses, 4), grad_norms=dict(enumerate(preclip.norms))
    )


class PlantedLogOfZero(TinyRegressor):
    """From step 30 the loss is the log of a softmax that underflowed to exactly 0."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.trainer.global_step >= 30:
            probs = torch.softmax(torch.cat([out, out + 1000.0], 1), 1)
            return -torch.log(probs[:, :1]).mean()  # LOG_OF_ZERO_LINE
        return nn.functional.mse_loss(out, y)


def planted_log_of_zero(root, cb):
    """40 healthy AdamW steps whose loss becomes a log of 0 at step 30; returns the planted class."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=40,
        logger=False,
        callbacks=[cb],
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PlantedLogOfZero(1e-3, optimizer="adamw"), synthetic_data())
    return PlantedLogOfZero


class ReadmeRegressor(pl.LightningModule):
    """The README's Lightning example, driven to blow up: SGD lr 0.2, momentum 0.9, no clipping."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class StepLog(logging.Handler):
    """The "nummon" logger's lines, each with the step the trainer was in when it was written."""

    def __init__(self, trainer):
        super().__init__(logging.WARNING)
        self.trainer = trainer
        self.lines = []

    def emit(self, record):
        # global_step counts finished optimizer steps: during nummon step s it is s
        self.lines.append((self.trainer.global_step, record.getMessage()))


def readme_blow_up(root, cb):
    """The README example with `cb`, 40 steps of 2 micro-batches: the nummon lines as (step, text)."""
    torch.manual_seed(0)
    x = torch.randn(1024, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=40,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[cb],
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    handler = StepLog(trainer)
    logging.getLogger("nummon").addHandler(handler)
    try:
        trainer.fit(ReadmeRegressor(), data)
    finally:
        logging.getLogger("nummon").removeHandler(handler)
    return handler.lines


def callback(sinks=(), **kwargs):
    return NummonLightningCallback(sinks=list(sinks), **kwargs)

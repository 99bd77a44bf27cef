"""The Lightning callback on a real Trainer (CPU): a tiny pre-norm residual MLP on synthetic data.

The runaway: SGD whose learning rate doubles every step (a warmup to a peak far too high), with
Lightning clipping gradients at 1.0. Without nummon the loss reaches NaN within ~25 steps.
"""
import logging
import math
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from nummon import MemorySink, Severity  # noqa: E402
from nummon.integrations.lightning import NummonCallback  # noqa: E402

from wandb_reader import find_run_file, nummon_alert_titles_and_steps, read_records  # noqa: E402

RUNAWAY_STEPS = 28
FP16_MAX = 65504.0  # "blown up": a loss that half precision could no longer even represent

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
        self.losses = []  # every micro-batch's loss, as training_step computed it

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().float().item())
        return loss

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


def fit(root, callbacks, *, runaway, steps, loggers=False, accumulate=1, clip=1.0, precision="32-true", batch=16):
    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(1.0, 2.0) if runaway else TinyRegressor(1e-3, optimizer="adamw")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=loggers, callbacks=callbacks, default_root_dir=str(root),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, precision=precision, log_every_n_steps=1,
    )
    trainer.fit(model, synthetic_data(batch))
    return trainer, model


@pytest.fixture(scope="module")
def unmonitored_runaway(tmp_path_factory):
    """The runaway without nummon: per-step losses and the first step that is lost."""
    _, model = fit(tmp_path_factory.mktemp("plain"), [], runaway=True, steps=RUNAWAY_STEPS)
    losses = model.losses
    first_bad = next(i for i, v in enumerate(losses) if not math.isfinite(v) or v > FP16_MAX)
    return losses, first_bad


def test_runaway_without_nummon_reaches_nan(unmonitored_runaway):
    losses, first_bad = unmonitored_runaway
    assert not math.isfinite(losses[-1]), losses
    assert first_bad >= 6, "the run must stay healthy long enough for a warning to mean something"


def test_runaway_is_warned_early_stopped_and_logged_to_tensorboard_and_wandb(tmp_path, wandb_env, unmonitored_runaway):
    import wandb
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, first_bad = unmonitored_runaway
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    wb = WandbLogger(offline=True, save_dir=str(tmp_path / "wb"), project="nummon-test")
    trainer, model = fit(tmp_path, [cb], runaway=True, steps=RUNAWAY_STEPS, loggers=[tb, wb])
    wandb.finish()
    wandb.teardown()  # the W&B singleton keeps this test's directories otherwise

    warnings_ = [a for a in cb.monitor.alerts if a.severity.rank >= Severity.WARNING.rank]
    assert warnings_, "no warning at all"
    assert min(a.step for a in warnings_) <= first_bad - 3, (min(a.step for a in warnings_), first_bad)
    critical = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL]
    assert critical and cb.stopped_at == critical[0].step
    assert trainer.global_step == cb.stopped_at + 1 < RUNAWAY_STEPS
    assert all(math.isfinite(v) for v in model.losses)
    # the loss nummon saw is each step's own loss
    assert [r.loss for r in memory.records] == pytest.approx(model.losses, rel=1e-6)

    # the event log and flight record in trainer.log_dir
    log_dir = tb.log_dir
    assert os.path.isfile(os.path.join(log_dir, "nummon-events.jsonl"))
    assert str(cb.monitor.flight_record.parent) == log_dir

    # nummon's scalars and alerts in the TensorBoardLogger's own event files
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("nummon/loss", "nummon/grad_norm", "nummon/activation_max", "nummon/health", "nummon/clip_ratio"):
        assert tag in scalars, tag
    assert {e.step for e in acc.Scalars("nummon/loss")} == {r.step for r in memory.records}
    assert any(t.startswith("nummon_2_alerts/") for t in acc.Tags()["tensors"])

    # the alerts in the WandbLogger's offline run file
    records = read_records(find_run_file(tmp_path / "wb"))
    titles, logged_steps = nummon_alert_titles_and_steps(records)
    assert any(t.startswith("nummon:") for t in titles), titles
    # and every step's scalars, charted against nummon/step (the framework logs without step=)
    assert logged_steps == [r.step for r in memory.records]


def test_healthy_run_gets_no_warning(tmp_path):
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    trainer, _ = fit(tmp_path, [cb], runaway=False, steps=30)
    assert trainer.global_step == 30 and cb.stopped_at is None
    assert len(memory.records) == 30
    assert [a for a in cb.monitor.alerts if a.severity.rank >= Severity.WARNING.rank] == []


def test_accumulation_and_clipping_report_the_unclipped_norm_and_step_loss(tmp_path):
    """4 micro-batches per step, clipping at 0.05 (active on every step): nummon's grad_norm is
    the norm clip_grad_norm_ would return, its loss the mean of the 4 micro-batch losses."""
    memory = MemorySink()
    cb, preclip = NummonCallback(sinks=[memory]), PreClipNorm()
    trainer, model = fit(tmp_path, [cb, preclip], runaway=False, steps=6, accumulate=4, clip=0.05)
    assert trainer.global_step == 6 and len(memory.records) == 6
    assert min(preclip.norms) > 0.05  # clipping really scaled every step down
    for rec, norm in zip(memory.records, preclip.norms):
        assert rec.grad_norm == pytest.approx(norm, rel=1e-5)
    for rec in memory.records:
        micro = model.losses[4 * rec.step: 4 * rec.step + 4]
        assert rec.loss == pytest.approx(sum(micro) / 4, rel=1e-5)
    assert cb.last_clip_ratio == pytest.approx(0.05 / preclip.norms[-1], rel=1e-5)


def test_bf16_mixed_precision(tmp_path):
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory])
    trainer, model = fit(tmp_path, [cb], runaway=False, steps=5, precision="bf16-mixed")
    assert len(memory.records) == 5 and all(r.is_finite() for r in memory.records)
    assert [r.loss for r in memory.records] == pytest.approx(model.losses, rel=1e-6)




def test_missing_lightning_gives_an_install_hint(tmp_path):
    # a stub package that fails to import stands in for an environment without lightning
    stub = tmp_path / "lightning"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('No module named lightning')\n")
    proc = subprocess.run([sys.executable, "-c", "import nummon.integrations.lightning"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "pip install 'nummon[lightning]'" in proc.stderr.strip().splitlines()[-1]


class PlantedLogOfZero(TinyRegressor):
    """From step 30 the loss is the log of a softmax that underflowed to exactly 0."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.trainer.global_step >= 30:
            probs = torch.softmax(torch.cat([out, out + 1000.0], 1), 1)
            return -torch.log(probs[:, :1]).mean()  # LOG_OF_ZERO_LINE
        return nn.functional.mse_loss(out, y)


def test_planted_log_of_zero_is_explained_in_the_critical_alert(tmp_path):
    import inspect

    line = next(i for i, l in enumerate(inspect.getsource(PlantedLogOfZero).splitlines())
                if "LOG_OF_ZERO_LINE" in l) + inspect.getsourcelines(PlantedLogOfZero)[1]
    pl.seed_everything(0, verbose=False)
    model = PlantedLogOfZero(1e-3, optimizer="adamw")
    cb = NummonCallback()
    trainer = pl.Trainer(accelerator="cpu", max_steps=40, logger=False, callbacks=[cb], default_root_dir=str(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, synthetic_data())
    crit = [a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL and a.kind.value == "nonfinite"]
    assert crit and crit[0].step == 30 and cb.stopped_at == 30
    assert "log_of_zero" in crit[0].message and f"test_lightning.py:{line}" in crit[0].message
    assert crit[0].details["cause"]["op"] == "aten::log"


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
    """The "nummon" logger's lines, each with the trainer step it was written during."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.trainer = None
        self.lines = []

    def emit(self, record):
        self.lines.append((self.trainer.global_step if self.trainer else None, record.getMessage()))


def readme_blow_up(root, console):
    torch.manual_seed(0)
    x = torch.randn(1024, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    memory = MemorySink()
    cb = NummonCallback(sinks=[memory], stop_on_critical=False, console=console)
    trainer = pl.Trainer(accelerator="cpu", max_steps=40, accumulate_grad_batches=2, logger=False, callbacks=[cb],
                         default_root_dir=str(root), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    handler = StepLog()
    handler.trainer = trainer
    logging.getLogger("nummon").addHandler(handler)
    try:
        trainer.fit(ReadmeRegressor(), data)
    finally:
        logging.getLogger("nummon").removeHandler(handler)
    first_bad = next(r.step for r in memory.records if not r.is_finite())
    return cb, handler.lines, first_bad


def test_the_readme_example_driven_to_blow_up_prints_incident_lines_before_the_first_nonfinite_step(tmp_path):
    cb, lines, first_bad = readme_blow_up(tmp_path, console=True)
    incident_lines = [(step, text) for step, text in lines if text.startswith("nummon: run ")]
    assert incident_lines and incident_lines[0][0] < first_bad, (incident_lines, first_bad)
    # one line per incident event, plain text (no Markdown marks)
    assert len(incident_lines) == len([e for e in cb.monitor.incidents if e.state.rank >= 1])
    assert not any("**" in text or "`" in text for _, text in lines)
    # the countdown of the first critical alert does not promise steps that were not there
    crit = next(a for a in cb.monitor.alerts if a.severity is Severity.CRITICAL)
    left = first_bad - crit.step
    assert 1 <= crit.details["steps_to_overflow"] <= 1.5 * left + 2, (crit.message, left)
    assert "at most" in crit.message or "speeds up" in crit.message


def test_console_false_keeps_the_callback_quiet(tmp_path):
    _, lines, _ = readme_blow_up(tmp_path, console=False)
    assert not [text for _, text in lines if text.startswith("nummon: run ")]


def test_the_stop_line_names_the_incident(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nummon"):
        fit(tmp_path, [NummonCallback(console=False)], runaway=True, steps=RUNAWAY_STEPS)
    stop = [r.getMessage() for r in caplog.records if "stopping training" in r.getMessage()]
    assert stop and "incident 1, run critical" in stop[0], stop


def test_a_run_resumed_from_a_checkpoint_resumes_the_health_engine_warm(tmp_path):
    """The callback's state (the engine's incident and re-warming records) rides in the trainer's
    checkpoint; a resumed fit starts its detectors where the first one left them."""
    first = NummonCallback(follow_loggers=False)
    trainer, _ = fit(tmp_path / "a", [first], runaway=False, steps=12)
    ckpt = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]  # plain data: loads with weights_only
    (state,) = [v for k, v in saved.items() if "NummonCallback" in k]
    assert [r["step"] for r in state["engine"]["first"]] == list(range(12))

    pl.seed_everything(0, verbose=False)
    resumed = NummonCallback(follow_loggers=False)
    trainer2 = pl.Trainer(accelerator="cpu", max_steps=14, logger=False, callbacks=[resumed],
                          default_root_dir=str(tmp_path / "b"), enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, gradient_clip_val=1.0)
    trainer2.fit(TinyRegressor(1e-3, optimizer="adamw"), synthetic_data(), ckpt_path=str(ckpt))
    steps = [r["step"] for r in resumed.monitor.engine.state_dict()["first"]]
    assert steps == list(range(14))  # 0..11 from the checkpoint, then 12 and 13: not a cold start at 12

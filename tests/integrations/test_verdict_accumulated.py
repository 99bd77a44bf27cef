"""Both framework callbacks re-run the whole optimizer step for a verdict: with gradient
accumulation every micro-batch, on the weights and random generators of the step. A run that blows
up through its learning rate (the docs' examples, SGD far too high) is `reproducible`, bitwise."""

import pytest

torch = pytest.importorskip("torch")


def _judged(verdicts, alerts):
    critical = [a for a in alerts if a.severity.value == "critical" and not a.cleared]
    assert critical, "the run never went critical"
    assert verdicts, [a.details.get("verdict_unavailable") for a in critical]
    return [(v.verdict, v.bitwise) for v in verdicts]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_hugging_face_example_blowing_up_is_reproducible_with_accumulation(tmp_path, accumulation):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nummon.integrations.transformers import NummonTrainerCallback

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (256, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        max_steps=30,
        use_cpu=True,
        save_strategy="no",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=0.0,
        logging_steps=1,
        disable_tqdm=True,
    )
    cb = NummonTrainerCallback(console=False)
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched), callbacks=[cb]).train()
    assert set(_judged(cb.monitor._steps.verdicts, cb.monitor.alerts)) == {("reproducible", True)}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_lightning_run_blowing_up_is_reproducible_with_accumulation(tmp_path, accumulate):
    pytest.importorskip("lightning.pytorch")
    import lightning.pytorch as pl
    from helpers.lightning_runs import TinyRegressor, synthetic_data, trainer_for

    from nummon.integrations.lightning import NummonLightningCallback

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(1.5)
    cb = NummonLightningCallback(follow_loggers=False, console=False)
    trainer_for(tmp_path, [cb], steps=40, accumulate=accumulate, clip=0.0).fit(model, synthetic_data(16))
    assert set(_judged(cb.monitor._steps.verdicts, cb.monitor.alerts)) == {("reproducible", True)}


def test_a_lightning_manual_optimization_step_is_never_re_run(tmp_path):
    """Its training_step steps the optimizer itself: a re-run would apply the update twice."""
    pytest.importorskip("lightning.pytorch")
    import lightning.pytorch as pl
    from helpers.lightning_runs import TinyRegressor, synthetic_data, trainer_for
    from torch import nn

    from nummon.integrations.lightning import NummonLightningCallback

    class Manual(TinyRegressor):
        def __init__(self, lr):
            super().__init__(lr)
            self.automatic_optimization = False
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.manual_backward(loss)
            opt.step()
            return loss

    pl.seed_everything(0, verbose=False)
    model = Manual(1.5)
    cb = NummonLightningCallback(follow_loggers=False, console=False, stop_on_critical=False)  # on to the NaN
    trainer = trainer_for(tmp_path, [cb], steps=40, clip=None)
    trainer.fit(model, synthetic_data(16))
    assert [a for a in cb.monitor.alerts if a.severity.value == "critical"], "the run never went critical"
    assert model.calls == trainer.global_step and cb.monitor._steps.verdicts == []

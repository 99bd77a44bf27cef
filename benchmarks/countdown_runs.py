"""The runaways the countdown is calibrated on that are not files: the demo and the README's two
callback examples driven to blow up. Each function trains for real (CPU, seconds) and returns
the path of nummon's event log (step records and alerts), which `countdown.py` replays.

- demo: `nummon demo` (SGD lr 0.02, momentum 0.9, a domain switch at step 60).
- lightning: the README's Lightning example with SGD lr 0.2, momentum 0.9, no clipping, seed 0.
- hf: the README's Hugging Face example with SGD lr 20, no clipping, seed 0.

Both callback runs use `stop_on_critical=False`, so they run on to the first non-finite step.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

__all__ = ["RUNS", "demo_run", "hf_run", "lightning_run"]


def demo_run(out: Path) -> Path:
    from nummon._tools.demo import DemoConfig, prepare, run

    plan = prepare(DemoConfig(out=out, wandb=False, tensorboard=False))
    run(plan)
    return out / "events.jsonl"


def lightning_run(out: Path, seed: int = 0, console: bool = False) -> Path:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from nummon.integrations.lightning import NummonLightningCallback

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    torch.manual_seed(seed)
    x = torch.randn(1024, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=60,
        accumulate_grad_batches=2,
        logger=False,
        default_root_dir=str(out),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[NummonLightningCallback(stop_on_critical=False, run_dir=str(out), console=console)],
    )
    trainer.fit(Regressor(), data)
    return out / "nummon-events.jsonl"


def hf_run(out: Path, seed: int = 0, console: bool = False) -> Path:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nummon.integrations.transformers import NummonTrainerCallback

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)

    class RandomTokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 64, (256, 16))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = TrainingArguments(
        output_dir=str(out),
        report_to=[],
        max_steps=20,
        use_cpu=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=0.0,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        optimizers=(opt, sched),
        callbacks=[NummonTrainerCallback(stop_on_critical=False, console=console)],
    ).train()
    return out / "nummon-events.jsonl"


RUNS = {
    "nummon demo": demo_run,
    "Lightning example, SGD lr 0.2 momentum 0.9": lightning_run,
    "HF example, SGD lr 20": hf_run,
}

"""What only the Lightning callback has, on a real Trainer (CPU): bf16 mixed precision and resuming
from the trainer's checkpoint. The scenarios both framework callbacks share are in
test_framework_callbacks.py; the tiny runs are in helpers/lightning_runs.py.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning.pytorch")

from helpers.lightning_runs import TinyRegressor, fit, synthetic_data, trainer_for  # noqa: E402

from nummon import MemorySink  # noqa: E402
from nummon.integrations.lightning import NummonLightningCallback  # noqa: E402


def test_bf16_mixed_precision(tmp_path):
    memory = MemorySink()
    cb = NummonLightningCallback(sinks=[memory])
    trainer, model = fit(tmp_path, [cb], runaway=False, steps=5, precision="bf16-mixed")
    assert len(memory.records) == 5 and all(r.is_finite() for r in memory.records)
    assert [r.loss for r in memory.records] == pytest.approx(model.losses, rel=1e-6)


def test_a_run_resumed_from_a_checkpoint_resumes_the_health_engine_warm(tmp_path):
    """The callback's state (the engine's incident and re-warming records) rides in the trainer's
    checkpoint; a resumed fit starts its detectors where the first one left them."""
    import lightning.pytorch as pl

    first = NummonLightningCallback(follow_loggers=False)
    trainer, _ = fit(tmp_path / "a", [first], runaway=False, steps=12)
    ckpt = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]  # plain data: loads with weights_only
    (state,) = [v for k, v in saved.items() if "NummonLightningCallback" in k]
    assert [r["step"] for r in state["engine"]["first"]] == list(range(12))

    pl.seed_everything(0, verbose=False)
    resumed = NummonLightningCallback(follow_loggers=False)
    trainer2 = trainer_for(tmp_path / "b", [resumed], steps=14)
    trainer2.fit(TinyRegressor(1e-3, optimizer="adamw"), synthetic_data(), ckpt_path=str(ckpt))
    steps = [r["step"] for r in resumed.monitor.engine_state()["first"]]
    assert steps == list(range(14))  # 0..11 from the checkpoint, then 12 and 13: not a cold start at 12

"""Which logged tag feeds which StepRecord field: defaults for the names common loggers use,
extendable by the caller (e.g. ``KeyMap({"my/loss": "loss"})``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._core.record_dict import NONFINITE_WORDS
from .._core.types import SCALAR_FIELDS, StepRecord

__all__ = ["DEFAULT_KEYS", "KeyMap"]

#: Tag name -> StepRecord field. Covers Hugging Face Trainer (TensorBoard `train/*` and
#: trainer_state.json), Lightning (`train_loss`, `grad_2.0_norm_total`), W&B conventions and
#: nummon's own `nummon/<stat>` tags. Evaluation metrics (`eval_loss`, `val_loss`) are left out on
#: purpose: they are not the optimizer's loss and a run's detectors would mix two series.
DEFAULT_KEYS: dict[str, str] = {
    "loss": "loss",
    "train/loss": "loss",
    "train_loss": "loss",
    "train_loss_step": "loss",
    "training_loss": "loss",
    "Loss/train": "loss",
    "grad_norm": "grad_norm",
    "train/grad_norm": "grad_norm",
    "gradient_norm": "grad_norm",
    "grad_2.0_norm_total": "grad_norm",
    "lr": "lr",
    "learning_rate": "lr",
    "train/learning_rate": "lr",
    "train/lr": "lr",
    "lr-AdamW": "lr",
    "lr-Adam": "lr",
    "lr-SGD": "lr",
}
DEFAULT_KEYS.update({f"nummon/{f}": f for f in SCALAR_FIELDS})


class KeyMap:
    """Maps a row of logged scalars (tag -> value) to a StepRecord."""

    def __init__(self, extra: Mapping[str, str] | None = None, defaults: bool = True) -> None:
        self.keys: dict[str, str] = dict(DEFAULT_KEYS) if defaults else {}
        for tag, field in (extra or {}).items():
            if field not in SCALAR_FIELDS:
                raise ValueError(f"key map: {tag!r} -> {field!r}: field must be one of {', '.join(SCALAR_FIELDS)}")
            self.keys[str(tag)] = field

    def field(self, tag: str) -> str | None:
        """The StepRecord field a tag feeds, or None."""
        return self.keys.get(tag)

    def record(self, step: int, row: Mapping[str, Any]) -> StepRecord | None:
        """A StepRecord from one row, or None when no tag of the row is mapped (an eval-only row
        measures nothing the detectors judge, and an empty record must not clear conditions)."""
        rec = StepRecord(step=int(step))
        found = False
        for tag, value in row.items():
            name = self.keys.get(tag)
            if name is None:
                continue
            num = _as_float(value)
            if num is None:
                continue
            setattr(rec, name, num)
            found = True
        return rec if found else None


def _as_float(v: Any) -> float | None:
    """A number from a logged value (float, int, numeric string, NaN/Infinity strings); else None."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        if not s:
            return None
        if s.lower() in NONFINITE_WORDS:
            return NONFINITE_WORDS[s.lower()]
        try:
            return float(s)
        except ValueError:
            return None
    return None

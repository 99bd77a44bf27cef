"""`overfit_one_batch`: can a copy of the model memorise one batch? A healthy model and loss can
(Karpathy's first check); one that cannot points at the code. Each tried learning rate trains a
fresh copy and stops as soon as the batch is memorised or the loss has flattened, so the cost is
bounded by `steps` x the number of learning rates, and healthy code usually needs far less.

What it can detect: a loss that cannot reach its floor (softmax before CrossEntropyLoss), frozen or
detached parameters, a model too small or broken to fit 16 samples, and, when `batch` is a
callable that re-fetches the same samples through the user's pipeline, inputs and labels that are
paired differently on each fetch. A fixed batch with wrong labels *can* be memorised: wrong labels
in a fixed batch are invisible to this check (use `check_data` and a held-out evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError
from .diagnose_common import Report, Status, copy_model, device_of, split_batch, to_device

__all__ = ["OVERFIT_LRS", "overfit_one_batch"]

# Adam learning rates tried in this order: 1e-2 memorises small MLPs, CNNs and transformers
# fastest; 3e-3 and 1e-3 suit larger models; 3e-2 rescues tiny, badly scaled ones.
OVERFIT_LRS: tuple[float, ...] = (1e-2, 3e-3, 1e-3, 3e-2)
_FLAT_PROGRESS = 0.01  # "flat": the windowed mean loss came < 1% closer to the floor over one window
_CAUSES = (
    "likely causes: labels that do not match the inputs, a loss that does not fit the outputs "
    "(e.g. softmax before CrossEntropyLoss), frozen or detached parameters, a too small model"
)


@dataclass
class _Trial:
    """One learning rate's attempt. `ended`: memorised, flat, budget (still falling), nonfinite,
    or no_grad (the loss depends on no trainable parameter)."""

    lr: float
    steps: int = 0
    start_loss: float = math.nan
    best_loss: float = math.inf
    final_loss: float = math.nan
    reference_loss: float = math.nan  # the loss of a constant prediction (or the start)
    accuracy: float | None = None  # best batch accuracy, classification only
    ended: str = "budget"

    def ratio(self, floor: float) -> float:
        """How far the best loss got toward the floor: (best - floor) / (reference - floor)."""
        span = self.reference_loss - floor
        if not math.isfinite(self.best_loss) or not span > 0:
            return math.inf
        return max(self.best_loss - floor, 0.0) / span


def _class_dim(out: Any, y: Any) -> int | None:
    """The class dimension when `out` are logits over classes and `y` class indices
    ((N, C) with (N,), (N, C, ...) with (N, ...), or (N, T, V) with (N, T)); else None."""
    if not (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor)) or not out.is_floating_point():
        return None
    if y.is_floating_point() or y.dtype == torch.bool or out.dim() != y.dim() + 1:
        return None
    if out.shape[:-1] == y.shape and out.shape[-1] >= 2:
        return out.dim() - 1
    if out.shape[0] == y.shape[0] and out.shape[2:] == y.shape[1:] and out.shape[1] >= 2:
        return 1
    return None


def _accuracy(out: torch.Tensor, y: torch.Tensor, dim: int) -> float:
    keep = y >= 0  # ignore_index targets (-100) do not count
    n = int(keep.sum())
    return float(((out.detach().argmax(dim) == y) & keep).sum()) / n if n else 1.0


def _constant_loss(loss_fn: Callable, out: Any, y: Any, dim: int | None) -> float | None:
    """The loss of the best trivial prediction: uniform logits for classification, the targets'
    batch mean for regression. Memorising means getting far below it, whatever the init."""
    with torch.no_grad():
        if dim is not None:
            const = torch.zeros_like(out)
        elif (
            isinstance(y, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and y.is_floating_point()
            and out.shape == y.shape
        ):
            const = y.mean(0, keepdim=True).expand_as(y).to(out.dtype)
        else:
            return None
        try:
            value = float(loss_fn(const, y))
        except Exception:  # a custom loss may not accept a plain tensor: fall back to the start loss
            return None
    return value if math.isfinite(value) else None


def _dropout_off(model: nn.Module) -> None:
    """Memorisation is judged without regularisation: dropout modules (and attention dropout,
    which nn.MultiheadAttention applies only in training mode) are switched off on the copy."""
    for m in model.modules():
        if isinstance(m, (nn.modules.dropout._DropoutNd, nn.MultiheadAttention)):
            m.eval()


def _flat(losses: list[float], window: int, floor: float) -> bool:
    if len(losses) < 2 * window:
        return False
    prev = sum(losses[-2 * window : -window]) / window
    last = sum(losses[-window:]) / window
    return prev - last < _FLAT_PROGRESS * max(prev - floor, 0.0)


def _run_trial(
    model: nn.Module,
    get_batch: Callable[[], Any],
    loss_fn: Callable,
    lr: float,
    steps: int,
    optimizer_cls: Callable[..., torch.optim.Optimizer],  # a class whose constructor takes lr=
    fraction: float,
    floor: float,
) -> _Trial:

    trial = _Trial(lr)
    clone = copy_model(model)
    _dropout_off(clone)
    params = [p for p in clone.parameters() if p.requires_grad]
    if not params:
        trial.ended = "no_grad"
        return trial
    opt = optimizer_cls(params, lr=lr)
    dev = device_of(clone)
    window = max(25, steps // 8)
    losses: list[float] = []
    dim: int | None = None
    for i in range(steps):
        x, y = (to_device(t, dev) for t in split_batch(get_batch()))
        opt.zero_grad(set_to_none=True)
        out = clone(x)
        loss = loss_fn(out, y)
        value = float(loss.detach())
        losses.append(value)
        trial.steps, trial.final_loss = i + 1, value
        if i == 0:
            dim = _class_dim(out, y)
            trial.start_loss = value
            trial.reference_loss = _constant_loss(loss_fn, out, y, dim) or value
        if not math.isfinite(value):
            trial.ended = "nonfinite"
            break
        trial.best_loss = min(trial.best_loss, value)
        acc = _accuracy(out, y, dim) if dim is not None else None
        if acc is not None:
            trial.accuracy = max(trial.accuracy or 0.0, acc)
        at_floor = value - floor <= fraction * (trial.reference_loss - floor)
        if at_floor and (acc is None or acc == 1.0):
            trial.ended = "memorised"
            break
        if not loss.requires_grad:
            trial.ended = "no_grad"
            break
        loss.backward()
        opt.step()
        if _flat(losses, window, floor):
            trial.ended = "flat"
            break
    return trial


def overfit_one_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    steps: int = 200,
    lr: float | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.Adam,
    target_fraction: float = 0.01,
    lrs: Sequence[float] = OVERFIT_LRS,
    loss_floor: float = 0.0,
) -> Report:
    """Train fresh copies on one batch, one per learning rate (`lr` first when given, then `lrs`),
    at most `steps` steps each, stopping at the first that memorises it: the loss within
    `target_fraction` (1%) of `loss_floor` relative to a constant prediction's loss and, when the
    outputs are class logits and the targets class indices, 100% batch accuracy. PASS when one
    memorises; PARTIAL when none did but the loss was still falling; FAIL otherwise.
    `batch`: an (inputs, targets) pair, or a callable returning one (called once per step).
    `loss_floor`: the loss's minimum when it is not 0 (label smoothing, a KL term)."""

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise NummonError(f"overfit_one_batch needs steps >= 1, got {steps!r}")
    tried = ([lr] if lr is not None else []) + [r for r in lrs if r != lr]
    if not tried or not all(isinstance(r, (int, float)) and r > 0 for r in tried):
        raise NummonError(f"overfit_one_batch needs positive learning rates, got lr={lr!r}, lrs={tuple(lrs)!r}")
    if callable(batch):
        get_batch = batch
    else:
        split_batch(batch)  # an (inputs, targets) pair, or a one-line error now
        get_batch = lambda: batch  # noqa: E731
    trials: list[_Trial] = []
    for rate in tried:
        trials.append(
            _run_trial(model, get_batch, loss_fn, float(rate), steps, optimizer_cls, target_fraction, loss_floor)
        )
        if trials[-1].ended in ("memorised", "no_grad"):
            break  # memorised: done; no_grad: no learning rate can change that
    return _verdict(trials, steps, loss_floor)


def _verdict(trials: list[_Trial], steps: int, floor: float) -> Report:
    best = min(trials, key=lambda t: (t.ended != "memorised", t.ratio(floor)))
    status, line = _judge(trials, best, steps, floor)
    return Report("overfit one batch", status, [line], _numbers(trials, best, steps, floor))


def _numbers(trials: list[_Trial], best: _Trial, steps: int, floor: float) -> dict[str, Any]:
    """The report's numbers: the best trial's losses and accuracy, and what every trial cost."""
    return {
        "start_loss": best.start_loss,
        "best_loss": best.best_loss,
        "final_loss": best.final_loss,
        "reference_loss": best.reference_loss,
        "best_over_reference": best.ratio(floor),
        "best_over_start": best.best_loss / best.start_loss if best.start_loss > 0 else math.inf,
        "accuracy": best.accuracy,
        "lr": best.lr,
        "steps": sum(t.steps for t in trials),
        "steps_per_lr": steps,
        "trials": [asdict(t) for t in trials],
    }


def _judge(trials: list[_Trial], best: _Trial, steps: int, floor: float) -> tuple[Status, str]:
    """(status, the one line that says why) from the best trial and how the others ended."""
    ratio = best.ratio(floor)
    total = sum(t.steps for t in trials)
    acc = "" if best.accuracy is None else f", batch accuracy {best.accuracy:.0%}"
    loss = f"loss {best.start_loss:.4g} -> {best.best_loss:.4g} ({ratio:.2%} of a constant prediction's {best.reference_loss:.4g})"
    cost = f"{total} steps over {len(trials)} learning rate(s) {', '.join(f'{t.lr:g}' for t in trials)}"
    if best.ended == "memorised":
        return Status.PASS, f"memorised the batch at lr {best.lr:g} in {best.steps} steps: {loss}{acc}; {cost}"
    if best.ended == "no_grad":
        return (
            Status.FAIL,
            "the loss depends on no trainable parameter: the model is frozen (requires_grad False everywhere) "
            "or its output is detached (.detach(), .item(), torch.no_grad, a numpy round trip)",
        )
    if all(t.ended == "nonfinite" for t in trials):
        return (
            Status.FAIL,
            f"the loss became non-finite at every learning rate tried ({cost}): check the loss for log(0)/division",
        )
    if best.ended == "budget" and ratio <= 0.5:
        return (
            Status.PARTIAL,
            f"not memorised within {steps} steps per learning rate but still falling: {loss}{acc}; raise steps; {cost}",
        )
    if best.accuracy == 1.0:
        return (
            Status.FAIL,
            f"every prediction is right but the loss flattened far above its floor {floor:g}: {loss}; the loss cannot "
            "reach its minimum: softmax before CrossEntropyLoss, or a loss with a non-zero floor "
            f"(label smoothing: pass loss_floor); {cost}",
        )
    return Status.FAIL, f"no learning rate memorised the batch: {loss}{acc}; {_CAUSES}; {cost}"

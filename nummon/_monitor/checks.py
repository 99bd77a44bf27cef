"""The checks of what a training loop hands the Monitor: each bad argument is rejected with a
one-line error naming it, before any state changes."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError

__all__ = ["check_clip_norm", "check_loss", "check_parts", "check_per_sample"]


def check_loss(loss: Any) -> Any:
    """A python number or a one-element tensor; anything else is rejected without side effects."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise NummonError(f"loss must be a scalar (0-d or one-element) tensor, got shape {tuple(loss.shape)}")
        if loss.dtype == torch.bool or loss.is_complex():
            raise NummonError(f"loss tensor must be numeric, got dtype {loss.dtype}")
        if loss.is_meta:  # a shape without a value: nothing to read
            raise NummonError("loss is on the meta device (it has no value): pass the loss of a materialised model")
        return loss
    if isinstance(loss, numbers.Complex) and not isinstance(loss, numbers.Real):  # numpy complex has __float__
        raise NummonError(f"loss must be a real number, got {type(loss).__name__} {loss!r:.40}")
    # python and numpy numbers (anything with __float__), but not bools or strings
    if isinstance(loss, (bool, str, bytes)) or not hasattr(loss, "__float__"):
        raise NummonError(f"loss must be a float or a 0-d tensor, got {type(loss).__name__} {loss!r:.40}")
    try:
        return float(loss)
    except OverflowError:  # e.g. 10**400: an integer beyond float's range
        raise NummonError(
            f"loss must fit in a float (magnitude at most 1.8e308), got a {type(loss).__name__} beyond that"
        ) from None
    except (TypeError, ValueError) as e:  # e.g. a numpy array with several elements
        raise NummonError(f"loss must be a single number, got {type(loss).__name__} ({e})") from None


def check_per_sample(losses: Any) -> Any:
    """None, or a non-empty real tensor / sequence of per-sample losses; else rejected here."""
    if losses is None:
        return None
    if not isinstance(losses, torch.Tensor):
        try:
            losses = torch.as_tensor(losses, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise NummonError(
                f"per_sample_loss must be a tensor or a sequence of numbers, got {type(losses).__name__} ({e})"
            ) from None
    if (
        losses.numel() == 0
        or losses.dtype == torch.bool
        or losses.is_complex()
        or not (losses.is_floating_point() or losses.dtype in (torch.int32, torch.int64))
    ):
        raise NummonError(
            f"per_sample_loss must be a non-empty real tensor, got dtype {losses.dtype} shape {tuple(losses.shape)}"
        )
    return losses


def check_parts(model: Any, optimizer: Any) -> None:
    if model is not None and not isinstance(model, nn.Module):
        raise NummonError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise NummonError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def check_clip_norm(clip_norm: Any) -> float | None:
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, numbers.Real):
        raise NummonError(f"clip_norm must be a number (the max gradient norm), got {type(clip_norm).__name__}")
    try:
        return float(clip_norm)
    except OverflowError:
        raise NummonError(f"clip_norm is too large for a float: {clip_norm!r:.40}") from None

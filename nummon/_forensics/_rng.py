"""Every random generator a training step can draw from, captured and put back as one state: a
re-run draws the same numbers as the step, and training after it draws what it would have drawn."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["Generators"]


def _cuda_states() -> list[torch.Tensor] | None:
    """Every CUDA device's generator state; None where CUDA is not in use (or a graph is being
    captured, where the state must not be read)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.get_rng_state_all()


def _same_numpy(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    import numpy

    return len(a) == len(b) and all(
        bool(numpy.array_equal(x, y)) if isinstance(x, numpy.ndarray) else x == y for x, y in zip(a, b)
    )


class Generators:
    """Torch's CPU generator, every initialised CUDA device's, Python's `random` and NumPy's global
    state (when NumPy is loaded), as they are at construction."""

    __slots__ = ("cpu", "cuda", "python", "numpy")

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = _cuda_states()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        """Put every generator back to this state."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)

    def same_as(self, other: Generators) -> bool:
        """Every generator in the same state as in `other`."""
        if not torch.equal(self.cpu, other.cpu) or self.python != other.python:
            return False
        if (self.cuda is None) != (other.cuda is None):
            return False
        if self.cuda is not None and other.cuda is not None:
            if len(self.cuda) != len(other.cuda) or not all(map(torch.equal, self.cuda, other.cuda)):
                return False
        return _same_numpy(self.numpy, other.numpy)

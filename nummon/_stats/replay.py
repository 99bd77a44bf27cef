"""The forward of a compiled model, replayed eagerly for the mechanism probes (see compiled.py).

A compiled forward cannot run the capture's hooks and mode inside its graph. So a sampled step's
pre-hook only keeps the forward's inputs (`keep`: references; traced, a side effect of the
graph), and `run` replays the first sample eagerly under the capture, leaving no trace on
training: random generators and buffers are put back, the other probes are paused.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .capture import ForwardCapture
from .compiled import (autocast_state, first_sample, has_batch_norm, loss_reads_compiled_output, replayed,
                       warn_at_user_line)

__all__ = ["REPLAY_FAILURES", "ForwardReplay"]

#: A compiled model whose replay fails this many sampled steps in a row is no longer replayed.
REPLAY_FAILURES = 3


def _replayable(model: nn.Module) -> nn.Module:
    """What a replay runs: a DDP wrapper's module (the same replicated weights, and no
    collective that every rank would have to join), else the model."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class ForwardReplay:
    """The kept inputs of a sampled compiled forward, and their eager replay under a capture."""

    def __init__(self, model: nn.Module, capture: ForwardCapture) -> None:
        self.model = model
        self.capture = capture
        self.active = False  # the model is compiled: its forward is replayed
        self.failed = False  # `REPLAY_FAILURES` replays in a row failed: no more (said once)
        self.running = False  # a replay is under way: the model's own hooks stand aside
        self.errors = 0
        #: within it, the other probes record nothing (the engine pauses its activation probes)
        self.others_paused: Callable[[], ContextManager] = contextlib.nullcontext
        self._kept: tuple | None = None  # (args, kwargs, autocast regions) of the step's first forward
        self._samples: int | None = None  # samples a replay takes (found at the first)
        self._failures = 0  # in a row

    def keep(self, args: tuple, kwargs: dict) -> None:
        """The sampled step's forward inputs (its first micro-batch's)."""
        if self._kept is None and not self.failed:
            self._kept = (args, kwargs, autocast_state())

    def take(self) -> tuple | None:
        """The kept inputs, now dropped."""
        kept, self._kept = self._kept, None
        return kept

    def run(self, kept: tuple, loss: Any, on_discovery: Callable[[], None]) -> None:
        """The kept forward again on its first sample (two with batch norm), eagerly under the
        capture (after the optimizer step where `post_step` comes after it); `on_discovery` runs
        when the capture rediscovers the model. A loss computed outside the model is not
        replayed: when it was the cross-entropy of the model's output, that output of the replay
        is measured as the logits."""
        cap = self.capture
        self.running = True
        try:
            target = _replayable(self.model)
            if self._samples is None:  # batch norm in train mode needs two samples
                self._samples = 2 if has_batch_norm(target) else 1
            args, kwargs = first_sample(kept[0], kept[1], self._samples)
            with replayed(self.model, kept[2]), self.others_paused():
                if cap.begin():
                    on_discovery()
                try:
                    out = target(*args, **kwargs)
                finally:
                    cap.end()
                    cap.close()
                logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
                if (not cap.out and isinstance(logits, torch.Tensor) and logits.is_floating_point()
                        and loss_reads_compiled_output(loss)):
                    cap.output_logits(logits)
            self._failures = 0
        except Exception as e:  # a probe must never break the user's step
            self.errors += 1
            cap.reset()  # what the failed forward left
            self._failures += 1
            if self._failures >= REPLAY_FAILURES:
                self.failed = True
                first = (str(e).strip().splitlines() or [""])[0][:200]
                warn_at_user_line(
                    f"nummon: replaying the compiled model's first sample failed {REPLAY_FAILURES} times in a row "
                    f"({type(e).__name__}: {first}), so its forward's mechanism probes (attention logits, output log Z, "
                    "Linear output RMS) are off. Gradients, parameters, activations and Adam's statistics are measured "
                    "as usual.")
        finally:
            self.running = False

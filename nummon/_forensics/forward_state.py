"""The state a re-run needs from the step it repeats: the weights of its forward (kept only when the
update's gradients were non-finite) and the random generators as each of its forwards found them.

The documented loop calls `post_step` after `optimizer.step()`, and a non-finite update has
written NaN into a plain SGD model's weights by then. `ForwardState` therefore looks at the
gradients in an optimizer step pre-hook (before the update) and, only when one is non-finite,
keeps a copy of the weights the forward used; the re-run swaps them in and puts the current
ones back. It is installed at the first `post_step` given a `recompute` (a loop without one pays
nothing). A healthy step then costs two hook calls and, only where `post_step` comes after the
update (the documented loop; the callbacks call it before), one finiteness check of the gradients
(one fused norm and a host read, free on CPU); and one copy of torch's generators' states per
forward (Python's and NumPy's too while an incident is open).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._stats.compiled import untraced
from ._rng import Generators

__all__ = ["ForwardState", "NoVerdict", "RerunTrace", "finite"]


def finite(t: torch.Tensor) -> bool:
    """Every element of `t` finite (a host read)."""
    return bool(torch.isfinite(t).all())


class NoVerdict(Exception):
    """The re-run was not the step's computation: no verdict (the message says why)."""


class RerunTrace:
    """What a re-run did: how many forwards of the model it ran, and whether it drew random
    numbers before its first forward (its inputs are then not the step's)."""

    def __init__(self) -> None:
        self.forwards = 0
        self.drew_before_forward = False
        self.drew_from_unkept_host = False  # Python's / NumPy's generators moved, their step states not kept

    def unfaithful(self, step_forwards: int) -> str | None:
        """Why the re-run is not the step's computation; None when it is."""
        if self.drew_from_unkept_host:
            return (
                "the re-run drew from Python's or NumPy's random generator, whose state at the step nummon keeps "
                "only while an incident is open"
            )
        if self.drew_before_forward:
            return (
                "the recompute drew random numbers before the model's forward (augmentation?), so its inputs "
                "are not the step's"
            )
        if self.forwards != step_forwards:
            return (
                f"the re-run ran the model's forward {self.forwards} time(s) and the step {step_forwards} "
                "(gradient accumulation?): a recompute must re-run every micro-batch of the optimizer step"
            )
        return None


class ForwardState:
    """What a re-run needs from before the update: installed on the model (a root forward
    pre-hook) and the optimizer (step pre- and post-hooks), removed by `close()`.

    `updated` is True once an optimizer update ran after the step's last forward; `saved` holds
    the weights of that forward when the update's gradients were non-finite (the failure path
    only: the copy is taken then and nowhere else); `forwards` the state of every random
    generator at each forward of the step (a re-run's i-th forward draws from the i-th).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, guarded: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.updated = False
        self.saved: list[torch.Tensor] | None = None
        self.forwards: list[Generators] = []
        self.paused = False  # the re-run's own forward is no training forward
        self._rerun: RerunTrace | None = None
        self._judged = False  # post_step judged the step: the next forward starts another
        # installed mid-step (at a post_step): not faithful until a forward has been seen
        self._seen_forward = False
        # did post_step come after the update? None until the first step says; the check before
        # an update is needed only then (the callbacks call post_step before it: no check)
        self.post_after_update: bool | None = None
        # on CUDA the finiteness check is a host sync: only where recovery's guard syncs anyway
        self._check = guarded or all(p.device.type == "cpu" for p in self.params)
        self._modes: list[bool] = []  # each forward's training mode (an evaluation's forwards are no step's)
        self._steps_unseen = 0  # steps judged without a forward of the model's root
        # keep Python's and NumPy's generators at each forward too (30 µs a forward: while an
        # incident is open, the Monitor says); torch's are always kept
        self.keep_host = False
        self._handles = [
            model.register_forward_pre_hook(untraced(self._on_forward)),  # reads flags, the generators
            optimizer.register_step_pre_hook(self._before_update),
            # an update has run only once the step returns: Lightning's step runs the last
            # micro-batch's forward and backward inside it (a closure), after the pre-hook
            optimizer.register_step_post_hook(self._after_update),
        ]

    def _hook_children(self) -> None:
        """A loop that never calls the model itself (Lightning's `training_step` calling
        `self.net(x)`): its forwards are those of the model's direct children."""
        for child in self.model.children():
            self._handles.append(child.register_forward_pre_hook(untraced(self._on_forward)))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if self.paused:
            if self._rerun is not None:
                self._on_rerun_forward(self._rerun)
            return
        self._seen_forward = True
        if self.updated or self._judged:  # a new step's first forward
            self.updated, self.saved, self._judged = False, None, False
            self.forwards, self._modes = [], []
        if module.training and not all(self._modes):  # an evaluation ran before the step's forwards
            self.forwards = [f for f, m in zip(self.forwards, self._modes) if m]
            self._modes = [True] * len(self.forwards)
        self.forwards.append(Generators(host=self.keep_host))
        self._modes.append(module.training)

    def _on_rerun_forward(self, rerun: RerunTrace) -> None:
        """The re-run's i-th forward draws from the generators of the step's i-th forward."""
        i, rerun.forwards = rerun.forwards, rerun.forwards + 1
        if i >= len(self.forwards):
            return
        if i == 0 and not Generators(host=self.forwards[0].host_kept).same_as(self.forwards[0]):
            rerun.drew_before_forward = True
        self.forwards[i].restore()

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.updated = True

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._check or self.post_after_update is False:
            return
        grads = [p.grad for p in self.params if p.grad is not None and not p.grad.is_sparse]
        if grads and not finite(torch.stack([n.float() for n in torch._foreach_norm(grads)])):
            self.saved = [p.detach().clone() for p in self.params]

    @property
    def seen_forward(self) -> bool:
        """A forward of the model (or of its direct children) has been seen since installation."""
        return self._seen_forward

    @property
    def faithful(self) -> bool:
        """The weights a re-run gets are those of the step's forward."""
        return self._seen_forward and (not self.updated or self.saved is not None)

    def step_done(self) -> None:
        """post_step has judged the step: its copy is no longer needed; whether post_step came
        after the update is learnt (a loop keeps its order)."""
        self.saved = None
        if self._seen_forward:
            self.post_after_update = self.updated
            self._judged = True
        elif self._steps_unseen == 1:  # installed mid-step, then a whole step without the root's forward
            self._hook_children()
        self._steps_unseen += not self._seen_forward

    @contextlib.contextmanager
    def forward_state(self) -> Iterator[RerunTrace]:
        """Within it the weights and every random generator are those of the step's forwards;
        after it the weights and every generator are as they were before it."""
        current = None
        now = Generators()
        self.paused, self._rerun = True, RerunTrace()
        try:
            if self.saved is not None:
                with torch.no_grad():
                    current = [p.detach().clone() for p in self.params]
                    torch._foreach_copy_([p.data for p in self.params], self.saved)
            if self.forwards:
                self.forwards[0].restore()
            yield self._rerun
        finally:
            rerun = self._rerun
            if rerun is not None and not all(f.host_kept for f in self.forwards):
                rerun.drew_from_unkept_host = not Generators().same_host_as(now)
            self.paused, self._rerun = False, None
            if current is not None:
                with torch.no_grad():
                    torch._foreach_copy_([p.data for p in self.params], current)
            now.restore()

"""The forward of a compiled model, replayed eagerly for the mechanism probes (see compiled.py).

A compiled forward cannot run the capture's hooks and mode inside its graph. So a sampled step's
pre-hook only keeps the forward's inputs (`keep`: references; traced, a side effect of the
graph), and `run` replays the first sample eagerly under the capture, leaving no trace on
training: random generators and buffers are put back, the other probes are paused.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from .capture import ForwardCapture
from .compiled import (
    autocast_state,
    first_sample,
    has_batch_norm,
    loss_reads_compiled_output,
    replayed,
    warn_at_user_line,
)

__all__ = ["REPLAY_FAILURES", "ForwardReplay"]

#: A compiled model whose replay fails this many sampled steps in a row is no longer replayed.
REPLAY_FAILURES = 3


#: what every nn.Module holds in its own __dict__ (parameters, hook tables, flags): not the
#: Python state a user's forward may change
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _hook_owner(hook: Any) -> str:
    """The module a hook function comes from ("" when unknown)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None) or ""


def foreign_hook(model: nn.Module) -> str | None:
    """Where a forward (pre-)hook that is neither nummon's nor torch's own sits on `model` ("all
    modules" for a global one), or None: a replay would call it once more per sampled step."""
    from torch.nn.modules import module as _module

    def foreign(hooks: Any) -> bool:
        return any(not _hook_owner(h).startswith(("nummon.", "torch.")) for h in hooks.values())

    if foreign(_module._global_forward_hooks) or foreign(_module._global_forward_pre_hooks):
        return "all modules"
    for name, m in model.named_modules():
        if foreign(m._forward_hooks) or foreign(m._forward_pre_hooks):
            return name or "the model"
    return None


class PythonState:
    """The Python attributes of a model's modules (not parameters, buffers, submodules, hooks),
    as they are now: `restore()` puts back what a forward rebound, added, or changed in place in
    a list, dict, set or deque, and names it. (Nested containers and state outside the modules
    are beyond it: a forward found changing its modules is not replayed again.)"""

    def __init__(self, model: nn.Module) -> None:
        self._saved = []
        for name, m in model.named_modules():
            attrs = {k: (v, _copy(v)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
            self._saved.append((name, m, attrs))

    def restore(self) -> list[str]:
        """Put every module's attributes back; the ones that had changed, as `module.attribute`."""
        changed = []
        for name, m, attrs in self._saved:
            d = vars(m)
            keys = [k for k in d if k not in _MODULE_INTERNALS and k not in attrs]  # added by the forward
            for k in keys:
                del d[k]
            for k, (v, c) in attrs.items():
                if k not in d or d[k] is not v:  # rebound or deleted
                    d[k] = v
                    keys.append(k)
                elif c is not None and not _same_contents(v, c):  # changed in place
                    _put_back(v, c)
                    keys.append(k)
            changed += [f"{name}.{k}" if name else k for k in keys]
        return changed


def _copy(v: Any) -> Any:
    """A shallow copy of a container a forward may change in place; None for anything else."""
    if isinstance(v, (list, collections.deque)):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, set):
        return set(v)
    return None


def _same_contents(v: Any, c: Any) -> bool:
    """Same elements, by identity (a tensor's == is elementwise)."""
    if isinstance(v, dict):
        return v.keys() == c.keys() and all(v[k] is c[k] for k in c)
    if isinstance(v, set):
        return v == c
    return len(v) == len(c) and all(a is b for a, b in zip(v, c))


def _put_back(v: Any, c: Any) -> None:
    v.clear()
    if isinstance(v, (dict, set)):
        v.update(c)
    else:  # list, deque
        v.extend(c)


#: a replay's "samples" that keeps the whole batch (first_sample cuts nothing)
WHOLE_BATCH = sys.maxsize


def samples_to_replay(model: nn.Module) -> int:
    """How many samples a replay cuts from the batch's first dimension: one, two with batch norm
    (train mode needs two), the whole batch for a sequence-first model (a module with
    `batch_first=False`: nn.MultiheadAttention, nn.Transformer*, RNNs), whose first dimension is
    the sequence's; cutting it would replay one token (measured: attention entropy 0)."""
    if any(getattr(m, "batch_first", True) is False for m in model.modules()):
        return WHOLE_BATCH
    return 2 if has_batch_norm(model) else 1


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
        #: within it, the other probes record nothing (the collector pauses its activation probes)
        self.others_paused: Callable[[], AbstractContextManager] = contextlib.nullcontext
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

    def run(self, kept: tuple, loss: Any) -> None:
        """The kept forward again on its first sample (`samples_to_replay`), eagerly under the
        capture (after the optimizer step where `post_step` comes after it). A loss computed
        outside the model is not replayed: when it was the cross-entropy of the model's output,
        that output of the replay is measured as the logits."""
        cap = self.capture
        target = _replayable(self.model)
        hooked = foreign_hook(target)
        if hooked is not None:  # it would fire once more per sampled step; without it, another forward is measured
            self._give_up(f"the model has a forward hook of its own (on {hooked}), which a replay would call again")
            return
        self.running = True
        changed: list[str] = []
        try:
            if self._samples is None:
                self._samples = samples_to_replay(target)
            args, kwargs = first_sample(kept[0], kept[1], self._samples)
            state = PythonState(target)
            with replayed(self.model, kept[2]), self.others_paused():
                cap.begin()
                try:
                    out = target(*args, **kwargs)
                finally:
                    changed = state.restore()  # e.g. an MoE layer's list of auxiliary losses
                    cap.end()
                    cap.close()
                logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
                if (
                    not cap.out
                    and isinstance(logits, torch.Tensor)
                    and logits.is_floating_point()
                    and loss_reads_compiled_output(loss)
                ):
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
                    "as usual."
                )
        finally:
            self.running = False
        if changed:
            self._give_up(
                f"its forward changes Python state of its modules ({', '.join(changed[:3])}); this replay's "
                "change was undone, and a forward that changes state is not replayed again"
            )

    def _give_up(self, why: str) -> None:
        """No more replays of this model, said once."""
        self.failed = True
        self._kept = None
        warn_at_user_line(
            f"nummon: the compiled model's forward is not replayed for the mechanism probes: {why}. Its forward's "
            "mechanism probes (attention logits, output log Z, Linear output RMS) are off; gradients, parameters, "
            "activations and Adam's statistics are measured as usual."
        )

"""The plan of `ForwardCapture` (capture.py): where a model's attention, output-logit and
Linear calls happen, found on a *discovery* forward (the first sampled one and every
`PLAN_EVERY`-th after it), which runs under the capture's mode with global module hooks that
name the module running. The plan then lets the other sampled forwards hook just those modules.

A mixin, as `CaptureMaths` is: `ForwardCapture` inherits these methods, so moving them here adds
no call per hook.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.nn.modules import module as _module

from .._core.maths import spaced

__all__ = ["LINEAR_LIMIT", "RECENT_OUTPUTS", "SAME_VALUES", "CapturePlan", "PlanDiscovery"]

#: at most this many `nn.Linear` outputs are measured (evenly spaced in registration order)
LINEAR_LIMIT = 64
#: a discovery forward holds its last this many module outputs until the loss has been computed
RECENT_OUTPUTS = 4

# autograd nodes that move or cast values without computing new ones: logits that reach the
# loss through them are a module's output (HF's `.float()`, a shift by one token, a reshape)
SAME_VALUES = {
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "ToCopyBackward0",
    "CloneBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "SliceBackward0",
    "ExpandBackward0",
}


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or a linear layer by another name (GPT-2's `Conv1D` in transformers: x @ W + b)."""
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))


@dataclass
class CapturePlan:
    """Where a model's attention and output-logit calls happen, from a discovery forward."""

    attention: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # innermost module of each call
    mha: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # nn.MultiheadAttention: read from its inputs
    heads: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # modules whose output became logits
    linear: list[tuple[nn.Module, str]] = field(default_factory=list)
    tail: bool = False  # logits that no module output matched, after the forward: the mode on after it
    whole: bool = False  # a call no module holds within the forward: the mode on over every forward


class PlanDiscovery:
    """The discovery forward of `ForwardCapture`, and the names its mode-seen calls run in. The
    state annotated below is `ForwardCapture`'s; the discovery's own is set in `_init_discovery`."""

    model: nn.Module
    want_linear: bool
    plan: CapturePlan | None
    _in_forward: bool
    _hooks: list[Any]
    _stack: list[tuple[nn.Module, str]]  # the modules running (innermost last), as far as they are known

    def _init_discovery(self) -> None:
        self._discovering = False
        self._names: dict[int, tuple[nn.Module, str]] = {}  # id(module) -> (module, name)
        # output storage / autograd node -> (module, its last dim, the output, held weakly)
        self._outputs: dict[tuple[str, int], tuple] = {}
        self._linear_ids: set[int] = set()
        self._last_out: Any = None
        self._recent: deque = deque(maxlen=RECENT_OUTPUTS)  # the last module outputs, held

    def _enter_mode(self) -> None:
        raise NotImplementedError  # ForwardCapture's

    def _linear_out(self, name: str, _m: nn.Module, _inp: Any, out: Any) -> None:
        raise NotImplementedError  # ForwardCapture's

    def _discover(self) -> None:
        """This forward is a discovery one: global module hooks name the module running, the
        mode is on over all of it, and a new plan is made."""
        self._discovering = True
        self._names = {id(m): (m, n) for n, m in self.model.named_modules()}
        linear = [(m, n) for m, n in self._names.values() if _is_linear(m)] if self.want_linear else []
        self.plan = CapturePlan(linear=spaced(linear, LINEAR_LIMIT))
        self._linear_ids = {id(m) for m, _ in self.plan.linear}
        self._outputs = {}
        self._recent.clear()
        self._hooks = [
            _module.register_module_forward_pre_hook(self._push),
            _module.register_module_forward_hook(self._pop, always_call=True),
        ]
        self._enter_mode()

    def _finish_discovery(self) -> None:
        """The discovery's plan is complete (the loss was computed, usually after the forward)."""
        self._discovering = False
        self._names, self._outputs = {}, {}
        self._recent.clear()
        plan = self.plan
        assert plan is not None  # a discovery forward made it (`_discover`)
        for key, (mod, _name) in list(plan.attention.items()):
            if isinstance(mod, nn.MultiheadAttention) and type(mod).forward is nn.MultiheadAttention.forward:
                plan.mha[key] = plan.attention.pop(key)  # its logits come from its inputs: no mode needed

    def _push(self, mod: nn.Module, _inp: Any) -> None:
        hit = self._names.get(id(mod))
        if hit is not None:
            self._stack.append(hit)

    def _pop(self, mod: nn.Module, _inp: Any, out: Any) -> None:
        hit = self._names.get(id(mod))
        if hit is None:
            return
        if self._stack and self._stack[-1][0] is mod:
            self._stack.pop()
        if isinstance(out, torch.Tensor) and out.ndim and out.is_floating_point():
            if out is not self._last_out:  # (a parent returning its child's output is not its source)
                # the last few outputs held (the logits' module is usually the last before the
                # loss, and `model(x).reshape(...)` frees the output's Python object at once);
                # the others by storage and autograd node, held weakly: an id or an address is
                # only that output's while it lives (a freed output's storage can hold the logits)
                self._recent.append((hit, out.shape[-1], out))
                seen = (hit, out.shape[-1], weakref.ref(out))
                self._outputs[("storage", out.untyped_storage().data_ptr())] = seen
                if out.grad_fn is not None:
                    self._outputs[("node", id(out.grad_fn))] = seen
            self._last_out = out
            if id(mod) in self._linear_ids:
                self._linear_out(hit[1], mod, _inp, out)

    def _where(self) -> str:
        """The name of the module a mode-seen call ran in (the innermost one known); on a
        discovery forward, noted in the plan, or the plan marked `tail` / `whole` where none holds it."""
        if self._discovering:
            plan = self.plan
            assert plan is not None  # a discovery forward made it (`_discover`)
            if self._in_forward and self._stack:
                mod, name = self._stack[-1]
                plan.attention.setdefault(id(mod), (mod, name))
                return name
            if self._in_forward:
                plan.whole = True
            else:
                plan.tail = True
        return self._stack[-1][1] if self._stack else "attention"

    def _source(self, x: torch.Tensor) -> tuple[tuple[nn.Module, str], int] | None:
        """The module whose output `x` is, up to views, slices, copies and casts, and the size of
        that output's last dim (discovery)."""
        ptr = x.untyped_storage().data_ptr()
        nodes: list[Node] = []
        fn = x.grad_fn  # x's autograd node and those it moves or casts values from
        while fn is not None and len(nodes) < 6:
            nodes.append(fn)
            if type(fn).__name__ not in SAME_VALUES:
                break
            nxt = [f for f, _ in fn.next_functions if f is not None]
            fn = nxt[0] if len(nxt) == 1 else None
        for hit, last, out in reversed(self._recent):
            if out.untyped_storage().data_ptr() == ptr or any(out.grad_fn is f for f in nodes):
                return hit, last
        seen = self._outputs.get(("storage", ptr))
        if seen is not None:
            out = seen[2]()
            if out is not None and out.untyped_storage().data_ptr() == ptr:
                return seen[:2]
        for f in nodes:
            seen = self._outputs.get(("node", id(f)))
            if seen is not None:
                out = seen[2]()
                if out is not None and out.grad_fn is f:
                    return seen[:2]
        return None

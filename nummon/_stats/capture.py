"""What one sampled forward's attention, output-logit and Linear calls show, measured on the
device: the max pre-softmax logit and the mean normalised entropy per attention module, log Z
of the output logits, the output RMS of `nn.Linear` layers.

- attention: hand-written q·kᵀ -> softmax, `F.scaled_dot_product_attention` (the fused kernel
  never materialises the logits: they are recomputed from q and k on a bounded sample of
  queries) and `nn.MultiheadAttention`;
- output: log Z (log-sum-exp of the logits that go into cross-entropy / log_softmax), mean and
  max over the first `OUTPUT_BUDGET` logits' rows, and the largest output logit;
- per-layer output RMS of `nn.Linear` (and transformers' GPT-2 `Conv1D`) outputs: of the first
  `RMS_BUDGET` elements, for at most `LINEAR_LIMIT` layers, evenly spaced.

How, with no change to user code. A `TorchFunctionMode` sees the softmax / SDPA / MHA /
cross-entropy calls, but every torch call under a mode passes through Python (~10 µs each), so
it covers a whole forward only on a *discovery* forward: the first sampled one and every
`PLAN_EVERY`-th after it, with global module hooks that name the module running. It leaves a
`_Plan`: which modules compute attention, which module's output becomes the logits (matched by
size), the Linear layers to measure. Every other sampled forward hooks just those modules: the
mode is on only inside the attention modules, log Z is read from the head's output, and the
Linear outputs from their own forward hooks. What no module holds falls back to the mode: after
the forward (a loss computed from the model's output) or over the whole forward.

The measurements themselves (the attention logits and entropy, log Z) are `CaptureMaths`'s
(capture_maths.py), which `ForwardCapture` inherits.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import Node
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from .._core.maths import spaced
from .capture_maths import ENTROPY_BUDGET, OUTPUT_BUDGET, SDPA_QUERY_BUDGET, CaptureMaths

__all__ = [
    "ENTROPY_BUDGET",
    "LINEAR_LIMIT",
    "OUTPUT_BUDGET",
    "PLAN_EVERY",
    "RMS_BUDGET",
    "SAME_VALUES",
    "SDPA_QUERY_BUDGET",
    "ForwardCapture",
]

#: A Linear's output RMS is that of its first this many elements (the first tokens or samples).
RMS_BUDGET = 1 << 14
#: at most this many `nn.Linear` outputs are measured (evenly spaced in registration order)
LINEAR_LIMIT = 64
#: a discovery forward (the whole forward under the mode, the plan made again) every this many
#: sampled forwards: a model may grow or change the path its forward takes
PLAN_EVERY = 20
#: a discovery forward holds its last this many module outputs until the loss has been computed
RECENT_OUTPUTS = 4

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_SDPA = F.scaled_dot_product_attention
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


def _dim_of(args: tuple, kwargs: dict, default: int | None = None) -> int | None:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 and isinstance(args[1], int) else default


def _is_attention_scores(x: torch.Tensor, dim: int) -> bool:
    """A softmax over the last dim of (batch, heads, queries, keys) or (batch*heads, q, k) scores."""
    if not x.is_floating_point() or x.ndim < 3 or dim not in (-1, x.ndim - 1):
        return False
    return x.ndim >= 4 or x.shape[-1] == x.shape[-2]


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or a linear layer by another name (GPT-2's `Conv1D` in transformers: x @ W + b)."""
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))


class _Capture(TorchFunctionMode):
    """Sees the attention and output-logit calls made while it is on."""

    def __init__(self, capture: ForwardCapture) -> None:
        super().__init__()
        self.c = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        out = func(*args, **kwargs)
        try:
            if func is F.multi_head_attention_forward:  # its inner calls run with this mode off
                c._mha(args, kwargs)
            elif func in _SOFTMAX:
                x = args[0]
                dim = _dim_of(args, kwargs)
                if isinstance(x, torch.Tensor) and dim is not None and _is_attention_scores(x, dim):
                    c._attention(x)
            elif func is _SDPA:
                c._sdpa(args, kwargs)
            elif func is F.cross_entropy:
                x = args[0] if args else kwargs.get("input")
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    c._loss_logits(x, 1 if x.ndim >= 2 else 0)
            elif func in _LOG_SOFTMAX:
                x = args[0]
                dim = _dim_of(args, kwargs)
                if isinstance(x, torch.Tensor) and dim is not None and not _is_attention_scores(x, dim):
                    c._loss_logits(x, dim)
        except Exception:  # a probe must never break the user's forward
            c.errors += 1
        return out


@dataclass
class _Plan:
    """Where a model's attention and output-logit calls happen, from a discovery forward."""

    attention: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # innermost module of each call
    mha: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # nn.MultiheadAttention: read from its inputs
    heads: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)  # modules whose output became logits
    linear: list[tuple[nn.Module, str]] = field(default_factory=list)
    tail: bool = False  # logits that no module output matched, after the forward: the mode on after it
    whole: bool = False  # a call no module holds within the forward: the mode on over every forward


class ForwardCapture(CaptureMaths):
    """The device values one sampled forward leaves: `attn` (per module: (max logit, the
    first score slices) per call), `out` ((mean, max log Z, max logit) per call), `rms` (per Linear:
    (sum of squares, elements) per call). `begin()` / `end()` bracket the model's forward;
    `close()` leaves the mode before the optimizer step or when the step's values are taken."""

    def __init__(self, model: nn.Module, attention: bool, output: bool, linear: bool) -> None:
        self.model = model
        self.want_attention, self.want_output, self.want_linear = attention, output, linear
        self.errors = 0  # probe failures swallowed (never the user's problem)
        self.plan: _Plan | None = None
        self._until_plan = 0
        self._mode: _Capture | None = None
        self._thread = 0
        self._discovering = False
        self._in_forward = False
        self._hooks: list[Any] = []
        self._names: dict[int, tuple[nn.Module, str]] = {}  # discovery: id(module) -> (module, name)
        self._stack: list[tuple[nn.Module, str]] = []
        self._outputs: dict[
            tuple[str, int], tuple
        ] = {}  # discovery: output storage / autograd node -> (module, its last dim, the output)
        self._linear_ids: set[int] = set()
        self._last_out: Any = None
        self._recent: deque = deque(maxlen=RECENT_OUTPUTS)  # discovery: the last module outputs, held
        self._depth = 0  # attention modules entered (scoped forwards)
        self._resume: list[bool] = []  # per child of an attention module running: whether to re-enter the mode after it
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[str, tuple]] = []  # planned MHA calls: (name, _mha_qk's tuple)
        self.attn: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rms: dict[str, list[tuple[torch.Tensor, int]]] = {}

    # ------------------------------------------------------------------ the forward
    def begin(self) -> bool:
        """The model's sampled forward starts; True when it is a periodic discovery forward (one
        every `PLAN_EVERY`, not a `whole` plan's every time)."""
        self.close()  # a second forward before the optimizer step (gradient accumulation): the first's plan is complete
        self._thread = threading.get_ident()
        self._in_forward = True
        self._stack = []
        self._depth = 0
        self._resume = []
        # a call that no module holds leaves no cheaper way: such a model is discovered every time
        plan = self.plan
        periodic = plan is None or self._until_plan <= 0
        self._until_plan = PLAN_EVERY if periodic else self._until_plan - 1
        if plan is None or periodic or plan.whole:
            self._discover()
        else:
            self._scoped(plan)
        return periodic

    def _discover(self) -> None:
        self._discovering = True
        self._names = {id(m): (m, n) for n, m in self.model.named_modules()}
        linear = [(m, n) for m, n in self._names.values() if _is_linear(m)] if self.want_linear else []
        self.plan = _Plan(linear=spaced(linear, LINEAR_LIMIT))
        self._linear_ids = {id(m) for m, _ in self.plan.linear}
        self._outputs = {}
        self._recent.clear()
        self._hooks = [
            _module.register_module_forward_pre_hook(self._push),
            _module.register_module_forward_hook(self._pop, always_call=True),
        ]
        self._enter_mode()

    def _scoped(self, plan: _Plan) -> None:
        hooks = self._hooks
        for mod, name in plan.linear:
            hooks.append(mod.register_forward_hook(partial(self._linear_out, name)))
        if not plan.tail:
            for mod, _name in plan.heads.values():
                hooks.append(mod.register_forward_hook(self._head_out))
        # the mode is on while an attention module's own code runs (the softmax / SDPA call is
        # there), and off while its children run: their calls, and the hooks on them (the
        # activation probes, the Linear RMS), need not pass through Python
        for mod, name in plan.mha.values():
            hooks.append(mod.register_forward_pre_hook(partial(self._mha_in, name), with_kwargs=True))
        for mod, name in plan.attention.values():
            hooks.append(mod.register_forward_pre_hook(partial(self._attention_in, mod, name)))
            hooks.append(mod.register_forward_hook(partial(self._attention_out, mod), always_call=True, prepend=True))
            for child in mod.children():
                if id(child) not in plan.attention:
                    hooks.append(child.register_forward_pre_hook(self._child_in, prepend=True))
                    hooks.append(child.register_forward_hook(self._child_out, always_call=True))

    def end(self) -> None:
        """The model's forward ended (or raised)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._stack = []
        self._last_out = None
        self._in_forward = False
        if self._depth:  # an attention module that raised: its forward hook ran, but to be sure
            self._depth = 0
            self._leave_mode()
        if not self._discovering and self.plan is not None and self.plan.tail:
            self._enter_mode()  # the loss's logits, computed from the model's output

    def close(self) -> None:
        """Leave the mode (on the thread that entered it: modes are per thread); a discovery's
        plan is complete then (the loss was computed, usually after the forward)."""
        if threading.get_ident() != self._thread:
            return
        self._leave_mode()
        if self._discovering:
            self._discovering = False
            self._names, self._outputs = {}, {}
            self._recent.clear()
            plan = self.plan
            assert plan is not None  # a discovery forward made it (`_discover`)
            for key, (mod, _name) in list(plan.attention.items()):
                if isinstance(mod, nn.MultiheadAttention) and type(mod).forward is nn.MultiheadAttention.forward:
                    plan.mha[key] = plan.attention.pop(key)  # its logits come from its inputs: no mode needed

    def _enter_mode(self) -> None:
        if self._mode is None:
            self._mode = _Capture(self)
            self._mode.__enter__()

    def _leave_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except RuntimeError:  # closed from inside a torch call (a SIGTERM handler mid-forward):
                pass  # the mode is off the stack while its handler runs, and ends with it

    # ------------------------------------------------------------------ discovery hooks
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

    # ------------------------------------------------------------------ scoped hooks
    def _attention_in(self, mod: nn.Module, name: str, _m: nn.Module, _inp: Any) -> None:
        if threading.get_ident() != self._thread:  # a DataParallel replica's thread
            return
        self._stack.append((mod, name))
        self._depth += 1
        if self._depth == 1:
            self._enter_mode()

    def _attention_out(self, mod: nn.Module, _m: nn.Module, _inp: Any, _out: Any) -> None:
        if threading.get_ident() != self._thread or not self._depth:
            return
        if self._stack and self._stack[-1][0] is mod:
            self._stack.pop()
        self._depth -= 1
        if self._depth == 0:
            self._leave_mode()

    def _child_in(self, _m: nn.Module, _inp: Any) -> None:
        if threading.get_ident() == self._thread:
            self._resume.append(self._mode is not None)
            self._leave_mode()

    def _child_out(self, _m: nn.Module, _inp: Any, _out: Any) -> None:
        if threading.get_ident() == self._thread and self._resume and self._resume.pop() and self._depth:
            self._enter_mode()

    def _head_out(self, _m: nn.Module, _inp: Any, out: Any) -> None:
        if (
            isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and out.ndim
            and threading.get_ident() == self._thread
        ):
            try:
                self._output(out, -1)
            except Exception:  # a probe must never break the user's forward
                self.errors += 1

    def _linear_out(self, name: str, _m: nn.Module, _inp: Any, out: Any) -> None:
        if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel()):
            return
        try:  # the mean square of the output's first RMS_BUDGET elements (the first tokens); sqrt at take
            with torch.no_grad():
                o = out.detach().reshape(-1)[:RMS_BUDGET]
                ss = (
                    torch.dot(o, o)
                    if o.dtype == torch.float32
                    else torch.linalg.vector_norm(o, dtype=torch.float32).square()
                )
            self.rms.setdefault(name, []).append((ss, o.numel()))
        except Exception:  # a probe must never break the user's forward
            self.errors += 1

    # ------------------------------------------------------------------ what the mode saw
    def _where(self) -> str:
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

    def _loss_logits(self, logits: torch.Tensor, dim: int) -> None:
        """Logits that go into cross-entropy / log_softmax over `dim`: measured, and on a
        discovery forward matched with the module output they came from (by size)."""
        if not self.want_output or logits.numel() == 0:
            return
        plan = self.plan
        assert plan is not None  # set by the first `begin()`, which every measured forward follows
        if self._discovering:
            src = self._source(logits) if dim % logits.ndim == logits.ndim - 1 else None
            head = src[0] if src is not None and src[1] == logits.shape[dim] else None  # its last dim the classes
            if head is not None:
                plan.heads.setdefault(id(head[0]), head)
            elif self._in_forward:
                plan.whole = True
            else:
                plan.tail = True
        elif not plan.tail:
            return  # the head's forward hook measured these logits
        self._output(logits, dim)

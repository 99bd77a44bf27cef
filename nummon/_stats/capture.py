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
`CapturePlan`: which modules compute attention, which module's output becomes the logits (matched by
size), the Linear layers to measure. Every other sampled forward hooks just those modules: the
mode is on only inside the attention modules, log Z is read from the head's output, and the
Linear outputs from their own forward hooks. What no module holds falls back to the mode: after
the forward (a loss computed from the model's output) or over the whole forward.

The discovery forward and its plan are `PlanDiscovery`'s (capture_plan.py), the measurements
themselves (the attention logits and entropy, log Z) `CaptureMaths`'s (capture_maths.py):
`ForwardCapture` inherits both, and keeps the forward's bracketing, the mode and the hooks a
plan places.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .capture_maths import ENTROPY_BUDGET, OUTPUT_BUDGET, SDPA_QUERY_BUDGET, CaptureMaths
from .capture_plan import LINEAR_LIMIT, CapturePlan, PlanDiscovery

__all__ = [
    "ENTROPY_BUDGET",
    "LINEAR_LIMIT",
    "OUTPUT_BUDGET",
    "PLAN_EVERY",
    "RMS_BUDGET",
    "SDPA_QUERY_BUDGET",
    "ForwardCapture",
]

#: A Linear's output RMS is that of its first this many elements (the first tokens or samples).
RMS_BUDGET = 1 << 14
#: a discovery forward (the whole forward under the mode, the plan made again) every this many
#: sampled forwards: a model may grow or change the path its forward takes
PLAN_EVERY = 20

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_SDPA = F.scaled_dot_product_attention


def _dim_of(args: tuple, kwargs: dict, default: int | None = None) -> int | None:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 and isinstance(args[1], int) else default


def _is_attention_scores(x: torch.Tensor, dim: int) -> bool:
    """A softmax over the last dim of (batch, heads, queries, keys) or (batch*heads, q, k) scores."""
    if not x.is_floating_point() or x.ndim < 3 or dim not in (-1, x.ndim - 1):
        return False
    return x.ndim >= 4 or x.shape[-1] == x.shape[-2]


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


class ForwardCapture(PlanDiscovery, CaptureMaths):
    """The device values one sampled forward leaves: `attn` (per module: (max logit, the
    first score slices) per call), `out` ((mean, max log Z, max logit) per call), `rms` (per Linear:
    (sum of squares, elements) per call). `begin()` / `end()` bracket the model's forward;
    `close()` leaves the mode before the optimizer step or when the step's values are taken."""

    def __init__(self, model: nn.Module, attention: bool, output: bool, linear: bool) -> None:
        self.model = model
        self.want_attention, self.want_output, self.want_linear = attention, output, linear
        self.errors = 0  # probe failures swallowed (never the user's problem)
        self.plan: CapturePlan | None = None
        self._until_plan = 0
        self._mode: _Capture | None = None
        self._thread = 0
        self._in_forward = False
        self._hooks: list[Any] = []
        self._stack: list[tuple[nn.Module, str]] = []
        self._init_discovery()
        self._depth = 0  # attention modules entered (scoped forwards)
        self._resume: list[bool] = []  # per child of an attention module running: whether to re-enter the mode after it
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[str, tuple]] = []  # planned MHA calls: (name, _mha_qk's tuple)
        self.attn: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rms: dict[str, list[tuple[torch.Tensor, int]]] = {}

    # ------------------------------------------------------------------ the forward
    def begin(self) -> None:
        """The model's sampled forward starts: under the whole mode on a discovery forward (one
        every `PLAN_EVERY`, and every time for a `whole` plan), else with the plan's hooks."""
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

    def _scoped(self, plan: CapturePlan) -> None:
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
            self._finish_discovery()

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
        # grad mode off by its C switch (a `no_grad` block is ~6 Python calls, and this runs per Linear)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:  # the mean square of the output's first RMS_BUDGET elements (the first tokens); sqrt at take
            n = min(out.numel(), RMS_BUDGET)
            # those elements in memory order: one strided view of a contiguous output (not a view and a slice)
            o = out.as_strided((n,), (1,)) if out.is_contiguous() else out.reshape(-1)[:n]
            ss = (
                torch.dot(o, o)
                if o.dtype == torch.float32
                else torch.linalg.vector_norm(o, dtype=torch.float32).square()
            )
            self.rms.setdefault(name, []).append((ss, n))
        except Exception:  # a probe must never break the user's forward
            self.errors += 1
        finally:
            torch._C._set_grad_enabled(grad)

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

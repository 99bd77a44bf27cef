"""Activation probes: forward hooks writing a module's output (min, max) into a per-dtype buffer
on the device (one `aminmax`, no conversion, no host read).

A forward hook is a Python call per module per forward (~2 µs on CPU just to be called, 10-20 µs
with its body), so the activation maxima are measured on a cadence: the hooks are registered
only for the forwards that measure (every `activations_every` steps, the step after one whose
values rose well out of the band the detectors had declared quiet, and a run's first steps while the
detectors warm up; `arm`, from the cadence at the end of the step before) and removed after
them. A step that does not measure has no forward
hook at all, and its record no `activation_max` / `layer_activation_max`. This gives up the
activation maxima on every step (a runaway of `activation_max` is seen on every sampled step;
between samples the gradient norm, measured every step, sees the same blow-up) and naming the
first non-finite module on a non-finite step that was not sampled (named from the next step on,
when every module is hooked, or at once by forensics with `recompute=`). It keeps full detail
while the run is watched closely: every step, every watched module, while an incident is open,
after a non-finite value (for `DETAIL_AFTER_NONFINITE` steps) and when histograms want the outputs.

On a large model a measuring step hooks only the block boundaries: the outputs of the blocks of
its main stack (the children of the module with the most children holding watched modules, e.g.
a transformer's `blocks.3`, at most `BOUNDARY_LIMIT`, evenly spaced) and the watched modules
outside it (embeddings, final norm, head). Every watched module is hooked as well ("detail")
every `activations_all_every` steps and whenever the run is watched closely. A non-finite value
propagates along the stack, so the first non-finite boundary always shows it; with detail on,
the first non-finite module is named exactly. Models with at most `FULL_LIMIT` watched modules
are hooked in full on every measuring step. Outputs above `ACT_BUDGET` elements are read in
full only while detail is on (otherwise their first `ACT_BUDGET`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._core.maths import spaced
from .compiled import tracing
from .distributed import Reduce
from .dtypes import dtype_name, narrowest
from .kernels import absmax_rows
from .transport import Segment

__all__ = ["ACT_BUDGET", "ActivationProbes", "ActivationStep", "block_boundaries"]

_OUTPUT_DTYPES = {torch.float32, torch.bfloat16, torch.float16}  # buffers made at install

#: models with at most this many watched modules are hooked in full on every measuring step
FULL_LIMIT = 64
#: at most this many blocks of the main stack are hooked on every measuring step (evenly spaced)
BOUNDARY_LIMIT = 32
#: of a larger (contiguous) output only the first this many elements (the first sample or
#: samples of the batch) are read, except while detail is on: a value gone non-finite through
#: the weights shows in every sample, and the read is the hook's cost (on the demo CNN, hook
#: time per step 0.70 ms at 2^18, 0.48 ms at 2^15, 0.43 ms at 2^13: the rest is the hook's call)
ACT_BUDGET = 1 << 15


@dataclass(frozen=True)
class ActivationStep:
    """What the probes saw in one step: modules in execution order (none: the step did not
    measure), the buffer dtype each wrote to (None: not called), the narrowest output dtype, and
    which modules are hooked on every measuring step (`activation_max` is taken over those only,
    so it means the same on every measuring step)."""

    names: list[str]
    order: list[int]
    src: list[torch.dtype | None]
    dtype: str | None
    always: frozenset[int] | None = None  # None: every module is hooked on every measuring step


def _watched(model: nn.Module, exclude: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters (where a runaway shows; hooking every module costs more
    than it tells), minus the excluded name patterns, in registration order."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if n and any(True for _ in m.parameters(recurse=False)) and not any(fnmatch.fnmatchcase(n, p) for p in exclude)
    ]


def block_boundaries(model: nn.Module, watched: list[str], exclude: Sequence[str] = ()) -> list[str]:
    """The module names hooked on every measuring step of a large model: the blocks of its main stack and
    the watched modules outside it (each capped at `BOUNDARY_LIMIT`, evenly spaced)."""
    children: dict[str, dict[str, None]] = {}  # parent -> its children holding watched modules
    for w in watched:
        parts = w.split(".")
        for d in range(len(parts)):
            children.setdefault(".".join(parts[:d]), {})[".".join(parts[: d + 1])] = None
    stack = max(children, key=lambda p: len(children[p]))  # the first of the widest (shallowest)
    blocks = [b for b in children[stack] if not any(fnmatch.fnmatchcase(b, p) for p in exclude)]
    inside = tuple(b + "." for b in children[stack])
    outside = [w for w in watched if w not in children[stack] and not w.startswith(inside)]
    chosen = set(spaced(blocks, BOUNDARY_LIMIT)) | set(spaced(outside, BOUNDARY_LIMIT))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)


class ActivationProbes:
    """Forward hooks on the watched modules, registered only for the forwards that measure:
    the boundaries (all modules on a small model), the rest on demand ("detail")."""

    def __init__(self, exclude: Sequence[str] = (), traced: bool = False) -> None:
        self.exclude = tuple(exclude)
        self.names: list[str] = []
        self._modules: list[nn.Module] = []
        self._index: dict[int, int] = {}  # id(module) -> its index in `names`
        self._always: frozenset[int] | None = None  # None: every module on every measuring step
        self._hook_fns: list[Callable] = []  # per module, its hook (made once)
        self._hooks: list[Any] = []  # the measuring steps' hooks, while registered
        self._detail_hooks: list[Any] = []  # the other modules' hooks, while detail is on
        self.measuring = False  # the next forward measures: its hooks are registered
        # the hooks run inside a compiled graph (torch.compile): they cost no Python call there,
        # and dynamo ignores hooks added after it compiled (and recompiles when one is removed),
        # so they stay registered on every step
        self.traced = traced
        self.detail = False
        self._bufs: dict[torch.dtype, torch.Tensor] = {}  # per dtype, (modules, 2) min and max
        self._views: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._src: list[torch.dtype | None] = []  # the buffer each module wrote to this step
        self._order: list[int] = []
        self._dtype: str | None = None
        self._step_dtypes: set[torch.dtype] = set()  # the output dtypes seen this step
        self.paused = False  # forensics re-runs a forward that is not a training step
        self.want_tensors = False  # keep the outputs for histograms
        self.tensors: dict[str, torch.Tensor] = {}
        self._idle: ActivationStep | None = None  # `idle_step`'s, for the current modules

    def install(self, model: nn.Module) -> None:
        """Choose the modules (again when the model grew), and hook them when the next forward
        measures. Modules keep their index (new ones are appended), so a forward already
        observed this step still reads right."""
        self._unhook()
        watched = _watched(model, self.exclude)
        names = [n for n, _ in watched]
        chosen, bounds = watched, None
        if len(watched) > FULL_LIMIT:
            by_name = dict(model.named_modules())
            bounds = set(block_boundaries(model, names, self.exclude))
            wset = set(names)
            chosen = watched + [(b, by_name[b]) for b in sorted(bounds - wset)]  # blocks own no parameters
        known = set(self._index)
        for n, m in chosen:
            if id(m) not in known:
                self._index[id(m)] = len(self.names)
                self.names.append(n)
                self._modules.append(m)
                self._src.append(None)
                self._hook_fns.append(self._make_hook(len(self._hook_fns)))
        self._always = None if bounds is None else frozenset(self._index[id(m)] for n, m in chosen if n in bounds)
        self._views.clear()  # buffers sized for the new module count
        # made now for the float dtypes outputs come in, not in the first forward: on a compiled
        # model dynamo traces the hook, and a buffer made while tracing changed what it guards
        # on, recompiling the whole model at its second forward (HF GPT-2: twice the compile)
        device = next((p.device for p in model.parameters()), None)
        if device is not None and self._modules:
            params = {p.dtype for p in model.parameters() if p.is_floating_point()}
            for dtype in (torch.float32, torch.bfloat16, torch.float16, *sorted(params - _OUTPUT_DTYPES, key=str)):
                self._buffer_views(dtype, device)
        measuring, detail = self.measuring, self.detail
        self.measuring = self.detail = False
        self.arm(measuring, detail)

    def arm(self, measure: bool, detail: bool) -> None:
        """What the next forward measures: nothing (no hook registered: a registered hook costs
        its call), the boundaries (every module on a small model), or every module (`detail`,
        which implies `measure`). Registers or removes only what changes."""
        measure = measure or detail or self.traced
        if measure != self.measuring:
            self.measuring = measure
            if measure:
                fns = self._hook_fns
                self._hooks = [
                    m.register_forward_hook(fns[i])
                    for i, m in enumerate(self._modules)
                    if self._always is None or i in self._always
                ]
            else:
                for h in self._hooks:
                    h.remove()
                self._hooks = []
        self.set_detail(detail)

    def set_detail(self, on: bool) -> None:
        """Hook every watched module (on: measuring too) or only the boundaries (off) from the next forward."""
        if on and not self.measuring:
            self.arm(True, True)
            return
        if on == self.detail or self._always is None:
            self.detail = on
            return
        self.detail = on
        if on:
            fns = self._hook_fns
            self._detail_hooks = [
                m.register_forward_hook(fns[i]) for i, m in enumerate(self._modules) if i not in self._always
            ]
        else:
            for h in self._detail_hooks:
                h.remove()
            self._detail_hooks = []

    def _unhook(self) -> None:
        for h in self._hooks + self._detail_hooks:
            h.remove()
        self._hooks, self._detail_hooks = [], []

    def remove(self) -> None:
        """Remove every hook; nothing is measured until armed again."""
        self._unhook()
        self.measuring = self.detail = False

    def _make_hook(self, idx: int) -> Callable:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            if self.paused:
                return
            t = out
            if not isinstance(t, torch.Tensor):
                if not isinstance(out, (tuple, list)):
                    return
                t = next((o for o in out if isinstance(o, torch.Tensor)), None)
                if t is None:
                    return
            if not t.is_floating_point() or t.numel() == 0:
                return
            t = t.detach()
            if not self.detail and t.numel() > ACT_BUDGET and t.is_contiguous():
                t = t.view(-1)[:ACT_BUDGET]
            src = self._src[idx]
            if src is None:  # the first call of this module in this step
                dtype = t.dtype
                views = self._views.get(dtype)  # (inline: a Python call per hooked module saved)
                if views is None or views[0][0].device != t.device:
                    views = self._buffer_views(dtype, t.device)
                lo, hi = views[idx]
                # one kernel, no conversion: min and max of bf16/fp16 values are exact in their own dtype
                torch.aminmax(t, out=(lo, hi))
                self._src[idx] = dtype
                self._order.append(idx)
                if dtype not in self._step_dtypes:  # the narrowest output dtype: once per dtype and step
                    self._step_dtypes.add(dtype)
                    if tracing():  # (a side effect of the compiled graph)
                        self.traced = True
                    self._dtype = narrowest(self._dtype, dtype_name(dtype))
            else:  # a module called twice in one step (weight sharing, loops)
                lo, hi = self._buffer_views(src, t.device)[idx]
                mn, mx = torch.aminmax(t)
                torch.minimum(lo, mn.to(lo.dtype), out=lo)
                torch.maximum(hi, mx.to(hi.dtype), out=hi)
            if self.want_tensors:
                self.tensors[self.names[idx]] = t

        return hook

    def _buffer_views(self, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-module (min, max) 0-d views of a (modules, 2) buffer of this dtype, made once:
        on a GPU every per-call tensor op is a launch to pay for."""
        views = self._views.get(dtype)
        if views is None or views[0][0].device != device:  # first forward, the model moved or grew
            buf = self._bufs[dtype] = torch.zeros(len(self.names), 2, dtype=dtype, device=device)
            views = self._views[dtype] = [(buf[i, 0], buf[i, 1]) for i in range(len(self.names))]
        return views

    def idle_step(self) -> ActivationStep | None:
        """What `take` would return when no hook measured since the last one (it would then reset
        nothing), made once per set of modules; None when a hook measured (call `take`)."""
        if self._order:
            return None
        idle = self._idle
        if (
            idle is None
            or idle.names is not self.names
            or len(idle.src) != len(self.names)
            or idle.always is not self._always
        ):
            idle = self._idle = ActivationStep(self.names, [], [None] * len(self.names), None, self._always)
        return idle

    def take(self, distributed: bool) -> tuple[ActivationStep, list[Segment]]:
        """This step's observations and their segments; resets for the next forward (its hooks
        stay until the cadence arms the next one, at the end of the same launch: removed unless
        it measures too).

        Under torch.distributed every rank packs every module's slot (detail is decided alike
        on every rank; a module not called reads as NaN-free zeros)."""
        step = ActivationStep(self.names, self._order, self._src, self._dtype, self._always)
        self._order, self._src, self._dtype = [], [None] * len(self.names), None
        self._step_dtypes = set()
        segments = []
        for dtype in filter(None, set(step.src)):  # (no comprehension: a Python call a step)
            buf = self._bufs[dtype]
            if distributed:  # ranks combine maxima; a (min, max) pair would need two rules
                segments.append(Segment(f"act_max:{dtype}", absmax_rows(buf), Reduce.MAX))
            else:
                segments.append(Segment(f"act_minmax:{dtype}", buf.view(-1), Reduce.LOCAL))
        return step, segments

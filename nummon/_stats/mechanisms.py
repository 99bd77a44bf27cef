"""Sampled mechanism probes: what comes before a transformer's loss spike, measured on the device
on sampled steps only and packed into the step's one device->host copy.

- the forward (`capture.py`): max attention logit and entropy per attention module, output
  log Z and the largest output logit, per-layer Linear output RMS;
- the optimizer (`adam_stats.py`): per tensor RMS(g / sqrt(v_hat)), the fraction of |g| below
  eps, ||update|| / ||param||;
- per-sample losses: the max/mean ratio and the worst samples (`per_sample`).

A forward pre-hook on the model starts the capture on an armed step only (unarmed steps pay one
flag test); its forward hook ends the forward's part; the capture's mode is left before
`optimizer.step()` (its per-tensor loop would otherwise pass through Python) or at `take`,
whichever comes first: the loss is usually computed after the forward. Everything computed here
is detached and under no_grad.

A compiled model (compiled.py, replay.py) cannot run the capture inside its graph: there the pre-hook
only keeps the armed forward's inputs, and `take` replays the first sample eagerly under the
capture, leaving no trace (random generators, buffers, activation probes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adam_stats import AdamStatistics
from .capture import ForwardCapture
from .capture_maths import index_tensor, owner_index
from .compiled import can_replay, has_compiled_parts, tracing, warn_at_user_line
from .distributed import Reduce
from .eager_replay import ForwardReplay
from .transport import Segment

__all__ = ["MechanismProbes", "MechanismStep", "StepHooks", "TOP_SAMPLES"]

#: Per-sample losses: indices of this many worst samples go into the record.
TOP_SAMPLES = 5


@dataclass
class MechanismStep:
    """The names behind one step's packed mechanism segments (host side)."""

    attention: list[str] = field(default_factory=list)
    adam: list[str] = field(default_factory=list)
    linear: list[str] = field(default_factory=list)
    output: bool = False
    samples: int = 0  # per-sample losses: top indices packed
    adam_elements: float = 0.0  # gradient elements the |g| < eps counts are out of
    adam_bound: float = 0.0  # sqrt((1 - beta2^t) / (1 - beta2)): the ratio's bound at this step


class MechanismProbes:
    """The sampled probes of one model and optimizer; `arm(True)` before a forward to sample it."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: Any,
        adam: bool = True,
        attention: bool = True,
        output: bool = True,
        linear_rms: bool = True,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.forward_off = False  # the forward's probes: off on a compiled model torch cannot run eagerly
        self._traced = False  # a forward hook of ours ran inside torch.compile's tracing
        self.optimizer = optimizer
        self.armed = False
        self.paused = False
        self._errors = 0  # probe failures swallowed (never the user's problem)
        self._in_forward = False
        self._samples: torch.Tensor | None = None
        self.capture = ForwardCapture(model, attention, output, linear_rms) if model is not None else None
        # a compiled model's forward is replayed (replay.py)
        self.replay = ForwardReplay(model, self.capture) if model is not None and self.capture is not None else None
        if compiled and (attention or output or linear_rms):
            self._compiled()
        self.adam = AdamStatistics(optimizer, self._param_names) if adam and optimizer is not None else None
        # whether optimizer.step() ran since the model's last forward: post_step after the step (a
        # plain loop) or before it (the Lightning and HF callbacks) sees the state after or before
        # v's update (without a model forward to see: since the last take)
        self._stepped = False
        self._steps_seen = 0  # optimizer steps since attaching (a host count: no device read)
        self._step_hooks = StepHooks(self, model is not None and (attention or output or linear_rms))
        self.arm(False)

    @property
    def errors(self) -> int:
        """Probe failures swallowed so far (never the user's problem)."""
        return (
            self._errors
            + (self.capture.errors if self.capture is not None else 0)
            + (self.replay.errors if self.replay is not None else 0)
        )

    def _before_step(self, *_: Any) -> None:
        if (
            self.capture is not None
        ):  # the loss and backward are done: Adam's per-tensor loop need not pass through Python
            self.capture.close()

    def _after_step(self, *_: Any) -> None:
        self._stepped = True
        self._steps_seen += 1

    def arm(self, on: bool) -> None:
        """Sample (or not) the next forward and optimizer step: the hooks are registered for it
        (and taken off after an armed step), unless they are kept for good (`StepHooks`)."""
        self.armed = bool(on)
        hooks = self._step_hooks
        if on or hooks.kept or self._traced or self.forward_off or (self.replay is not None and self.replay.active):
            hooks.on()
        elif hooks.registered:
            hooks.off()

    def _enter(self, _mod: nn.Module, args: tuple, kwargs: dict) -> None:
        model, capture, replay = self.model, self.capture, self.replay
        assert model is not None and capture is not None and replay is not None  # hooked on the model: made with it
        if replay.running:
            return
        if tracing() or replay.active:  # compiled: keep the inputs (traced, this is a side effect of the graph)
            if tracing():
                self._traced = True
            self._stepped = False
            if self.armed and not self.paused and not self.forward_off:
                replay.keep(args, kwargs)
            return
        if self._in_forward:  # a nested call of the model itself
            return
        self._in_forward = True
        self._stepped = False  # the step's forward: an optimizer.step() from now on is this step's
        if self.armed and not self.paused and not self.forward_off:
            if has_compiled_parts(model):  # compiled in place since (a walk: sampled forwards only)
                self._in_forward = False
                self._compiled()
                self._enter(_mod, args, kwargs)
            else:
                capture.begin()

    def _compiled(self) -> None:
        """The model is (now) compiled: its forward is replayed, or where torch cannot, left alone."""
        if can_replay() and self.replay is not None:
            self.replay.active = True
            return
        self.forward_off = True
        warn_at_user_line(
            "nummon: the model is compiled (torch.compile), and this torch cannot run it eagerly (torch.compiler."
            "set_stance, torch 2.6+), so the forward's mechanism probes (attention logits, output log Z, Linear output "
            "RMS) are off. Gradients, parameters, activations and Adam's statistics are measured as usual."
        )

    def _leave(self, _mod: nn.Module | None, _inp: Any, _out: Any) -> None:
        capture, replay = self.capture, self.replay
        assert capture is not None and replay is not None  # hooked on the model (or `remove`): made with it
        if tracing() or replay.running:
            return
        if self._in_forward:
            self._in_forward = False
            capture.end()

    # ------------------------------------------------------------------ per-sample losses
    @torch.no_grad()
    def per_sample(self, losses: Any) -> None:
        """Max/mean ratio and the worst samples of this step's per-sample losses (any shape: flattened)."""
        t = losses.detach() if isinstance(losses, torch.Tensor) else torch.as_tensor(losses)
        t = t.reshape(-1).double()
        if t.numel() == 0:
            self._samples = None
            return
        k = min(TOP_SAMPLES, t.numel())
        top = torch.topk(t, k).indices.double()
        ratio = (t.max() / t.mean()).reshape(1)
        self._samples = torch.cat([ratio, top])

    # ------------------------------------------------------------------ the step
    @property
    def idle(self) -> bool:
        """Nothing was hooked and no per-sample loss came since the last `take`: it would take or
        reset nothing."""
        return not self._step_hooks.registered and self._samples is None

    def take(
        self, distributed: bool, loss: Any = None, clip_scale: Callable[[], torch.Tensor | None] | None = None
    ) -> tuple[MechanismStep, list[Segment]]:
        """This step's segments (empty when it was not sampled); resets for the next step.
        `loss`: the step's loss, as `post_step` got it; `clip_scale`: gives the factor the loop's
        clipping will scale today's gradients by before the optimizer step (None: no clipping)."""
        if self.idle:
            return MechanismStep(), []
        replay = self.replay
        if self._traced and replay is not None and not replay.active and not self.forward_off:
            self._compiled()
        kept = replay.take() if replay is not None else None
        if self.capture is not None:
            self.capture.close()
        ms, segs = MechanismStep(), []
        if self._samples is not None:
            segs.append(Segment("mech_samples", self._samples, Reduce.LOCAL))
            ms.samples = self._samples.numel() - 1
            self._samples = None
        cap = self.capture
        if not self.armed or self.paused:
            if cap is not None:
                cap.reset()
            return ms, segs
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # (no_grad by its C switch: a `no_grad` block is ~6 Python calls)
        try:
            if cap is not None:
                if kept is not None and replay is not None and replay.active and not replay.failed:
                    replay.run(kept, loss)
                segs += self._forward_segments(cap, ms)
                cap.reset()
            if self.adam is not None:
                try:
                    names, adam_segs, elements, bound = self.adam.measure(self._stepped, self._steps_seen, clip_scale)
                except Exception:  # a probe must never break the user's step (e.g. a group across devices)
                    self._errors += 1
                    names, adam_segs, elements, bound = [], [], 0.0, 0.0
                if names:
                    ms.adam, ms.adam_elements, ms.adam_bound = names, elements, bound
                    segs += adam_segs
        finally:
            torch._C._set_grad_enabled(grad)
        if not self._step_hooks.forward:
            self._stepped = False
        return ms, segs

    @staticmethod
    def _forward_segments(cap: ForwardCapture, ms: MechanismStep) -> list[Segment]:
        """The forward's device values as segments; `ms` gets their names."""
        segs = []
        attn = cap.attention_values()
        if attn is not None:
            ms.attention, mx, ent = attn
            segs += [Segment("mech_attn_max", mx, Reduce.MAX), Segment("mech_attn_entropy", ent, Reduce.MEAN)]
        if cap.out:
            ms.output = True
            if len(cap.out) == 1:  # one output call (the usual): its values as they are (no stack, mean, max)
                o = cap.out[0]
                mean, mx, lmax = o[0].reshape(1), o[1].reshape(1), o[2].reshape(1)
            else:
                mean = torch.stack([o[0] for o in cap.out]).mean().reshape(1)
                mx = torch.stack([o[1] for o in cap.out]).amax().reshape(1)
                lmax = torch.stack([o[2] for o in cap.out]).amax().reshape(1)
            segs += [
                Segment("mech_lse_mean", mean, Reduce.MEAN),
                Segment("mech_lse_max", mx, Reduce.MAX),
                Segment("mech_logit_max", lmax, Reduce.MAX),
            ]
        if cap.rms:  # per module its largest RMS over the calls of this step
            ms.linear = list(cap.rms)
            calls = [c for cs in cap.rms.values() for c in cs]
            ss = torch.stack([c[0] for c in calls])
            # (the elements per call repeat from step to step: their tensor is made once)
            rms = (ss / index_tensor(tuple([float(c[1]) for c in calls]), ss.device, torch.float32)).sqrt()
            if len(calls) > len(ms.linear):  # a module called more than once (weight sharing)
                owner = owner_index(tuple([len(cs) for cs in cap.rms.values()]), ss.device)
                rms = torch.full((len(ms.linear),), -math.inf, device=ss.device).scatter_reduce(0, owner, rms, "amax")
            segs.append(Segment("mech_linear_rms", rms, Reduce.MAX))
        return segs

    def _param_names(self) -> dict[int, str]:
        if self.model is None:
            return {}
        return {id(p): n for n, p in self.model.named_parameters()}

    def remove(self) -> None:
        if self.capture is not None:
            self._leave(None, None, None)
            self.capture.close()
        self._step_hooks.off()


class StepHooks:
    """The probes' hooks on the model's forward, the optimizer's step and Adam's gradient: on
    while a step is armed only (each is a Python call per forward or step), for good once the
    model is compiled (adding or removing a hook changes what torch.compile traced) or where the
    optimizer keeps its step count on the device (`_steps_seen` must see every step)."""

    def __init__(self, probes: MechanismProbes, forward: bool) -> None:
        self.probes = probes
        self.forward = forward  # the model's forward is hooked (a forward probe is on)
        opt = probes.optimizer
        self.kept = any(g.get("fused") or g.get("capturable") for g in getattr(opt, "param_groups", ()))
        self.handles: list[Any] = []
        self.registered = False
        if probes.adam is not None:  # (it hooks itself when made: from here on, on and off with these)
            probes.adam.remove()

    def on(self) -> None:
        if self.registered:
            return
        p, opt, model = self.probes, self.probes.optimizer, self.probes.model
        if opt is not None and hasattr(opt, "register_step_post_hook"):
            self.handles += [opt.register_step_pre_hook(p._before_step), opt.register_step_post_hook(p._after_step)]
        if self.forward and model is not None:
            self.handles += [
                model.register_forward_pre_hook(p._enter, with_kwargs=True),
                model.register_forward_hook(p._leave, always_call=True),
            ]
        if p.adam is not None:
            p.adam.watch()
        self.registered = True

    def off(self) -> None:
        if not self.registered:
            return
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.probes.adam is not None:
            self.probes.adam.remove()
        self.registered = False

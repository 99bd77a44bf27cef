"""Hardware or algorithm? Re-run a failing step and say whether its failure repeats.

A step that went non-finite (or raised a critical alert) is re-run on the same batch with the
weights of its forward and every random generator (torch's CPU and CUDA ones, Python's `random`,
NumPy's global state) as each of its forwards found them, and compared with what the step produced:

- ``reproducible``: the same inputs fail again (bitwise the same loss, or within `LOSS_RTOL`):
  the data or the optimisation (a poisoned batch, an LR too high); the batch is named.
- ``not_reproducible``: the re-run is finite, or its loss differs: a transient fault on this
  process (hardware, memory, a nondeterministic kernel); rank, host and device are named.
- no verdict, with the reason, when the re-run was not the step's computation: it ran the model's
  forward another number of times than the step (a recompute of one micro-batch of an accumulated
  step: `MicroBatches` re-runs them all), or drew random numbers before its first forward.

Every generator is put back after the re-run, so training goes on as it would have without it.

The documented loop calls `post_step` after `optimizer.step()`, and a non-finite update has
written NaN into a plain SGD model's weights by then. `ForwardState` therefore looks at the
gradients in an optimizer step pre-hook (before the update) and, only when one is non-finite,
keeps a copy of the weights the forward used; the re-run swaps them in and puts the current
ones back. It is installed at the first `post_step` given a `recompute` (a loop without one pays
nothing). A healthy step then costs two hook calls and, only where `post_step` comes after the
update (the documented loop; the callbacks call it before), one finiteness check of the gradients
(one fused norm and a host read, free on CPU); and one copy of the generators' states per forward.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import NummonError
from .._stats.compiled import untraced
from ._explain import _leaves, _loss_tensors
from ._rng import Generators
from ._scope import ModuleScope

__all__ = [
    "LOSS_RTOL",
    "REPRODUCIBLE",
    "NOT_REPRODUCIBLE",
    "ForwardState",
    "MicroBatches",
    "NoVerdict",
    "Verdict",
    "gather_verdict",
    "rerun_verdict",
]

REPRODUCIBLE = "reproducible"
NOT_REPRODUCIBLE = "not_reproducible"
#: a re-run loss within this relative distance of the step's is the same result (nondeterministic
#: reductions in float32 differ by a few ulps, 1e-7 relative; a fault changes far more)
LOSS_RTOL = 1e-5


def _finite(t: torch.Tensor) -> bool:
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
        if grads and not _finite(torch.stack([n.float() for n in torch._foreach_norm(grads)])):
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


class MicroBatches:
    """The `recompute` of an optimizer step made of several micro-batches (gradient accumulation),
    for `Monitor.post_step(..., recompute=MicroBatches([...]))`: each function returns one
    micro-batch's loss, in the step's order. The step's loss is their mean, or with `share` their
    sum (each already its share of the step's loss, times `scale`); the re-run accumulates their
    gradients as the step did (each loss times 1/count, or times `scale` with `share`).

    A re-run of fewer micro-batches than the step ran gives no verdict: it is not the step's
    computation."""

    def __init__(self, parts: Sequence[Callable[[], Any]], share: bool = False, scale: float = 1.0) -> None:
        parts = list(parts)
        if not parts or not all(callable(p) for p in parts):
            raise NummonError("MicroBatches needs one or more functions, each returning a micro-batch's loss")
        self.parts, self.share, self.scale = parts, share, scale

    @property
    def weight(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward."""
        return self.scale if self.share else 1.0 / len(self.parts)

    def combine(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The step's loss from the micro-batches' (detached, float32) losses."""
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total if self.share else total / len(values)

    def __call__(self) -> Any:
        """The whole step's loss as one differentiable tensor (the explanation's re-run)."""
        losses = [_loss_tensors(part())[0] for part in self.parts]
        total = losses[0] * self.weight
        for loss in losses[1:]:
            total = total + loss * self.weight
        return total


@dataclass(frozen=True)
class Verdict:
    """The outcome of one re-run. `grads` (not serialised): the re-run's gradients of the
    optimizer's parameters, for a retry of the update (None where unused)."""

    verdict: str
    step_loss: float
    rerun_loss: float
    rerun_finite: bool
    bitwise: bool
    rank: int
    host: str
    device: str
    batch: str | None = None
    grads: list[torch.Tensor | None] | None = field(default=None, repr=False, compare=False)

    @property
    def reproducible(self) -> bool:
        return self.verdict == REPRODUCIBLE

    def where(self) -> str:
        return f"rank {self.rank}, host {self.host}, device {self.device}"

    def sentence(self) -> str:
        """The words that go into the alert's message."""
        if self.reproducible:
            same = "bitwise" if self.bitwise else f"within rtol {LOSS_RTOL:g}"
            batch = f" (batch {self.batch})" if self.batch else ""
            return (
                f"verdict: reproducible: re-run on the same weights and batch{batch} it fails again "
                f"(loss {self.rerun_loss:.6g}, {same}): the data or the optimisation, not the machine"
            )
        return (
            f"verdict: not reproducible: re-run on the same weights and batch it gives loss {self.rerun_loss:.6g} "
            f"({'finite' if self.rerun_finite else 'different'}; the step gave {self.step_loss:.6g}): a transient "
            f"fault on {self.where()} (hardware, memory or a nondeterministic kernel)"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "verdict": self.verdict,
            "step_loss": self.step_loss,
            "rerun_loss": self.rerun_loss,
            "rerun_finite": self.rerun_finite,
            "bitwise": self.bitwise,
            "rank": self.rank,
            "host": self.host,
            "device": self.device,
        }
        if self.batch:
            d["batch_fingerprint"] = self.batch
        return d


def _as_float(loss: Any) -> float:
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().reshape(-1)[0].double())
    return float(loss)


def _same(a: float, b: float) -> tuple[bool, bool]:
    """(same result, bitwise equal): NaN equals NaN and an inf its own sign here."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b), math.isnan(a) and math.isnan(b)
    if a == b:
        return True, True
    if not (math.isfinite(a) and math.isfinite(b)):
        return False, False
    return abs(a - b) <= LOSS_RTOL * max(abs(a), abs(b)), False


def _device_name(params: list[torch.Tensor]) -> str:
    if not params:
        return "cpu"
    dev = params[0].device
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(dev)


def _rerun_part(
    fn: Callable[[], Any], params: list[torch.Tensor], weight: float
) -> tuple[torch.Tensor, bool, list[Any]]:
    """(loss, loss and gradients all finite, gradients of `params` of `weight` x the loss) of one
    call of `fn`."""
    losses = _loss_tensors(fn())
    if not losses:
        raise ValueError("recompute returned no floating tensor")
    finite = all(_finite(t) for t in losses)
    outputs = [t for t in losses if t.requires_grad]
    grads: list[Any] = [None] * len(params)
    if outputs:
        wanted = [p for p in params if p.requires_grad]
        reachable = set(map(id, _leaves(outputs)))
        targets = [p for p in wanted if id(p) in reachable]
        if targets:
            seeds = [torch.full_like(t, weight) for t in outputs]
            got = torch.autograd.grad(outputs, targets, grad_outputs=seeds, allow_unused=True)
            by_id = {id(p): g for p, g in zip(targets, got)}
            grads = [by_id.get(id(p)) for p in params]
            finite = finite and all(_finite(g) for g in got if g is not None)
    return losses[0].detach(), finite, grads


def _add(total: list[Any], grads: list[Any]) -> list[Any]:
    return [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]


def rerun_once(recompute: Callable[[], Any], params: list[torch.Tensor]) -> tuple[float, bool, list[Any]]:
    """(loss, loss and gradients all finite, gradients of `params`) of one re-run of the step
    (every micro-batch of a `MicroBatches`, the gradients accumulated as the step's were),
    leaving buffers (BatchNorm's running statistics) and every `.grad` as they were."""
    scope = ModuleScope()
    scope.install()
    try:
        with torch.enable_grad():
            if not isinstance(recompute, MicroBatches):
                loss, finite, grads = _rerun_part(recompute, params, 1.0)
                return _as_float(loss), finite, grads
            values, finite, grads = [], True, [None] * len(params)
            for part in recompute.parts:
                loss, ok, got = _rerun_part(part, params, recompute.weight)
                values.append(
                    loss.float().reshape(()) * recompute.scale if recompute.share else loss.float().reshape(())
                )
                finite, grads = finite and ok, _add(grads, got)
            return _as_float(recompute.combine(values)), finite, grads
    finally:
        scope.remove()
        scope.restore_buffers()


def step_failed(rec: Any) -> bool:
    """The step's own result was non-finite (its loss, gradients, activations or inputs)."""
    return bool(set(rec.nonfinite_parts) & {"loss", "gradients", "activations", "input"})


def rerun_verdict(
    recompute: Callable[[], Any],
    rec: Any,
    step_loss: Any,
    evidence: ForwardState,
    rank: int,
) -> Verdict:
    """Re-run the step (in the weights and RNG state of its forwards) and compare; raises
    `NoVerdict` when the re-run was not the step's computation (another number of forwards,
    random numbers drawn before the forward)."""
    with evidence.forward_state() as trace:
        loss, finite, grads = rerun_once(recompute, evidence.params)
    why = trace.unfaithful(len(evidence.forwards))
    if why is not None:
        raise NoVerdict(why)
    own = _as_float(step_loss)
    same, bitwise = _same(own, loss)
    if step_failed(rec):
        verdict = REPRODUCIBLE if not finite else NOT_REPRODUCIBLE
    else:  # a critical but finite step: the loss itself must come out again
        verdict = REPRODUCIBLE if same else NOT_REPRODUCIBLE
    return Verdict(
        verdict=verdict,
        step_loss=own,
        rerun_loss=loss,
        rerun_finite=finite,
        bitwise=bitwise,
        rank=rank,
        host=socket.gethostname(),
        device=_device_name(evidence.params),
        batch=rec.fingerprint,
        grads=grads if finite else None,
    )


def gather_verdict(
    recompute: Callable[[], Any], rec: Any, step_loss: Any, evidence: ForwardState, rank: int, current: bool
) -> tuple[Verdict | None, str | None]:
    """(the verdict, None) of re-running the step, or (None, why no verdict could be given);
    `current`: the record is of the step `recompute` re-runs. Never raises (a re-run must not
    break training)."""
    import logging

    if not current:  # lagged mode: the recompute given is the next step's
        return None, "the step was read a step late (lagged mode): its batch is gone"
    if not evidence.seen_forward:
        return None, (
            "no forward of the model was seen in this step (nummon began watching during it, or the loop "
            "calls only the model's submodules: they are watched from the next step on)"
        )
    if not evidence.faithful:
        return None, (
            "the update was applied before post_step with finite gradients, so the weights of the step's "
            "forward are gone (call post_step before optimizer.step, as the callbacks do)"
        )
    try:
        return rerun_verdict(recompute, rec, step_loss, evidence, rank), None
    except NoVerdict as e:
        return None, str(e)
    except Exception as e:  # forensics must never break training
        logging.getLogger("nummon").warning(
            "nummon: could not re-run the step for a verdict (%s: %s)", type(e).__name__, e
        )
        return None, f"the re-run raised {type(e).__name__}"

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

The state the re-run needs from the step (weights, generators) is kept by `ForwardState`
(forward_state.py).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.errors import NummonError
from ._explain import _leaves, _loss_tensors
from ._scope import ModuleScope
from .forward_state import ForwardState, NoVerdict
from .forward_state import finite as all_finite

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
    finite = all(all_finite(t) for t in losses)
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
            finite = finite and all(all_finite(g) for g in got if g is not None)
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

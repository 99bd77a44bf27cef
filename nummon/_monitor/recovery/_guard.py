"""The pre-step gradient guard: wraps `optimizer.step` and skips a poisoned update.

Like `torch.amp.GradScaler.step`, which does not call `optimizer.step()` when it finds inf: at
`step()` time the total L2 norm of the gradients just computed is reduced on the device (one fused
`torch._foreach_norm` per device) and read on the host once. A non-finite norm, or one far above
its robust recent range (log10 median + k * 1.4826 * MAD over the last accepted steps, as OLMo and
Megatron skip), skips the update: the wrapped `step` is not called, so parameters and optimizer
state are untouched, and the gradients are zeroed.
"""

from __future__ import annotations

import math
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..._core.maths import robust_center
from ..._policy.runtime import RecoveryPolicy
from ..._stats.distributed import local_tensor

__all__ = ["GradientGuard", "SkipDecision"]


@dataclass(frozen=True)
class SkipDecision:
    """Why one update was skipped: the total grad norm and the limit it broke (None: non-finite)."""

    step: int
    grad_norm: float
    limit: float | None
    median: float | None

    @property
    def nonfinite(self) -> bool:
        return not math.isfinite(self.grad_norm)

    @property
    def reason(self) -> str:
        if self.nonfinite:
            return f"non-finite gradient (total grad norm {self.grad_norm})"
        assert self.median is not None and self.limit is not None  # a finite norm is skipped only past a limit
        return (
            f"total grad norm {self.grad_norm:.4g} is {self.grad_norm / self.median:.3g}x its recent median "
            f"{self.median:.4g} (limit {self.limit:.4g})"
        )


class GradientGuard:
    """Installed on one optimizer instance; `skips` holds the decisions not yet reported.

    `step_of()` gives the step the update belongs to (the Monitor's next post_step). `process_group`
    (a DistributedReducer's group, or None): the norm and the non-finite flag are maxed over ranks,
    so every rank skips the same steps.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, policy: RecoveryPolicy, step_of: Callable[[], int], dist: Any = None
    ) -> None:
        self.optimizer = optimizer
        self.policy = policy
        self.step_of = step_of
        self.dist = dist
        self.history: deque[tuple[int, float]] = deque(maxlen=policy.guard_window)  # (step, log10 norm)
        self.skips: dict[int, SkipDecision] = {}
        self.checked = 0
        had_own = "step" in vars(optimizer)  # e.g. an LR scheduler's wrapper on the instance
        self._inner = optimizer.step
        self._restore = self._inner if had_own else None
        guard = self

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return guard._guarded(*args, **kwargs)

        # a bound method of the optimizer: LR schedulers re-wrap `opt.step` through `__func__`
        self._installed = types.MethodType(step, optimizer)
        optimizer.step = self._installed  # type: ignore[method-assign]  # the instance's step, deliberately
        self.active = True

    def uninstall(self) -> None:
        """Stop guarding; put the previous `step` back unless something wrapped ours since."""
        self.active = False
        if vars(self.optimizer).get("step") is self._installed:
            if self._restore is not None:
                self.optimizer.step = self._restore  # type: ignore[method-assign]  # the one it had
            else:
                del self.optimizer.step

    # ------------------------------------------------------------------ the check
    def _grads(self) -> list[torch.Tensor]:
        return [
            local_tensor(p.grad)
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and not p.grad.is_sparse
        ]

    def total_norm(self, grads: list[torch.Tensor]) -> float:
        """The total L2 norm of `grads` (maxed over ranks): the one host read per step."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        parts = []
        for dev_grads in by_device.values():
            norms = torch._foreach_norm(dev_grads)
            parts.append(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))
        first = parts[0].device
        total = torch.linalg.vector_norm(torch.stack([p.to(first) for p in parts])) if parts else torch.zeros(())
        if self.dist is not None:
            # flag and norm maxed over ranks (MAX of NaN is not portable across backends)
            bad = (~torch.isfinite(total)).float()
            both = torch.stack([bad, torch.where(bad > 0, torch.zeros_like(total), total)]).double()
            if torch.distributed.get_backend(self.dist.group) == "nccl" and both.device.type != "cuda":
                both = both.cuda()
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.dist.group)
            bad_any, norm = both.tolist()
            return math.inf if bad_any > 0 else norm
        return float(total)

    def _limit(self) -> tuple[float, float] | None:
        """(limit, median) of the accepted history in linear units, or None while it is short."""
        if len(self.history) < self.policy.guard_min_history:
            return None
        med, sigma = robust_center([v for _, v in self.history])
        need = max(math.log10(self.policy.guard_factor), self.policy.guard_mad * sigma)
        return 10.0 ** (med + need), 10.0**med

    def decide(self, step: int, norm: float) -> SkipDecision | None:
        """A skip decision for this norm, or None (accepted, and added to the history)."""
        p = self.policy
        if not math.isfinite(norm):
            return SkipDecision(step, norm, None, None) if p.skip_nonfinite else None
        lim = self._limit() if p.skip_outliers else None
        if lim is not None and norm > lim[0]:
            return SkipDecision(step, norm, lim[0], lim[1])
        if norm > 0:
            self.history.append((step, math.log10(norm)))
        return None

    def retry(self, grads: list[Any]) -> bool:
        """Apply the update a skipped step should have made, from `grads` (one per parameter of
        the optimizer, in its order; a re-run's): True when it was applied. The gradients are
        zeroed again afterwards, as after a skip. Single process only: a rank's re-run
        gradients are not the all-reduced ones."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.dist is not None or len(grads) != len(params):
            return False
        if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
            return False
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is not None:
                    p.grad = g.detach().clone()
        self._inner()
        with torch.no_grad():
            torch._foreach_zero_([p.grad for p in params if p.grad is not None])
        return True

    def _guarded(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or args or kwargs.get("closure") is not None:
            return self._inner(*args, **kwargs)  # a closure recomputes the gradients inside step()
        grads = self._grads()
        if not grads:
            return self._inner(*args, **kwargs)
        step = self.step_of()
        self.checked += 1
        decision = self.decide(step, self.total_norm(grads))
        if decision is None:
            return self._inner(*args, **kwargs)
        with torch.no_grad():
            torch._foreach_zero_(grads)
        self.skips[step] = decision
        return None

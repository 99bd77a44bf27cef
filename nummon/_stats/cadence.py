"""What the statistics collector measures and hooks on a given step, beyond the policy's
sampling cadence (the activation hooks only on their steps): everything while an incident is
open and for `DETAIL_AFTER_NONFINITE` steps after a non-finite one, max |g| every step for
narrow gradient dtypes. Decided from the step number and the (rank-identical) records, so alike
on every rank."""

from __future__ import annotations

from .._policy.policy import Policy
from .preclip import PreClipCapture
from .probes import ActivationProbes

__all__ = ["DETAIL_AFTER_NONFINITE", "NARROW_GRAD_DTYPES", "Cadence"]

#: after a non-finite step, every module's output is hooked for this many steps
DETAIL_AFTER_NONFINITE = 50
#: gradient dtypes whose range is narrow enough that max |g| is measured on every step (for the
#: others the L2 norm, an upper bound of max |g|, stands for it between the sampled steps)
NARROW_GRAD_DTYPES = ("float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


class Cadence:
    """When the run is watched closely, and what the next forward and backward measure (the
    activation probes' detail, the pre-clip capture's max |g|)."""

    def __init__(self, policy: Policy, probes: ActivationProbes, preclip: PreClipCapture | None) -> None:
        self.policy = policy
        self.probes = probes
        self.preclip = preclip
        self.incident_open = False
        self.detail_until = -1  # every module hooked up to this step (after a non-finite one)
        self.narrow_grads = False  # the last gradients had a narrow dtype (float16, float8)

    def watch_closely(self, step: int) -> bool:
        """Whether this step measures everything (while an incident is open or after a non-finite step)."""
        return self.incident_open or step <= self.detail_until

    def extremes_due(self, step: int, params_due: bool, close: bool | None = None) -> bool:
        """max |g| is measured with the parameters' cadence, every step for narrow dtypes and
        while the run is watched closely; the L2 norm bounds it (and shows NaN/Inf) between."""
        # (`close`: `watch_closely(step)` when the caller has it already)
        return params_due or self.narrow_grads or (self.watch_closely(step) if close is None else close)

    def arm_next(self, next_step: int, first: bool = False) -> None:
        """What the next forward hooks: nothing between the activation samples; the boundaries
        (every module on a small model) every `activations_every` steps; every module every
        `activations_all_every` steps, while an incident is open, after a non-finite step, and
        for histograms. And whether the next backward measures max |g|. The `first` forward
        is measured whatever its step: a model compiled after the Monitor traces the hooks then
        (and keeps them, see `ActivationProbes.traced`)."""
        sampling = self.policy.sampling
        detail = (
            self.probes.want_tensors
            or self.incident_open
            or next_step <= self.detail_until
            # (not the first: a compiled model guards on the detail flag, and its first graph
            # would be recompiled at the second forward)
            or (not first and next_step % sampling.activations_all_every == 0)
        )
        self.probes.arm(first or sampling.activations_due(next_step), detail)
        if self.preclip is not None:
            self.preclip.absmax = self.extremes_due(next_step, sampling.params_due(next_step))

    def measure_next(self) -> None:
        """Measure the activations on the next forward too, between their samples (the engine:
        a value rose well out of the region it had declared quiet, or none has formed yet)."""
        self.probes.arm(True, self.probes.detail)

    def watch_all_modules(self, on: bool) -> None:
        """Hook every watched module's output, and measure everything every step, while `on`
        (the Monitor: while an incident is open)."""
        self.incident_open = on
        if on:
            self.probes.set_detail(True)
            if self.preclip is not None:
                self.preclip.absmax = True

    def after_nonfinite(self, step: int) -> None:
        """A record of `step` went non-finite: name the first non-finite module exactly on the
        next steps, and measure max |g| from the next backward on."""
        self.detail_until = max(self.detail_until, step + 1 + DETAIL_AFTER_NONFINITE)
        self.probes.set_detail(True)
        if self.preclip is not None:
            self.preclip.absmax = True

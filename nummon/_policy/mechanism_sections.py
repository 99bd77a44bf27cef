"""The sections of the mechanism detectors: the sampled probes (`mechanisms`) and what reads them
(attention, output logits, Adam's second moment), validated as strictly as every section."""

from __future__ import annotations

from pydantic import Field, model_validator

from .sections import (
    MAX_WINDOW,
    Factor,
    Fraction,
    FractionOrAll,
    Logits,
    Multiple,
    Nats,
    Samples,
    Steps,
    StepsOrZero,
    _Section,
)

__all__ = ["MechanismsPolicy", "AttentionPolicy", "OutputLogitsPolicy", "AdamMomentPolicy"]


class MechanismsPolicy(_Section):
    """Sampled probes of what comes before a transformer's loss spike (nummon/_stats/mechanisms.py)."""

    enabled: bool = Field(
        True,
        description="sample attention logits and entropy, output log Z, Adam's second moment and per-layer output RMS",
    )
    every: Steps = Field(
        10,
        description="sample every this many steps; a sampled step's cost is bounded whatever the model's size (benchmarks/RESULTS.md, \"Mechanism probes\"); at 20 from the start the detectors' baselines form too late for the proxies' spikes (steps)",
    )
    calm_multiple: Multiple = Field(
        2,
        description="from `calm_after` on, while the run is calm (the detectors hold a quiet region, nothing rose out of it toward trouble, and every probe value of the last sample lies within 1.44x of its level, the median of its last 5 samples), sample every `every` x this many steps only; anything else brings back `every` (or the next step, for a detector's confirmation or an open incident) at once. Gives up: a mechanism that starts to move alone while loss, gradients and activations stay calm is first sampled up to (calm_multiple - 1) x `every` steps later, and near the attention-growth rule's threshold its warning can come up to 3 samples later (tests/engine/test_calm_cadence.py); keeps: the baselines (formed before `calm_after`) and every proxy's first warning of every kind (benchmarks/RESULTS.md). 1: never sparser (multiple)",
    )
    calm_after: StepsOrZero = Field(
        100,
        description="steps before which the cadence stays `every`, calm or not: the detectors' baselines form (steps)",
    )
    during_incident: bool = Field(True, description="sample every step while an incident is open")
    attention: bool = Field(
        True,
        description="max attention logit and entropy per attention module (softmax of q·kᵀ scores, scaled_dot_product_attention, nn.MultiheadAttention)",
    )
    output: bool = Field(
        True, description="log-sum-exp (log Z) and max of the logits that go into cross_entropy / log_softmax"
    )
    adam: bool = Field(
        True,
        description="Adam/AdamW per tensor: RMS(g_t / sqrt(v_hat_t)) with v_t including g_t, fraction of |g| < eps, ||update|| / ||param||",
    )
    linear_rms: bool = Field(True, description="output RMS of every nn.Linear (per-layer output growth)")

    def due(self, step: int, calm: bool) -> bool:
        """Whether `step` samples the probes on the cadence (`calm`: the engine's `calm` after the
        step before; a detector's confirmation and an open incident are the engine's to add)."""
        if step % self.every:
            return False
        return not calm or step < self.calm_after or step % (self.every * self.calm_multiple) == 0


class AttentionPolicy(_Section):
    """Attention-logit growth and attention-entropy collapse (Dehghani et al. 2023; Wortsman et al. 2023)."""

    enabled: bool = True
    baseline_samples: Samples = Field(
        5,
        description="a layer's entropy baseline is the highest of its first this many samples (samples)",
    )
    recent_steps: int = Field(
        80,
        ge=1,
        le=100 * MAX_WINDOW,
        description="a layer's recent logit level is the median of its samples of the last this many steps (its last sample when none is that recent), whatever the cadence (steps)",
    )
    start_step: StepsOrZero = Field(0, description="samples before this step do not set the recent level (steps)")
    warning_growth: Factor = Field(
        3.0,
        description="warning when a layer's max logit stands this multiple above its baseline and above warning_floor (ratio)",
    )
    warning_floor: Logits = Field(
        20.0,
        description="logits below this never warn: a logit gap of 20 already gives a one-hot softmax weight of 1 - 2e-9 (logit units)",
    )
    warning_logit: Logits = Field(50.0, description="warning at this max logit whatever the baseline (logit units)")
    critical_logit: Logits = Field(
        1e4,
        description="critical at this max logit (a stop, and a rollback under recovery): on the CPU proxies the logits of runs that diverged passed 1e4 only after their loss had left its band, and a healthy Llama's copy heads reached 1.6e3; QK-clip (Kimi K2) caps them at 100, where nummon warns (logit units)",
    )
    collapse_entropy: Fraction = Field(
        0.1,
        description="attention collapsed when a layer's mean normalised entropy (entropy / ln keys) falls below this (fraction)",
    )
    collapse_drop: Fraction = Field(0.25, description="and below this fraction of its baseline entropy (fraction)")
    chance_match: Fraction = Field(
        0.05,
        description="after a collapse, a loss within this relative distance of its starting level is the model back at chance: critical (fraction)",
    )
    patience: Samples = Field(2, description="consecutive samples a condition must hold (samples)")

    @model_validator(mode="after")
    def _order(self) -> AttentionPolicy:
        if self.critical_logit <= self.warning_logit:
            raise ValueError("critical_logit must be > warning_logit")
        return self


class OutputLogitsPolicy(_Section):
    """Output-logit divergence: the log-partition log Z of the output softmax drifting (PaLM; Wortsman et al. 2023)."""

    enabled: bool = True
    baseline_samples: Samples = Field(
        5,
        description="the baseline is the median |log Z| of the first this many samples (samples)",
    )
    warning_drift: Nats = Field(
        10.0,
        description="warning when the mean |log Z| has drifted this far (nats) above its baseline: every probability is then off by a factor e^drift before normalisation (nats)",
    )
    critical_drift: Nats = Field(50.0, description="critical at this drift (nats)")
    warning_logit: Logits = Field(
        100.0,
        description="warning when the largest output logit exceeds this (bfloat16 keeps 3 significant digits, so a softmax over logits near 100 is coarse) (logit units)",
    )
    patience: Samples = Field(2, description="consecutive samples a condition must hold (samples)")

    @model_validator(mode="after")
    def _order(self) -> OutputLogitsPolicy:
        if self.critical_drift <= self.warning_drift:
            raise ValueError("critical_drift must be > warning_drift")
        return self


class AdamMomentPolicy(_Section):
    """Adam's second moment out of step with the gradients (Wortsman et al. 2023, arXiv 2304.13013; arXiv 2506.04805)."""

    enabled: bool = True
    warning_rms: Factor = Field(
        3.0,
        description="warning when a tensor's RMS(g_t / sqrt(v_hat_t)) exceeds this, where v_t = beta2 v_{t-1} + (1 - beta2) g_t^2 includes the gradient itself and v_hat_t = v_t / (1 - beta2^t): about 1 when v tracks g², at most sqrt((1 - beta2^t) / (1 - beta2)) at Adam step t (3.3 at step 11 and 31.6 in the long run for beta2 0.999; 4.5 for 0.95); g_t is the gradient Adam applies, after the loop's norm clipping when post_step gets clip_norm. Measured over every step of a tiny AdamW regressor (tests/stats/test_adam_clip_quiet.py), the highest of two consecutive steps' ratio over the level (3 or bound_fraction of the bound): healthy runs (112 seeds, lr 1e-3 to 1e-2, with and without clipping, and 12 that spike and recover) at most 0.70, runaways (learning rate growing 1.1x and 1.2x a step, 24 seeds) at least 1.11 (ratio)",
    )
    critical_rms: float | None = Field(
        None,
        gt=1,
        description="critical at or above this; off (None) by default: on high-LR runs of small models the ratio sits at its bound for dozens of steps in runs that recover on their own as in runs that are lost, so no level separates them and this kind only warns (tests/stats/test_adam_moment_truth.py) (ratio)",
    )
    bound_fraction: Fraction = Field(
        0.67,
        description="the warning level is at least this fraction of the ratio's bound at the step, sqrt((1 - beta2^t) / (1 - beta2)): early in a run, and with a long second-moment memory, the bound is near and ratios of 3-4 come and go in healthy runs (at 0.67 the level for beta2 0.95 stays 3) (fraction)",
    )
    small_fraction: FractionOrAll = Field(
        0.1,
        description="warning when at least this fraction of gradient elements is below Adam's eps (their parameters have stopped receiving gradient while Adam's second moment still carries their old size) (fraction)",
    )
    small_growth: float = Field(
        5.0,
        ge=1,
        description="and that fraction is at least this multiple of the run's own level: the lowest of its first `baseline_samples` samples (ratio)",
    )
    baseline_samples: Samples = Field(
        5,
        description="samples from `start_step` on that set the run's own level of the small-gradient fraction (samples)",
    )
    warning_update_ratio: float = Field(
        1.0, gt=0, description="warning when one tensor's ||update|| / ||param|| exceeds this in one step (ratio)"
    )
    patience: Samples = Field(2, description="consecutive samples a condition must hold (samples)")
    start_step: StepsOrZero = Field(
        10,
        description="no finding before this step: the first updates are large relative to small initial parameters (steps)",
    )

    @model_validator(mode="after")
    def _order(self) -> AdamMomentPolicy:
        if self.critical_rms is not None and self.critical_rms <= self.warning_rms:
            raise ValueError("critical_rms must be > warning_rms")
        return self

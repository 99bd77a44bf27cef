"""Remediation hints: a short, specific next step for each alert kind."""

from __future__ import annotations

from .._core.types import AlertKind, Finding

__all__ = ["hint_for"]

_BASE = {
    AlertKind.NONFINITE: "find the first non-finite tensor named here; check for log/div/sqrt of 0 "
    "(use log_softmax, add an epsilon), then lower the LR or clip gradients",
    AlertKind.EXPLOSION: "clip gradients (torch.nn.utils.clip_grad_norm_) and check the batch that caused the jump; "
    "if it repeats, lower the LR",
    AlertKind.RUNAWAY: "lower the LR about 10x, add gradient clipping, and check for a recent data/domain switch; "
    "the run is not recovering on its own",
    AlertKind.LOSS_SPIKE: "inspect this step's batch (bad labels or outliers); add gradient clipping or LR warm-up",
    AlertKind.DIVERGENCE: "the loss is far above where it started: restore the last good checkpoint and lower the LR",
    AlertKind.EXTREME: "values are close to the dtype's limit: lower the LR, clip gradients, add normalisation; "
    "for float16 use bfloat16 or dynamic loss scaling",
    AlertKind.STALL: "no progress: check that the LR is not tiny, that gradients reach every layer, and that "
    "labels match inputs (overfit one batch first: nummon.diagnose.overfit_one_batch)",
    AlertKind.OSCILLATION: "the loss swings without progress: lower the LR (or the momentum) about 3x, "
    "or use a LR schedule",
    AlertKind.ATTENTION_LOGITS: "add qk-layernorm (LayerNorm on queries and keys before q·kᵀ) or QK-clip (rescale W_q and "
    "W_k when a head's max logit passes 100, as Kimi K2 does); or lower the LR or lengthen the warm-up",
    AlertKind.ATTENTION_COLLAPSE: "restore a checkpoint from before the collapse and restart with qk-layernorm (or QK-clip at "
    "a max logit of 100) and a lower LR or a longer warm-up: a collapsed attention rarely recovers on its own",
    AlertKind.OUTPUT_LOGITS: "add z-loss to the loss: 1e-4 * logsumexp(logits, -1).pow(2).mean() (PaLM; OLMo 2 uses 1e-5); "
    "or lower the LR",
    AlertKind.ADAM_SECOND_MOMENT: "lower the LR or Adam's beta2 (0.95 tracks g² faster than 0.999), lengthen the warm-up, "
    "and clip gradients; in large transformers a loss spike often follows within 1-8 steps (Wortsman et al. 2023)",
    AlertKind.REPLICA_MISMATCH: "drain and replace the node of the named rank(s) and resume from the last checkpoint: "
    "replicas that should be bit-identical differ (silent data corruption); lowering the LR will not help",
    AlertKind.VANISHING: "some layers get no gradient: check activations (saturating sigmoid/tanh), "
    "initialisation, detached tensors, and consider residual connections or normalisation",
}


def hint_for(finding: Finding, context: dict | None = None) -> str:
    """A hint for a finding; `context` may name the optimizer ("sgd_momentum", "adam") and dtype."""
    context = context or {}
    kind = finding.kind
    if kind is AlertKind.RUNAWAY and context.get("optimizer") == "sgd_momentum":
        return (
            "momentum SGD is amplifying a runaway: lower the LR about 10x (or the momentum), add gradient "
            "clipping, and check for a recent data/domain switch"
        )
    if kind is AlertKind.EXTREME and finding.details.get("dtype") == "float16":
        return "float16 overflow ahead: use bfloat16 autocast or torch.amp.GradScaler (dynamic loss scaling)"
    if kind is AlertKind.NONFINITE and finding.metric == "input":
        return "the input batch holds NaN/Inf: fix the data pipeline (normalisation by a zero std, corrupt files)"
    if kind is AlertKind.NONFINITE and finding.details.get("rule") == "log_skip":
        return (
            "with fp16 and a loss scaler this is the scaler calibrating, nothing to do while it stays rare; "
            "without one, the next update makes the weights non-finite: lower the LR, clip gradients, check the data"
        )
    if kind is AlertKind.NONFINITE and "forward" in (finding.location or ""):
        return (
            "the forward pass overflowed here: if it is a softmax/log/exp use log_softmax or add an epsilon; "
            "if values grew step by step, lower the LR and clip gradients"
        )
    if kind is AlertKind.DIVERGENCE and finding.details.get("rule") == "rebound":
        return (
            "the loss climbed back far above the best it had reached: restore a checkpoint from before the rise, "
            "lower the LR (or lengthen the warm-up), and check what changed in the data at that step"
        )
    if kind is AlertKind.STALL and ("frozen_records" in finding.details or "chance_loss" in finding.details):
        return (
            "the model's output does not change: check that the optimizer holds the model's parameters and the "
            "LR is not 0, that the loss is not computed on detached tensors, that labels match inputs, and that "
            "the last layer is not saturated (a sigmoid at 0.5 gives ln 2, a uniform softmax ln k)"
        )
    if kind is AlertKind.ADAM_SECOND_MOMENT and finding.metric == "adam_small_grad_fraction":
        return (
            "lower the LR or lengthen the warm-up (dead units or saturated normalisation layers stop passing "
            "gradient at too high a LR); if the gradients are merely tiny rather than zero, lower Adam's eps "
            "(arXiv 2506.04805) or keep the optimizer state in float32"
        )
    return _BASE[kind]

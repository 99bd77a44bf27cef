"""The sampled mechanism probes (`..mechanisms`, on sampled steps only): attention logits and
entropy, the output's log Z and largest logit, per-layer Linear output RMS, Adam's per-tensor
RMS(g / sqrt(v_hat)), small-gradient fraction and update ratio, per-sample losses."""

from __future__ import annotations

import torch

from ..distributed import Reduce
from ..transport import Segment
from .family import Collecting, LaunchStep, RecordBuild, StatFamily, rules

__all__ = ["FAMILY", "decode_mechanisms", "launch_mechanisms"]


def launch_mechanisms(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The mechanism probes' segments of this step (none but per-sample losses when it was not sampled)."""
    if c.mechanisms is None:
        return []
    s.mech, segs = c.mechanisms.take(s.distributed, s.loss, lambda: _clip_scale(s))
    return segs


def _clip_scale(s: LaunchStep) -> torch.Tensor | None:
    """The factor the loop's norm clipping will scale today's gradients by, on the device, as
    torch.nn.utils.clip_grad_norm_ computes it: min(1, clip_norm / (total norm + 1e-6)); None
    when the loop does not clip after post_step. Adam divides that clipped gradient by its second
    moment, so its statistics must see it, not the gradient before clipping."""
    if s.clip_norm is None:
        return None
    norms = next((seg.tensor for seg in s.segments if seg.name == "grad_norms"), None)
    if norms is None:
        return None
    total = norms.float().square().sum().sqrt()
    return (s.clip_norm / (total + 1e-6)).clamp(max=1.0)


def decode_mechanisms(b: RecordBuild) -> None:
    """The sampled mechanism probes' fields (attention, output log Z, layer RMS, Adam)."""
    ms, rec, get = b.pending.mech, b.rec, b.get
    if ms is None:
        return
    if ms.samples and (v := get("mech_samples")) is not None:
        rec.sample_loss_ratio = v[0]
        rec.sample_loss_top = tuple(int(i) for i in v[1:])
    if ms.attention and (mx := get("mech_attn_max")) is not None:
        ent = get("mech_attn_entropy") or []
        rec.layer_attention_logit_max = dict(zip(ms.attention, mx))
        rec.layer_attention_entropy = dict(zip(ms.attention, ent))
        rec.attention_logit_max = max(mx)
        rec.attention_entropy = min(ent) if ent else None
    if ms.output and (m := get("mech_lse_mean")) is not None:
        lse_max, logit_max = get("mech_lse_max"), get("mech_logit_max")
        assert lse_max is not None and logit_max is not None  # packed with mech_lse_mean
        rec.output_logsumexp_mean = m[0]
        rec.output_logsumexp_max = lse_max[0]
        rec.output_logit_max = logit_max[0]
    if ms.linear and (r := get("mech_linear_rms")) is not None:
        rec.layer_output_rms = dict(zip(ms.linear, r))
    if ms.adam and (r := get("mech_adam_rms")) is not None:
        small, upd = get("mech_adam_small"), get("mech_adam_update")
        assert small is not None and upd is not None  # packed with mech_adam_rms
        rec.layer_adam_ratio_rms = dict(zip(ms.adam, r))
        rec.layer_update_ratio = dict(zip(ms.adam, upd))
        rec.adam_ratio_rms = max(r)
        rec.update_ratio_max = max(upd)
        rec.adam_small_grad_fraction = sum(small) / ms.adam_elements if ms.adam_elements else None
        rec.adam_ratio_bound = ms.adam_bound or None


_MAX, _MEAN = Reduce.MAX, Reduce.MEAN
FAMILY = StatFamily(
    "mechanisms",
    rules(
        mech_samples=Reduce.LOCAL,
        mech_attn_max=_MAX,
        mech_attn_entropy=_MEAN,
        mech_lse_mean=_MEAN,
        mech_lse_max=_MAX,
        mech_logit_max=_MAX,
        mech_linear_rms=_MAX,
        mech_adam_rms=_MAX,
        mech_adam_small=_MAX,
        mech_adam_update=_MAX,
    ),
    launch_mechanisms,
    (decode_mechanisms,),
)

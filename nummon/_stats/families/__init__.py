"""The statistic families: each one unit that declares its device segments with their
cross-rank reductions (`Reduce`), its launch function (device side, `launch.py`) and its
decoders (host side, `decode.py`). The collector launches and the decoder decodes from this one
list, in its order (later families read what earlier ones noted or set: the clip ratio needs the
gradient norm, the update ratio the parameter norm), so a family cannot be launched without
being decoded.

Model: torchmetrics' `Metric.add_state(name, default, dist_reduce_fx=...)` over pure
`update`/`compute`; here a segment's rule travels with its values (`transport.Segment`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..decode import (
    RecordBuild,
    decode_activations,
    decode_clip_ratio,
    decode_grads,
    decode_inputs,
    decode_loss,
    decode_mechanisms,
    decode_optimizer,
    decode_params,
)
from ..distributed import Reduce
from ..launch import (
    Collecting,
    LaunchStep,
    launch_activations,
    launch_batch,
    launch_grads,
    launch_loss,
    launch_mechanisms,
    launch_optimizer,
    launch_params,
)
from ..transport import Segment

__all__ = ["FAMILIES", "StatFamily", "decoders", "declared_rules"]

Launch = Callable[[Collecting, LaunchStep], list[Segment]]
Decode = Callable[[RecordBuild], None]

#: per-tensor norms: a shard's L2 norm combines by sum of squares, a replicated tensor's by max
#: (chosen per tensor from its sharding: `WatchedParams.param_rules`, `OptimizerView.state_rules`)
NORM_RULES = frozenset({Reduce.SUM_SQ, Reduce.MAX})


@dataclass(frozen=True)
class StatFamily:
    """One statistic family. `segments`: {segment name (a trailing "*" names a prefix): the
    cross-rank rules its elements may use}; `launch`: its device side; `decode`: its host side,
    one or more decoders run in order."""

    name: str
    segments: Mapping[str, frozenset[str]]
    launch: Launch
    decode: tuple[Decode, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"statistic family {self.name!r} declares no segments")
        for seg, rules in self.segments.items():
            if not rules or not rules <= Reduce.ALL:
                raise ValueError(f"statistic family {self.name!r}: segment {seg!r} has no valid reduction {rules!r}")
        if not callable(self.launch):
            raise ValueError(f"statistic family {self.name!r} declares no launch function")
        if not self.decode or not all(map(callable, self.decode)):
            raise ValueError(f"statistic family {self.name!r} declares no decoder")

    def rules_for(self, segment: str) -> frozenset[str] | None:
        """The rules this family declares for a segment name, or None if it declares no such segment."""
        if segment in self.segments:
            return self.segments[segment]
        return next((r for p, r in self.segments.items() if p.endswith("*") and segment.startswith(p[:-1])), None)


def _rules(**by_segment: frozenset[str] | str) -> Mapping[str, frozenset[str]]:
    return MappingProxyType({k: frozenset({v}) if isinstance(v, str) else v for k, v in by_segment.items()})


_LOCAL, _MAX = Reduce.LOCAL, Reduce.MAX
FAMILIES: tuple[StatFamily, ...] = (
    StatFamily("loss", _rules(loss=Reduce.MEAN), launch_loss, (decode_loss,)),
    StatFamily(
        "gradients",
        # the pre-clip capture's values are single-process only (LOCAL)
        _rules(grad_norms=NORM_RULES | {_LOCAL}, grad_absmax=frozenset({_MAX, _LOCAL}), grad_norms_post=_LOCAL),
        launch_grads,
        (decode_grads, decode_clip_ratio),
    ),
    StatFamily("parameters", _rules(param_norms=NORM_RULES), launch_params, (decode_params,)),
    StatFamily("optimizer", _rules(state_norms=NORM_RULES, lr=_LOCAL), launch_optimizer, (decode_optimizer,)),
    StatFamily(
        "activations",
        MappingProxyType({"act_max:*": frozenset({_MAX}), "act_minmax:*": frozenset({_LOCAL})}),
        launch_activations,
        (decode_activations,),
    ),
    StatFamily(
        "mechanisms",
        _rules(
            mech_samples=_LOCAL,
            mech_attn_max=_MAX,
            mech_attn_entropy=Reduce.MEAN,
            mech_lse_mean=Reduce.MEAN,
            mech_lse_max=_MAX,
            mech_logit_max=_MAX,
            mech_linear_rms=_MAX,
            mech_adam_rms=_MAX,
            mech_adam_small=_MAX,
            mech_adam_update=_MAX,
        ),
        launch_mechanisms,
        (decode_mechanisms,),
    ),
    StatFamily("inputs", _rules(input_nonfinite=Reduce.SUM, fingerprint=_LOCAL), launch_batch, (decode_inputs,)),
)


def decoders(families: tuple[StatFamily, ...] = FAMILIES) -> tuple[Decode, ...]:
    """Every family's decoders, flattened in the families' order (what `Decoder` runs)."""
    return tuple(d for f in families for d in f.decode)


def declared_rules(segment: str, families: tuple[StatFamily, ...] = FAMILIES) -> frozenset[str] | None:
    """The rules the family that declares `segment` gives it, or None when no family does."""
    return next((r for f in families if (r := f.rules_for(segment)) is not None), None)

"""Sampled mechanism probes: what comes before a transformer's loss spike, measured on the device
on sampled steps only and packed into the step's one device->host copy.

- attention: max pre-softmax logit and mean normalised entropy per attention module, for
  hand-written q·kᵀ -> softmax, `F.scaled_dot_product_attention` (the fused kernel never
  materialises the logits: they are recomputed from q and k on a bounded sample of queries) and
  `nn.MultiheadAttention`;
- output: log Z (log-sum-exp of the logits that go into cross-entropy / log_softmax), mean and
  max over the first `OUTPUT_BUDGET` logits' rows, and the largest output logit;
- Adam/AdamW: per tensor RMS(g / sqrt(v_hat)) (v_hat: the bias-corrected second moment this
  gradient is divided by, whether `post_step` runs before or after `optimizer.step()`), the
  fraction of |g| below eps, and ||update|| / ||param||;
- per-layer output RMS of every `nn.Linear` (and transformers' GPT-2 `Conv1D`; of its first `RMS_BUDGET` output elements; at
  most `LINEAR_LIMIT` of them, evenly spaced).

How, with no change to user code: a forward pre-hook on the model, on an armed step only, enters
a `TorchFunctionMode` that sees softmax / SDPA / cross-entropy calls, and global module hooks
that keep the name of the module running; the forward hook leaves the module hooks, and the
mode is left before `optimizer.step()` (its per-tensor loop would otherwise pass through Python)
or at `post_step`, whichever comes first: the loss is usually computed after the forward.
Unarmed steps pay one flag test. Everything computed here is detached and under no_grad.

Cost is bounded per sampled step, whatever the model's size: the Adam statistics read
`ADAM_SAMPLE` elements of each tensor, the attention entropy the first `ENTROPY_BUDGET` scores,
and recomputed fused-attention logits at most `SDPA_QUERY_BUDGET` of them.
"""
from __future__ import annotations

import inspect
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from .._distributed import Reduce
from .._functional import spaced
from .._types import StepRecord
from .transport import Layout, Segment

__all__ = ["ADAM_SAMPLE", "ENTROPY_BUDGET", "OUTPUT_BUDGET", "RMS_BUDGET", "MechanismProbes", "MechanismStep", "SDPA_QUERY_BUDGET"]

#: At most this many logits (batch x heads x queries x keys) are recomputed per fused-attention
#: call: the first batch element, and evenly spaced queries when the sequence is long.
SDPA_QUERY_BUDGET = 1 << 18
#: The attention entropy is the mean over the score rows of the first (batch x head) slices
#: holding at most this many scores (at least one slice); the max logit is over every score.
ENTROPY_BUDGET = 1 << 13
#: A Linear's output RMS is that of its first this many elements (the first tokens or samples).
RMS_BUDGET = 1 << 14
#: at most this many `nn.Linear` outputs are measured (evenly spaced in registration order)
LINEAR_LIMIT = 64
#: the module names are re-read every this many sampled steps (a model may grow)
NAMES_EVERY = 20
#: log Z is taken over the first rows (samples, tokens) of the logits holding at most this many
#: (at least one row); the largest logit over all of them.
OUTPUT_BUDGET = 1 << 20
#: The Adam statistics of a tensor are estimated from this many of its elements when it has
#: more (a fixed random subset; all of them when it has fewer): ratios and fractions,
#: which a uniform sample estimates without bias, at a cost that does not grow with the model.
ADAM_SAMPLE = 1024
#: ... read as runs of this many consecutive elements (a random element each is a cache miss each)
SAMPLE_RUN = 256
#: Per-sample losses: indices of this many worst samples go into the record.
TOP_SAMPLES = 5
# a logit this far below zero is a mask (masked_fill(-1e9), finfo.min), not a score
_MASKED = -1e4

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_SDPA = F.scaled_dot_product_attention
_grad_of = operator.attrgetter("grad")
_sparse = operator.attrgetter("is_sparse")


def _is_none(x: Any) -> bool:
    return x is None


_MHA_PARAMS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


@dataclass
class MechanismStep:
    """The names behind one step's packed mechanism segments (host side)."""

    attention: list[str] = field(default_factory=list)
    adam: list[str] = field(default_factory=list)
    linear: list[str] = field(default_factory=list)
    output: bool = False
    samples: int = 0  # per-sample losses: top indices packed
    adam_elements: float = 0.0  # gradient elements the |g| < eps counts are out of


def _dim_of(args: tuple, kwargs: dict, default: int | None = None) -> int | None:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[1] if len(args) > 1 and isinstance(args[1], int) else default


class _Capture(TorchFunctionMode):
    """Sees the attention and output-logit calls of one armed forward."""

    def __init__(self, probes: "MechanismProbes") -> None:
        super().__init__()
        self.p = probes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = self.p
        out = func(*args, **kwargs)
        try:
            if func is F.multi_head_attention_forward:  # its inner calls run with this mode off
                p._mha(args, kwargs)
            elif func in _SOFTMAX:
                x = args[0]
                dim = _dim_of(args, kwargs)
                if isinstance(x, torch.Tensor) and dim is not None and _is_attention_scores(x, dim):
                    p._attention(x, out)
            elif func is _SDPA:
                p._sdpa(args, kwargs)
            elif func is F.cross_entropy:
                x = args[0] if args else kwargs.get("input")
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    p._output(x, 1 if x.ndim >= 2 else 0)
            elif func in _LOG_SOFTMAX:
                x = args[0]
                dim = _dim_of(args, kwargs)
                if isinstance(x, torch.Tensor) and dim is not None and not _is_attention_scores(x, dim):
                    p._output(x, dim)
        except Exception:  # a probe must never break the user's forward
            p.errors += 1
        return out


def _is_attention_scores(x: torch.Tensor, dim: int) -> bool:
    """A softmax over the last dim of (batch, heads, queries, keys) or (batch*heads, q, k) scores."""
    if not x.is_floating_point() or x.ndim < 3 or dim not in (-1, x.ndim - 1):
        return False
    return x.ndim >= 4 or x.shape[-1] == x.shape[-2]


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or a linear layer by another name (GPT-2's `Conv1D` in transformers: x @ W + b)."""
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))


class _Sample:
    """How one list of tensors is read as a flat float32 vector: small tensors whole (one
    concatenation in C++), each large one as `ADAM_SAMPLE` fixed random elements (a `take`
    each); `seg` is the tensor index of each element. Made once per list of shapes."""

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        dev = tensors[0].device
        self.names = names
        self.shapes = [t.shape for t in tensors]
        self.elements = float(sum(t.numel() for t in tensors))
        self.sizes = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64, device=dev)
        self.small = [i for i, t in enumerate(tensors) if t.numel() <= ADAM_SAMPLE]
        self.big = [i for i, t in enumerate(tensors) if t.numel() > ADAM_SAMPLE]
        self.index = []
        for i in self.big:  # runs at fixed random offsets: few cache lines, and no stride that
            n = tensors[i].numel()  # could alias with a row length
            g = torch.Generator().manual_seed(n)
            starts = torch.randperm(n // SAMPLE_RUN, generator=g)[: ADAM_SAMPLE // SAMPLE_RUN].sort().values * SAMPLE_RUN
            self.index.append((starts[:, None] + torch.arange(SAMPLE_RUN)).reshape(-1).to(dev))
        counts = [tensors[i].numel() for i in self.small] + [ADAM_SAMPLE] * len(self.big)
        order = self.small + self.big
        self.n = len(tensors)
        self.seg = torch.repeat_interleave(torch.tensor(order, dtype=torch.long), torch.tensor(counts)).to(dev)
        self.count = torch.zeros(self.n, dtype=torch.float64).index_add_(
            0, torch.tensor(order, dtype=torch.long), torch.tensor(counts, dtype=torch.float64)).to(dev)

    def values(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        parts = []
        if self.small:
            parts.append(torch._utils._flatten_dense_tensors([tensors[i] for i in self.small]))
        parts += [torch.take(tensors[i], idx) for i, idx in zip(self.big, self.index)]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]  # (cat promotes mixed dtypes)
        return flat if flat.dtype == torch.float32 else flat.float()

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The per-tensor mean of a flat per-element vector (float64 sums)."""
        total = torch.zeros(self.n, dtype=torch.float64, device=x.device).index_add_(0, self.seg, x.double())
        return (total / self.count).to(x.dtype)


class _Samplers:
    """One `_Sample` per parameter group, re-made when its shapes change."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, _Sample] = {}

    def get(self, params: list[torch.Tensor], names_of: Callable[[], dict[int, str]]) -> _Sample:
        """The sample of these parameters; `names_of()` maps id(param) -> name (called on a miss)."""
        key = (tensors_key := tuple(map(id, params)), params[0].device)
        s = self._by_key.get(key)
        if s is None or s.shapes != [p.shape for p in params]:
            names = names_of()
            s = self._by_key[key] = _Sample(params, [names.get(i, f"param{k}") for k, i in enumerate(tensors_key)])
        return s


class MechanismProbes:
    """The sampled probes of one model and optimizer; `arm(True)` before a forward to sample it."""

    def __init__(self, model: nn.Module | None, optimizer: Any, adam: bool = True, attention: bool = True,
                 output: bool = True, linear_rms: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.want_adam, self.want_attention, self.want_output, self.want_linear = adam, attention, output, linear_rms
        self.armed = False
        self.paused = False
        self.errors = 0  # probe failures swallowed (never the user's problem)
        self._mode: _Capture | None = None
        self._thread = 0
        self._global: list[Any] = []
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        self._linear: set[int] = set()
        self._samples_until_names = 0
        self._reset()
        self._hooks: list[Any] = []
        self._samples: torch.Tensor | None = None
        self._sampler = _Samplers()
        self._groups: dict[int, tuple[tuple, tuple]] = {}  # per param group: (key, its Adam tensors)
        # whether optimizer.step() ran since the model's last forward: post_step after the step (a
        # plain loop) or before it (the Lightning and HF callbacks) sees the state after or before
        # v's update (without a model forward to see: since the last take)
        self._stepped = False
        self._steps_seen = 0  # optimizer steps since attaching (a host count: no device read)
        self._hooks_opt = []
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._hooks_opt = [optimizer.register_step_pre_hook(self._before_step),
                               optimizer.register_step_post_hook(self._after_step)]
        if model is not None and (attention or output or linear_rms):
            self._hooks = [model.register_forward_pre_hook(self._enter),
                           model.register_forward_hook(self._leave, always_call=True)]

    def _before_step(self, *_: Any) -> None:
        self._close_mode()  # the loss and backward are done: Adam's per-tensor loop need not pass through Python

    def _after_step(self, *_: Any) -> None:
        self._stepped = True
        self._steps_seen += 1

    # ------------------------------------------------------------------ forward capture
    def _reset(self) -> None:
        self._attn: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._rms: dict[str, list[tuple[torch.Tensor, int]]] = {}  # per Linear: (sum of squares, elements) per call

    def arm(self, on: bool) -> None:
        """Sample (or not) the next forward and optimizer step."""
        self.armed = bool(on)

    def _enter(self, _mod: nn.Module, _inp: Any) -> None:
        if not self._global:  # the step's forward: an optimizer.step() from now on is this step's
            self._stepped = False
        if not self.armed or self.paused:
            return
        if self._global:  # a nested call of the model itself
            return
        if self._samples_until_names <= 0:  # the module names, again now and then: a model may grow
            self._names = {id(m): n for n, m in self.model.named_modules()}
            linear = [id(m) for m in self.model.modules() if _is_linear(m)] if self.want_linear else []
            self._linear = set(spaced(linear, LINEAR_LIMIT))
            self._samples_until_names = NAMES_EVERY
        self._samples_until_names -= 1
        self._stack = []
        self._global = [_module.register_module_forward_pre_hook(self._push),
                        _module.register_module_forward_hook(self._pop, always_call=True)]
        if self._mode is None:
            # stays on past the forward: the loss (cross_entropy of the logits) is usually computed
            # after it; left before optimizer.step() or at post_step (the backward runs in C++)
            self._mode = _Capture(self)
            self._mode.__enter__()
            self._thread = threading.get_ident()

    def _leave(self, _mod: nn.Module, _inp: Any, _out: Any) -> None:
        for h in self._global:
            h.remove()
        self._global = []
        self._stack = []

    def _close_mode(self) -> None:
        """Leave the capture mode (on the thread that entered it: modes are per thread)."""
        if self._mode is not None and threading.get_ident() == self._thread:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except RuntimeError:  # closed from inside a torch call (a SIGTERM handler mid-forward):
                pass               # the mode is off the stack while its handler runs, and ends with it

    def _push(self, mod: nn.Module, _inp: Any) -> None:
        name = self._names.get(id(mod))
        if name is not None:
            self._stack.append(name)

    def _pop(self, mod: nn.Module, _inp: Any, out: Any) -> None:
        name = self._names.get(id(mod))
        if name is None:
            return
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        if id(mod) in self._linear and isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            try:  # the mean square of the output's first RMS_BUDGET elements (the first tokens); sqrt at take()
                o = out.detach().reshape(-1)[:RMS_BUDGET]
                ss = torch.dot(o, o) if o.dtype == torch.float32 else torch.linalg.vector_norm(o, dtype=torch.float32).square()
                self._rms.setdefault(name, []).append((ss, o.numel()))
            except Exception:  # a probe must never break the user's forward
                self.errors += 1

    def _where(self) -> str:
        return self._stack[-1] if self._stack else "attention"

    @torch.no_grad()
    def _attention(self, scores: torch.Tensor, probs: torch.Tensor | None) -> None:
        if not self.want_attention:
            return
        s = scores.detach()
        mx = s.amax().float()  # masked scores (-inf, -1e9) are never the max of a row with a key left
        # the entropy from the first slices only (the first sample's heads): it tells a collapse
        # as well as the whole batch does, at a bounded cost
        rows = s.reshape(-1, s.shape[-2], s.shape[-1]) if s.ndim >= 3 else s.reshape(1, 1, -1)
        k = max(1, ENTROPY_BUDGET // max(rows.shape[1] * rows.shape[2], 1))
        sub = rows[:k].float()
        if isinstance(probs, torch.Tensor):
            p = probs.detach().reshape(rows.shape)[:k].float()
        else:
            p = torch.softmax(sub, dim=-1)
        ent = -torch.special.xlogy(p, p).sum(-1)
        keys = (sub > _MASKED).sum(-1)
        live = keys >= 2
        norm = ent / torch.log(keys.clamp(min=2).float())
        mean = (norm * live).sum() / live.sum().clamp(min=1)
        self._attn.setdefault(self._where(), []).append((mx, mean))

    @torch.no_grad()
    def _sdpa(self, args: tuple, kwargs: dict) -> None:
        if not self.want_attention:
            return
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k = a["query"].detach(), a["key"].detach()
        mask, causal, scale = a.get("attn_mask"), bool(a.get("is_causal", False)), a.get("scale")
        if q.ndim < 2:
            return
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if q.ndim >= 3 and k.ndim == q.ndim and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # grouped-query attention
        L, S = q.shape[-2], k.shape[-2]
        qi = torch.arange(L, device=q.device)
        if q.ndim >= 3:  # the first batch element: the logits of one sample tell the growth
            q, k = q[:1], k[:1]
            if mask is not None and mask.ndim == q.ndim:
                mask = mask[:1]
        per_query = max(1, q.numel() // max(q.shape[-1] * L, 1)) * S  # logits per query row
        keep = max(1, min(L, SDPA_QUERY_BUDGET // per_query))
        if keep < L:  # evenly spaced queries
            qi = torch.linspace(0, L - 1, keep, device=q.device).long()
            q = q.index_select(-2, qi)
        s = (q.float() @ k.float().transpose(-2, -1)) * scale
        if causal:
            allowed = torch.arange(S, device=s.device)[None, :] <= (qi[:, None] + (S - L))
            s = s.masked_fill(~allowed, -math.inf)
        if mask is not None:
            m = mask.detach()
            if m.shape[-2] == L and keep < L:
                m = m.index_select(-2, qi)
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        self._attention(s, None)

    @torch.no_grad()
    def _mha(self, args: tuple, kwargs: dict) -> None:
        """nn.MultiheadAttention: its logits recomputed from the projections it was given."""
        if not self.want_attention:
            return
        a = dict(zip(_MHA_PARAMS, args))  # (inspect's bind costs more than the probe)
        a.update(kwargs)
        query, key, heads = a["query"].detach(), a["key"].detach(), int(a["num_heads"])
        if query.ndim == 2:  # unbatched (L, E)
            query, key = query.unsqueeze(1), key.unsqueeze(1)
        E = query.shape[-1]
        if a.get("use_separate_proj_weight"):
            wq, wk = a["q_proj_weight"], a["k_proj_weight"]
        else:
            wq, wk = a["in_proj_weight"][:E], a["in_proj_weight"][E : 2 * E]
        b = a.get("in_proj_bias")
        bq, bk = (b[:E], b[E : 2 * E]) if b is not None else (None, None)
        L, N, S = query.shape[0], query.shape[1], key.shape[0]
        q = F.linear(query[:, :1], wq, bq).reshape(L, heads, -1).transpose(0, 1)  # the first sample
        k = F.linear(key[:, :1], wk, bk).reshape(S, heads, -1).transpose(0, 1)
        s = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = a.get("attn_mask")
        if a.get("is_causal") and mask is None:
            mask = torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1)
        if mask is not None:
            m = mask.detach()
            if m.ndim == 3:  # (N * heads, L, S)
                m = m[:heads]
            s = s.masked_fill(m, -math.inf) if m.dtype == torch.bool else s + m.float()
        kpm = a.get("key_padding_mask")
        if kpm is not None and kpm.dtype == torch.bool:
            s = s.masked_fill(kpm.detach()[:1].reshape(1, 1, S), -math.inf)
        self._attention(s, None)

    @torch.no_grad()
    def _output(self, logits: torch.Tensor, dim: int) -> None:
        if not self.want_output or logits.numel() == 0:
            return
        x = logits.detach()
        top = x.amax().float()  # over every logit, in their own dtype (no float copy of a large vocabulary's)
        if x.ndim >= 2 and dim % x.ndim != 0 and x.numel() > OUTPUT_BUDGET:
            x = x[: max(1, OUTPUT_BUDGET // x[0].numel())]  # log Z of the first samples / tokens
        lse = torch.logsumexp(x.float(), dim=dim)
        self._out.append((lse.mean(), lse.amax(), top))

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
    def take(self, distributed: bool) -> tuple[MechanismStep, list[Segment]]:
        """This step's segments (empty when it was not sampled); resets for the next step."""
        self._close_mode()
        ms, segs = MechanismStep(), []
        if self._samples is not None:
            segs.append(Segment("mech_samples", self._samples, Reduce.LOCAL))
            ms.samples = self._samples.numel() - 1
            self._samples = None
        if not self.armed or self.paused:
            self._reset()
            return ms, segs
        with torch.no_grad():
            if self._attn:
                ms.attention = list(self._attn)
                mx = torch.stack([torch.stack([v[0] for v in vs]).amax() for vs in self._attn.values()])
                ent = torch.stack([torch.stack([v[1] for v in vs]).mean() for vs in self._attn.values()])
                segs += [Segment("mech_attn_max", mx, Reduce.MAX), Segment("mech_attn_entropy", ent, Reduce.MEAN)]
            if self._out:
                ms.output = True
                mean = torch.stack([o[0] for o in self._out]).mean().reshape(1)
                mx = torch.stack([o[1] for o in self._out]).amax().reshape(1)
                lmax = torch.stack([o[2] for o in self._out]).amax().reshape(1)
                segs += [Segment("mech_lse_mean", mean, Reduce.MEAN), Segment("mech_lse_max", mx, Reduce.MAX),
                         Segment("mech_logit_max", lmax, Reduce.MAX)]
            if self._rms:  # per module its largest RMS over the calls of this step
                ms.linear = list(self._rms)
                calls = [c for cs in self._rms.values() for c in cs]
                ss = torch.stack([c[0] for c in calls])
                ms_ = (ss / torch.tensor([float(c[1]) for c in calls], device=ss.device)).sqrt()
                if len(calls) > len(ms.linear):  # a module called more than once (weight sharing)
                    sizes = torch.tensor([len(cs) for cs in self._rms.values()], device=ss.device)
                    owner = torch.repeat_interleave(torch.arange(len(ms.linear), device=ss.device), sizes)
                    ms_ = torch.full((len(ms.linear),), -math.inf, device=ss.device).scatter_reduce(0, owner, ms_, "amax")
                segs.append(Segment("mech_linear_rms", ms_, Reduce.MAX))
            if self.want_adam and self.optimizer is not None:
                try:
                    names, adam_segs, elements = self._adam()
                except Exception:  # a probe must never break the user's step (e.g. a group across devices)
                    self.errors += 1
                    names, adam_segs, elements = [], [], 0.0
                if names:
                    ms.adam, ms.adam_elements = names, elements
                    segs += adam_segs
        self._reset()
        if not self._hooks:
            self._stepped = False
        return ms, segs

    def _param_names(self) -> dict[int, str]:
        if self.model is None:
            return {}
        return {id(p): n for n, p in self.model.named_parameters()}

    def _group_state(self, gi: int, group: dict) -> tuple[list, list, list, dict]:
        """A group's parameters with Adam state, their exp_avg and exp_avg_sq, and the first one's
        state dict (cached: Adam updates its state in place; `load_state_dict` replaces the
        state mapping and the first step fills it, which the cache key notices)."""
        state, params = self.optimizer.state, group["params"]
        key = (id(state), len(state), id(params), len(params))
        hit = self._groups.get(gi)
        if hit is not None and hit[0] == key:
            return hit[1]
        ps, ms_, vs, first = [], [], [], {}
        for p in params:
            st = state.get(p)
            m, v = (st.get("exp_avg"), st.get("exp_avg_sq")) if st else (None, None)
            if m is None or v is None or p.is_sparse or v.shape != p.shape:  # e.g. a factored v
                continue
            first = first or st
            ps.append(p), ms_.append(m), vs.append(v)
        out = (ps, ms_, vs, first)
        self._groups[gi] = (key, out)
        return out

    def _adam(self) -> tuple[list[str], list[Segment], float]:
        """Per tensor: RMS(g / sqrt(v_hat)), the fraction of |g| < eps (packed as an element
        count), ||update|| / ||param||; exact on small tensors, estimated on large ones."""
        names: list[str] = []
        rms: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        upd: list[torch.Tensor] = []
        elements = 0.0
        stepped = self._stepped
        for gi, group in enumerate(self.optimizer.param_groups):
            betas = group.get("betas")
            if betas is None or "eps" not in group:
                continue
            b1, b2 = (float(b) for b in betas)
            eps, lr = float(group["eps"]), float(group["lr"])
            ps, ms_, vs, first = self._group_state(gi, group)
            if not ps:
                continue
            gs = list(map(_grad_of, ps))
            if any(map(_is_none, gs)) or any(map(_sparse, gs)):  # no (dense) gradient this step: Adam skips them too
                keep = [i for i, g in enumerate(gs) if g is not None and not g.is_sparse]
                ps, gs, ms_, vs = ([xs[i] for i in keep] for xs in (ps, gs, ms_, vs))
                if not ps:
                    continue
            # the first step's ratio is 1 by construction: nothing to tell yet. The step count is
            # read from the group's first state (the others step with it); a fused / capturable
            # optimizer's lives on the device: a host count of the steps stands in (no sync)
            t = first.get("step", 0.0)
            on_device = isinstance(t, torch.Tensor) and t.device.type != "cpu"
            if (self._steps_seen if on_device else float(t)) < (2 if stepped else 1):
                continue
            sample = self._sampler.get(ps, self._param_names)
            names += sample.names
            elements += sample.elements
            P, G, M, V = (sample.values(k) for k in (ps, gs, ms_, vs))  # flat float32, with sample.seg
            if isinstance(t, torch.Tensor):
                t = t.to(G.device, torch.float32)
            g2 = G * G
            # v_hat_t, the second moment this gradient is (or will be) divided by: the state after
            # the step, or beta2 * v + (1 - beta2) g² before it. It includes g² itself, so the
            # ratio g²/v_hat_t is bounded by 1/(1 - beta2): no tensor whose v is still ~0 (a layer
            # that had no gradient yet) can make it explode, and before/after give the same value
            vt, tt = (V, t) if stepped else (V * b2 + g2 * (1.0 - b2), t + 1.0)
            vhat = (vt / (1.0 - b2 ** tt)).clamp_min(eps * eps)
            rms.append(sample.mean(g2 / vhat).sqrt())
            small.append(sample.mean((G.abs() < eps).double()) * sample.sizes)  # (estimated) count of |g| < eps
            # the update Adam just applied: lr * m_hat / (sqrt(v_hat) + eps), against the parameter
            step = M / ((V / (1.0 - b2 ** t)).sqrt() + eps)
            upd.append(sample.mean(step.square()).sqrt() * (lr / (1.0 - b1 ** t))
                       / sample.mean(P.square()).sqrt().clamp(min=1e-30))
        if not names:
            return [], [], 0.0
        return names, [Segment("mech_adam_rms", torch.cat(rms), Reduce.MAX),
                       Segment("mech_adam_small", torch.cat(small), Reduce.MAX),
                       Segment("mech_adam_update", torch.cat(upd), Reduce.MAX)], elements

    # ------------------------------------------------------------------ host side
    def decode(self, rec: StepRecord, layout: Layout, vals: list[float], ms: MechanismStep | None) -> None:
        """Write the mechanism fields of `rec` from the packed values."""
        if ms is None:
            return

        def get(name: str) -> list[float] | None:
            s = layout.get(name)
            return None if s is None else vals[s.start : s.stop]

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
            rec.output_logsumexp_mean = m[0]
            rec.output_logsumexp_max = get("mech_lse_max")[0]
            rec.output_logit_max = get("mech_logit_max")[0]
        if ms.linear and (r := get("mech_linear_rms")) is not None:
            rec.layer_output_rms = dict(zip(ms.linear, r))
        if ms.adam and (r := get("mech_adam_rms")) is not None:
            small, upd = get("mech_adam_small"), get("mech_adam_update")
            rec.layer_adam_ratio_rms = dict(zip(ms.adam, r))
            rec.layer_update_ratio = dict(zip(ms.adam, upd))
            rec.adam_ratio_rms = max(r)
            rec.update_ratio_max = max(upd)
            rec.adam_small_grad_fraction = sum(small) / ms.adam_elements if ms.adam_elements else None

    def remove(self) -> None:
        self._leave(None, None, None)
        self._close_mode()
        for h in self._hooks_opt:
            h.remove()
        self._hooks_opt = []
        for h in self._hooks:
            h.remove()
        self._hooks = []

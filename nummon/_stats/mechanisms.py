"""Sampled mechanism probes: what comes before a transformer's loss spike, measured on the device
on sampled steps only and packed into the step's one device->host copy.

- attention: max pre-softmax logit and mean normalised entropy per attention module, for
  hand-written q·kᵀ -> softmax, `F.scaled_dot_product_attention` (the fused kernel never
  materialises the logits: they are recomputed from q and k on a bounded sample of queries) and
  `nn.MultiheadAttention`;
- output: log Z (log-sum-exp of the logits that go into cross-entropy / log_softmax), mean and
  max, and the largest output logit;
- Adam/AdamW: per tensor RMS(g / sqrt(v_hat)) (v_hat: the bias-corrected second moment this
  gradient is divided by, whether `post_step` runs before or after `optimizer.step()`), the
  fraction of |g| below eps, and ||update|| / ||param||;
- per-layer output RMS of every `nn.Linear`.

How, with no change to user code: a forward pre-hook on the model, on an armed step only, enters
a `TorchFunctionMode` that sees softmax / SDPA / cross-entropy calls, and global module hooks
that keep the name of the module running; the forward hook leaves both. Unarmed steps pay one
flag test. Everything computed here is detached and under no_grad.
"""
from __future__ import annotations

import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from .._distributed import Reduce
from .._types import StepRecord
from .transport import Layout, Segment

__all__ = ["MechanismProbes", "MechanismStep", "SDPA_QUERY_BUDGET"]

#: At most this many logits (batch x heads x queries x keys) are recomputed per fused-attention
#: call: the first batch element, and evenly spaced queries when the sequence is long.
SDPA_QUERY_BUDGET = 1 << 22
#: Per-sample losses: indices of this many worst samples go into the record.
TOP_SAMPLES = 5
# a logit this far below zero is a mask (masked_fill(-1e9), finfo.min), not a score
_MASKED = -1e4

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_SDPA = F.scaled_dot_product_attention


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
        self._reset()
        self._hooks: list[Any] = []
        self._samples: torch.Tensor | None = None
        # whether optimizer.step() ran since the model's last forward: post_step after the step (a
        # plain loop) or before it (the Lightning and HF callbacks) sees the state after or before
        # v's update (without a model forward to see: since the last take)
        self._stepped = False
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._hooks_opt = optimizer.register_step_post_hook(self._after_step)
        else:
            self._hooks_opt = None
        if model is not None and (attention or output or linear_rms):
            self._hooks = [model.register_forward_pre_hook(self._enter),
                           model.register_forward_hook(self._leave, always_call=True)]

    def _after_step(self, *_: Any) -> None:
        self._stepped = True

    # ------------------------------------------------------------------ forward capture
    def _reset(self) -> None:
        self._attn: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._rms: dict[str, torch.Tensor] = {}

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
        self._names = {id(m): n for n, m in self.model.named_modules()}  # cheap, and follows a growing model
        self._linear = {id(m) for m in self.model.modules() if isinstance(m, nn.Linear)} if self.want_linear else set()
        self._stack = []
        self._global = [_module.register_module_forward_pre_hook(self._push),
                        _module.register_module_forward_hook(self._pop, always_call=True)]
        if self._mode is None:
            # stays on until the step is taken: the loss (cross_entropy of the logits) is usually
            # computed after the model's forward; the backward runs in C++ and is not seen
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
            mode.__exit__(None, None, None)

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
            try:
                with torch.no_grad():
                    o = out.detach()
                    wide = o.dtype in (torch.float64, torch.float32)  # half types: accumulate in float32
                    rms = (torch.linalg.vector_norm(o) if wide else torch.linalg.vector_norm(o, dtype=torch.float32)) / math.sqrt(o.numel())
                prev = self._rms.get(name)
                self._rms[name] = rms.float() if prev is None else torch.maximum(prev, rms.float())
            except Exception:  # a probe must never break the user's forward
                self.errors += 1

    def _where(self) -> str:
        return self._stack[-1] if self._stack else "attention"

    @torch.no_grad()
    def _attention(self, scores: torch.Tensor, probs: torch.Tensor | None) -> None:
        if not self.want_attention:
            return
        s = scores.detach().float()
        valid = s > _MASKED
        mx = torch.where(valid, s, torch.full_like(s, -math.inf)).amax()
        p = probs.detach().float() if isinstance(probs, torch.Tensor) else torch.softmax(s, dim=-1)
        ent = -torch.special.xlogy(p, p).sum(-1)
        keys = valid.sum(-1)
        rows = keys >= 2
        norm = ent / torch.log(keys.clamp(min=2).float())
        mean = (norm * rows).sum() / rows.sum().clamp(min=1)
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
        a = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs).arguments
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
        x = logits.detach().float()
        lse = torch.logsumexp(x, dim=dim)
        self._out.append((lse.mean(), lse.amax(), x.amax()))

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
            if self._rms:
                ms.linear = list(self._rms)
                segs.append(Segment("mech_linear_rms", torch.stack(list(self._rms.values())), Reduce.MAX))
            if self.want_adam and self.optimizer is not None:
                names, adam_segs, elements = self._adam()
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

    def _adam(self) -> tuple[list[str], list[Segment], float]:
        """Per tensor: RMS(g / sqrt(v_hat)), count of |g| < eps, ||update|| / ||param||."""
        names_of = self._param_names()
        names: list[str] = []
        rms: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        upd: list[torch.Tensor] = []
        sizes: list[float] = []
        stepped = self._stepped
        for gi, group in enumerate(self.optimizer.param_groups):
            betas = group.get("betas")
            if betas is None or "eps" not in group:
                continue
            b1, b2 = (float(b) for b in betas)
            eps, lr = float(group["eps"]), float(group["lr"])
            ps, gs, ms_, vs, ts = [], [], [], [], []
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if p.grad is None or p.grad.is_sparse or not st or "exp_avg_sq" not in st or "exp_avg" not in st:
                    continue
                t = st.get("step")
                t = float(t) if t is not None else 0.0
                if t < (2 if stepped else 1) or st["exp_avg_sq"].shape != p.grad.shape:  # the first: ratio 1
                    continue
                ps.append(p.detach()), gs.append(p.grad.detach().float()), ms_.append(st["exp_avg"].float())
                vs.append(st["exp_avg_sq"].float()), ts.append(t)
                names.append(names_of.get(id(p), f"group{gi}.param{len(names)}"))
                sizes.append(float(p.numel()))
            if not ps:
                continue
            g2 = torch._foreach_mul(gs, gs)
            # v_hat_t, the second moment this gradient is (or will be) divided by: the state after
            # the step, or beta2 * v + (1 - beta2) g² before it. It includes g² itself, so the
            # ratio g²/v_hat_t is bounded by 1/(1 - beta2): no tensor whose v is still ~0 (a layer
            # that had no gradient yet) can make it explode, and before/after give the same value
            if stepped:
                vhat = [v.clone() for v in vs]
                tt = ts
            else:
                vhat = torch._foreach_mul(vs, b2)
                torch._foreach_add_(vhat, g2, alpha=1.0 - b2)
                tt = [t + 1.0 for t in ts]
            for v, t in zip(vhat, tt):
                v.mul_(1.0 / (1.0 - b2 ** t))
            torch._foreach_clamp_min_(vhat, eps * eps)
            vprev = vhat
            torch._foreach_div_(g2, vprev)
            norms = torch._foreach_norm(torch._foreach_sqrt(g2))
            rms += [n / math.sqrt(s) for n, s in zip(norms, sizes[len(sizes) - len(ps):])]
            a = torch._foreach_abs(gs)
            torch._foreach_neg_(a)
            torch._foreach_add_(a, eps)
            torch._foreach_clamp_min_(a, 0.0)
            small += list(torch._foreach_norm(a, 0))
            # the update Adam just applied: lr * m_hat / (sqrt(v_hat) + eps)
            den = torch._foreach_sqrt(vs)
            for d, t in zip(den, ts):
                d.mul_(1.0 / math.sqrt(1.0 - b2 ** t))
            torch._foreach_add_(den, eps)
            step_dir = torch._foreach_div(ms_, den)
            un = torch._foreach_norm(step_dir)
            pn = torch._foreach_norm([p.float() for p in ps])
            upd += [u * (lr / (1.0 - b1 ** t)) / pn_.clamp(min=1e-30) for u, pn_, t in zip(un, pn, ts)]
        if not names:
            return [], [], 0.0
        return names, [Segment("mech_adam_rms", torch.stack(rms), Reduce.MAX),
                       Segment("mech_adam_small", torch.stack(small).double(), Reduce.MAX),
                       Segment("mech_adam_update", torch.stack(upd), Reduce.MAX)], sum(sizes)

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
        if self._hooks_opt is not None:
            self._hooks_opt.remove()
            self._hooks_opt = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

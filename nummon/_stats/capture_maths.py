"""The device maths of `ForwardCapture` (capture.py): what its mode and hooks saw, measured.

- attention: the max logit of each call now, and a copy of its first score slices, whose
  normalised entropy is computed for every call of the step at once (`attention_values`); the
  fused kernel's logits recomputed from q and k on a bounded sample of queries (`_sdpa`);
  `nn.MultiheadAttention`'s from the projections it was given, batched over its calls;
- output: log Z of the logits that go into cross-entropy / log_softmax (`_output`).

A mixin: `ForwardCapture` inherits these methods, so moving them here adds no call per step.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ENTROPY_BUDGET",
    "OUTPUT_BUDGET",
    "OUTPUT_ROWS",
    "SDPA_QUERY_BUDGET",
    "CaptureMaths",
    "index_tensor",
    "owner_index",
]

#: At most this many logits (batch x heads x queries x keys) are recomputed per fused-attention
#: call: the first batch element, and evenly spaced queries when the sequence is long.
SDPA_QUERY_BUDGET = 1 << 18
#: The attention entropy is the mean over the score rows of the first (batch x head) slices
#: holding at most this many scores (at least one slice); the max logit is over every score.
ENTROPY_BUDGET = 1 << 13
#: log Z is taken over the first rows (samples, tokens) of the logits holding at most this many,
#: and at least `OUTPUT_ROWS` rows; the largest logit over all of them.
OUTPUT_BUDGET = 1 << 16
OUTPUT_ROWS = 16
# a logit this far below zero is a mask (masked_fill(-1e9), finfo.min), not a score
_MASKED = -1e4
_MHA_PARAMS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


@functools.lru_cache(maxsize=64)
def index_tensor(values: tuple, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(values)` made once per (values, device, dtype): the groupings of a step's calls
    repeat from one sampled step to the next, and `torch.tensor` of a list costs more than its
    use. Shared: never written to."""
    return torch.tensor(values, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def owner_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Per item, the group it belongs to, where group i holds `sizes[i]` consecutive items (the
    score slices of a call, the calls of a module); made once per (sizes, device), shared."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


class CaptureMaths:
    """The measurements of `ForwardCapture`; the state below is its (set in its `__init__` /
    `reset`), and `_where` names the module a call ran in."""

    want_attention: bool
    want_output: bool
    errors: int  # probe failures swallowed (never the user's problem)
    _thread: int  # the thread whose forward is captured
    _pending: list[tuple[str, tuple]]
    attn: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def _where(self) -> str:
        raise NotImplementedError  # ForwardCapture's

    _MHA_FORWARD = (
        "query",
        "key",
        "value",
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )

    def _mha_in(self, name: str, mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        """nn.MultiheadAttention's forward arguments, as F.multi_head_attention_forward gets them."""
        if threading.get_ident() != self._thread or not self.want_attention:
            return
        a = dict(zip(self._MHA_FORWARD, args))
        a.update(kwargs)
        # grad mode off by its C switch (a `no_grad` block is ~6 Python calls)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:  # the projections now (the weights the forward used); the logits of all layers at take, batched
            q, k = a["query"], a["key"]
            params = mod._parameters  # (where `mod.in_proj_weight` finds them, without Module.__getattr__'s call)
            qk = self._mha_qk(
                {
                    "query": q,
                    "key": k,
                    "batch_first": mod.batch_first,
                    "num_heads": mod.num_heads,
                    "in_proj_weight": params.get("in_proj_weight"),
                    "in_proj_bias": params.get("in_proj_bias"),
                    "use_separate_proj_weight": not mod._qkv_same_embed_dim,
                    "q_proj_weight": params.get("q_proj_weight"),
                    "k_proj_weight": params.get("k_proj_weight"),
                    "attn_mask": a.get("attn_mask"),
                    "key_padding_mask": a.get("key_padding_mask"),
                    "is_causal": a.get("is_causal", False),
                }
            )
            self._pending.append((name, qk))
        except Exception:  # a probe must never break the user's forward
            self.errors += 1
        finally:
            torch._C._set_grad_enabled(grad)

    # (no `no_grad` below where every tensor read is detached: a `no_grad` costs ~6 Python calls)
    def _attention(self, scores: torch.Tensor) -> None:
        """The max over every score now; a copy of the first slices' scores for the entropy,
        computed for every call of the step at once (`attention_values`)."""
        if not self.want_attention:
            return
        s = scores.detach()
        mx = s.amax()  # masked scores (-inf, -1e9) are never the max of a row with a key left
        # the entropy from the first slices only (the first sample's heads): it tells a collapse
        # as well as the whole batch does, at a bounded cost
        rows = s.reshape(-1, s.shape[-2], s.shape[-1]) if s.ndim >= 3 else s.reshape(1, 1, -1)
        k = max(1, ENTROPY_BUDGET // max(rows.shape[1] * rows.shape[2], 1))
        self.attn.setdefault(self._where(), []).append((mx, rows[:k].to(torch.float32, copy=True)))

    def attention_values(self) -> tuple[list[str], torch.Tensor, torch.Tensor] | None:
        """Per attention module: its max logit over the step's calls and its mean normalised
        entropy (entropy / ln keys, over the query rows with two keys or more), the mean over
        its calls; one batched computation per shape of score rows."""
        if self._pending:
            try:
                self._flush_mha()
            except Exception:  # a probe must never break the user's step
                self.errors += 1
                self._pending = []
        if not self.attn:
            return None
        names = list(self.attn)
        owner = [i for i, n in enumerate(names) for _ in self.attn[n]]  # per call, its module
        calls = [c for n in names for c in self.attn[n]]
        by_shape: dict[tuple, list[int]] = {}
        for j, (_, sub) in enumerate(calls):
            by_shape.setdefault((sub.shape[1:], sub.device), []).append(j)
        parts, order = [], []
        for idx in by_shape.values():
            x = torch.cat([calls[j][1] for j in idx]) if len(idx) > 1 else calls[idx[0]][1]  # (slices, queries, keys)
            ent = torch.special.entr(torch.softmax(x, dim=-1)).sum(-1)
            # counts summed as float32 (exact below 2^24): no int64 result and a copy of it
            keys = (x > _MASKED).sum(-1, dtype=torch.float32)
            live = keys >= 2
            norm = torch.where(live, ent / torch.log(keys.clamp(min=2)), 0.0)
            per = torch.stack([norm.sum(-1), live.sum(-1, dtype=torch.float32)])  # per slice: summed entropy, live rows
            sizes = tuple([calls[j][1].shape[0] for j in idx])
            if max(sizes) > 1:  # slices -> calls
                slice_owner = owner_index(sizes, x.device)
                per = torch.zeros(2, len(idx), device=x.device).index_add_(1, slice_owner, per)
            parts.append(per[0] / per[1].clamp(min=1))
            order += idx
        means = torch.cat(parts) if len(parts) > 1 else parts[0]
        if order != sorted(order):
            means = means[index_tensor(tuple(sorted(range(len(order)), key=order.__getitem__)), means.device)]
        mx = torch.stack([c[0] for c in calls]).float()
        if len(calls) > len(names):  # a module called more than once: its largest logit, its mean entropy
            own = index_tensor(tuple(owner), mx.device)
            mx = torch.full((len(names),), -math.inf, device=mx.device).scatter_reduce(0, own, mx, "amax")
            means = torch.zeros(len(names), device=mx.device).scatter_reduce(0, own, means, "mean", include_self=False)
        return names, mx, means

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
        self._attention(s)

    @torch.no_grad()
    def _mha(self, args: tuple, kwargs: dict) -> None:
        """nn.MultiheadAttention: its logits recomputed from the projections it was given."""
        if not self.want_attention:
            return
        a = dict(zip(_MHA_PARAMS, args))  # (inspect's bind costs more than the probe)
        a.update(kwargs)
        qk = self._mha_qk(a)
        self._materialize(self._where(), [qk])

    @staticmethod
    def _mha_qk(a: dict) -> tuple:
        """(q (heads, L, d), k (heads, S, d) of the first sample, attn_mask, is_causal, key
        padding (1, 1, S) or None) from F.multi_head_attention_forward's arguments (query and key
        (L, N, E), or (N, L, E) where `batch_first` is set), called with grad mode off: nothing is
        detached, so a mask keeps its identity (`_flush_mha` batches the calls that share one)."""
        query, key, heads = a["query"], a["key"], int(a["num_heads"])
        if query.ndim == 2:  # unbatched (L, E): the first sample itself
            q0, k0 = query, key
        else:  # the first sample's (L, E): one view each
            batch = 0 if a.get("batch_first") else 1
            q0, k0 = query.select(batch, 0), key.select(batch, 0)
        if a.get("use_separate_proj_weight"):
            wq, wk = a["q_proj_weight"], a["k_proj_weight"]
        else:
            wq, wk = a["in_proj_weight"].chunk(3)[:2]  # (3E, E): one op (C) for the three views
        b = a.get("in_proj_bias")
        bq, bk = b.chunk(3)[:2] if b is not None else (None, None)
        L, S = q0.shape[0], k0.shape[0]
        q = F.linear(q0, wq, bq).reshape(L, heads, -1).transpose(0, 1)
        k = F.linear(k0, wk, bk).reshape(S, heads, -1).transpose(0, 1)
        mask = a.get("attn_mask")
        if mask is not None and mask.ndim == 3:  # (N * heads, L, S)
            mask = mask[:heads]
        kpm = a.get("key_padding_mask")
        if kpm is not None:  # (N, S): True or -inf where a key is padding
            kpm = kpm[:1].reshape(1, 1, S)
        return q, k, mask, bool(a.get("is_causal")) and mask is None, kpm

    def _materialize(self, name: str | list[str], qks: list[tuple]) -> None:
        """The logits of MHA calls with the same shapes and masks, in one batched product:
        their maxima and first score slices go where `_attention` puts them."""
        names = [name] * len(qks) if isinstance(name, str) else name
        _q0, _k0, mask, causal, kpm0 = qks[0]
        qs = torch.stack([qk[0] for qk in qks]).float()  # (calls, heads, L, d)
        ks = torch.stack([qk[1] for qk in qks]).float()
        calls, heads, L, d = qs.shape
        S = ks.shape[-2]
        # (qs @ ksᵀ as the one bmm matmul makes of it, without its expands and reshapes)
        s = torch.bmm(qs.view(-1, L, d), ks.view(-1, S, d).transpose(1, 2)).view(calls, heads, L, S) / math.sqrt(d)
        if causal:
            s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1), -math.inf)
        if mask is not None:
            s = s.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
        if kpm0 is not None:
            kpm = torch.stack([qk[4] for qk in qks])  # (calls, 1, 1, S)
            s = s.masked_fill(kpm, -math.inf) if kpm.dtype == torch.bool else s + kpm.float()
        mx = s.amax(dim=(1, 2, 3))  # masked scores (-inf) are never the max of a row with a key left
        k = max(1, ENTROPY_BUDGET // max(L * S, 1))
        # per call (one `unbind` each, not an index per call)
        for name_i, m, sub in zip(names, mx.unbind(0), s[:, :k].unbind(0)):
            self.attn.setdefault(name_i, []).append((m, sub))

    def _flush_mha(self) -> None:
        """The MHA calls the planned forward deferred: grouped by shapes and masks."""
        groups: dict[tuple, tuple[list[str], list[tuple]]] = {}
        for name, qk in self._pending:
            q, k, mask, causal, kpm = qk
            key = (
                q.shape,
                k.shape,
                q.device,
                id(mask) if mask is not None else None,
                causal,
                None if kpm is None else kpm.dtype,
            )
            names, qks = groups.setdefault(key, ([], []))
            names.append(name)
            qks.append(qk)
        self._pending = []
        for names, qks in groups.values():
            self._materialize(names, qks)

    def output_logits(self, logits: torch.Tensor) -> None:
        """Measure `logits` (classes last) as the step's output logits: what a loss computed
        outside a replayed forward read (see compiled.py)."""
        self._output(logits, -1)

    def _output(self, logits: torch.Tensor, dim: int) -> None:
        if not self.want_output or logits.numel() == 0:
            return
        x = logits.detach()
        top = x.amax().float()  # over every logit, in their own dtype (no float copy of a large vocabulary's)
        if x.ndim >= 2 and dim % x.ndim != 0 and x.numel() > OUTPUT_BUDGET:  # log Z of the first samples / tokens
            row = x.numel() // x.shape[0]  # (elements of x[0], without indexing it)
            x = x[: max(1, OUTPUT_BUDGET // row, OUTPUT_ROWS // max(1, row // x.shape[dim]))]
        lse = torch.logsumexp(x.float(), dim=dim)
        self.out.append((lse.mean(), lse.amax(), top))

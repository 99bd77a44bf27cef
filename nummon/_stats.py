"""The statistics engine: the only part of nummon that touches tensors.

Per step it launches reductions on the device: L2 norms of gradients, parameters and optimizer
state (one fused ``torch._foreach_norm`` on CUDA; a BLAS dot per tensor into a preallocated
buffer on CPU), max |g| (a fused inf-norm on CUDA; ``aminmax`` into a buffer on CPU) and the
(min, max) of every watched module output (``aminmax`` from a forward hook, into a buffer of the
output's dtype). It packs every scalar into one vector, copies that to the host once
(non-blocking into pinned memory on CUDA, read one step later) and turns it into plain floats,
the only thing that leaves here.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ._distributed import local_tensor, norm_kinds
from ._functional import DTYPE_MAX, headroom_decades
from ._policy import Policy
from ._types import StepRecord

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_HALF = (torch.float16, torch.bfloat16)
_STATE_KEYS = ("momentum_buffer", "exp_avg")  # the first-moment state of SGD / Adam-family optimizers


def _dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, "float32")


def _narrowest(a: str | None, b: str) -> str:
    if a is None:
        return b
    return a if DTYPE_MAX[a] <= DTYPE_MAX[b] else b


@dataclass
class Pending:
    """Device work launched for one step, not yet read on the host."""

    step: int
    packed: torch.Tensor  # float64 on the host (CPU) or pinned host memory being filled (CUDA)
    event: Any  # torch.cuda.Event or None
    layout: dict[str, slice]
    grad_names: list[str]
    act_names: list[str]
    act_order: list[int]
    act_dtype: str | None
    grad_dtype: str | None
    loss_host: float | None
    lr: float | None
    meta: dict[str, Any] = field(default_factory=dict)


class StatsEngine:
    """Computes one step's health statistics for a model and optimizer."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        policy: Policy,
        dist: Any = None,
        grad_scaler: Any = None,
    ) -> None:
        self.model = model
        self.grad_scaler = grad_scaler  # torch.amp.GradScaler: non-finite grads mean a skipped step
        self.optimizer = optimizer
        self.policy = policy
        self.dist = dist  # a DistributedReducer: one collective over the packed vector per step
        self.named_params: list[tuple[str, nn.Parameter]] = []
        if model is not None:
            self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        elif optimizer is not None:
            self.named_params = [
                (f"param_group{gi}.{pi}", p)
                for gi, g in enumerate(optimizer.param_groups)
                for pi, p in enumerate(g["params"])
            ]
        # FSDP1 shards every parameter of the wrapped model (flat or original-parameter views)
        self._all_sharded = model is not None and any(
            type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()
        )
        self.device = self.named_params[0][1].device if self.named_params else torch.device("cpu")
        # made once: the hot path loops over these every step
        self._params = [p for _, p in self.named_params]
        self._param_names = [n for n, _ in self.named_params]
        self._local_views = any(callable(getattr(p, "to_local", None)) for p in self._params)
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]] = {}
        self._hooks: list[Any] = []
        self._act_names: list[str] = []
        # per output dtype, a (modules, 2) buffer of each output's min and max in this step
        self._act_bufs: dict[torch.dtype, torch.Tensor] = {}
        self._act_view_cache: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._act_src: list[torch.dtype | None] = []  # the buffer each module wrote to this step
        self._act_order: list[int] = []
        self._act_dtype: str | None = None
        self._hist_acts: dict[str, torch.Tensor] = {}
        self._want_act_hist = False
        self._state_cache: tuple[Any, int, list[torch.Tensor]] = (None, -1, [])
        self._fp_weights: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._pinned: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        if model is not None and policy.sampling.activations:
            self._install_hooks(model)

    # ---------------------------------------------------------------- activations
    def _install_hooks(self, model: nn.Module) -> None:
        # only modules that own parameters: they are where a runaway shows, and hooking every
        # module (activations, containers) costs more than it tells
        exclude = self.policy.sampling.activations_exclude
        for name, mod in model.named_modules():
            if any(fnmatch.fnmatchcase(name, pat) for pat in exclude):
                continue
            if name and any(True for _ in mod.parameters(recurse=False)):
                idx = len(self._act_names)
                self._act_names.append(name)
                self._act_src.append(None)
                self._hooks.append(mod.register_forward_hook(self._make_hook(idx)))

    def _make_hook(self, idx: int) -> Callable:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            t = out
            if not isinstance(t, torch.Tensor):
                if not isinstance(out, (tuple, list)):
                    return
                t = next((o for o in out if isinstance(o, torch.Tensor)), None)
                if t is None:
                    return
            if not t.is_floating_point() or t.numel() == 0:
                return
            t = t.detach()
            if self._act_src[idx] is None:  # the first call of this module in this step
                lo, hi = self._act_views(t.dtype, t.device)[idx]
                # one kernel, no conversion: min and max of bf16/fp16 values are exact in their own dtype
                torch.aminmax(t, out=(lo, hi))
                self._act_src[idx] = t.dtype
                self._act_order.append(idx)
                self._act_dtype = _narrowest(self._act_dtype, _dtype_name(t.dtype))
            else:  # a module called twice in one step (weight sharing, loops)
                lo, hi = self._act_views(self._act_src[idx], t.device)[idx]
                mn, mx = torch.aminmax(t)
                torch.minimum(lo, mn.to(lo.dtype), out=lo)
                torch.maximum(hi, mx.to(hi.dtype), out=hi)
            if self._want_act_hist:
                self._hist_acts[self._act_names[idx]] = t

        return hook

    def _act_views(self, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-module (min, max) 0-d views of a (modules, 2) buffer of this dtype, made once:
        on a GPU every per-call tensor op is a launch to pay for."""
        views = self._act_view_cache.get(dtype)
        if views is None or views[0][0].device != device:  # first forward, or the model moved
            buf = self._act_bufs[dtype] = torch.zeros(len(self._act_names), 2, dtype=dtype, device=device)
            views = self._act_view_cache[dtype] = [(buf[i, 0], buf[i, 1]) for i in range(len(self._act_names))]
        return views

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---------------------------------------------------------------- optimizer
    def _state_tensors(self) -> list[torch.Tensor]:
        opt = self.optimizer
        if opt is None:
            return []
        state = opt.state
        cached_state, cached_n, found = self._state_cache
        # state appears lazily after the first step; load_state_dict replaces the whole mapping
        if state is not cached_state or len(state) != cached_n:
            found = []
            for st in state.values():
                for key in _STATE_KEYS:
                    t = st.get(key) if isinstance(st, dict) else None
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        found.append(t)
                        break
            self._state_cache = (state, len(state), found)
        return found

    def _lr(self) -> float | None:
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            return None  # a tensor LR (capturable optimizers) rides in the packed vector instead
        try:
            return float(lr)
        except (TypeError, ValueError):
            return None

    def optimizer_kind(self) -> str | None:
        opt = self.optimizer
        if opt is None:
            return None
        name = type(opt).__name__.lower()
        if name == "sgd":
            mom = opt.param_groups[0].get("momentum", 0) if opt.param_groups else 0
            return "sgd_momentum" if mom else "sgd"
        if "adam" in name:
            return "adam"
        return name

    # ---------------------------------------------------------------- fingerprints
    def _fingerprint(self, t: torch.Tensor) -> torch.Tensor:
        """Exact, order-independent integer hash of a tensor's bits (mod 2^52, as float64)."""
        flat = t.detach().reshape(-1)
        if flat.dtype in (torch.float32, torch.int32):
            bits = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        elif flat.dtype in (torch.float16, torch.bfloat16, torch.int16):
            bits = flat.view(torch.int16).to(torch.int64) & 0xFFFF
        elif flat.dtype in (torch.float64, torch.int64):
            bits = flat.view(torch.int64) & 0x7FFFFFFF  # low bits: cheap and still position-sensitive
        else:
            bits = flat.to(torch.int64)
        key = (flat.numel(), flat.device)
        w = self._fp_weights.get(key)
        if w is None:
            w = (torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 2654435761 + 97) % 2147483629
            self._fp_weights[key] = w
        h = (bits * w).sum()  # int64 sums wrap identically in any order: exact and deterministic
        return (h % (1 << 52)).to(torch.float64)

    # ---------------------------------------------------------------- the step
    def launch(self, step: int, loss: Any, batch: Any = None, params_due: bool = True, optim_due: bool = True) -> Pending:
        """Launch this step's reductions and start the single device->host copy."""
        with torch.no_grad():  # out= reductions over parameters; and nothing here is for autograd
            return self._launch(step, loss, batch, params_due, optim_due)

    def _launch(self, step: int, loss: Any, batch: Any, params_due: bool, optim_due: bool) -> Pending:
        parts: list[tuple[str, torch.Tensor]] = []
        params = self._params
        # the parameters' device now (the model may have moved since the Monitor was made)
        dev = params[0].device if params else self.device
        distributed = self.dist is not None
        loss_host = None
        if isinstance(loss, torch.Tensor):
            parts.append(("loss", loss.detach().reshape(1)))
            dev = loss.device
        elif distributed:  # every rank must pack the same layout
            parts.append(("loss", torch.tensor([float(loss)], device=dev)))
        else:
            loss_host = float(loss)

        grads = [p.grad for p in params]
        grad_names = self._param_names
        if any(g is None for g in grads):
            if distributed:  # placeholders: the layout is the same on every rank
                grads = [torch.zeros((), device=dev) if g is None else g for g in grads]
            else:
                grad_names = [n for n, g in zip(grad_names, grads) if g is not None]
                grads = [g for g in grads if g is not None]
        grad_src = grads
        grad_dtype = None
        for dt in {g.dtype for g in grads}:
            grad_dtype = _narrowest(grad_dtype, _dtype_name(dt))
        if self._local_views:  # DTensor (FSDP2) shards: their rank-local part
            grads = [local_tensor(g) for g in grads]
        if any(g.is_sparse for g in grads):
            grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        meta: dict[str, Any] = {"grads": grads}
        kinds: dict[str, list[str]] = {}
        # every L2 norm of the step (gradients, parameters, optimizer state) in one fused pass
        segments: list[tuple[str, list[torch.Tensor]]] = [("grad_norms", grads)]
        if distributed:
            kinds["grad_norms"] = self._kinds(grad_src)
        if params_due and params:
            segments.append(("param_norms", [local_tensor(p) for p in params] if self._local_views else params))
            if distributed:
                kinds["param_norms"] = self._kinds(params)
        if optim_due:
            st = self._state_tensors()
            if st:
                segments.append(("state_norms", [local_tensor(t) for t in st] if self._local_views else st))
                meta["state"] = st
                if distributed:
                    kinds["state_norms"] = self._kinds(st)
        flat = [t for _, ts in segments for t in ts]
        if flat:
            norms = self._l2_norms(flat)
            i = 0
            for name, ts in segments:
                if ts:
                    parts.append((name, norms[i : i + len(ts)]))
                    i += len(ts)
        lr_t = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None and self.optimizer.param_groups else None
        lr_is_tensor = isinstance(lr_t, torch.Tensor)
        if lr_is_tensor:  # a tensor LR (capturable optimizers) rides in the packed vector
            parts.append(("lr", lr_t.detach().reshape(1)))
        if grads:
            parts.append(self._grad_extremes(grads, distributed))
        act_order, self._act_order = self._act_order, []
        act_src = self._act_src
        if act_order:
            parts.extend(self._act_extremes(act_src, distributed))
        if batch is not None:
            tensors = [t for t in _tensors_in(batch)]
            if tensors:
                fl = [t for t in tensors if t.is_floating_point()]
                if fl:
                    parts.append(("input_nonfinite", torch.stack([(~torch.isfinite(t)).sum() for t in fl]).sum().reshape(1)))
                parts.append(("fingerprint", torch.stack([self._fingerprint(t) for t in tensors])))
        # reset the per-step activation bookkeeping for the next forward
        self._act_src = [None] * len(self._act_names)
        act_dtype, self._act_dtype = self._act_dtype, None

        packed, layout = _pack(parts, dev)
        if distributed:
            packed = self.dist.gather(packed)
            meta["kinds"] = kinds
        event = None
        if packed.device.type == "cuda":
            host = self._pinned_buffer(packed.numel(), packed.dtype)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        elif packed.device.type != "cpu":
            packed = packed.cpu()
        meta["act_src"] = act_src
        return Pending(
            step=step,
            packed=packed,
            event=event,
            layout=layout,
            grad_names=grad_names,
            act_names=self._act_names,  # fixed after the hooks are installed
            act_order=act_order,
            act_dtype=act_dtype,
            grad_dtype=grad_dtype,
            loss_host=loss_host,
            lr=None if lr_is_tensor else self._lr(),
            meta=meta,
        )

    def _l2_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """float32 L2 norm of each tensor.

        CUDA: one fused `_foreach_norm`. CPU, where `_foreach_norm` is a loop of `vector_norm`
        kernels: a BLAS dot product per dense float32 tensor (half the time of `vector_norm` on
        the tensors that matter, measured inside a training step) written into a preallocated
        buffer, then one square root.
        """
        dev = tensors[0].device
        if dev.type != "cpu":
            return _stack_float(torch._foreach_norm(tensors))
        buf, views = self._cached_views("norms", len(tensors), 1, dev)
        for t, (v,) in zip(tensors, views):
            if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
                f = t.view(-1)
                torch.dot(f, f, out=v)
            else:  # other dtypes, layouts, devices (rare); float32 overflow is recomputed later
                n = torch.linalg.vector_norm(t, dtype=torch.float32) if t.dtype in _HALF else torch.linalg.vector_norm(t)
                v.copy_(n.square())
        return buf.view(-1).sqrt_()

    def _grad_extremes(self, grads: list[torch.Tensor], distributed: bool) -> tuple[str, torch.Tensor]:
        """Each gradient's max |g| ("grad_absmax"), or its (min, max) pair ("grad_minmax"), which
        the host turns into max |g| (fewer device ops than doing it here).

        CUDA: one fused `_foreach_norm(inf)` (a kernel per tensor would be launch-bound: 148
        tensors of GPT-2 cost ~9 ms). CPU, where that norm is slow: one `aminmax` per gradient
        written into a preallocated buffer.
        """
        dev = grads[0].device
        if dev.type == "cuda":
            return "grad_absmax", _stack_float(torch._foreach_norm(grads, float("inf")))
        buf, views = self._cached_views("grad_minmax", len(grads), 2, dev)
        for g, (lo, hi) in zip(grads, views):
            if g.numel() == 0:
                lo.zero_()
                hi.zero_()
            elif g.dtype == torch.float32 and g.device == dev:
                torch.aminmax(g, out=(lo, hi))
            else:
                mn, mx = torch.aminmax(g)
                lo.copy_(mn)
                hi.copy_(mx)
        if distributed:  # ranks combine maxima; a (min, max) pair would need its own rule
            return "grad_absmax", _absmax_rows(buf)
        return "grad_minmax", buf.view(-1)

    def _act_extremes(self, act_src: list[torch.dtype | None], distributed: bool) -> list[tuple[str, torch.Tensor]]:
        """The watched modules' (min, max) buffers, one part per output dtype seen this step."""
        parts = []
        for dtype in {d for d in act_src if d is not None}:
            buf = self._act_bufs[dtype]
            if distributed:
                parts.append((f"act_max:{dtype}", _absmax_rows(buf)))
            else:
                parts.append((f"act_minmax:{dtype}", buf.view(-1)))
        return parts

    def _cached_views(self, key: str, n: int, width: int, dev: torch.device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """A preallocated float32 (n, width) buffer and its per-row 0-d views, made once per shape."""
        hit = self._buffers.get((key, n))
        if hit is None or hit[0].device != dev:
            buf = torch.zeros(n, width, device=dev)
            hit = self._buffers[(key, n)] = (buf, [tuple(buf[i, j] for j in range(width)) for i in range(n)])
        return hit

    def _kinds(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        if self._all_sharded:
            return ["sum_sq"] * len(tensors)
        return norm_kinds(tensors)

    def _pinned_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Two pinned host buffers per size and dtype, used alternately (pinned allocation is slow, and the
        lagged step's buffer must survive until it is read)."""
        pool = self._pinned.get((n, dtype))
        if pool is None:
            pool = self._pinned[(n, dtype)] = [torch.empty(n, dtype=dtype, pin_memory=True) for _ in range(2)]
        pool.reverse()
        return pool[0]

    def resolve(self, pending: Pending) -> StepRecord:
        """Read a launched step on the host (waits for its copy) and build the StepRecord."""
        if pending.event is not None and not pending.event.query():
            pending.event.synchronize()  # only when the GPU is more than a step behind
        vals = pending.packed.tolist()
        lay = pending.layout
        ranks: dict[str, list[int | None]] = {}
        if self.dist is not None:
            vals, ranks = self.dist.combine(vals, lay, pending.meta.get("kinds", {}))

        if self.dist is not None:
            vals = self._exact_overflowed_across_ranks(vals, lay, pending)

        def get(name: str) -> list[float] | None:
            s = lay.get(name)
            return None if s is None else vals[s]

        rec = StepRecord(step=pending.step, lr=pending.lr if "lr" not in lay else get("lr")[0])
        rec.loss = pending.loss_host if pending.loss_host is not None else get("loss")[0]
        parts: list[str] = []
        if not math.isfinite(rec.loss):
            parts.append("loss")
        gn = get("grad_norms")
        gmax = get("grad_absmax")
        if gmax is None and "grad_minmax" in lay:
            gmax = _absmax_pairs(get("grad_minmax"))
        if gn is not None:
            gn = _exact_where_overflowed(gn, pending.meta.get("grads", []), self.dist is None)
            rec.grad_norm = _l2(gn)
            rec.layer_grad_norms = dict(zip(pending.grad_names, gn))
            rec.grad_max = _nanmax(gmax)
            # a gradient is non-finite when its max |g| or its L2 norm is (a max kernel may skip
            # NaN; a finite-but-huge gradient has a finite max even when its float32 norm overflows)
            bad_grads = [n for n, v, w in zip(pending.grad_names, gmax, gn)
                         if not math.isfinite(v) or (math.isnan(w))]
            if bad_grads:
                parts.append("gradients")
                pending.meta["bad_grads"] = bad_grads
        pn = get("param_norms")
        if pn is not None:
            pn = _exact_where_overflowed(pn, self._params, self.dist is None)
            rec.param_norm = _l2(pn)
            if not all(math.isfinite(v) for v in pn):
                parts.append("parameters")
        sn = get("state_norms")
        if sn is not None:
            sn = _exact_where_overflowed(sn, pending.meta.get("state", []), self.dist is None)
            rec.optim_state_norm = _l2(sn)
            if not all(math.isfinite(v) for v in sn):
                parts.append("optimizer state")
            if rec.lr is not None and rec.param_norm:
                rec.update_ratio = rec.lr * rec.optim_state_norm / rec.param_norm
        elif gn is not None and rec.lr is not None and rec.param_norm:
            rec.update_ratio = rec.lr * rec.grad_norm / rec.param_norm
        first_bad_act = None
        if pending.act_order:
            act = self._act_values(vals, lay, pending.meta["act_src"])
            seen = pending.act_order
            rec.layer_activation_max = {pending.act_names[i]: act[i] for i in seen}
            rec.activation_max = _nanmax([act[i] for i in seen])
            for i in seen:  # execution order: the first module whose output went non-finite
                if not math.isfinite(act[i]):
                    first_bad_act = pending.act_names[i]
                    break
            if first_bad_act is not None:
                parts.append("activations")
        inp = get("input_nonfinite")
        if inp is not None and inp[0]:
            rec.input_nonfinite = int(inp[0])
        fp = get("fingerprint")
        if fp is not None:
            rec.fingerprint = "-".join(f"{int(v):013x}" for v in fp)
        # headroom: the family closest to its dtype's limit
        best = None
        for mag, dt in ((rec.grad_max, pending.grad_dtype), (rec.activation_max, pending.act_dtype), (abs(rec.loss) if rec.loss is not None else None, "float32")):
            if mag is None or dt is None or not math.isfinite(mag):
                continue
            h = headroom_decades(mag, dt)
            if best is None or h < best[0]:
                best = (h, dt)
        if best is not None:
            rec.headroom, rec.headroom_dtype = best
        if parts == ["gradients"] and self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # after scaler.step() gradients are unscaled; non-finite ones mean the scaler found
            # an overflow and skipped the update: the run is fine, the statistics meaningless
            rec.scaler_skipped = True
            rec.grad_norm = rec.grad_max = rec.update_ratio = None
            rec.layer_grad_norms = {}
            parts = []
        if parts:
            rec.nonfinite_parts = tuple(parts)
            rec.nonfinite_location = self._locate(rec, first_bad_act, pending)
            # exact counts are rank-local: left out under torch.distributed so every rank's alert is identical
            rec.nonfinite_count = self._count_nonfinite() if self.dist is None else None
            if ranks:
                rec.rank = self._origin_rank(rec, first_bad_act, pending, ranks)
        elif ranks and rec.grad_max is not None and "grad_absmax" in ranks:
            src = ranks["grad_absmax"]
            gm = get("grad_absmax")
            rec.rank = src[max(range(len(gm)), key=lambda i: gm[i])] if gm else None
        return rec

    def _exact_overflowed_across_ranks(self, vals: list[float], lay: dict[str, slice], pending: Pending) -> list[float]:
        """Under torch.distributed, recompute norms that overflowed float32 (combined +inf) from
        every rank's exact float64 sums of squares, so a finite-but-extreme tensor is not taken
        for a non-finite one. Every rank sees the same combined values, so every rank either
        makes the one extra collective or none does."""
        families = {
            "grad_norms": pending.meta.get("grads", []),
            "param_norms": [local_tensor(p) for p in self._params],
            "state_norms": [local_tensor(t) for t in pending.meta.get("state", [])],
        }
        over: list[tuple[int, torch.Tensor, str]] = []
        for name, tensors in families.items():
            s = lay.get(name)
            if s is None or len(tensors) != s.stop - s.start:
                continue
            kinds = pending.meta.get("kinds", {}).get(name, ["replicated"] * len(tensors))
            for j, i in enumerate(range(s.start, s.stop)):
                if vals[i] == math.inf:
                    over.append((i, tensors[j], kinds[j]))
        if not over:
            return vals
        local = []
        for _, t, _ in over:
            t = t.detach()
            if t.is_sparse:
                t = t.coalesce().values()
            n = float(torch.linalg.vector_norm(t.double()))
            local.append(n * n)  # inf past ~1e154, where float ** 2 would raise
        exact = self.dist.exact_norms(local, [kind for _, _, kind in over])
        vals = list(vals)
        for (i, _, _), v in zip(over, exact):
            vals[i] = v
        return vals

    @staticmethod
    def _act_values(vals: list[float], lay: dict[str, slice], act_src: list[Any]) -> list[float]:
        """max |output| per watched module (NaN-aware), from the per-dtype buffer it wrote to."""
        out = [math.nan] * len(act_src)
        for i, dtype in enumerate(act_src):
            if dtype is None:
                continue
            s = lay.get(f"act_minmax:{dtype}")
            if s is not None:
                out[i] = _absmax(vals[s.start + 2 * i], vals[s.start + 2 * i + 1])
            else:  # distributed: maxima already taken on the device
                out[i] = vals[lay[f"act_max:{dtype}"].start + i]
        return out

    def _origin_rank(self, rec: StepRecord, first_bad_act: str | None, pending: Pending, ranks: dict) -> int | None:
        """The rank where the first non-finite value appeared (same order as `_locate`)."""
        if rec.input_nonfinite and "input_nonfinite" in ranks:
            return ranks["input_nonfinite"][0]
        if first_bad_act is not None:
            i = pending.act_names.index(first_bad_act)
            key = f"act_max:{pending.meta['act_src'][i]}"
            if key in ranks:
                return ranks[key][i]
        if "loss" in rec.nonfinite_parts and "loss" in ranks:
            return ranks["loss"][0]
        bad = pending.meta.get("bad_grads", [])
        if bad and "grad_absmax" in ranks:
            return ranks["grad_absmax"][pending.grad_names.index(bad[-1])]
        return None

    def _locate(self, rec: StepRecord, first_bad_act: str | None, pending: Pending) -> str:
        if rec.input_nonfinite:
            return "input batch"
        if first_bad_act is not None:
            return f"output of `{first_bad_act}` (forward)"
        if "loss" in rec.nonfinite_parts:
            return "loss (forward, after the last watched module)"
        bad = pending.meta.get("bad_grads", [])
        if bad:  # backward runs in reverse: the origin is the last one in forward order
            return f"gradient of `{bad[-1]}` (backward)"
        if "parameters" in rec.nonfinite_parts:
            return "parameters (optimizer step)"
        if "optimizer state" in rec.nonfinite_parts:
            return "optimizer state"
        return "loss"

    def _count_nonfinite(self) -> int:
        # failure path only: exact counts cost a sync, which no longer matters once a run is failing
        total = 0
        for _, p in self.named_params:
            total += int((~torch.isfinite(p.detach())).sum())
            if p.grad is not None and not p.grad.is_sparse:
                total += int((~torch.isfinite(p.grad)).sum())
        return total

    # ---------------------------------------------------------------- histograms
    def want_activation_histograms(self, on: bool) -> None:
        self._want_act_hist = on
        if not on:
            self._hist_acts = {}

    def histograms(self, bins: int = 64) -> dict[str, dict[str, Any]]:
        """Histograms of gradients, parameters and (last forward's) activations per layer.

        Linear histograms over each tensor's own range and log10|x| histograms over fixed edges
        (decades -30..39, which shows dtype headroom), computed on the device and copied once.
        """
        import numpy as np

        tensors: list[tuple[str, torch.Tensor]] = []
        for n, p in self.named_params:
            tensors.append((f"params/{n}", p.detach()))
            if p.grad is not None and not p.grad.is_sparse:
                tensors.append((f"grads/{n}", p.grad.detach()))
        for n, t in self._hist_acts.items():
            tensors.append((f"activations/{n}", t))
        self._hist_acts = {}
        tensors = [(n, t) for n, t in tensors if t.numel()]
        if not tensors:
            return {}
        lo_dec, hi_dec = -30.0, 39.0
        rows = []
        with torch.no_grad():
            for _, t in tensors:
                # a private float32 copy (NaN/Inf zeroed), so the passes below may work in place
                x = torch.nan_to_num(t.float().reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
                mn, mx = torch.aminmax(x)
                if x.is_cpu:  # reading the range costs no sync here: bin over it directly
                    lo, hi = mn.item(), mx.item()
                    lin = torch.histc(x, bins=bins, min=lo, max=hi) if hi > lo else _first_bin(bins, x.numel())
                else:  # on a GPU, normalise on the device rather than wait for the range
                    span = torch.clamp(mx - mn, min=1e-30)
                    lin = torch.histc((x - mn) / span, bins=bins, min=0.0, max=1.0)
                # float32 sums (float64 ones would cost a widened copy of every tensor): they only
                # feed the histograms' displayed mean and spread
                moments = torch.stack([x.sum(), torch.dot(x, x), torch.tensor(float(x.numel()), device=x.device)]).double()
                lg = torch.histc(x.abs_().clamp_(min=1e-30).log10_(), bins=bins, min=lo_dec, max=hi_dec)  # x is spent
                rows.append(torch.cat([mn.reshape(1).double(), mx.reshape(1).double(), moments, lin.double(), lg.double()]))
        host = torch.stack(rows).cpu().numpy()  # one copy for all histograms
        log_edges = np.linspace(lo_dec, hi_dec, bins + 1)
        out = {}
        for (name, _), row in zip(tensors, host):
            mn, mx = float(row[0]), float(row[1])
            out[name] = {
                "min": mn,
                "max": mx,
                "sum": float(row[2]),
                "sum_squares": float(row[3]),
                "num": float(row[4]),
                "counts": row[5 : 5 + bins],
                "edges": np.linspace(mn, mx if mx > mn else mn + 1e-30, bins + 1),
                "log10_counts": row[5 + bins :],
                "log10_edges": log_edges,
            }
        return out


def _first_bin(bins: int, n: int) -> torch.Tensor:
    """The histogram of a tensor whose values are all equal: everything in the first bin."""
    counts = torch.zeros(bins)
    counts[0] = n
    return counts


def _pack(parts: list[tuple[str, torch.Tensor]], dev: torch.device) -> tuple[torch.Tensor, dict[str, slice]]:
    """One new vector holding every part (copied: the parts may be reused buffers), and where
    each part lies in it.

    float32/16 parts are concatenated into one float32 vector; only when there are float64 or
    integer parts (fingerprints, counts, a float64 loss) is it widened, once, to float64, so
    those join exactly.
    """
    narrow = [(n, t) for n, t in parts if t.is_floating_point() and t.dtype != torch.float64]
    wide = [(n, t) for n, t in parts if not (t.is_floating_point() and t.dtype != torch.float64)]
    chunks, layout, pos = [], {}, 0
    for group, is_narrow in ((narrow, True), (wide, False)):
        if not group:
            continue
        ts = [t if t.device == dev else t.to(dev) for _, t in group]
        if is_narrow:
            ts = [t if t.dtype == torch.float32 else t.float() for t in ts]
            chunk = torch.cat(ts) if len(ts) > 1 else ts[0].clone()
            if wide:
                chunk = chunk.to(torch.float64)
        else:
            chunk = torch.cat([t.to(torch.float64) for t in ts])
        chunks.append(chunk)
        for name, t in group:
            layout[name] = slice(pos, pos + t.numel())
            pos += t.numel()
    if not chunks:
        return torch.zeros(0, device=dev), layout
    return (torch.cat(chunks) if len(chunks) > 1 else chunks[0]), layout


def _stack_float(values: Sequence[torch.Tensor]) -> torch.Tensor:
    if any(v.dtype != torch.float32 for v in values):
        values = [v.float() for v in values]
    return torch.stack(values)


def _tensors_in(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        out: list[torch.Tensor] = []
        for b in batch:
            out.extend(_tensors_in(b))
        return out
    return []


def _exact_where_overflowed(norms: list[float], tensors: Sequence[torch.Tensor], local: bool = True) -> list[float]:
    """Float32 norms overflow to inf for finite values above ~1e19; recompute those few in float64.

    Runs only when a norm is not finite (a failing run), so the extra sync costs a healthy run
    nothing. A tensor that really holds NaN/Inf keeps its non-finite norm.
    """
    if not local or all(math.isfinite(v) for v in norms) or len(tensors) != len(norms):
        return norms  # combined (distributed) norms are not this rank's to recompute
    out = list(norms)
    for i, v in enumerate(norms):
        if not math.isfinite(v):
            t = tensors[i].detach()
            if t.is_sparse:
                t = t.coalesce().values()
            if bool(torch.isfinite(t).all()):
                out[i] = float(torch.linalg.vector_norm(t.double()))
    return out


def _l2(values: Sequence[float]) -> float:
    # in float64 on the host: the sum of squares of float32 norms cannot overflow here
    try:
        return math.sqrt(math.fsum(v * v for v in values))
    except OverflowError:
        return math.inf


def _absmax_rows(buf: torch.Tensor) -> torch.Tensor:
    """max |x| of each (min, max) row of a (n, 2) buffer, on the device."""
    return torch.maximum(buf[:, 1], buf[:, 0].neg())


def _absmax(lo: float, hi: float) -> float:
    """max |x| from a tensor's min and max; NaN if either is NaN."""
    return math.nan if lo != lo or hi != hi else max(hi, -lo)


def _absmax_pairs(flat: Sequence[float]) -> list[float]:
    """max |x| of each (min, max) pair of a flat list."""
    return [_absmax(lo, hi) for lo, hi in zip(flat[0::2], flat[1::2])]


def _nanmax(values: Sequence[float]) -> float:
    m = -math.inf
    for v in values:
        if math.isnan(v):
            return math.nan
        m = max(m, v)
    return m

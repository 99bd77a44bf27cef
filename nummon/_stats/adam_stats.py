"""Adam/AdamW second-moment health, per tensor, from the optimizer state on the device: RMS(g /
sqrt(v_hat)), the fraction of |g| below eps, and ||update|| / ||param||.

The ratio, exactly: g_t / sqrt(v_hat_t) per element, where g_t is the gradient of step t as
measured, v_t = beta2 v_{t-1} + (1 - beta2) g_t^2 is the second moment *including* g_t (the state
after the update, or that formula applied to the state before it) and v_hat_t = v_t / (1 - beta2^t)
its bias correction. Since v_t >= (1 - beta2) g_t^2, every element (and so the RMS) is at most
sqrt((1 - beta2^t) / (1 - beta2)): 3.3 at t = 11 and 31.6 for large t with beta2 0.999. Against
v_{t-1} (without g_t) there would be no bound at all, so whether optimizer.step() already consumed
this gradient is read from the autograd engine (one parameter's post-accumulate-grad hook), not
guessed from the model's forward (Lightning's `training_step` need not call `forward`).

Cost is bounded per sampled step, whatever the model's size: a tensor of more than `ADAM_SAMPLE`
elements is read at fixed random runs of `SAMPLE_RUN` consecutive elements, smaller ones whole;
the four quantities (parameter, gradient, both moments) of a parameter group are read by one
concatenation, and every per-tensor mean of the group is one reduction.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from .distributed import Reduce
from .transport import Segment

__all__ = ["ADAM_SAMPLE", "SAMPLE_RUN", "AdamStatistics", "ratio_bound"]

#: The Adam statistics of a tensor are estimated from this many of its elements when it has
#: more (a fixed random subset; all of them when it has fewer): ratios and fractions,
#: which a uniform sample estimates without bias, at a cost that does not grow with the model.
ADAM_SAMPLE = 1024
#: ... read as runs of this many consecutive elements (a random element each is a cache miss each)
SAMPLE_RUN = 256

_grad_of = operator.attrgetter("grad")
# a state mapping's moments (any mapping with `get`, as `_group` reads them)
_EXP_AVG, _EXP_AVG_SQ = operator.methodcaller("get", "exp_avg"), operator.methodcaller("get", "exp_avg_sq")


def _one_minus_pow(beta: float, t: Any) -> Any:
    """1 - beta^t, accurate where beta^t is near 1 (a host float or a device tensor, as `t`)."""
    if isinstance(t, torch.Tensor):
        return -torch.expm1(t * math.log(beta)) if beta > 0 else torch.ones_like(t)
    return -math.expm1(t * math.log(beta)) if beta > 0 else 1.0


def ratio_bound(beta2: float, t: float) -> float:
    """The largest g_t / sqrt(v_hat_t) any element can reach at Adam step t (t >= 1):
    sqrt((1 - beta2^t) / (1 - beta2)), from v_t >= (1 - beta2) g_t^2 (no unit)."""
    if beta2 >= 1:
        return math.inf
    return math.sqrt(_one_minus_pow(beta2, max(float(t), 1.0)) / (1.0 - beta2))


class _Sample:
    """Where one list of tensors is read: small tensors whole, each large one at `ADAM_SAMPLE`
    fixed random positions (runs of `SAMPLE_RUN`). The flat read holds the small tensors first,
    then `ADAM_SAMPLE` elements per large one, so a per-tensor mean is one `index_add_` over the
    small part and one row mean over the large part. Made once per list of shapes, with the
    (4, width) float32 buffer the per-element quantities are written into (`out=`: no stack) and
    its views the means read."""

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        dev = tensors[0].device
        self.names = names
        self.shapes = [t.shape for t in tensors]
        self.elements = float(sum(t.numel() for t in tensors))
        self.small = [i for i, t in enumerate(tensors) if t.numel() <= ADAM_SAMPLE]
        self.big = [i for i, t in enumerate(tensors) if t.numel() > ADAM_SAMPLE]
        self.starts: list[list[int]] = []  # per large tensor: its runs' first elements
        self.index: list[torch.Tensor] = []  # ... and the positions they read (a `take` each)
        for i in self.big:  # runs at fixed random offsets: few cache lines, and no stride that
            n = tensors[i].numel()  # could alias with a row length
            g = torch.Generator().manual_seed(n)
            starts = (
                torch.randperm(n // SAMPLE_RUN, generator=g)[: ADAM_SAMPLE // SAMPLE_RUN].sort().values * SAMPLE_RUN
            )
            self.starts.append(starts.tolist())
            self.index.append((starts[:, None] + torch.arange(SAMPLE_RUN)).reshape(-1).to(dev))
        sizes = [tensors[i].numel() for i in self.small]
        self.n_small = sum(sizes)  # elements of the flat read before the large tensors' samples
        self.width = self.n_small + ADAM_SAMPLE * len(self.big)
        self.seg = torch.repeat_interleave(torch.arange(len(self.small)), torch.tensor(sizes, dtype=torch.long)).to(dev)
        self.small_count = torch.tensor(sizes, dtype=torch.float32, device=dev)
        # the result's order is that of `tensors`: small ones first in the means, then large
        order = self.small + self.big
        self.unorder = torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=dev)
        self.sizes = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float32, device=dev)
        # the gradients' small tensors as `cat` takes them: 1-D ones as they are (a reshape each is an op)
        self.flat_small = [len(tensors[i].shape) != 1 for i in self.small]
        self.rows = torch.empty(4, self.width, dtype=torch.float32, device=dev)
        self.row = self.rows.unbind(0)
        self.rows_small = self.rows[:, : self.n_small]
        self.rows_big = self.rows[:, self.n_small :].view(4, len(self.big), ADAM_SAMPLE)

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Flat views of what is read of `tensors` (for tensors updated in place: cacheable)."""
        out = [tensors[i].reshape(-1) for i in self.small]
        for i, starts in zip(self.big, self.starts):
            flat = tensors[i].reshape(-1)
            out += [flat[s : s + SAMPLE_RUN] for s in starts]
        return out

    def reads(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """What is read of `tensors` (new tensors every step, such as gradients), as flat pieces
        for the caller's one `cat`: the small ones whole, a `take` per large one."""
        small = [tensors[i].reshape(-1) if f else tensors[i] for i, f in zip(self.small, self.flat_small)]
        return small + [torch.take(tensors[i], idx) for i, idx in zip(self.big, self.index)]

    def means(self) -> torch.Tensor:
        """Per-tensor means of the rows of the (4, width) per-element buffer `rows`: (4, n_tensors)."""
        x = self.rows
        parts = []
        if self.small:
            total = torch.zeros(x.shape[0], len(self.small), dtype=x.dtype, device=x.device)
            parts.append(total.index_add_(1, self.seg, self.rows_small) / self.small_count)
        if self.big:
            parts.append(self.rows_big.mean(-1))
        out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        return out.index_select(1, self.unorder) if self.small and self.big else out


class _Group:
    """One parameter group's tensors with Adam state, their sample and the cached views of the
    tensors Adam updates in place (parameters, exp_avg, exp_avg_sq)."""

    def __init__(self, members: list, ps: list, ms: list, vs: list, states: list, names: list[str], size: int) -> None:
        self.members = list(members)  # the group's parameters, those without Adam state too
        self.size = size  # how many parameters had optimizer state then (one that gains it: more)
        self.ps, self.ms, self.vs = ps, ms, vs
        self.states = states  # each of `ps`' state mapping, as it was when the views were made
        self.first = states[0]  # the first one's (its step count)
        self.ptrs = list(map(torch.Tensor.data_ptr, ps))
        self.sample = _Sample(ps, names)
        self.fixed = self.sample.views(ps) + self.sample.views(ms) + self.sample.views(vs)

    def current(self, state: Any, params: list) -> bool:
        """Whether the cached views still read what Adam updates: the same parameters in the
        group, the same state mapping and moment tensors for each, and each parameter's data
        where it was (`p.data = ...` moves it; the views hold the old memory alive, so no new
        tensor can land there). ~0.2 µs a tensor at each sample, where making the group again
        costs ~17 µs a tensor."""
        states = self.states
        return (
            len(params) == len(self.members)
            and all(map(operator.is_, params, self.members))
            and all(map(operator.is_, map(state.get, self.ps), states))
            and all(map(operator.is_, map(_EXP_AVG, states), self.ms))
            and all(map(operator.is_, map(_EXP_AVG_SQ, states), self.vs))
            and list(map(torch.Tensor.data_ptr, self.ps)) == self.ptrs
        )


def _group_statistics(
    flat: torch.Tensor,
    s: _Sample,
    t: Any,
    betas: tuple[float, float],
    eps_lr: tuple[float, float],
    stepped: bool,
    present: list[int] | None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tensor of one parameter group: (RMS of g / sqrt(v_hat_t), the estimated count of
    |g| < eps, ||update|| / ||param||), from `flat`, the group's sampled (parameter, exp_avg,
    exp_avg_sq, gradient) end to end; `t`: the state's step count (host float or device tensor),
    `stepped`: whether the state already holds this gradient; `present`: the tensors to keep
    (those with a gradient), or None for all; `scale`: the clipping factor the gradient will be
    multiplied by before the step (None: 1)."""
    b1, b2 = betas
    eps, lr = eps_lr
    P, M, V, G = flat.float().reshape(4, s.width).unbind(0)
    if isinstance(t, torch.Tensor):
        t = t.to(G.device, torch.float32)
    if scale is not None:  # the gradient Adam will divide by its second moment: after clipping
        G = G * scale.to(G.device, G.dtype)
    g2 = G * G
    # v_hat_t, the second moment this gradient is (or will be) divided by: the state after
    # the step, or beta2 * v + (1 - beta2) g² before it. It includes g² itself, so the
    # ratio g²/v_hat_t is at most (1 - beta2^t)/(1 - beta2): no tensor whose v is still ~0 (a
    # layer that had no gradient yet) can make it explode, and before/after give the same value.
    # 1 - beta2^t as -expm1(t ln beta2): no cancellation in float32 (beta2 0.9999 at t = 2)
    vt, tt = (V, t) if stepped else (V * b2 + g2 * (1.0 - b2), t + 1.0)
    # the update Adam just applied: lr * m_hat / (sqrt(v_hat) + eps), against the parameter
    step = M / ((V / (1.0 - b2**t)).sqrt() + eps)
    rows = s.row  # the per-element quantities written into the sample's buffer (no stack)
    torch.div(g2, (vt / _one_minus_pow(b2, tt)).clamp_min(eps * eps), out=rows[0])
    torch.lt(G.abs(), eps, out=rows[1])  # (as 0.0 / 1.0)
    torch.mul(step, step, out=rows[2])
    torch.mul(P, P, out=rows[3])
    mean = s.means()
    sizes = s.sizes
    if present is not None:
        mean, sizes = mean[:, present], sizes[present]
    root = mean.sqrt()  # (of all four rows at once: the counts' row is read from `mean`)
    return (
        root[0],
        mean[1] * sizes,  # (estimated) count of |g| < eps
        root[2] * (lr / (1.0 - b1**t)) / root[3].clamp(min=1e-30),
    )


class AdamStatistics:
    """Per tensor of an Adam-like optimizer (state `exp_avg` and `exp_avg_sq`, group `betas` and
    `eps`): the segments `mech_adam_rms`, `mech_adam_small`, `mech_adam_update`."""

    def __init__(self, optimizer: Any, names_of: Callable[[], dict[int, str]]) -> None:
        self.optimizer = optimizer
        self._names_of = names_of  # id(param) -> name
        self._groups: dict[int, _Group] = {}
        self._steps = 0  # optimizer steps since attaching (our own step post-hook: a host count)
        self._grad_at: int | None = None  # `_steps` when a gradient last reached the watched parameter
        self._hooks: list = []
        self.watch()

    def watch(self) -> None:
        """(Again, after `remove`:) hooks that tell, on the host and without a device read, whether optimizer.step() ran
        since the last backward: the first trainable parameter's post-accumulate-grad hook (one
        Python call per backward) and the optimizer's step post-hook."""
        opt = self.optimizer
        p = next(
            (
                p
                for g in getattr(opt, "param_groups", ())
                for p in g["params"]
                # a lazy parameter (LazyLinear before its first forward) takes no hook yet: with only
                # lazy ones, the step is told from the forward as before
                if isinstance(p, torch.Tensor) and p.requires_grad and not is_lazy(p)
            ),
            None,
        )
        if (
            self._hooks
            or p is None
            or not hasattr(p, "register_post_accumulate_grad_hook")
            or not hasattr(opt, "register_step_post_hook")
        ):
            return
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_arrived),
            opt.register_step_post_hook(self._step_done),
        ]

    def _grad_arrived(self, _p: Any) -> None:
        self._grad_at = self._steps

    def _step_done(self, *_: Any) -> None:
        self._steps += 1

    def stepped(self, fallback: bool) -> bool:
        """Whether the optimizer already stepped on the gradient now in `.grad` (`fallback`, the
        caller's guess, when no gradient reached the watched parameter since the last call)."""
        at, self._grad_at = self._grad_at, None
        return fallback if at is None else self._steps > at

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _group(self, gi: int, group: dict) -> _Group | None:
        """The group's parameters with Adam state, cached while they stay what it read
        (`_Group.current`: Adam updates its state in place; `load_state_dict`, `p.data = ...`, a
        replaced moment or parameter, or a parameter's first step makes it again)."""
        state, params = self.optimizer.state, group["params"]
        hit = self._groups.get(gi)
        if hit is not None and hit.size == len(state) and hit.current(state, params):
            return hit
        ps: list[torch.Tensor] = []
        ms: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        states: list[Any] = []
        for p in params:
            st = state.get(p)
            m, v = (st.get("exp_avg"), st.get("exp_avg_sq")) if st else (None, None)
            if m is None or v is None or p.is_sparse or v.shape != p.shape:  # e.g. a factored v
                continue
            ps.append(p)
            ms.append(m)
            vs.append(v)
            states.append(st)
        if not ps or len({t.device for t in ps}) > 1:
            self._groups.pop(gi, None)
            return None
        names = self._names_of()
        out = self._groups[gi] = _Group(
            params, ps, ms, vs, states, [names.get(id(p), f"param{k}") for k, p in enumerate(ps)], len(state)
        )
        return out

    def measure(
        self, stepped: bool, steps_seen: int, clip_scale: Callable[[], torch.Tensor | None] | None = None
    ) -> tuple[list[str], list[Segment], float, float]:
        """(tensor names, segments, gradient elements the |g| < eps counts are out of, the largest
        bound sqrt((1 - beta2^t) / (1 - beta2)) of the ratio over the groups measured); `stepped`:
        the caller's guess whether optimizer.step() already ran for this gradient (the hooks' answer
        wins); `steps_seen`: a host count of the optimizer's steps (a fused / capturable one keeps
        its count on the device); `clip_scale`: the loop's clipping factor, read only before the
        step (Adam will see the clipped gradient)."""
        stepped = self.stepped(stepped)
        scale = clip_scale() if clip_scale is not None and not stepped else None
        names: list[str] = []
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rms, small, update) per group
        elements, bound = 0.0, 0.0
        for gi, group in enumerate(self.optimizer.param_groups):
            betas = group.get("betas")
            if betas is None or "eps" not in group:
                continue
            if (g := self._group(gi, group)) is None:
                continue
            grads = list(map(_grad_of, g.ps))
            missing = {k for k, x in enumerate(grads) if x is None or x.is_sparse}
            if len(missing) == len(grads):
                continue
            present = [k for k in range(len(grads)) if k not in missing]
            for k in missing:  # no (dense) gradient this step: Adam skips them, and so do these statistics
                grads[k] = torch.zeros_like(g.ps[k])
            # the first step's ratio is 1 by construction: nothing to tell yet. The step count is
            # read from the group's first state (the others step with it); a fused / capturable
            # optimizer's lives on the device: the host count stands in (no sync); a CPU one is read once
            t = g.first.get("step", 0.0)
            on_device = isinstance(t, torch.Tensor) and t.device.type != "cpu"
            # (off the device `t` becomes the host float, exact: the maths then takes no device ops for it)
            t_state = steps_seen if on_device else (t := float(t))
            if t_state < (2 if stepped else 1):
                continue
            (b1, b2), eps, lr = (float(b) for b in betas), float(group["eps"]), float(group["lr"])
            s = g.sample
            # the step count of this gradient's update, on the host (the state's before the step + 1)
            t_host = t_state + (0.0 if stepped else 1.0)
            bound = max(bound, ratio_bound(b2, t_host))
            names += [s.names[k] for k in present]
            elements += s.elements - sum(g.ps[k].numel() for k in missing)
            flat = torch.cat(g.fixed + s.reads(grads))  # (cat promotes mixed dtypes)
            parts.append(
                _group_statistics(flat, s, t, (b1, b2), (eps, lr), stepped, present if missing else None, scale)
            )
        if not names:
            return [], [], 0.0, 0.0
        rms, small, upd = [torch.cat(x) if len(x) > 1 else x[0] for x in zip(*parts)]  # (one group: no copy)
        return (
            names,
            [
                Segment("mech_adam_rms", rms, Reduce.MAX),
                Segment("mech_adam_small", small, Reduce.MAX),
                Segment("mech_adam_update", upd, Reduce.MAX),
            ],
            elements,
            bound,
        )

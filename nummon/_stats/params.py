"""Which parameters are watched, re-scanned cheaply when the model or optimizer grows."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .distributed import local_tensor, norm_rules
from .optim import OptimizerView

__all__ = ["WatchedParams", "dense_grads"]

_grad = operator.attrgetter("grad")
_sparse = operator.attrgetter("is_sparse")
_is_none = functools.partial(operator.is_, None)


def dense_grads(params: Any) -> list[torch.Tensor] | None:
    """The `.grad` of each of `params` as it is, or None when one is missing or sparse (map and
    any in C: no Python call per tensor)."""
    grads = list(map(_grad, params))
    return None if any(map(_is_none, grads)) or any(map(_sparse, grads)) else grads


class _RegistrationFlag:
    """Set whenever any module registers a parameter or submodule (global torch hooks), so the
    per-step check for a grown model is one attribute read, not a walk of the model."""

    def __init__(self) -> None:
        self.dirty = False
        self._handles = [
            nn.modules.module.register_module_parameter_registration_hook(self._set),
            nn.modules.module.register_module_module_registration_hook(self._set),
        ]

    def _set(self, *_: Any) -> None:
        self.dirty = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class WatchedParams:
    """The model's trainable parameters, plus any the optimizer holds that the model does not.

    `refresh()` runs every step and re-scans only when the optimizer's parameter count changed
    (`add_param_group`) or some module registered a parameter or submodule since the last scan.
    """

    def __init__(self, model: nn.Module | None, optim: OptimizerView) -> None:
        self.model = model
        self.optim = optim
        # FSDP1 shards every parameter of the wrapped model (flat or original-parameter views)
        self.all_sharded = model is not None and any(
            type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()
        )
        optim.all_sharded = self.all_sharded
        self._flag = _RegistrationFlag() if model is not None else None
        self.named: list[tuple[str, nn.Parameter]] = []
        self.params: list[torch.Tensor] = []  # the nn.Parameters of `named`, read as tensors
        self.names: list[str] = []
        self.local_views = False
        self._optim_count = -1
        self.scan()

    def scan(self) -> None:
        named: list[tuple[str, nn.Parameter]] = []
        if self.model is not None:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        seen = {id(p) for _, p in named}
        opt = self.optim.optimizer
        if opt is not None:
            named += [
                (f"param_group{gi}.{pi}", p)
                for gi, g in enumerate(opt.param_groups)
                for pi, p in enumerate(g["params"])
                if id(p) not in seen and p.requires_grad
            ]
        # a lazy module's parameters (LazyLinear before its first forward) have no shape yet:
        # watched once the first forward has materialised them (in place: same objects)
        self.lazy = [p for _, p in named if is_lazy(p)]
        if self.lazy:
            named = [(n, p) for n, p in named if not is_lazy(p)]
        self.named = named
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.local_views = any(callable(getattr(p, "to_local", None)) for p in self.params)
        self.has_complex = any(p.is_complex() for p in self.params)
        self.param_rules = norm_rules(self.params, self.all_sharded)  # gradients share them
        self._optim_count = self.optim.param_count()
        if self._flag is not None:
            self._flag.dirty = False

    def refresh(self) -> bool:
        """Re-scan if something may have been added; True when the watched set changed."""
        if (
            (self._flag is None or not self._flag.dirty)
            and self.optim.param_count() == self._optim_count
            and not (self.lazy and not all(map(is_lazy, self.lazy)))
        ):
            return False
        before = len(self.params)
        self.scan()
        return len(self.params) != before

    def grads(self, dev: torch.device, distributed: bool) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor]]:
        """(what the kernels measure, their names, the gradients as they are).

        Missing gradients are left out, or under torch.distributed replaced by zero placeholders
        (the layout must be the same on every rank); DTensor shards give their local part,
        sparse gradients their values, complex ones their (re, im) view.
        """
        grads, names = list(map(_grad, self.params)), self.names  # map/any in C: no Python work per tensor
        if any(map(_is_none, grads)):
            if distributed:
                grads = [torch.zeros((), device=dev) if g is None else g for g in grads]
            else:
                names = [n for n, g in zip(names, grads) if g is not None]
                grads = [g for g in grads if g is not None]
        raw = grads
        if self.local_views:
            grads = self.local(grads)
        if any(map(_sparse, grads)):
            grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if self.has_complex:
            grads = [torch.view_as_real(g) if g.is_complex() else g for g in grads]
        return grads, names, raw

    def local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The rank-local parts of DTensor (FSDP2) shards; other tensors as they are."""
        return [local_tensor(t) for t in tensors] if self.local_views else tensors

    def close(self) -> None:
        if self._flag is not None:
            self._flag.remove()

"""What nummon reads from the optimizer: its first-moment state tensors, its LR, its kind."""

from __future__ import annotations

import operator
from typing import Any

import torch

from .distributed import norm_rules

__all__ = ["OptimizerView"]

_PARAMS = operator.itemgetter("params")
_STATE_KEYS = ("momentum_buffer", "exp_avg")  # the first-moment state of SGD / Adam-family optimizers


class OptimizerView:
    """Read-only view of an optimizer (or of none)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.optimizer = optimizer
        # (the mapping, its length, the tensors found, and where each was: its parameter, that
        # parameter's state, the key)
        self._state_cache: tuple[Any, int, list[torch.Tensor], tuple[list, list, list]] = (None, -1, [], ([], [], []))
        self.all_sharded = False  # FSDP1: every state tensor is a shard (set by the collector)
        self.state_rules: tuple[str, ...] = ()  # each state tensor's cross-rank norm rule

    def state_tensors(self) -> list[torch.Tensor]:
        """The first-moment state tensor of every parameter that has one (cached)."""
        opt = self.optimizer
        if opt is None:
            return []
        state = opt.state
        cached_state, cached_n, found, where = self._state_cache
        # state appears lazily after the first step; load_state_dict replaces the whole mapping, and
        # a parameter's state or moment can be replaced under the same key (`opt.state[p] = {}`
        # makes it anew at the next step): each found tensor must still be where it was
        if state is not cached_state or len(state) != cached_n or not _still_there(state, where, found):
            found, where = [], ([], [], [])
            params, states, keys = where
            for p, st in state.items():
                for key in _STATE_KEYS:
                    t = st.get(key) if isinstance(st, dict) else None
                    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                        found.append(t)
                        params.append(p)
                        states.append(st)
                        keys.append(key)
                        break
            self._state_cache = (state, len(state), found, where)
            self.state_rules = norm_rules(found, self.all_sharded)
        return found

    def lr(self) -> tuple[float | None, torch.Tensor | None]:
        """The first group's LR, read once: (a float, None), or (None, the tensor) for a tensor LR
        (capturable optimizers), which then rides in the packed vector instead of a host read."""
        opt = self.optimizer
        if opt is None or not opt.param_groups:
            return None, None
        lr = opt.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            return None, lr.detach().reshape(1)
        if lr is None:  # no "lr" key: float(None) would raise TypeError, read as no LR below too
            return None, None
        try:
            return float(lr), None
        except (TypeError, ValueError):
            return None, None

    def param_count(self) -> int:
        """Parameters across groups: cheap (a length per group), to notice `add_param_group`."""
        opt = self.optimizer
        return 0 if opt is None else sum(map(len, map(_PARAMS, opt.param_groups)))  # in C: no Python call per group

    def kind(self) -> str | None:
        """ "sgd", "sgd_momentum", "adam" (any Adam variant) or the class name, lower case."""
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


def _still_there(state: Any, where: tuple[list, list, list], found: list[torch.Tensor]) -> bool:
    """Whether each tensor found is still its parameter's state under its key (maps in C: ~0.13 µs
    a tensor, on the steps the optimizer state is measured)."""
    params, states, keys = where
    return all(map(operator.is_, map(state.get, params), states)) and all(
        map(operator.is_, map(dict.get, states, keys), found)
    )

"""Where an operator runs: the user's source line (a cheap frame walk) and the module path
(global forward hooks, installed only while the explanation runs). Also keeps the modules'
buffers as they were, because a forward in train mode updates BatchNorm's running statistics."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import warnings
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils._pytree import tree_leaves

from .._stats.compiled import is_compile_wrapper

__all__ = ["ModuleScope", "user_location"]


def _dir_prefix(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


_TORCH_DIR = _dir_prefix(torch.__file__)
_NUMMON_DIR = os.path.dirname(_dir_prefix(__file__).rstrip(os.sep)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
# nummon's demo is a training script like the user's: its lines are the answer, not machinery.
_NUMMON_USER_FILES = frozenset({os.path.join("_tools", "demo.py"), os.path.join("_tools", "demo_model.py")})


def _is_library(filename: str) -> bool:
    """Frames of torch, of nummon's own machinery and of the standard library are never the
    user's line (site-packages below the stdlib, e.g. transformers' models, are)."""
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename) if not os.path.isabs(filename) else filename
    if path.startswith(_TORCH_DIR):
        return True
    if path.startswith(_NUMMON_DIR):
        return path[len(_NUMMON_DIR) :] not in _NUMMON_USER_FILES
    if path.startswith(_STDLIB_DIR):
        return "site-packages" not in path and "dist-packages" not in path
    return False


def user_location() -> tuple[str, int] | None:
    """(filename, line) of the innermost frame outside torch, nummon and the stdlib; a walk over
    frame objects only (no source reading), so it is cheap enough for every grad-recording op."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def source_text(location: tuple[str, int] | None) -> str | None:
    """The stripped code of that line, or None when the file cannot be read."""
    if location is None:
        return None
    return linecache.getline(location[0], location[1]).strip() or None


class ModuleScope:
    """A stack of the modules whose forward is running, their dotted paths, the tensors they
    were given and a snapshot of every buffer they own, taken before their first forward."""

    def __init__(self, model: nn.Module | None = None) -> None:
        # the model nummon watches: module paths are its qualified names (`net.2`, not `2`, where
        # the loop calls `model.net(x)`)
        self.model = model
        self._model_names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self._stack: list[tuple[nn.Module, str]] = []
        self._roots: list[nn.Module] = []
        self._names: dict[int, dict[int, str]] = {}  # id(root) -> {id(module): dotted path}
        self._seen: set[int] = set()
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.inputs: list[tuple[torch.Tensor, str]] = []  # (tensor, "input to <module>")
        self._handles: list[Any] = []
        self._quiet: warnings.catch_warnings | None = None

    # -- hooks -------------------------------------------------------------------------------
    def install(self) -> None:
        # torch warns that global hooks also fire for torch.compile's wrapper; `_enter` skips the
        # wrapper, so to the user that warning would only say something nummon already handles
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", r"Using `torch\.compile\(module\)` when there are global hooks", UserWarning)
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._enter),
            module_hooks.register_module_forward_hook(self._leave, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None

    def _enter(self, module: nn.Module, args: Any) -> None:
        if is_compile_wrapper(module):  # torch.compile's wrapper: its module is the root (no `_orig_mod.` in names)
            return
        path = self._path_of(module)
        if not self._stack and all(root is not module for root in self._roots):
            self._roots.append(module)
        self._stack.append((module, path))
        if id(module) not in self._seen:
            self._seen.add(id(module))
            self._snapshot_buffers(module)
            label = path or type(module).__name__
            for tensor in tree_leaves(args):
                if isinstance(tensor, torch.Tensor):
                    self.inputs.append((tensor, f"input to {label}"))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        # always_call: also runs when the forward raised, so the stack stays balanced.
        if self._stack and self._stack[-1][0] is module:
            self._stack.pop()

    def _path_of(self, module: nn.Module) -> str:
        """Dotted path from the outermost running module ("" for that root itself); the
        roots' name tables are built once, so a deep model costs O(modules), not O(modules²)."""
        known = self._model_names.get(id(module))
        if known:
            if not self._stack:
                self._names.setdefault(id(module), {id(m): name for name, m in module.named_modules()})
            return known
        if not self._stack:
            self._names.setdefault(id(module), {id(m): name for name, m in module.named_modules()})
            return ""
        for table in [self._names[id(self._stack[0][0])], *self._names.values()]:
            name = table.get(id(module))
            if name:
                return name
        return type(module).__name__

    @property
    def current(self) -> str | None:
        """The module path the next operator runs in; the root's class name at its top level."""
        if not self._stack:
            return None
        module, path = self._stack[-1]
        return path or type(module).__name__

    # -- naming tensors that came from outside -----------------------------------------------
    def describe(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """('parameter encoder.fc1.weight' | 'buffer bn.running_var' | 'input to Net', that
        tensor) when `tensor` is (a view of) one of those; None otherwise."""
        ptr = _storage_ptr(tensor)
        for root in [self.model, *self._roots] if self.model is not None else self._roots:
            for kind, named in (("parameter", root.named_parameters()), ("buffer", root.named_buffers())):
                for name, value in named:
                    if value is tensor or (ptr is not None and _storage_ptr(value) == ptr):
                        return f"{kind} {name}", value
        for value, label in self.inputs:
            if value is tensor or (ptr is not None and _storage_ptr(value) == ptr):
                return label, value
        return None

    def role(self, tensor: torch.Tensor) -> tuple[str, str]:
        """(role, label) of an operand: ("weights", "parameter fc1.weight"), ("data", "the batch")
        for what the outermost module or fn was given, else ("activations", its label)."""
        named = self.describe(tensor)
        if named is None:
            return "activations", "an activation"
        label = named[0]
        if label.startswith("parameter "):
            return "weights", label
        # the data: what fn or the model was given (without the model: the outermost module that ran)
        outer = [self.model] if self.model is not None else self._roots
        roots = {f"input to {self._model_names.get(id(r)) or type(r).__name__}" for r in outer}
        if label.startswith("argument ") or label in roots:
            return "data", f"the batch ({label})"
        return "activations", f"the activation ({label})"

    def largest_parameter(self) -> tuple[str, float] | None:
        """(name, max |w|) of the largest finite weight of the models that ran (failure path only)."""
        best: tuple[str, float] | None = None
        models = [self.model] if self.model is not None else self._roots
        for root in models:
            for name, p in root.named_parameters():
                values = p.detach().float().abs()
                values = values[torch.isfinite(values)]
                if values.numel() and (best is None or float(values.max()) > best[1]):
                    best = (name, float(values.max()))
        return best

    # -- buffers -----------------------------------------------------------------------------
    def _snapshot_buffers(self, module: nn.Module) -> None:
        for buffer in module.buffers():
            if id(buffer) not in self._buffers:
                self._buffers[id(buffer)] = (buffer, buffer.detach().clone())

    def restore_buffers(self) -> None:
        """Put every buffer back bit for bit (copy only where it changed: no version bump)."""
        with torch.no_grad():
            for buffer, saved in self._buffers.values():
                if buffer.shape == saved.shape and not torch.equal(buffer, saved):
                    buffer.copy_(saved)


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta without storage
        return None

"""Lazy imports of optional backends, with an install hint that names the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import `module` or raise ImportError telling which nummon extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is not installed ({e}); install it with: pip install 'nummon[{extra}]'") from None

"""One table of dtype names: torch dtypes as the plain strings detectors and records use."""

from __future__ import annotations

import torch

from .._core.maths import DTYPE_MAX

__all__ = ["HALF_DTYPES", "dtype_name", "narrowest"]

_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.complex128: "float64",  # a complex number's parts have its real dtype's range
    torch.complex64: "float32",
    torch.complex32: "float16",
}

#: 16-bit floats: reduced in float32 where a kernel would otherwise lose range or precision.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """The name of `dtype`'s range as `DTYPE_MAX` knows it ("float32" for anything else)."""
    return _NAMES.get(dtype, "float32")


def narrowest(a: str | None, b: str) -> str:
    """Of two dtype names, the one with the smaller largest finite value (`a` may be None)."""
    if a is None:
        return b
    return a if DTYPE_MAX[a] <= DTYPE_MAX[b] else b

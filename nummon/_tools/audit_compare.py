"""Walking a checkpoint's tensors and comparing two checkpoints exactly, in bounded memory.

Keys are tuples of dict keys and list indices (so a top-level "a.b" never collides with
{"a": {"b": ...}}); complex tensors compare both parts; integers compare and report their
difference exactly (Python integers beyond 2^53); tensors are read in chunks of CHUNK elements.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

from .._core.errors import NummonError

__all__ = ["CHUNK", "compare", "iter_tensors", "key_name", "numeric_chunks", "numeric_view"]

CHUNK = 1 << 22  # elements read at once: bounds the temporaries to tens of MB
_MAX_DEPTH = 64  # nesting of dicts / lists a checkpoint may have (guards against cycles)
_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_WIDEN = (torch.float16, torch.bfloat16) + tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_SMALL_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n))
_EXACT_INT64 = 1 << 62  # below this magnitude int64 subtraction cannot overflow


def key_name(path: tuple) -> str:
    """A readable name for a key path: dotted, with keys that hold dots or brackets quoted."""
    if not path:
        return "<root>"
    parts = []
    for k in path:
        s = str(k)
        if isinstance(k, str) and (not s or any(c in s for c in '.[]"')):
            parts.append(f"[{json.dumps(s)}]")
        else:
            parts.append(("." if parts else "") + s)
    return "".join(parts)


def iter_tensors(obj: Any, path: tuple = (), depth: int = 0) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(key path, tensor) for every tensor in nested dicts / lists / tuples / modules."""
    if depth > _MAX_DEPTH:
        raise NummonError(f"checkpoint nests deeper than {_MAX_DEPTH} levels at {key_name(path)}")
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, path + (k,), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, path + (i,), depth + 1)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):  # a pickled module (with trust)
        yield from iter_tensors(obj.state_dict(), path, depth + 1)


def numeric_view(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """The values to check as a plain strided tensor (complex as real pairs, quantized
    dequantized, sparse as stored values), or None with the reason it cannot be read."""
    t = t.detach()
    note = None
    if t.is_meta:
        return None, "meta tensor: no data to check"
    try:
        if t.is_quantized:
            note = f"quantized ({str(t.dtype).replace('torch.', '')}): checked after dequantizing"
            t = t.dequantize()
        if t.layout in _SPARSE:
            name = str(t.layout).replace("torch.sparse_", "")
            t = t.coalesce().values() if t.layout is torch.sparse_coo else t.values()
            note = f"sparse ({name}): {t.numel()} stored values checked"
        elif t.layout is not torch.strided:
            return None, f"layout {t.layout} not checked"
        if t.dtype is torch.complex32:
            t = t.to(torch.complex64)
        if t.is_complex():
            t = torch.view_as_real(t)
    except (RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"not checked: {first[:120]}"
    return t, note


def numeric_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Flat chunks of CHUNK elements; narrow floats widened to float32 and small unsigned ints
    to int64 per chunk (their own kernels are missing), the rest as stored."""
    flat = t.reshape(-1)
    for start in range(0, max(flat.numel(), 1), CHUNK):
        c = flat[start : start + CHUNK]
        if c.dtype in _WIDEN:
            c = c.float()
        elif c.dtype in _SMALL_UNSIGNED or c.dtype is torch.bool:
            c = c.to(torch.int64)
        yield c


def _float_diff(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Equality (NaN equals NaN), max |difference| where both are finite, finite-mismatch
    count, and which side holds non-finite values."""
    equal, mismatch, top = True, 0, None
    nf_a = nf_b = False
    for cx, cy in zip(numeric_chunks(x), numeric_chunks(y)):
        fx, fy = torch.isfinite(cx), torch.isfinite(cy)
        nf_a |= not bool(fx.all())
        nf_b |= not bool(fy.all())
        mismatch += int((fx != fy).sum())
        if not bool(((cx == cy) | (torch.isnan(cx) & torch.isnan(cy))).all()):
            equal = False
        both = fx & fy
        if bool(both.any()):
            m = float(torch.where(both, (cx.double() - cy.double()).abs(), 0.0).max())
            top = m if top is None else max(top, m)
    return {
        "equal": equal,
        "max_abs_diff": top if top is not None else float("nan"),
        "nonfinite_mismatch": mismatch,
        "nonfinite_a": nf_a,
        "nonfinite_b": nf_b,
    }


def _int_diff(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Exact equality and exact max |difference| of integer tensors (a Python int)."""
    top = 0
    equal = True
    for cx, cy in zip(numeric_chunks(x), numeric_chunks(y)):
        if cx.dtype is torch.uint64:  # few kernels exist for uint64: compare as Python ints
            pairs = [(a, b) for a, b in zip(cx.tolist(), cy.tolist()) if a != b]
        else:
            ne = cx != cy
            if not bool(ne.any()):
                continue
            bound = max(abs(int(cx.min())), abs(int(cx.max())), abs(int(cy.min())), abs(int(cy.max())))
            if bound < _EXACT_INT64:
                equal = False
                top = max(top, int((cx.to(torch.int64) - cy.to(torch.int64)).abs().max()))
                continue
            pairs = list(zip(cx[ne].tolist(), cy[ne].tolist()))
        if pairs:
            equal = False
            top = max(top, max(abs(a - b) for a, b in pairs))
    return {"equal": equal, "max_abs_diff": top}


def compare(a: Any, b: Any) -> dict[str, Any]:
    """Differences between two loaded checkpoints: keys only in one, shape/dtype changes, max
    |difference| (over finite values; exact for integers), non-finite values in one only, and
    tensors that could not be compared (meta) with the reason."""
    ta, tb = dict(iter_tensors(a)), dict(iter_tensors(b))

    def order(k: tuple) -> tuple[str, str]:
        return key_name(k), repr(k)

    only_a = [key_name(k) for k in sorted(set(ta) - set(tb), key=order)]
    only_b = [key_name(k) for k in sorted(set(tb) - set(ta), key=order)]
    common = sorted(set(ta) & set(tb), key=order)
    changed, diffs, nonfinite_one, skipped = [], [], [], []
    for k in common:
        name, x, y = key_name(k), ta[k].detach(), tb[k].detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            changed.append({"key": name, "a": [list(x.shape), str(x.dtype)], "b": [list(y.shape), str(y.dtype)]})
            continue
        if x.layout in _SPARSE or y.layout in _SPARSE:  # the stored values of two sparse tensors need not align
            x, y = x.to_dense(), y.to_dense()
        (vx, why_x), (vy, why_y) = numeric_view(x), numeric_view(y)
        if vx is None or vy is None:
            skipped.append({"key": name, "reason": why_x if vx is None else why_y})
            continue
        if vx.is_floating_point():
            d = _float_diff(vx, vy)
            if d["nonfinite_a"] != d["nonfinite_b"]:
                nonfinite_one.append({"key": name, "nonfinite_in": "a" if d["nonfinite_a"] else "b"})
            if not d["equal"]:
                diffs.append(
                    {"key": name, "max_abs_diff": d["max_abs_diff"], "nonfinite_mismatch": d["nonfinite_mismatch"]}
                )
        else:
            d = _int_diff(vx, vy)
            if not d["equal"]:
                diffs.append({"key": name, "max_abs_diff": d["max_abs_diff"]})
    return {
        "identical": not (only_a or only_b or changed or diffs or skipped),
        "only_in_a": only_a,
        "only_in_b": only_b,
        "shape_or_dtype_changed": changed,
        "different": diffs,
        "nonfinite_in_one_only": nonfinite_one,
        "not_compared": skipped,
        "compared": len(common) - len(skipped),
    }

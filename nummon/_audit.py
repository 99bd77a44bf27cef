"""`nummon audit`: NaN/Inf census of checkpoints, and a comparison of two.

Checkpoints load with ``torch.load(..., weights_only=True)``: a file that needs pickled code is
refused unless the user passes ``--trust``.
"""
from __future__ import annotations

import json
import math
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ._errors import NummonError
from ._functional import headroom_decades

_DT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


@dataclass
class TensorAudit:
    """Census of one tensor (counts exact; max_abs over finite values; headroom in decades)."""

    key: str
    shape: list[int]
    dtype: str
    numel: int
    nan: int
    posinf: int
    neginf: int
    max_abs: float | None
    headroom: float | None

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


def load_checkpoint(path: str | Path, trust: bool = False) -> Any:
    """Load a checkpoint safely (weights_only unless `trust`); raise NummonError on any failure."""
    p = Path(path)
    if not p.exists():
        raise NummonError(f"checkpoint not found: {p}")
    if p.is_dir():
        raise NummonError(f"checkpoint is a directory: {p}")
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise NummonError("reading .safetensors needs the safetensors package: pip install 'nummon[safetensors]'") from None
        try:
            return load_file(str(p))
        except Exception as e:
            raise NummonError(f"cannot read checkpoint {p}: {_first_line(e)}") from None
    try:
        return torch.load(p, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as e:
        if not trust:
            raise NummonError(
                f"checkpoint {p} needs pickled code to load and was refused (weights_only=True); "
                f"pass --trust only if you trust its source ({_first_line(e)[:120]})"
            ) from None
        raise NummonError(f"cannot read checkpoint {p}: {_first_line(e)}") from None
    except Exception as e:  # truncated zip, garbage bytes, EOF: all one message
        msg = _first_line(e)
        if "weights_only" in msg.lower() or "unsupported global" in msg.lower():
            raise NummonError(f"checkpoint {p} needs pickled code to load and was refused; pass --trust only if you trust its source") from None
        raise NummonError(f"cannot read checkpoint {p}: file is truncated or not a checkpoint ({msg[:160]})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) for every tensor in nested dicts / lists / tuples / objects."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<root>", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):  # a pickled module (with --trust)
        yield from iter_tensors(obj.state_dict(), prefix)


def audit_tensor(key: str, t: torch.Tensor) -> TensorAudit:
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    nan = posinf = neginf = 0
    max_abs = headroom = None
    if t.is_floating_point() or t.is_complex():
        x = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        if t.is_complex():
            x = torch.view_as_real(t)
        nan = int(torch.isnan(x).sum())
        posinf = int(torch.isposinf(x).sum())
        neginf = int(torch.isneginf(x).sum())
        fin = x[torch.isfinite(x)]
        if fin.numel():
            max_abs = float(fin.abs().max())
            headroom = headroom_decades(max_abs, _DT.get(t.dtype, "float32"))
    elif t.numel() and t.dtype != torch.bool:
        max_abs = float(t.abs().max())
    return TensorAudit(key, list(t.shape), str(t.dtype).replace("torch.", ""), t.numel(), nan, posinf, neginf, max_abs, headroom)


def audit(obj: Any) -> list[TensorAudit]:
    return [audit_tensor(k, t) for k, t in iter_tensors(obj)]


def compare(a: Any, b: Any) -> dict[str, Any]:
    """Differences between two checkpoints: keys, shapes/dtypes, max |difference|, non-finite in one only."""
    ta, tb = dict(iter_tensors(a)), dict(iter_tensors(b))
    only_a = sorted(set(ta) - set(tb))
    only_b = sorted(set(tb) - set(ta))
    changed, diffs, nonfinite_one = [], [], []
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            changed.append({"key": k, "a": [list(x.shape), str(x.dtype)], "b": [list(y.shape), str(y.dtype)]})
            continue
        if x.is_floating_point() or x.is_complex():
            fa, fb = bool(torch.isfinite(x).all()), bool(torch.isfinite(y).all())
            if fa != fb:
                nonfinite_one.append({"key": k, "nonfinite_in": "a" if not fa else "b"})
            equal = torch.equal(x, y) or bool(torch.isclose(x, y, rtol=0, atol=0, equal_nan=True).all())
            if not equal:
                d = (x.double() - y.double()).abs()
                mismatch = int((torch.isfinite(x) != torch.isfinite(y)).sum())
                d = d[torch.isfinite(d)]
                diffs.append({"key": k, "max_abs_diff": float(d.max()) if d.numel() else math.nan,
                              "nonfinite_mismatch": mismatch})
        elif not torch.equal(x, y):
            diffs.append({"key": k, "max_abs_diff": float((x.double() - y.double()).abs().max())})
    identical = not (only_a or only_b or changed or diffs)
    return {
        "identical": identical,
        "only_in_a": only_a,
        "only_in_b": only_b,
        "shape_or_dtype_changed": changed,
        "different": diffs,
        "nonfinite_in_one_only": nonfinite_one,
        "compared": len(set(ta) & set(tb)),
    }


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.4g}"


def run_audit(args: Any) -> int:
    """CLI: exit 1 when any tensor holds NaN/Inf, 0 otherwise; errors exit 2 (raised)."""
    first = load_checkpoint(args.ckpt, trust=args.trust)
    second = load_checkpoint(args.ckpt2, trust=args.trust) if args.ckpt2 else None
    rows = audit(first)
    rows2 = audit(second) if second is not None else []
    cmp = compare(first, second) if second is not None else None
    bad = sum(r.nonfinite > 0 for r in rows) + sum(r.nonfinite > 0 for r in rows2)
    if args.format == "json":
        out: dict[str, Any] = {"checkpoint": str(args.ckpt), "tensors": [asdict(r) for r in rows],
                               "summary": _summary(rows)}
        if second is not None:
            out["checkpoint2"] = str(args.ckpt2)
            out["tensors2"] = [asdict(r) for r in rows2]
            out["summary2"] = _summary(rows2)
            out["comparison"] = cmp
        print(json.dumps(out, indent=1, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else str(v)))
        return 1 if bad else 0
    for path, rs in ((args.ckpt, rows), (args.ckpt2, rows2)) if second is not None else ((args.ckpt, rows),):
        print(f"{path}:")
        _print_table(rs)
        s = _summary(rs)
        print(f"  {s['tensors']} tensors, {s['elements']} elements; {s['nonfinite_tensors']} with non-finite values "
              f"({s['nan']} NaN, {s['posinf']} +Inf, {s['neginf']} -Inf); min headroom {_fmt(s['min_headroom'])} decades")
    if cmp is not None:
        print()
        if cmp["identical"]:
            print(f"identical: {cmp['compared']} tensors compared, no difference")
        else:
            print("different:")
            for k in cmp["only_in_a"]:
                print(f"  only in {args.ckpt}: {k}")
            for k in cmp["only_in_b"]:
                print(f"  only in {args.ckpt2}: {k}")
            for c in cmp["shape_or_dtype_changed"]:
                print(f"  {c['key']}: {c['a']} -> {c['b']}")
            for d in cmp["different"]:
                extra = f"; {d['nonfinite_mismatch']} positions finite in one only" if d.get("nonfinite_mismatch") else ""
                print(f"  {d['key']}: max |difference| {_fmt(d['max_abs_diff'])} over finite values{extra}")
            for n in cmp["nonfinite_in_one_only"]:
                print(f"  {n['key']}: non-finite only in {args.ckpt if n['nonfinite_in'] == 'a' else args.ckpt2}")
    return 1 if bad else 0


def _summary(rows: list[TensorAudit]) -> dict[str, Any]:
    heads = [r.headroom for r in rows if r.headroom is not None]
    return {
        "tensors": len(rows),
        "elements": sum(r.numel for r in rows),
        "nonfinite_tensors": sum(r.nonfinite > 0 for r in rows),
        "nan": sum(r.nan for r in rows),
        "posinf": sum(r.posinf for r in rows),
        "neginf": sum(r.neginf for r in rows),
        "min_headroom": min(heads) if heads else None,
    }


def _print_table(rows: list[TensorAudit]) -> None:
    head = ("tensor", "shape", "dtype", "NaN", "+Inf", "-Inf", "max|x|", "headroom")
    cells = [(r.key, "x".join(map(str, r.shape)) or "scalar", r.dtype, str(r.nan), str(r.posinf), str(r.neginf),
              _fmt(r.max_abs), _fmt(r.headroom)) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]
    print("  " + "  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for c in cells:
        mark = " !" if any(x != "0" for x in c[3:6]) else ""
        print("  " + "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))) + mark)

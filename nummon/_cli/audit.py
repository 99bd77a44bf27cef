"""`nummon audit`: NaN/Inf census of one checkpoint, or two and their comparison.

Exit 1 when any tensor holds NaN/Inf, 0 otherwise, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._core.text import clean_text, fmt_num
from ._common import non_empty

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    a = sub.add_parser(
        "audit",
        help="check checkpoints for NaN/Inf and compare two",
        description="NaN/Inf census of a checkpoint's weights, buffers and optimizer state (exit 1 when "
        "any holds NaN/Inf; non-finite trainer metadata is listed and does not fail it), "
        "or of two checkpoints and what changed between them.",
    )
    a.add_argument(
        "ckpt",
        metavar="CKPT",
        type=non_empty("a checkpoint path"),
        help="a checkpoint (.pt/.pth/.ckpt/.bin, .safetensors, or a folder of shards)",
    )
    a.add_argument(
        "ckpt2",
        metavar="CKPT2",
        nargs="?",
        type=non_empty("a checkpoint path"),
        help="a second checkpoint to compare with the first",
    )
    a.add_argument(
        "--format", choices=("text", "json"), default="text", help="text tables (default) or one JSON report"
    )
    a.add_argument("--trust", action="store_true", help="allow pickled code (only for checkpoints you trust)")
    a.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._tools.audit import audit, report_json

    report = audit(args.ckpt, args.ckpt2, trust=args.trust)
    status = 1 if report.nonfinite_tensors else 0
    if args.format == "json":
        print(report_json(report))
        return status
    for ck in (report.first, report.second):
        if ck is None:
            continue
        print(clean_text(f"{ck.path} ({ck.format}):"))
        _print_table(ck.tensors)
        s = ck.summary
        meta = s.get("nonfinite_metadata", 0)
        extra = (
            f"; {meta} non-finite in trainer metadata (callback or loop state: listed, not failing the audit)"
            if meta
            else ""
        )
        print(
            f"  {s['tensors']} tensors, {s['elements']} elements; {s['nonfinite_tensors']} with non-finite values "
            f"({s['nan']} NaN, {s['posinf']} +Inf, {s['neginf']} -Inf){extra}; "
            f"min headroom {fmt_num(s['min_headroom'])} decades"
        )
        for r in ck.tensors:
            if r.note:
                print(clean_text(f"  note: {r.key}: {r.note}"))
    if report.comparison is not None:
        print()
        _print_comparison(report.comparison, args.ckpt, args.ckpt2)
    return status


def _print_comparison(cmp: dict[str, Any], a: str, b: str) -> None:
    if cmp["identical"]:
        print(f"identical: {cmp['compared']} tensors compared, no difference")
        return
    lines = ["different:"]
    lines += [f"  only in {a}: {k}" for k in cmp["only_in_a"]]
    lines += [f"  only in {b}: {k}" for k in cmp["only_in_b"]]
    lines += [f"  {c['key']}: {c['a']} -> {c['b']}" for c in cmp["shape_or_dtype_changed"]]
    for d in cmp["different"]:
        extra = f"; {d['nonfinite_mismatch']} positions finite in one only" if d.get("nonfinite_mismatch") else ""
        lines.append(f"  {d['key']}: max |difference| {fmt_num(d['max_abs_diff'])} over finite values{extra}")
    lines += [
        f"  {n['key']}: non-finite only in {a if n['nonfinite_in'] == 'a' else b}" for n in cmp["nonfinite_in_one_only"]
    ]
    lines += [f"  {s['key']}: not compared ({s['reason']})" for s in cmp.get("not_compared", [])]
    print("\n".join(clean_text(line) for line in lines))


KEY_WIDTH = 48  # longer keys are shortened in the middle: the table stays readable in a terminal


def short_key(key: str, width: int = KEY_WIDTH) -> str:
    """`key` in at most `width` characters: its start and its end, "…" between."""
    if len(key) <= width:
        return key
    head = (width - 1) // 3
    return key[:head] + "…" + key[len(key) - (width - 1 - head) :]


def _print_table(rows: list) -> None:
    head = ("tensor", "shape", "dtype", "NaN", "+Inf", "-Inf", "max|x|", "headroom")
    cells = [
        (
            short_key(clean_text(r.key)),
            "x".join(map(str, r.shape)) or "scalar",
            r.dtype,
            str(r.nan),
            str(r.posinf),
            str(r.neginf),
            fmt_num(r.max_abs),
            fmt_num(r.headroom),
        )
        for r in rows
    ]
    marks = [" (metadata)" if r.metadata else " !" for r in rows]  # metadata: listed, does not fail the audit
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]
    print("  " + "  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for c, flag in zip(cells, marks):
        mark = flag if any(x != "0" for x in c[3:6]) else ""
        print("  " + "  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))) + mark)

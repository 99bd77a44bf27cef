"""The classic debugging checklist, as functions: overfit one batch, check data, gradients and
weights, LR range test. Everything runs on copies: the user's model and optimizer are never
touched.

Each function returns a report with `status` (PASS, PARTIAL, WARN, FAIL), its numbers, and a
human summary via `str()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._core.errors import NummonError
from ._core.maths import MAD_TO_SIGMA
from ._core.types import Health, StepRecord
from ._forensics import CAUSES, NonfiniteReport, explain_nonfinite
from ._sinks.builtin import as_sink
from ._tools.diagnose_common import (
    Diagnosis,
    LossFn,
    LRRangeReport,
    Report,
    Status,
    copy_model,
    copy_with_batch,
    device_of,
    split_batch,
    to_device,
)
from ._tools.overfit import OVERFIT_LRS, overfit_one_batch

__all__ = [
    "Status",
    "Report",
    "Diagnosis",
    "LRRangeReport",
    "OVERFIT_LRS",
    "overfit_one_batch",
    "check_gradients",
    "check_data",
    "check_loader",
    "check_weights",
    "lr_range_test",
    "run_all",
    "explain_nonfinite",
    "NonfiniteReport",
    "CAUSES",
]

# ------------------------------------------------------------------ overfit one batch

# `overfit_one_batch` (the learning-rate search and its verdict) lives in ._overfit; re-exported here.


# ------------------------------------------------------------------ gradients


def check_gradients(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    explode: float = 1e3,
    vanish_ratio: float = 1e-7,
) -> Report:
    """One forward/backward on a copy; per parameter: no grad (not in the graph), zero,
    non-finite, exploding (norm > `explode`), vanishing (< `vanish_ratio` of the largest layer's)."""
    clone, x, y = copy_with_batch(model, batch)
    clone.zero_grad(set_to_none=True)
    loss = loss_fn(clone(x), y)
    loss.backward()
    per: dict[str, dict[str, Any]] = {}
    norms = {}
    for name, p in clone.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            per[name] = {"problem": "no grad"}
            continue
        g = p.grad.detach()
        finite = bool(torch.isfinite(g).all())
        n = float(torch.linalg.vector_norm(g.double())) if finite else math.nan
        norms[name] = n
        per[name] = {"norm": n, "finite": finite, "zero": finite and n == 0.0}
    top = max((v for v in norms.values() if math.isfinite(v)), default=0.0)
    fails, warns = [], []
    for name, d in per.items():
        if d.get("problem") == "no grad":
            fails.append(f"{name}: no gradient (not in the graph: unused, detached, or requires_grad lost)")
        elif not d["finite"]:
            fails.append(f"{name}: non-finite gradient")
        elif d["zero"]:
            warns.append(f"{name}: gradient exactly zero (dead units, frozen-zero layer, or a detached path)")
        elif d["norm"] > explode:
            warns.append(f"{name}: exploding gradient (norm {d['norm']:.3g} > {explode:g})")
        elif top > 0 and d["norm"] < vanish_ratio * top:
            warns.append(
                f"{name}: vanishing gradient (norm {d['norm']:.3g}, < {vanish_ratio:g} of the largest {top:.3g})"
            )
    status = Status.FAIL if fails else (Status.WARN if warns else Status.PASS)
    return Report("check gradients", status, fails + warns, {"loss": float(loss.detach()), "per_parameter": per})


# ------------------------------------------------------------------ data


def _data_numbers(x: torch.Tensor, y: torch.Tensor | None, num_classes: int | None, outlier_z: float) -> dict[str, Any]:
    nums: dict[str, Any] = {"samples": int(x.shape[0]) if x.dim() else 1}
    if x.is_floating_point():
        xf = x.detach().double()
        finite = torch.isfinite(xf)
        nums["nan"] = int(torch.isnan(xf).sum())
        nums["inf"] = int(torch.isinf(xf).sum())
        vals = xf[finite]
    else:
        vals = x.detach().double().reshape(-1)
        nums["nan"] = nums["inf"] = 0
    flat = x.detach().reshape(x.shape[0], -1) if x.dim() > 1 else x.detach().reshape(-1, 1)
    nums["all_zero_samples"] = int((flat == 0).all(dim=1).sum())
    if vals.numel():
        nums["min"], nums["max"] = float(vals.min()), float(vals.max())
        med = vals.median()
        mad = (vals - med).abs().median()
        scale = float(mad) * MAD_TO_SIGMA
        if scale == 0.0 and vals.numel() > 1:  # over half the values equal: fall back to the std
            scale = float(vals.std())
        if scale > 0:
            z = (vals - med).abs() / scale
            nums["outliers"] = int((z > outlier_z).sum())
            nums["max_robust_z"] = float(z.max())
        else:
            nums["outliers"] = 0
    if y is not None:
        yl = y.detach().reshape(-1)
        if not yl.is_floating_point() or bool((yl == yl.round()).all()):
            yl = yl.long()
            nums["label_min"], nums["label_max"] = int(yl.min()), int(yl.max())
            if num_classes is not None:
                nums["labels_out_of_range"] = int(((yl < 0) | (yl >= num_classes)).sum())
            counts = torch.bincount(yl.clamp(min=0), minlength=num_classes or 0)
            nums["label_counts"] = counts.tolist()
    return nums


def _data_verdict(name: str, nums: dict[str, Any], num_classes: int | None, imbalance_limit: float) -> Report:
    fails, warns = [], []
    if nums.get("nan") or nums.get("inf"):
        fails.append(f"inputs hold {nums['nan']} NaN and {nums['inf']} Inf values")
    if nums.get("labels_out_of_range"):
        fails.append(
            f"{nums['labels_out_of_range']} labels outside [0, {num_classes}) (label range {nums['label_min']}..{nums['label_max']})"
        )
    elif nums.get("label_min", 0) < 0:
        fails.append(f"negative labels (min {nums['label_min']})")
    if nums.get("all_zero_samples"):
        warns.append(f"{nums['all_zero_samples']} of {nums['samples']} samples are all zeros")
    if nums.get("outliers"):
        warns.append(
            f"{nums['outliers']} extreme outliers (robust z > threshold; max z {nums.get('max_robust_z', 0):.3g})"
        )
    counts = [c for c in nums.get("label_counts", []) if c > 0]
    present = nums.get("label_counts", [])
    if counts:
        ratio = max(counts) / min(counts)
        nums["imbalance_ratio"] = ratio
        # Small samples are judged only where sampling noise cannot explain the finding: a ratio
        # over the limit needs its largest class to hold >= 2x limit samples, and an unseen class
        # needs enough samples that a uniform draw shows every class with 99.9% probability.
        if ratio > imbalance_limit and max(counts) >= 2 * imbalance_limit:
            warns.append(f"class imbalance: the largest class has {ratio:.1f}x the samples of the smallest")
        if num_classes is not None and len(counts) < num_classes:
            missing = [i for i, c in enumerate(present[:num_classes]) if c == 0]
            nums["unseen_classes"] = missing
            if sum(counts) >= num_classes * math.log(1000 * num_classes):
                warns.append(f"classes never seen: {missing[:10]}")
    status = Status.FAIL if fails else (Status.WARN if warns else Status.PASS)
    return Report(name, status, fails + warns, nums)


def check_data(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    num_classes: int | None = None,
    outlier_z: float = 10.0,
    imbalance_limit: float = 10.0,
) -> Report:
    """Inputs: non-finite counts, all-zero samples, extreme outliers (robust z), value range;
    labels: range against `num_classes`, histogram, imbalance ratio."""
    return _data_verdict("check data", _data_numbers(x, y, num_classes, outlier_z), num_classes, imbalance_limit)


def check_loader(
    loader: Iterable,
    max_batches: int = 10,
    num_classes: int | None = None,
    outlier_z: float = 10.0,
    imbalance_limit: float = 10.0,
) -> Report:
    """`check_data` over the first `max_batches` batches of a loader, combined."""
    xs, ys = [], []
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        x, y = split_batch(batch)
        xs.append(x.detach().cpu())
        ys.append(y.detach().cpu() if isinstance(y, torch.Tensor) else None)
    if not xs:
        return Report("check loader", Status.FAIL, ["the loader yielded no batch"], {})
    x = torch.cat(xs)
    labels = [t for t in ys if t is not None]
    y = torch.cat(labels) if len(labels) == len(ys) else None  # labels only when every batch had them
    rep = _data_verdict("check loader", _data_numbers(x, y, num_classes, outlier_z), num_classes, imbalance_limit)
    rep.numbers["batches"] = len(xs)
    return rep


# ------------------------------------------------------------------ weights


def check_weights(model: nn.Module, max_abs: float = 1e3, constant_std: float = 1e-8) -> Report:
    """Per parameter: non-finite values, near-constant weights (bad initialisation; biases and
    norm scales are allowed to start constant, and zero matrices unless every matrix is zero),
    absurd scale (max |w| > `max_abs`)."""
    fails, warns, zero, matrices = [], [], [], 0
    per = {}
    for name, p in model.named_parameters():
        w = p.detach()
        finite = bool(torch.isfinite(w).all())
        d: dict[str, Any] = {"finite": finite, "numel": w.numel()}
        if not finite:
            fails.append(f"{name}: {int((~torch.isfinite(w)).sum())} non-finite values")
        else:
            wf = w.double()
            d["std"] = float(wf.std()) if w.numel() > 1 else 0.0
            d["max_abs"] = float(wf.abs().max()) if w.numel() else 0.0
            matrices += w.dim() >= 2 and w.numel() > 1
            if w.dim() >= 2 and w.numel() > 1 and d["max_abs"] == 0.0:
                zero.append(name)  # zero init is deliberate in many models (LoRA B, position tables)
            elif w.dim() >= 2 and w.numel() > 1 and d["std"] <= constant_std * max(1.0, d["max_abs"]):
                warns.append(
                    f"{name}: all weights (near) identical ({float(wf.reshape(-1)[0]):.4g}): units stay symmetric and learn the same thing"
                )
            if d["max_abs"] > max_abs:
                warns.append(f"{name}: absurd scale (max |w| {d['max_abs']:.3g} > {max_abs:g})")
        per[name] = d
    if zero and len(zero) == matrices:  # every weight matrix is zero: nothing breaks the symmetry
        warns += [f"{name}: all weights zero: units stay symmetric and learn the same thing" for name in zero]
    status = Status.FAIL if fails else (Status.WARN if warns else Status.PASS)
    return Report("check weights", status, fails + warns, {"per_parameter": per, "zero_weights": zero})


# ------------------------------------------------------------------ LR range test


def lr_range_test(
    model: nn.Module,
    loader: Iterable,
    loss_fn: LossFn,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.SGD,
    start: float = 1e-7,
    end: float = 10.0,
    steps: int = 100,
    smooth: float = 0.9,
    diverge_factor: float = 4.0,
    plot: str | None = None,
    sinks: Sequence[Any] = (),
    **optimizer_kwargs: Any,
) -> LRRangeReport:
    """Exponential LR sweep from `start` to `end` on a copy; stops early once the smoothed loss
    exceeds `diverge_factor` x its best. Suggests the LR of steepest descent (per log10 LR) and
    reports the LR where it diverged. `plot` saves a PNG (needs matplotlib); `sinks` receive each
    step as a record with `loss` and `lr`."""
    if not (0 < start < end):
        raise NummonError(f"lr_range_test needs 0 < start < end, got start={start!r}, end={end!r}")
    lrs, smoothed, diverged = _sweep(
        model,
        loader,
        loss_fn,
        optimizer_cls,
        start,
        end,
        steps,
        smooth,
        diverge_factor,
        [as_sink(s) for s in sinks],
        optimizer_kwargs,
    )
    suggested = _steepest_descent(lrs, smoothed, smooth)
    findings = []
    if suggested is not None:
        findings.append(f"steepest descent at lr {suggested:.3g}")
    else:
        findings.append("the loss never fell during the sweep")
    findings.append(
        f"diverged at lr {diverged:.3g}"
        if diverged is not None
        else f"no divergence up to lr {lrs[-1] if lrs else end:.3g}"
    )
    status = Status.PASS if suggested is not None else Status.WARN
    rep = LRRangeReport(
        "lr range test",
        status,
        findings,
        {"suggested_lr": suggested, "diverged_lr": diverged, "steps_run": len(lrs)},
        lrs=lrs,
        losses=smoothed,
        suggested_lr=suggested,
        diverged_lr=diverged,
    )
    if plot:
        _plot_lr_range(rep, plot)
    return rep


def _sweep(
    model: nn.Module,
    loader: Iterable,
    loss_fn: LossFn,
    optimizer_cls: Callable[..., torch.optim.Optimizer],  # a class whose constructor takes lr=
    start: float,
    end: float,
    steps: int,
    smooth: float,
    diverge_factor: float,
    sinks: list[Any],
    optimizer_kwargs: dict[str, Any],
) -> tuple[list[float], list[float], float | None]:
    """(learning rates, bias-corrected EMA losses, the lr it diverged at or None) of the sweep on a copy."""
    clone = copy_model(model)
    dev = device_of(clone)
    opt = optimizer_cls(clone.parameters(), lr=start, **optimizer_kwargs)
    gamma = (end / start) ** (1.0 / max(steps - 1, 1))
    lrs: list[float] = []
    smoothed: list[float] = []
    avg, best = 0.0, math.inf
    batches = _cycle(loader)
    for i in range(steps):
        x, y = (to_device(t, dev) for t in split_batch(next(batches)))
        lr = start * gamma**i
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        loss = loss_fn(clone(x), y)
        loss.backward()
        opt.step()
        v = float(loss.detach())
        if not math.isfinite(v):
            return lrs, smoothed, lr
        avg = smooth * avg + (1 - smooth) * v
        s = avg / (1 - smooth ** (i + 1))  # bias-corrected EMA
        lrs.append(lr)
        smoothed.append(s)
        for sink in sinks:
            sink.on_step(StepRecord(step=i, loss=s, lr=lr), Health.HEALTHY)
        best = min(best, s)
        if s > diverge_factor * best:
            return lrs, smoothed, lr
    return lrs, smoothed, None


def _cycle(loader: Iterable) -> Iterator[Any]:
    """The loader's batches, starting over when it is exhausted."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise NummonError("the loader yielded no batch")


def _steepest_descent(lrs: list[float], smoothed: list[float], smooth: float) -> float | None:
    """The lr where the smoothed loss falls fastest per log10 lr; None when it never falls."""
    # The EMA's first ~1/(1 - smooth) points still follow batch-to-batch differences, not the LR:
    # their slopes are skipped (fastai's skip_start), or a tiny start LR looks like steep descent.
    skip = min(round(1 / (1 - smooth)) if smooth < 1 else 0, max(len(smoothed) - 3, 0))
    if len(smoothed) < 3:
        return None
    logs = [math.log10(lr) for lr in lrs]
    slopes = [
        (smoothed[j + 1] - smoothed[j - 1]) / (logs[j + 1] - logs[j - 1]) for j in range(1 + skip, len(smoothed) - 1)
    ]
    j = min(range(len(slopes)), key=lambda k: slopes[k])
    return lrs[j + 1 + skip] if slopes[j] < 0 else None


def _plot_lr_range(rep: LRRangeReport, path: str) -> None:
    """Save the sweep's curve as a PNG (needs matplotlib; a finding says so when it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        rep.findings.append("plot skipped: pip install 'nummon[plot]' (matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogx(rep.lrs, rep.losses)
    if rep.suggested_lr:
        ax.axvline(rep.suggested_lr, color="g", ls="--", label=f"suggested {rep.suggested_lr:.2g}")
    if rep.diverged_lr:
        ax.axvline(rep.diverged_lr, color="r", ls=":", label=f"diverged {rep.diverged_lr:.2g}")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("smoothed loss")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    rep.plot = path


# ------------------------------------------------------------------ all of it


def run_all(
    model: nn.Module,
    loader: Iterable,
    loss_fn: LossFn,
    num_classes: int | None = None,
    overfit_steps: int = 200,
    overfit_lr: float | None = None,
) -> Diagnosis:
    """data -> overfit one batch -> gradients -> weights, stopping at the first FAIL.
    `overfit_steps` caps each learning rate's steps; `overfit_lr`, when given, is tried first."""
    reports: list[Report] = []
    data = check_loader(loader, num_classes=num_classes)
    reports.append(data)
    if data.status is Status.FAIL:
        return Diagnosis(reports, stopped_at=data.name)
    batch = next(iter(loader))
    steps = [
        lambda: overfit_one_batch(model, batch, loss_fn, steps=overfit_steps, lr=overfit_lr),
        lambda: check_gradients(model, batch, loss_fn),
        lambda: check_weights(model),
    ]
    for step in steps:
        rep = step()
        reports.append(rep)
        if rep.status is Status.FAIL:
            return Diagnosis(reports, stopped_at=rep.name)
    return Diagnosis(reports)

"""The peers' documented spike rules, as pure functions over per-step traces: each returns the
first step it fires at (None: never). Same traces, same steps as nummon's."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

__all__ = ["PEERS", "lightning_spike", "olmo_6sigma", "zclip", "wandb_zscore", "loss_band_exit"]


def lightning_spike(
    loss: Sequence[float], grad_norm: Sequence[float], window: int = 10, warmup: int = 1, rtol: float = 2.0
) -> int | None:
    """Lightning `SpikeDetection` defaults: a loss above its running mean (window 10) by rtol x the mean."""
    run: deque[float] = deque(maxlen=window)
    for i, v in enumerate(loss):
        if i >= warmup and run:
            m = sum(run) / len(run)
            if not math.isfinite(v) or (v > m and abs(v - m) >= rtol * m):
                return i
        run.append(v)
    return None


def olmo_6sigma(
    loss: Sequence[float], grad_norm: Sequence[float], window: int = 128, min_history: int = 20, sigmas: float = 6.0
) -> int | None:
    """OLMo's rule: a loss or grad norm more than 6 standard deviations above its recent mean."""
    first = None
    for series in (loss, grad_norm):
        hist: deque[float] = deque(maxlen=window)
        for i, v in enumerate(series):
            if len(hist) >= min_history:
                mu, sd = statistics.fmean(hist), statistics.pstdev(hist)
                if not math.isfinite(v) or v > mu + sigmas * sd:
                    first = i if first is None else min(first, i)
                    break
            hist.append(v)
    return first


def zclip(
    loss: Sequence[float], grad_norm: Sequence[float], alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25
) -> int | None:
    """ZClip (arXiv 2504.02507): EMA mean and variance of the grad norm; a spike when z > 2.5."""
    mu = var = None
    for i, g in enumerate(grad_norm):
        if not math.isfinite(g):
            return i
        if i < warmup:
            mu = g if mu is None else alpha * mu + (1 - alpha) * g
            var = 0.0 if var is None else alpha * var + (1 - alpha) * (g - mu) ** 2
            continue
        sd = math.sqrt(var) if var else 0.0
        if sd > 0 and (g - mu) / sd > z_thresh:
            return i
        mu = alpha * mu + (1 - alpha) * g
        var = alpha * var + (1 - alpha) * (g - mu) ** 2
    return None


def wandb_zscore(loss: Sequence[float], grad_norm: Sequence[float], window: int = 20, z: float = 3.0) -> int | None:
    """W&B's z-score automation on the loss: above the mean of the last `window` values by z std."""
    hist: deque[float] = deque(maxlen=window)
    for i, v in enumerate(loss):
        if len(hist) == window:
            mu, sd = statistics.fmean(hist), statistics.pstdev(hist)
            if not math.isfinite(v) or (sd > 0 and (v - mu) / sd > z):
                return i
        hist.append(v)
    return None


PEERS = {
    "Lightning SpikeDetection": lightning_spike,
    "OLMo 6σ": olmo_6sigma,
    "ZClip z>2.5": zclip,
    # ZClip's defaults fire during the LR warm-up of every run here, healthy ones too; with its
    # warm-up as long as the LR's (100 steps) it stays quiet on healthy runs: the fair comparison
    "ZClip, warm-up 100": lambda loss, gn: zclip(loss, gn, warmup=100),
    "W&B z-score": wandb_zscore,
}


def loss_band_exit(
    loss: Sequence[float], start: int = 20, factor: float = 1.2, smooth: int = 5, confirm: int = 10
) -> int | None:
    """The step where the loss leaves its band: above `factor` x the best running median (of
    `smooth` steps) so far, and still above it in at least half of the next `confirm` steps."""
    best = math.inf
    for i in range(len(loss)):
        if i >= smooth:
            best = min(best, statistics.median(loss[i - smooth : i]))
        if i < start or not math.isfinite(best):
            continue
        edge = factor * best
        if not math.isfinite(loss[i]) or loss[i] > edge:
            nxt = loss[i : i + confirm]
            if sum(1 for v in nxt if not math.isfinite(v) or v > edge) * 2 >= len(nxt):
                return i
    return None

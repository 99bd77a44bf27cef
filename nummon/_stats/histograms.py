"""Histograms of gradients, parameters and activations, computed on the device, copied once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["histograms"]

LOG10_RANGE = (-30.0, 39.0)  # decades: from underflow to past float32's limit (shows headroom)


def _first_bin(bins: int, n: int) -> torch.Tensor:
    """The histogram of a tensor whose values are all equal: everything in the first bin."""
    counts = torch.zeros(bins)
    counts[0] = n
    return counts


def histograms(tensors: Sequence[tuple[str, torch.Tensor]], bins: int = 64) -> dict[str, dict[str, Any]]:
    """Linear histograms over each tensor's own range and log10|x| histograms over fixed edges.

    Returns {name: {min, max, sum, sum_squares, num, counts, edges, log10_counts, log10_edges}}.
    """
    import numpy as np

    tensors = [(n, torch.view_as_real(t) if t.is_complex() else t) for n, t in tensors if t.numel()]
    if not tensors:
        return {}
    lo_dec, hi_dec = LOG10_RANGE
    rows = []
    with torch.no_grad():
        for _, t in tensors:
            # a private float32 copy (NaN/Inf zeroed), so the passes below may work in place
            x = torch.nan_to_num(t.float().reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
            mn, mx = torch.aminmax(x)
            if x.is_cpu:  # reading the range costs no sync here: bin over it directly
                lo, hi = mn.item(), mx.item()
                lin = torch.histc(x, bins=bins, min=lo, max=hi) if hi > lo else _first_bin(bins, x.numel())
            else:  # on a GPU, normalise on the device rather than wait for the range
                span = torch.clamp(mx - mn, min=1e-30)
                lin = torch.histc((x - mn) / span, bins=bins, min=0.0, max=1.0)
            # float32 sums (float64 ones would cost a widened copy of every tensor): they only
            # feed the histograms' displayed mean and spread
            moments = torch.stack([x.sum(), torch.dot(x, x), torch.tensor(float(x.numel()), device=x.device)]).double()
            lg = torch.histc(x.abs_().clamp_(min=1e-30).log10_(), bins=bins, min=lo_dec, max=hi_dec)  # x is spent
            rows.append(torch.cat([mn.reshape(1).double(), mx.reshape(1).double(), moments, lin.double(), lg.double()]))
    host = torch.stack(rows).cpu().numpy()  # one copy for all histograms
    log_edges = np.linspace(lo_dec, hi_dec, bins + 1)
    out = {}
    for (name, _), row in zip(tensors, host):
        row_min, row_max = float(row[0]), float(row[1])
        out[name] = {
            "min": row_min,
            "max": row_max,
            "sum": float(row[2]),
            "sum_squares": float(row[3]),
            "num": float(row[4]),
            "counts": row[5 : 5 + bins],
            "edges": np.linspace(row_min, row_max if row_max > row_min else row_min + 1e-30, bins + 1),
            "log10_counts": row[5 + bins :],
            "log10_edges": log_edges,
        }
    return out

"""Batch fingerprints: an exact, order-independent hash of every bit of each input tensor,
computed on the device (so a step that fails again on identical inputs can be recognised)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Fingerprinter", "tensors_in"]

_MOD = 1 << 52  # the hash travels in a float64 slot: 52 bits stay exact
_MASK32 = 0xFFFFFFFF


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a tensor, or a (nested) tuple/list/dict of them, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        out: list[torch.Tensor] = []
        for b in batch:
            out.extend(tensors_in(b))
        return out
    return []


class Fingerprinter:
    """Hashes tensors' bits; position weights are made once per (length, device)."""

    def __init__(self) -> None:
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Exact integer hash of a tensor's bits (mod 2^52, as a float64 0-d tensor).

        Each element contributes 32-bit words times a position weight; int64 sums wrap
        identically in any order, so the result is exact and deterministic. 64-bit elements
        contribute both halves (low word at position 2i, high word at 2i+1), so a change in
        any bit, the exponent's included, changes the hash.
        """
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        if flat.dtype in (torch.float32, torch.int32):
            words = flat.view(torch.int32).to(torch.int64) & _MASK32
        elif flat.dtype in (torch.float16, torch.bfloat16, torch.int16):
            words = flat.view(torch.int16).to(torch.int64) & 0xFFFF
        elif flat.dtype in (torch.float64, torch.int64):
            bits = flat.view(torch.int64)
            # (n, 2): low and high 32-bit words; the arithmetic shift's sign bits are masked off
            words = torch.stack([bits & _MASK32, (bits >> 32) & _MASK32], dim=1).reshape(-1)
        else:
            words = flat.to(torch.int64)
        key = (words.numel(), words.device)
        w = self._weights.get(key)
        if w is None:
            w = (torch.arange(words.numel(), device=words.device, dtype=torch.int64) * 2654435761 + 97) % 2147483629
            self._weights[key] = w
        h = (words * w).sum()
        return (h % _MOD).to(torch.float64)

"""A tiny causal self-attention (manual or SDPA) and the attention statistics computed directly."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attn(nn.Module):
    def __init__(self, d=16, h=2, impl="manual"):
        super().__init__()
        self.h, self.dh, self.impl = h, d // h, impl
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 4)

    def scores(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x):
        q, k, v = self.scores(x)
        T = x.shape[1]
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)
            s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            y = torch.softmax(s, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(x.shape))


def attention_reference(model, x):
    """Max causal logit and mean normalised entropy, computed directly."""
    with torch.no_grad():
        q, k, _ = model.scores(x)
        T = x.shape[1]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(model.dh)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        p = s.softmax(-1)
        ent = -torch.special.xlogy(p, p).sum(-1)
        n = mask.sum(-1).float()
        norm = (ent / torch.log(n.clamp(min=2)))[..., 1:]  # rows with one key have no entropy to lose
        return float(s.amax()), float(norm.mean())

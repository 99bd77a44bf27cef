"""A tiny pre-LN causal LM on a synthetic corpus, the small-scale proxy of Wortsman et al. 2023
("Small-scale proxies for large-scale Transformer training instabilities", arXiv 2309.14322).

Hand-written attention (q·kᵀ/√d -> softmax) or `F.scaled_dot_product_attention`, optional
qk-layernorm and z-loss, AdamW with linear warm-up then cosine decay, gradient clipping at 1.
The corpus: a seeded order-1 Markov chain over 256 tokens with 5 successors per token (the best
possible loss is about ln 5 = 1.61; chance is ln 256 = 5.55), whose second half of every
sequence repeats the first (so attention has something to learn: copying).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ProxyConfig", "TinyLM", "Corpus", "build", "hf_model", "train"]


@dataclass(frozen=True)
class ProxyConfig:
    lr: float = 0.01
    seed: int = 0
    d: int = 128
    heads: int = 4
    layers: int = 2
    seq: int = 64
    batch: int = 16
    vocab: int = 256
    data_vocab: int = 0  # tokens the corpus uses (0: all of `vocab`); the rest are never a target
    steps: int = 300
    warmup: int = 100
    qk_layernorm: bool = False
    z_loss: float = 0.0
    attention: str = "manual"  # or "sdpa"
    weight_decay: float = 0.1
    clip: float = 1.0
    ln_f_affine: bool = True  # False: the final LayerNorm has no learnable scale or shift
    bf16: bool = False  # forward under CPU/GPU autocast to bfloat16 (the logits come out in bfloat16)
    arch: str = "tiny"  # or "gpt2" / "llama": a Hugging Face model built from a config, SDPA attention

    @property
    def name(self) -> str:
        extra = ("+qkln" if self.qk_layernorm else "") + (f"+z{self.z_loss:g}" if self.z_loss else "")
        extra += "+sdpa" if self.attention == "sdpa" else ""
        extra += f"+wd{self.weight_decay:g}" if self.weight_decay != 0.1 else ""
        extra += f"+v{self.vocab}" if self.vocab != 256 else ""
        extra += f"+dv{self.data_vocab}" if self.data_vocab else ""
        extra += f"+t{self.steps}" if self.steps != 300 else ""
        extra += "+noaffine" if not self.ln_f_affine else ""
        extra += "+bf16" if self.bf16 else ""
        arch = "" if self.arch == "tiny" else f"{self.arch}-"
        return f"{arch}lr{self.lr:g}-d{self.d}-s{self.seed}{extra}"


class Attention(nn.Module):
    def __init__(self, c: ProxyConfig) -> None:
        super().__init__()
        self.h, self.dh, self.impl = c.heads, c.d // c.heads, c.attention
        self.qkv = nn.Linear(c.d, 3 * c.d, bias=False)
        self.proj = nn.Linear(c.d, c.d, bias=False)
        self.q_ln = nn.LayerNorm(self.dh) if c.qk_layernorm else None
        self.k_ln = nn.LayerNorm(self.dh) if c.qk_layernorm else None
        self.register_buffer("causal", torch.ones(c.seq, c.seq).tril().bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        if self.q_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)
            att = att.masked_fill(~self.causal[:T, :T], float("-inf"))
            y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, c: ProxyConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.d), Attention(c)
        self.ln2 = nn.LayerNorm(c.d)
        self.mlp = nn.Sequential(nn.Linear(c.d, 4 * c.d), nn.GELU(), nn.Linear(4 * c.d, c.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, c: ProxyConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.d)
        self.pos = nn.Parameter(torch.randn(c.seq, c.d) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d, elementwise_affine=c.ln_f_affine)
        self.head = nn.Linear(c.d, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def hf_model(c: ProxyConfig) -> nn.Module:
    """A Hugging Face GPT-2 or Llama of the proxy's shape, built from a config (never downloaded),
    with `attn_implementation="sdpa"`; GPT-2 ties its head to the embedding, Llama does not."""
    import transformers

    if c.arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=c.layers,
            n_embd=c.d,
            n_head=c.heads,
            vocab_size=c.vocab,
            n_positions=c.seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = transformers.GPT2LMHeadModel
    elif c.arch == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=c.layers,
            hidden_size=c.d,
            num_attention_heads=c.heads,
            num_key_value_heads=c.heads,
            intermediate_size=4 * c.d,
            vocab_size=c.vocab,
            max_position_embeddings=c.seq,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown proxy arch {c.arch!r}")
    model = cls._from_config(cfg, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    return model


class _Logits(nn.Module):
    """The HF model's logits only, so the proxy's own loss (and its per-token losses) apply."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx, use_cache=False).logits


def build(c: ProxyConfig) -> nn.Module:
    return TinyLM(c) if c.arch == "tiny" else _Logits(hf_model(c))


class Corpus:
    """Seeded batches: an order-1 Markov chain (5 successors per token), second half = first half."""

    def __init__(self, c: ProxyConfig) -> None:
        g = torch.Generator().manual_seed(1234)  # the same corpus for every run
        self.n = c.data_vocab or c.vocab
        self.succ = torch.randint(0, self.n, (self.n, 5), generator=g)
        self.c = c
        self.g = torch.Generator().manual_seed(10_000 + c.seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        c, g = self.c, self.g
        half = (c.seq + 1 + 1) // 2
        tok = torch.empty(c.batch, half, dtype=torch.long)
        tok[:, 0] = torch.randint(0, self.n, (c.batch,), generator=g)
        choice = torch.randint(0, 5, (c.batch, half), generator=g)
        for t in range(1, half):
            tok[:, t] = self.succ[tok[:, t - 1], choice[:, t]]
        seq = torch.cat([tok, tok], dim=1)[:, : c.seq + 1]
        return seq[:, :-1], seq[:, 1:]


def lr_at(c: ProxyConfig, step: int) -> float:
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    t = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(c: ProxyConfig, on_step: Callable[..., None] | None = None, monitor_factory=None) -> dict:
    """Train one proxy; returns its trace: per step loss, pre-clip grad norm, lr (and the monitor's reports)."""
    torch.manual_seed(c.seed)
    model = build(c)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=c.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data = Corpus(c)
    mon = monitor_factory(model, opt) if monitor_factory else None
    trace = {"loss": [], "grad_norm": [], "lr": [], "logz": [], "logit_mean": [], "reports": []}
    for step in range(c.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(c, step)
        x, y = data.batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
            logits = model(x)
        per_tok = F.cross_entropy(logits.reshape(-1, c.vocab), y.reshape(-1), reduction="none")
        loss = per_tok.mean()
        total = loss + c.z_loss * torch.logsumexp(logits.float(), -1).pow(2).mean() if c.z_loss else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
        opt.step()
        trace["loss"].append(float(loss.detach()))
        trace["grad_norm"].append(float(gn))
        trace["lr"].append(opt.param_groups[0]["lr"])
        trace["logz"].append(float(torch.logsumexp(logits.detach().float(), -1).mean()))
        trace["logit_mean"].append(float(logits.detach().float().mean()))
        if mon is not None:
            trace["reports"].append(mon.post_step(loss, per_sample_loss=per_tok.detach().view(c.batch, -1).mean(1)))
        if on_step is not None:
            on_step(step, model, opt)
    if mon is not None:
        mon.close()
    return trace

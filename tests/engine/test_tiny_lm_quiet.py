"""A tiny LM that trains healthily gets no warning.

Recipe (built below): 2 pre-LN blocks of nn.MultiheadAttention (d 128, 4 heads), vocabulary 64,
sequences of 32 from x[t+1] = (3 x[t] + 1) mod 64 with 10% random tokens, batch 16, AdamW lr 1e-3,
weight decay 0.1, 30-step linear warm-up, clip 1.0, bf16 autocast on CPU, 300 steps. The loss
falls 4.3 -> 0.8 and sits on its noise floor (~0.75 nats: the 10% random tokens).

A 300-step run takes 450-680 s on this project's shared 2-core machine, so the per-step losses
and grad norms of real runs are recorded once in tests/data/tiny_lm/seed*.jsonl
(`python tests/engine/test_tiny_lm_quiet.py SEED...` records them again) and replayed through the health
engine here; the end-to-end run under `nummon.Monitor` runs where NUMMON_SLOW_TESTS=1.
"""

import json
import os
import sys

import pytest
import torch
from helpers import checkout
from helpers.detector_tester import loud
from torch import nn

import nummon
from nummon import StepRecord, load_policy
from nummon._engine.detectors.oscillation import swing_structure

DATA = checkout.DATA / "tiny_lm"
SEEDS = sorted(int(p.stem[4:]) for p in DATA.glob("seed*.jsonl"))
VOCAB, CONTEXT, WIDTH, HEADS, BATCH, STEPS = 64, 32, 128, 4, 16, 300


class Block(nn.Module):
    """Pre-LN: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, mask):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))

    def forward(self, ids):
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n))
        for b in self.blocks:
            x = b(x, self.mask[:n, :n])
        return self.head(self.ln(x))


def sequences(gen, noise=0.1):
    """(BATCH, CONTEXT + 1) tokens of x[t+1] = (3 x[t] + 1) mod 64, each replaced by a random
    token with probability `noise`."""
    x = torch.empty(BATCH, CONTEXT + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    for t in range(CONTEXT):
        x[:, t + 1] = (3 * x[:, t] + 1) % VOCAB
        r = torch.rand(BATCH, generator=gen) < noise
        x[r, t + 1] = torch.randint(0, VOCAB, (int(r.sum()),), generator=gen)
    return x


def train(seed, monitor_dir=None, steps=STEPS):
    """The recipe; with `monitor_dir`, under nummon.Monitor (default policy). (rows, alerts)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    mon = nummon.Monitor(model, opt, policy="default", sinks=[], run_dir=monitor_dir) if monitor_dir else None
    rows, alerts = [], []
    try:
        for step in range(steps):
            ids = sequences(gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if mon is not None:
                alerts += mon.post_step(loss).alerts
            rows.append({"step": step, "loss": round(loss.item(), 6), "grad_norm": round(norm.item(), 6)})
    finally:
        if mon is not None:
            mon.close()
    return rows, alerts


def recorded(seed):
    return [json.loads(line) for line in (DATA / f"seed{seed}.jsonl").read_text().splitlines() if line.strip()]


def replay(rows, policy):
    """The loud alerts over the recorded rows."""
    return loud((StepRecord(step=r["step"], loss=r["loss"], grad_norm=r["grad_norm"]) for r in rows), policy)


def test_there_are_at_least_three_recorded_seeds_of_the_recipe():
    assert len(SEEDS) >= 3
    for seed in SEEDS:
        rows = recorded(seed)
        assert len(rows) == STEPS and rows[0]["loss"] > 4.0 and sum(r["loss"] for r in rows[-50:]) / 50 < 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_the_tiny_lm_gets_no_warning_under_the_default_policy(seed):
    assert replay(recorded(seed), load_policy("default")) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_its_noise_floor_is_no_oscillation_even_without_the_level_gate(seed):
    """The floor sits at ~0.18 of the starting loss, just under oscillation.high_fraction (0.25);
    a noisier floor would be above it. With the gate lowered the rule itself must say no: the
    window (fall + floor) is not waves, and no oscillation is raised."""
    rows = recorded(seed)
    for end in range(140, STEPS, 20):
        shape, _ = swing_structure([r["loss"] for r in rows[:end]])
        assert shape is None, f"step {end}: {shape}"
    policy = load_policy({"oscillation": {"high_fraction": 0.05}})
    assert "oscillation" not in {a.kind.value for a in replay(rows, policy)}


@pytest.mark.skipif(
    os.environ.get("NUMMON_SLOW_TESTS") != "1", reason="a real 300-step run: minutes on 2 cores (NUMMON_SLOW_TESTS=1)"
)
def test_a_real_run_under_the_monitor_gets_no_warning(tmp_path):
    rows, alerts = train(SEEDS[0], monitor_dir=tmp_path)
    assert [a for a in alerts if a.severity.rank >= 1] == []
    assert rows[0]["loss"] > 4.0 and sum(r["loss"] for r in rows[-50:]) / 50 < 1.0


if __name__ == "__main__":  # record the fixtures: python tests/engine/test_tiny_lm_quiet.py 0 1 2
    torch.set_num_threads(1)
    DATA.mkdir(parents=True, exist_ok=True)
    for s in map(int, sys.argv[1:]):
        out, _ = train(s)
        (DATA / f"seed{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))

"""A tiny transformer language model watched by nummon as a new user would.

Two pre-norm blocks (d_model 32), AdamW with linear warm-up, clip_grad_norm_ 1.0 and bf16 autocast on
CPU, trained on synthetic token sequences with learnable structure (arithmetic progressions mod 16 with
10% noise tokens). Healthy: three seeds x two learning rates, no warning at all. Driven to blow up
(no clipping, lr 1 and 3): a warning before the first non-finite loss or the first loss at >= 10x
its start. One thread: tiny matrices gain nothing from more, and the CI box is shared.
"""

import math

import pytest
import torch
from torch import nn

import nummon
from nummon import Health, Severity

__all__ = []

VOCAB, SEQ, D_MODEL = 16, 16, 32


class TinyLM(nn.Module):
    """Embedding + learned positions, two causal pre-norm transformer blocks, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, 2, 2 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batches(seed: int, size: int = 16):
    """(inputs, next tokens): sequences start + stride * t (mod VOCAB), stride 1-3, 10% random tokens."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        noisy = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noisy, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
        yield seq[:, :-1], seq[:, 1:]


def train(tmp_path, seed: int, lr: float, steps: int, clip: bool, warmup: int = 20):
    """Train through nummon.Monitor; returns (losses, warning-or-worse alerts, healths). Stops 3 steps
    after the loss is non-finite or >= 10x its first value (the run is lost by then)."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    data = batches(seed)
    losses, loud, healths = [], [], []
    lost_at = None
    with nummon.Monitor(model, opt, run_dir=tmp_path / f"run-{seed}-{lr}") as mon:
        for step in range(steps):
            tokens, targets = next(data)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            report = mon.post_step(loss)
            losses.append(loss.item())
            healths.append(report.health)
            loud += [a for a in report.alerts if a.severity.rank >= Severity.WARNING.rank]
            if lost_at is None and (not math.isfinite(losses[-1]) or losses[-1] >= 10 * losses[0]):
                lost_at = step
            if lost_at is not None and step >= lost_at + 3:
                break
    return losses, loud, healths


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("seed", "lr"),
    # 200 steps each (5-10 s): the full suite's; the quick subset keeps the blow-up runs below
    [pytest.param(s, lr, marks=pytest.mark.slow) for s in (0, 1, 2) for lr in (3e-4, 1e-3)],
)
def test_healthy_runs_raise_no_warning(tmp_path, seed, lr):
    losses, loud, healths = train(tmp_path, seed, lr, steps=200, clip=True)
    assert len(losses) == 200
    # it is a learning run, not a trivially flat one: the loss fell by a fifth or more
    assert sum(losses[-20:]) < 0.8 * sum(losses[:20]), losses[::20]
    assert loud == [], [(a.step, a.kind.value, a.message) for a in loud]
    assert set(healths) == {Health.HEALTHY}


@pytest.mark.parametrize("lr", [1.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_runs_driven_to_blow_up_warn_before_they_are_lost(tmp_path, seed, lr):
    """No clipping, lr 1 or 3: the loss climbs and the run is lost (non-finite or >= 10x its start)
    within 60 steps; a warning must come strictly before that step."""
    losses, loud, _ = train(tmp_path, seed, lr, steps=60, clip=False)
    lost_at = next((i for i, v in enumerate(losses) if not math.isfinite(v) or v >= 10 * losses[0]), None)
    assert lost_at is not None, f"the run did not blow up: {losses[::5]}"
    assert loud, "no warning at all"
    first = min(a.step for a in loud)
    assert first < lost_at, (first, lost_at, [(a.step, a.kind.value) for a in loud][:5], losses[: lost_at + 1])

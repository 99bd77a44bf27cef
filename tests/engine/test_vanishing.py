"""The vanishing-gradient detector: a gradient that fell to ~0 warns; one that was ~0 from its
first step on (structurally zero: a key LayerNorm's bias, an unused parameter) never does."""

import math

import torch
from helpers.detector_tester import detector_findings
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nummon import AlertKind, Monitor, Policy
from nummon._engine.detectors import VanishingDetector

P = Policy().vanishing
live_norm = st.floats(min_value=1e-3, max_value=1e3)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(live_norm, live_norm, st.floats(min_value=0, max_value=0.999 * P.ratio)),
        min_size=P.patience,
        max_size=3 * P.patience,
    )
)
def test_a_gradient_zero_from_its_first_step_never_warns(rows):
    # "k_ln.bias" stays below ratio x the largest layer's norm on every step, from the first
    steps = [{"w.weight": a, "k_ln.weight": b, "k_ln.bias": z * max(a, b)} for a, b, z in rows]
    assert not any(detector_findings(VanishingDetector(P), steps, "layer_grad_norms"))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=20),
    live_norm,
    st.floats(min_value=0, max_value=0.999 * P.ratio),
    st.integers(min_value=0, max_value=20),
)
def test_a_gradient_that_falls_to_zero_warns_after_patience_steps(live_steps, top, z, extra):
    steps = [{"w.weight": top, "fc.weight": top / 2}] * live_steps
    steps += [{"w.weight": top, "fc.weight": z * top}] * (P.patience + extra)
    found = detector_findings(VanishingDetector(P), steps, "layer_grad_norms")
    first = next(i for i, f in enumerate(found) if f)
    assert first == live_steps + P.patience - 1
    f = found[first][0]
    assert f.kind is AlertKind.VANISHING and set(f.details["layers"]) == {"fc.weight"}


def test_a_structurally_zero_gradient_that_comes_alive_and_vanishes_again_warns():
    steps = [{"w.weight": 1.0, "b": 0.0}] * 60 + [{"w.weight": 1.0, "b": 0.3}] * 3 + [{"w.weight": 1.0, "b": 0.0}] * 50
    found = detector_findings(VanishingDetector(P), steps, "layer_grad_norms")
    assert not any(found[:112]) and found[112][0].details["layers"] == {"b": 0.0}


def _reference_vanished(steps, ratio, patience):
    """The rule, one tensor at a time: per step, the names at `patience`+ records in a row at ~0
    (at most `ratio` of the step's largest finite norm) after having been above that once; a
    tensor absent from a step, or non-finite in it, keeps its count."""
    live, count, out = set(), {}, []
    for norms in steps:
        finite = {k: v for k, v in norms.items() if math.isfinite(v)}
        top = max(finite.values(), default=0.0)
        if len(finite) < 2 or top <= 0:
            out.append(set())
            continue
        gone = set()
        for k, v in finite.items():
            if v > ratio * top:
                live.add(k)
                count[k] = 0
            elif k in live:
                count[k] = count.get(k, 0) + 1
                if count[k] >= patience:
                    gone.add(k)
            else:
                count[k] = 0
        out.append(gone)
    return out


norm_or_gap = st.one_of(
    st.sampled_from([0.0, 1.0, 1e-9, None, math.nan, math.inf]), st.floats(min_value=0, max_value=1e3, allow_nan=False)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(norm_or_gap, min_size=4, max_size=4), max_size=40), st.integers(min_value=1, max_value=4))
def test_the_counts_follow_the_rule_tensor_by_tensor(rows, patience):
    # tensors that come and go (None: absent), NaN/Inf, exact zeros, values near the limit
    names = ["a", "b", "c", "d"]
    steps = [{n: v for n, v in zip(names, row) if v is not None} for row in rows]
    pol = P.model_copy(update={"patience": patience})
    found = detector_findings(VanishingDetector(pol), steps, "layer_grad_norms")
    got = [set(f[0].details["layers"]) if f else set() for f in found]
    want = _reference_vanished(steps, pol.ratio, patience)
    # the finding names the worst `max_named` of them
    assert [len(g) for g in got] == [min(len(w), pol.max_named) for w in want]
    assert all(g <= w for g, w in zip(got, want))
    assert [f[0].details["count"] if f else 0 for f in found] == [len(w) for w in want]


class QKLayerNormAttention(nn.Module):
    """One causal attention layer with qk-layernorm: the keys' LayerNorm bias adds q·b to every
    logit of a query alike, so softmax gives it a gradient of rounding error only."""

    def __init__(self, d=16, heads=2, vocab=32):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_ln, self.k_ln = nn.LayerNorm(self.dh), nn.LayerNorm(self.dh)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.emb(idx)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        q, k = self.q_ln(q), self.k_ln(k)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.dh)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
        return self.head(x + y)


def test_a_real_key_layernorm_bias_does_not_warn():
    torch.manual_seed(0)
    model = QKLayerNormAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, policy={"vanishing": {"patience": 5}, "mechanisms": {"enabled": False}})
    ids = torch.randint(0, 32, (4, 12))
    alerts, recs = [], []
    for _ in range(12):
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 32), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        r = mon.post_step(loss)
        alerts += [a for a in r.alerts if a.kind is AlertKind.VANISHING]
        recs.append(r.record)
    mon.close()
    # the premise: k_ln.bias's gradient is below the detector's limit on every step
    for rec in recs:
        g = rec.layer_grad_norms
        assert g["k_ln.bias"] <= P.ratio * max(g.values()) and g["q_ln.bias"] > P.ratio * max(g.values())
    assert alerts == []

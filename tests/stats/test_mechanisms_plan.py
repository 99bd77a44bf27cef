"""The capture plan: a discovery forward (the whole forward under the capture mode) finds the
attention modules and the module whose output becomes the logits; the sampled forwards after it
hook only those. They must measure exactly what the discovery forward measured, on every kind
of model, and pass (almost) nothing through the mode."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.attention import Attn
from torch import nn

import nummon
from nummon._stats import capture

FIELDS = (
    "layer_attention_logit_max",
    "layer_attention_entropy",
    "output_logsumexp_mean",
    "output_logsumexp_max",
    "output_logit_max",
    "layer_output_rms",
)


class MHA(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(16, 2, batch_first=batch_first)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        pad = torch.zeros(x.shape[1] if not self.batch_first else x.shape[0], 6, dtype=torch.bool)
        pad[:, -1] = True  # the last key is padding
        y = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        return self.head(y if self.batch_first else y.transpose(0, 1))


class TiedLogits(nn.Module):
    """Hidden states out of the model, and logits from the embedding's weight made after it: the
    loss's logits are no module's output, so the mode stays on after the forward (`tail`)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 16)
        self.attn = Attn(d=16)
        self.up = nn.Linear(4, 16)

    def forward(self, x):
        return self.up(self.attn(x))


class LossInside(nn.Module):
    """Logits that no module returns, and the loss computed inside the forward: the mode over
    every forward (the `whole` plan)."""

    def __init__(self):
        super().__init__()
        self.attn = Attn(d=16)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x, y):
        logits = self.attn(x) @ self.w
        return F.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )  # no dropout: the same forward every step
        return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _model_and_loss(kind):
    torch.manual_seed(0)
    x, y = torch.randn(3, 6, 16), torch.randint(0, 4, (3, 6))
    if kind in ("manual", "sdpa"):
        model = nn.Sequential(nn.Linear(16, 16), Attn(impl=kind))
    elif kind.startswith("mha"):
        model = MHA(batch_first=kind == "mha-batch-first")
    elif kind == "tail":
        model = TiedLogits()
        return model, lambda: F.cross_entropy(F.linear(model(x), model.emb.weight).reshape(-1, 4), y.reshape(-1))
    elif kind == "whole":
        model = LossInside()
        return model, lambda: model(x, y)
    else:
        model = _hf(kind)
        ids = torch.randint(0, 64, (2, 12))
        return model, lambda: model(input_ids=ids, labels=ids).loss

    def loss():
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, loss


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,plan",
    [
        ("manual", "scoped"),
        ("sdpa", "scoped"),
        ("mha-batch-first", "mha"),
        ("mha-seq-first", "mha"),
        ("gpt2", "scoped"),
        ("llama", "scoped"),
        ("tail", "tail"),
        ("whole", "whole"),
    ],
)
def test_a_planned_forward_measures_what_the_discovery_forward_measured(kind, plan):
    model, loss_fn = _model_and_loss(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights and inputs at every step
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    recs = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    p = mon._stats.mechanisms.capture.plan
    mon.close()
    got = {
        "whole": p.whole,
        "tail": p.tail and not p.whole,
        "mha": bool(p.mha),
        "scoped": bool(p.attention) and bool(p.heads) and not (p.whole or p.tail),
    }
    assert got[plan], p
    first = recs[0]
    assert first.layer_attention_logit_max and first.output_logsumexp_mean is not None
    assert all(math.isfinite(v) for v in first.layer_attention_logit_max.values())
    for rec in recs[1:]:  # the planned forwards
        for f in FIELDS:
            assert getattr(rec, f) == pytest.approx(getattr(first, f), rel=1e-6), f


def test_key_padding_is_masked_in_multihead_attention():
    torch.manual_seed(0)
    model = MHA(batch_first=True)
    x = torch.randn(3, 6, 16)
    x[:, -1] *= 100  # the padded key would hold every large logit
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    recs = []
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    mon.close()
    with torch.no_grad():
        w, b = model.mha.in_proj_weight, model.mha.in_proj_bias
        q = (x[0] @ w[:16].T + b[:16]).view(6, 2, 8).transpose(0, 1)
        k = (x[0] @ w[16:32].T + b[16:32]).view(6, 2, 8).transpose(0, 1)
        s = (q @ k.transpose(-2, -1) / math.sqrt(8))[..., :-1]  # the last key is padding
    for rec in recs:  # discovery (float mask inside F.multi_head_attention_forward), then planned (the bool mask)
        assert rec.attention_logit_max == pytest.approx(float(s.amax()), rel=1e-5)


def test_a_planned_forward_passes_only_the_attention_modules_own_calls_through_the_mode(monkeypatch):
    calls = []
    tf = capture._Capture.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        calls[-1] += 1
        return tf(self, func, types, args, kwargs)

    monkeypatch.setattr(capture._Capture, "__torch_function__", counted)
    for kind, most in (("manual", 20), ("mha-batch-first", 0)):
        model, loss_fn = _model_and_loss(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
        counts = []
        for _ in range(3):
            calls.append(0)
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
            mon.post_step(loss)
            counts.append(calls[-1])
        mon.close()
        assert counts[0] > 50, counts  # discovery: every call of the forward and the loss
        assert max(counts[1:]) <= most, (kind, counts)


def test_a_model_that_grows_has_its_new_attention_measured_at_the_next_discovery():
    torch.manual_seed(0)
    model = nn.Sequential(Attn())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    x, y = torch.randn(2, 5, 16), torch.randint(0, 4, (2, 5))

    def step():
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))
        loss.backward()
        opt.step()
        return mon.post_step(loss).record

    step()
    model.append(nn.Linear(4, 16))
    model.append(Attn())
    seen = [set(step().layer_attention_logit_max) for _ in range(capture.PLAN_EVERY + 1)]
    mon.close()
    assert seen[0] == {"0"}  # the old plan: the new layer's logits are not among the head's
    assert seen[-1] == {"0", "2"}


def test_an_attention_module_called_twice_reports_its_largest_logit_and_its_mean_entropy():
    from helpers.attention import attention_reference

    torch.manual_seed(0)
    attn = Attn(d=16, impl="manual")
    attn.out = nn.Linear(16, 16)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = attn, nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.attn(self.attn(x) * 4))

    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    x, y = torch.randn(2, 6, 16), torch.randint(0, 4, (2, 6))
    recs = []
    for _ in range(2):  # discovery, then planned
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    mon.close()
    with torch.no_grad():
        (m1, e1), (m2, e2) = attention_reference(attn, x), attention_reference(attn, attn(x) * 4)
    for rec in recs:
        assert rec.layer_attention_logit_max["attn"] == pytest.approx(max(m1, m2), rel=1e-5)
        assert rec.layer_attention_entropy["attn"] == pytest.approx((e1 + e2) / 2, rel=1e-4)


def test_gradient_accumulation_measures_every_micro_batch_in_discovery_and_planned_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attn())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    xs = [torch.randn(2, 6, 16), torch.randn(2, 6, 16) * 3]  # the second micro-batch has the larger logits
    y = torch.randint(0, 4, (2, 6))
    recs = []
    for _ in range(3):
        opt.zero_grad()
        for x in xs:
            loss = F.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))
            loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    p = mon._stats.mechanisms.capture.plan
    mon.close()
    assert p.heads and not (p.tail or p.whole)
    with torch.no_grad():
        from helpers.attention import attention_reference

        want = max(attention_reference(model[1], model[0](x))[0] for x in xs)
    for rec in recs:
        assert rec.layer_attention_logit_max["1"] == pytest.approx(want, rel=1e-5)
        for f in FIELDS:
            assert getattr(rec, f) == pytest.approx(getattr(recs[0], f), rel=1e-6), f

"""The sampled mechanism probes on real models and optimizers: attention logits and entropy
(hand-written, SDPA, nn.MultiheadAttention, a Hugging Face GPT-2 with SDPA built from a config),
output log Z, Adam's second moment, per-sample losses, the cadence, and the JSONL round trip."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.attention import Attn, attention_reference
from torch import nn

import nummon
from nummon import read_trace


def _step(model, opt, mon, x, y, **kw):
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return mon.post_step(loss, **kw)


def _run(impl, steps=3, every=1, seed=0):
    torch.manual_seed(seed)
    model = Attn(impl=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(3, 6, 16), torch.randint(0, 4, (3, 6))
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": every}})
    reports = [_step(model, opt, mon, x, y) for _ in range(steps)]
    mon.close()
    return model, x, reports


@pytest.mark.parametrize("impl", ["manual", "sdpa"])
def test_attention_logits_and_entropy_match_a_direct_computation(impl):
    torch.manual_seed(0)
    model = Attn(impl=impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay those of the forward
    x, y = torch.randn(3, 6, 16) * 3, torch.randint(0, 4, (3, 6))
    mon = nummon.Monitor(model, opt)
    rec = _step(model, opt, mon, x, y).record
    mon.close()
    want_max, want_ent = attention_reference(model, x if impl == "manual" else x[:1])  # SDPA: the first sample
    assert rec.attention_logit_max == pytest.approx(want_max, rel=1e-5)
    assert rec.attention_entropy == pytest.approx(want_ent, rel=1e-4)
    # the loss's logits: log Z of the (18, 4) logits that went into cross_entropy
    with torch.no_grad():
        lse = torch.logsumexp(model(x).reshape(-1, 4), -1)
    assert rec.output_logsumexp_mean == pytest.approx(float(lse.mean()), rel=1e-5)
    assert rec.output_logsumexp_max == pytest.approx(float(lse.max()), rel=1e-5)


def test_attention_is_named_after_the_module_that_computes_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Attn())
    opt = torch.optim.AdamW(model.parameters())
    mon = nummon.Monitor(model, opt)
    rec = _step(model, opt, mon, torch.randn(2, 5, 16), torch.randint(0, 4, (2, 5))).record
    mon.close()
    assert list(rec.layer_attention_logit_max) == ["1"]
    assert set(rec.layer_output_rms) == {"0", "1.qkv", "1.out"}


def test_linear_output_rms_is_the_largest_over_a_shared_layers_calls():
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(self.a(self.a(x) * 3))  # `a` twice: its second output is the larger

    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    x = torch.randn(6, 8)
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    rec = mon.post_step(loss).record
    mon.close()
    with torch.no_grad():
        first = model.a(x)
        second = model.a(first * 3)

        def rms(t):
            return float(t.square().mean().sqrt())

        assert rec.layer_output_rms["a"] == pytest.approx(max(rms(first), rms(second)), rel=1e-5)
        assert rec.layer_output_rms["b"] == pytest.approx(rms(model.b(second)), rel=1e-5)


def test_multihead_attention_is_seen():
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.mha(x, x, x)[0])

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay those of the forward
    x = torch.randn(2, 5, 16)
    mon = nummon.Monitor(model, opt)
    rec = _step(model, opt, mon, x, torch.randint(0, 4, (2, 5))).record
    mon.close()
    assert list(rec.layer_attention_logit_max) == ["mha"]
    with torch.no_grad():  # the logits of the first sample, from MHA's own projections
        w, b = model.mha.in_proj_weight, model.mha.in_proj_bias
        q = (x[0] @ w[:16].T + b[:16]).view(5, 2, 8).transpose(0, 1)
        k = (x[0] @ w[16:32].T + b[16:32]).view(5, 2, 8).transpose(0, 1)
        s = q @ k.transpose(-2, -1) / math.sqrt(8)
        p = s.softmax(-1)
        ent = float((-torch.special.xlogy(p, p).sum(-1) / math.log(5)).mean())
    assert rec.attention_logit_max == pytest.approx(float(s.amax()), rel=1e-5)
    assert rec.attention_entropy == pytest.approx(ent, rel=1e-4)


def test_hugging_face_gpt2_with_sdpa_is_covered():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")  # never downloaded
    assert model.config._attn_implementation == "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(3):
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        rec = mon.post_step(out.loss).record
    mon.close()
    assert sorted(rec.layer_attention_logit_max) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(math.isfinite(v) and v > 0 for v in rec.layer_attention_logit_max.values())
    assert 0 < rec.attention_entropy <= 1
    # HF computes the loss inside forward: log Z of its logits, near ln 64 for a fresh model
    assert rec.output_logsumexp_mean == pytest.approx(math.log(64), abs=1.0)
    assert rec.adam_ratio_rms is not None and rec.adam_ratio_rms > 0
    # GPT-2's projections are transformers' Conv1D: their output RMS is measured like a Linear's
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"} <= set(rec.layer_output_rms)


def _one_parameter_adam() -> tuple:
    """(w, Adam over it with lr 0.1, betas (0.9, 0.99), eps 1e-8, a Monitor sampling every step):
    gradients are set by hand, no forward."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 3))
    model = nn.Module()
    model.w = w
    opt = torch.optim.Adam([w], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    return w, opt, nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})


def test_adam_second_moment_matches_a_hand_computation():
    w, opt, mon = _one_parameter_adam()
    v = torch.zeros_like(w)
    rec = None
    for t in range(1, 22):
        g = torch.randn(5, 3) * (10.0 if t == 21 else 1.0)  # the last gradient is 10x: v lags behind
        w.grad = g.clone()
        v = 0.99 * v + 0.01 * g * g
        v_hat = v / (1 - 0.99**t)
        opt.step()
        rec = mon.post_step(1.0).record
    mon.close()
    want = float(torch.sqrt((g * g / v_hat).mean()))
    assert rec.adam_ratio_rms == pytest.approx(want, rel=1e-4)
    assert rec.adam_ratio_rms > 3  # the spike the second moment did not see coming
    # at most sqrt((1 - 0.99^21) / (1 - 0.99)) = 4.36 at step 21 (1/sqrt(0.01) = 10 in the long run)
    assert rec.adam_ratio_bound == pytest.approx(math.sqrt((1 - 0.99**21) / 0.01))
    assert rec.adam_small_grad_fraction == pytest.approx(float((g.abs() < 1e-8).float().mean()))


@pytest.mark.parametrize("replaced", ["data", "exp_avg", "exp_avg_sq", "state"])
def test_adam_statistics_read_a_parameter_or_moment_replaced_out_of_place_at_the_next_sample(replaced):
    """`p.data = ...` (what `model.to()` does), a moment tensor or the whole state replaced in the
    optimizer: the next sample reads the new tensors, not the cached views of the old ones."""
    w, opt, mon = _one_parameter_adam()

    def step() -> tuple:
        w.grad = torch.randn(5, 3)
        opt.step()
        rec = mon.post_step(1.0).record
        st = opt.state[w]
        t = float(st["step"])
        v_hat = st["exp_avg_sq"] / (1 - 0.99**t)
        m_hat = st["exp_avg"] / (1 - 0.9**t)
        rms = float(torch.sqrt((w.grad**2 / v_hat).mean()))
        upd = float(
            0.1 * torch.linalg.vector_norm(m_hat / (v_hat.sqrt() + 1e-8)) / torch.linalg.vector_norm(w.detach())
        )
        return rec, rms, upd

    for _ in range(8):
        step()
    st = opt.state[w]
    if replaced == "data":
        w.data = w.data * 3.0  # out of place: a new tensor under the same Parameter
    elif replaced == "state":
        opt.state[w] = {
            "step": st["step"].clone(),
            "exp_avg": st["exp_avg"] * 2.0,
            "exp_avg_sq": st["exp_avg_sq"] * 4.0,
        }
    else:
        st[replaced] = st[replaced] * 4.0
    for _ in range(2):
        rec, rms, upd = step()
        assert rec.layer_adam_ratio_rms["w"] == pytest.approx(rms, rel=1e-5)
        assert rec.layer_update_ratio["w"] == pytest.approx(upd, rel=1e-5)
    mon.close()


def test_adam_statistics_skip_a_tensor_without_a_gradient_this_step_and_keep_the_others():
    torch.manual_seed(0)
    model = nn.Module()
    model.a, model.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(2000))  # small, and sampled
    opt = torch.optim.Adam([model.a, model.b], lr=0.1, betas=(0.9, 0.99))
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    recs = []
    for t in range(4):
        model.a.grad = torch.randn(4, 3)
        model.b.grad = None if t == 3 else torch.randn(2000)  # `b` unused at the last step: Adam skips it
        opt.step()
        recs.append(mon.post_step(1.0).record)
    mon.close()
    assert set(recs[2].layer_adam_ratio_rms) == {"a", "b"}
    assert set(recs[3].layer_adam_ratio_rms) == {"a"}
    st = opt.state[model.a]
    v_hat = st["exp_avg_sq"] / (1 - 0.99**4)
    want = float(torch.sqrt((model.a.grad**2 / v_hat).mean()))
    assert recs[3].layer_adam_ratio_rms["a"] == pytest.approx(want, rel=1e-5)
    assert recs[3].adam_small_grad_fraction == 0.0  # out of `a`'s 12 elements, none below eps


def test_adam_statistics_of_a_large_tensor_come_from_a_sample_close_to_the_exact_ones():
    """A tensor over ADAM_SAMPLE elements is read at fixed sampled positions: the estimates stay
    within a few percent of the whole tensor's values, and a tensor at most that size is exact."""
    from nummon._stats.adam_stats import ADAM_SAMPLE

    torch.manual_seed(0)
    big, tiny = nn.Parameter(torch.randn(256, 64)), nn.Parameter(torch.randn(7))
    assert big.numel() > 8 * ADAM_SAMPLE >= tiny.numel()
    model = nn.Module()
    model.big, model.tiny = big, tiny
    opt = torch.optim.Adam([big, tiny], lr=0.1, betas=(0.9, 0.99), eps=1e-6)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
    for t in range(1, 16):
        for p in (big, tiny):
            g = torch.randn(p.shape) * (torch.rand(p.shape) * 4 if t == 15 else 1.0)  # an uneven last jump
            g[torch.rand(p.shape) < 0.3] = 0.0  # 30% of |g| below eps
            p.grad = g
        opt.step()
        rec = mon.post_step(1.0).record
    mon.close()
    for p, name, rel in ((big, "big", 0.05), (tiny, "tiny", 1e-5)):
        st = opt.state[p]
        v_hat = st["exp_avg_sq"] / (1 - 0.99**15)
        want_rms = float(torch.sqrt((p.grad**2 / v_hat.clamp_min(1e-12)).mean()))
        m_hat = st["exp_avg"] / (1 - 0.9**15)
        want_upd = float(
            0.1 * torch.linalg.vector_norm(m_hat / (v_hat.sqrt() + 1e-6)) / torch.linalg.vector_norm(p.detach())
        )
        assert rec.layer_adam_ratio_rms[name] == pytest.approx(want_rms, rel=rel)
        assert rec.layer_update_ratio[name] == pytest.approx(want_upd, rel=rel)
    exact_small = float(sum((p.grad.abs() < 1e-6).sum() for p in (big, tiny)) / (big.numel() + tiny.numel()))
    assert rec.adam_small_grad_fraction == pytest.approx(exact_small, abs=0.03)


def test_cadence_samples_every_n_steps_and_nothing_between():
    _, _, reports = _run("manual", steps=7, every=3)
    sampled = [r.record.step for r in reports if r.record.attention_logit_max is not None]
    assert sampled == [0, 3, 6]
    assert all(r.record.output_logsumexp_mean is None for r in reports if r.record.step not in sampled)


def test_the_model_and_optimizer_are_hooked_for_the_sampled_steps_only():
    # a hook is a Python call per forward or optimizer step: the probes' hooks are registered when
    # a step is armed and taken off after it (the samples are the same as test_cadence's)
    torch.manual_seed(0)
    model = Attn(impl="manual")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(3, 6, 16), torch.randint(0, 4, (3, 6))
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 3}, "sampling": {"activations": False}})
    hooked, sampled = [], []
    for _ in range(7):
        rec = _step(model, opt, mon, x, y).record
        sampled.append(rec.adam_ratio_rms is not None)
        hooked.append((bool(model._forward_pre_hooks), bool(opt._optimizer_step_post_hooks)))
    mon.close()
    assert sampled == [s in (3, 6) for s in range(7)]  # (Adam has no ratio to tell at its first step)
    assert hooked == [(s + 1 in (3, 6),) * 2 for s in range(7)]  # after step s: for step s + 1
    assert not model._forward_pre_hooks and not opt._optimizer_step_post_hooks  # closed: none left


def test_no_probe_runs_when_mechanisms_are_off():
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.AdamW(model.parameters())
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"enabled": False}})
    rec = _step(model, opt, mon, torch.randn(2, 5, 16), torch.randint(0, 4, (2, 5))).record
    mon.close()
    assert rec.attention_logit_max is None and rec.adam_ratio_rms is None and not rec.layer_output_rms


def test_per_sample_losses_name_the_worst_samples_in_alerts_and_the_jsonl(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "events.jsonl"
    mon = nummon.Monitor(model, opt, sinks=[nummon.JsonlSink(log)], policy={"mechanisms": {"every": 1}})
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for step in range(12):
        xb = x.clone()
        if step == 11:
            xb[5] *= 1e4  # one poisoned sample
        per = F.cross_entropy(model(xb), y, reduction="none")
        loss = per.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rep = mon.post_step(loss, per_sample_loss=per)
    mon.close()
    rec = rep.record
    assert rec.sample_loss_top[0] == 5
    assert rec.sample_loss_ratio == pytest.approx(float(per.detach().max() / per.detach().mean()))
    assert rep.alerts and rep.alerts[0].details["worst_samples"][0] == 5
    back = [r for r in read_trace(log)]
    assert back[-1].sample_loss_top[0] == 5
    assert back[-1].layer_output_rms == rec.layer_output_rms


def test_bad_per_sample_loss_is_refused_without_changing_state():
    model = nn.Linear(2, 1)
    mon = nummon.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(nummon.NummonError, match="per_sample_loss"):
        mon.post_step(1.0, per_sample_loss=torch.tensor([]))
    with pytest.raises(nummon.NummonError, match="per_sample_loss"):
        mon.post_step(1.0, per_sample_loss="abc")
    assert mon.step == 0
    mon.close()


def test_replay_of_the_jsonl_sees_the_mechanisms_the_live_monitor_saw(tmp_path):
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = tmp_path / "events.jsonl"
    mon = nummon.Monitor(model, opt, sinks=[nummon.JsonlSink(log)], policy={"mechanisms": {"every": 2}})
    x, y = torch.randn(2, 5, 16), torch.randint(0, 4, (2, 5))
    live = [_step(model, opt, mon, x, y).record for _ in range(4)]
    mon.close()
    back = list(read_trace(log))
    for a, b in zip(live, back):
        assert a.attention_logit_max == b.attention_logit_max
        assert a.layer_attention_entropy == b.layer_attention_entropy
        assert a.adam_ratio_rms == b.adam_ratio_rms
        assert a.adam_ratio_bound == b.adam_ratio_bound  # replay judges the ratio against the same bound
    lines = [json.loads(l) for l in log.read_text().splitlines()]
    assert any("layer_attention_logit_max" in d for d in lines)
    # AdamW's default beta2 at the step: sqrt((1 - 0.999^t) / (1 - 0.999))
    assert any(b.adam_ratio_bound == pytest.approx(math.sqrt((1 - 0.999 ** (b.step + 1)) / 0.001)) for b in back)


def test_adam_second_moment_is_the_same_before_and_after_the_optimizer_step():
    """The callbacks call post_step before optimizer.step(), a plain loop after: same RMS(g/sqrt(v_hat))."""
    got = {}
    for when in ("after", "before"):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.9, 0.99))
        mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 1}})
        vals = []
        g = torch.Generator().manual_seed(1)
        for t in range(4):
            x = torch.randn(8, 4, generator=g) * (1 + 3 * t)
            opt.zero_grad()
            model(x).square().mean().backward()
            if when == "before":
                vals.append(mon.post_step(1.0).record.adam_ratio_rms)
                opt.step()
            else:
                opt.step()
                vals.append(mon.post_step(1.0).record.adam_ratio_rms)
        mon.close()
        got[when] = vals
    assert got["after"][0] is None and got["before"][0] is None  # nothing to compare the first gradient with
    assert got["after"][1:] == pytest.approx(got["before"][1:], rel=1e-5)


@pytest.mark.slow
def test_lightning_callback_passes_the_per_sample_losses_a_training_step_leaves(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from nummon.integrations.lightning import NummonLightningCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            per = (self.net(x) - y).pow(2).mean(1)
            self.nummon_per_sample_loss = per.detach()
            return per.mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    y[3] += 100.0  # the outlier the record must name
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    cb = NummonLightningCallback(policy={"mechanisms": {"every": 1}}, follow_loggers=False, run_dir=str(tmp_path))
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Module(), loader)
    rec = cb.last_report.record
    assert rec.sample_loss_top[0] == 3 and rec.sample_loss_ratio > 5


def test_hugging_face_callback_passes_the_per_sample_losses_the_model_leaves(tmp_path):
    """A model whose forward sets `nummon_per_sample_loss` gets its worst samples named through
    the Trainer callback (the batch that did it), with no other change to the training code."""
    pytest.importorskip("transformers")
    from helpers.transformers_runs import RandomTokens, training_args
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    from nummon.integrations.transformers import NummonTrainerCallback

    class PerSampleGPT2(GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            self.last_ids = input_ids
            logits = out.logits[:, :-1].float()
            per_token = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")
            per_token = per_token * torch.where(labels[:, 1:, None] == 7, 50.0, 1.0).squeeze(-1)  # token 7 costs 50x
            self.nummon_per_sample_loss = per_token.mean(1).detach()
            out.loss = per_token.mean()
            return out

    torch.manual_seed(0)
    model = PerSampleGPT2(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    data = RandomTokens(n=8)
    data.ids[5] = 7  # sample 5 of the batch of 8: all 7s
    cb = NummonTrainerCallback(policy={"mechanisms": {"every": 1}})
    Trainer(model=model, args=training_args(tmp_path, steps=2, batch=8), train_dataset=data, callbacks=[cb]).train()
    rec = cb.last_report.record
    # the Trainer shuffles the batch: the worst sample is wherever sample 5 went, the one of all 7s
    assert rec.sample_loss_ratio > 5 and len(rec.sample_loss_top) == 5
    assert bool((model.last_ids[rec.sample_loss_top[0]] == 7).all())


def test_a_calm_run_is_sampled_more_sparsely_and_trouble_brings_the_cadence_back():
    """`calm_multiple`: past `calm_after`, while the detectors hold a quiet region and the probes'
    values hold still, the probes sample every `every` x `calm_multiple` steps; a blow-up brings
    every step back (an incident is open)."""
    torch.manual_seed(0)
    model = Attn(impl="manual")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [(torch.randn(3, 6, 16), torch.randint(0, 4, (3, 6))) for _ in range(4)]
    policy = {"mechanisms": {"every": 2, "calm_after": 20, "calm_multiple": 3}, "sinks": {"console": False}}
    mon = nummon.Monitor(model, opt, policy=policy)
    sampled, health = [], {}
    for step in range(110):
        if step == 100:  # the learning rate blows up
            for g in opt.param_groups:
                g["lr"] = 3.0
        rep = _step(model, opt, mon, *batches[step % 4])
        health[step] = rep.health
        if rep.record.attention_logit_max is not None:
            sampled.append(step)
    mon.close()
    calm = [s for s in sampled if 20 <= s < 100]
    assert [s for s in sampled if s < 20] == list(range(0, 20, 2))  # before calm_after: every 2 steps
    assert all(s % 2 == 0 for s in calm)  # never off the base cadence (no confirmation was asked for)
    assert {s for s in range(20, 100) if s % 6 == 0} <= set(calm)  # the calm cadence's steps are sampled, calm or not
    thinned = [s for s in range(20, 100, 2) if s % 6 and s not in calm]
    assert len(thinned) >= 10, sampled  # ... and the steps between them, once the run was calm, were not
    assert health[101] is not nummon.Health.HEALTHY and sampled[-5:] == list(range(105, 110))  # every step again

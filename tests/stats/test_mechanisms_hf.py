"""A live Monitor on a tiny Hugging Face Llama built from a config with SDPA attention (never
downloaded): the attention probe sees every SDPA layer and the output probe sees log Z.
(GPT-2 with SDPA: tests/stats/test_mechanisms.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F

import nummon


@pytest.mark.slow
def test_llama_with_sdpa_records_attention_logits_per_layer_and_log_z():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nummon.Monitor(model, opt, policy={"mechanisms": {"every": 2}, "recorder": {"write": False}})
    ids = torch.randint(0, 64, (2, 12))
    recs = []
    for _ in range(3):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    mon.close()
    assert [r.attention_logit_max is not None for r in recs] == [True, False, True]  # the cadence
    rec = recs[-1]
    assert sorted(rec.layer_attention_logit_max) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(math.isfinite(v) and v > 0 for v in rec.layer_attention_logit_max.values())
    assert rec.attention_logit_max == max(rec.layer_attention_logit_max.values())
    # log Z of the logits that went into cross_entropy (a fresh model's is near ln 64)
    want = torch.logsumexp(logits.detach(), -1)
    assert rec.output_logsumexp_mean == pytest.approx(float(want.mean()), rel=1e-4)
    assert rec.output_logsumexp_max == pytest.approx(float(want.max()), rel=1e-4)
    assert rec.output_logsumexp_mean == pytest.approx(math.log(64), abs=1.0)

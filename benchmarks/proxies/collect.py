"""Train every proxy once with every mechanism probe sampled at every step and write its step
records as a nummon JSONL trace (`score.py` then replays them at any cadence, with and without
the probes: the probes do not change the training).

    .venv/bin/python -m benchmarks.proxies.collect OUT_DIR [name-substring ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import nummon
from benchmarks.proxies.lm import ProxyConfig, train

__all__ = ["ALL", "CONFIGS", "HF_CONFIGS", "OUTPUT_LOGIT_CONFIGS", "collect"]

#: The proxies: healthy (lr 0.01), unstable (0.1, 0.3) at two widths and two seeds; the unstable
#: LR again with qk-layernorm, with z-loss, and with fused (SDPA) attention.
CONFIGS = tuple(
    [ProxyConfig(lr=lr, seed=s, d=d) for lr in (0.01, 0.1, 0.3) for d in (64, 128) for s in (0, 1)]
    + [ProxyConfig(lr=0.3, seed=s, qk_layernorm=True) for s in (0, 1)]
    + [
        ProxyConfig(lr=0.3, seed=0, z_loss=1e-4),
        ProxyConfig(lr=0.3, seed=0, attention="sdpa"),
        ProxyConfig(lr=0.01, seed=0, qk_layernorm=True),
    ]
)

#: Wortsman et al.'s recipe for output-logit divergence (section 3.2): qk-layernorm on (no
#: attention-logit growth), no weight decay, high LR, with and without z-loss 1e-4; no learnable
#: scale on the final LayerNorm; and a head over 1024 tokens of which the corpus uses 256 (the
#: other 768 are never a target, so Adam pushes their logits down every step); and 3000 steps
#: with the forward under bfloat16 autocast.
OUTPUT_LOGIT_CONFIGS = tuple(
    [
        ProxyConfig(lr=lr, seed=0, qk_layernorm=True, weight_decay=0.0, z_loss=z)
        for lr in (0.3, 1.0)
        for z in (0.0, 1e-4)
    ]
    + [ProxyConfig(lr=0.3, seed=s, qk_layernorm=True, weight_decay=0.0, ln_f_affine=False) for s in (0, 1)]
    + [ProxyConfig(lr=0.3, seed=0, qk_layernorm=True, weight_decay=0.0, ln_f_affine=False, z_loss=1e-4)]
    + [
        ProxyConfig(lr=0.1, seed=0, qk_layernorm=True, weight_decay=0.0, vocab=1024, data_vocab=256, z_loss=z)
        for z in (0.0, 1e-4)
    ]
    + [
        ProxyConfig(
            lr=0.3, seed=0, qk_layernorm=True, weight_decay=0.0, ln_f_affine=False, bf16=True, steps=3000, z_loss=z
        )
        for z in (0.0, 1e-4)
    ]  # bfloat16 logits, 3000 steps: where log Z drifts
)

#: Hugging Face GPT-2 and Llama of the same shape, built from a config with SDPA attention.
HF_CONFIGS = tuple(ProxyConfig(arch=a, lr=lr, seed=0) for a in ("gpt2", "llama") for lr in (0.01, 0.03, 0.3))

ALL = CONFIGS + OUTPUT_LOGIT_CONFIGS + HF_CONFIGS


def collect(c: ProxyConfig, out: Path) -> Path:
    policy = nummon.Policy.model_validate(
        {"mechanisms": {"every": 1}, "alerts": {"stop_on_critical": False}, "recorder": {"write": False}}
    )
    path = out / f"{c.name}.jsonl"
    with path.open("w") as fh:

        def factory(model, opt):
            return nummon.Monitor(model, opt, policy=policy)

        t0 = time.perf_counter()
        tr = train(c, monitor_factory=factory)
        for r in tr["reports"]:
            fh.write(json.dumps(r.record.to_dict()) + "\n")
    print(f"{c.name}: {time.perf_counter() - t0:.1f}s, final loss {tr['loss'][-1]:.3f}", flush=True)
    return path


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    want = sys.argv[2:]
    for c in ALL:
        if not want or any(w in c.name for w in want):
            collect(c, out)

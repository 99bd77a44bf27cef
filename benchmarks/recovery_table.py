"""Runaway configurations trained with and without recovery (issue 17); results in benchmarks/RESULTS.md.

    python benchmarks/recovery_table.py            # the table (>= 10 configurations)
    python benchmarks/recovery_table.py --demo     # the demo's scenario, with and without recovery
    python benchmarks/recovery_table.py --cost     # snapshot cost on the demo CNN, side by side

Each configuration runs away to NaN without recovery (run to the end, the stop signal ignored, to
show the NaN); with the `recover` preset the loop honours `report.should_stop`. Timings are CPU
wall clock of this machine and only meaningful as ratios measured side by side.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nummon import Monitor  # noqa: E402
from nummon._tools.demo_model import DemoCNN, SyntheticDigits  # noqa: E402

__all__ = ["CONFIGS", "Config", "run_plain", "run_monitored", "demo_with_recovery", "snapshot_cost"]


# ---------------------------------------------------------------------------- models and data
class TinyTransformer(nn.Module):
    """Embedding 16 -> d 32, one single-head self-attention block and an MLP, no normalisation."""

    def __init__(self, vocab: int = 16, d: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff1 = nn.Linear(d, 2 * d)
        self.ff2 = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        h = h + self.proj(att @ v)
        h = h + self.ff2(torch.relu(self.ff1(h)))
        return self.head(h.mean(1))


def leaky_mlp(depth: int = 4, d_in: int = 32, hidden: int = 64, classes: int = 10) -> nn.Module:
    """LeakyReLU 0.01 (no dead units), no normalisation."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else hidden, hidden), nn.LeakyReLU(0.01)]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


def mlp(d_in: int = 32, hidden: int = 64, classes: int = 10, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d_in if i == 0 else hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


class Clusters:
    """Ten Gaussian clusters in 32 dimensions; from `switch` on, classes 5-9 at `gain` x scale."""

    def __init__(self, seed: int, switch: int, gain: float) -> None:
        g = torch.Generator().manual_seed(seed)
        self.centres = torch.randn(10, 32, generator=g)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.switch, self.gain = switch, gain

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, gain = (0, 1.0) if step < self.switch else (5, self.gain)
        y = torch.randint(0, 5, (64,), generator=self.gen) + lo
        return (self.centres[y] + torch.randn(64, 32, generator=self.gen)) * gain, y


class Tokens:
    """Sequences of 8 tokens; the label is the most frequent token class (token mod 4); from
    `switch` on the model sees sequences of a different vocabulary half (a domain switch)."""

    def __init__(self, seed: int, switch: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.switch = switch

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = 0 if step < self.switch else 8
        t = torch.randint(0, 8, (64, 8), generator=self.gen) + lo
        y = torch.mode(t % 4, dim=1).values
        return t, y


class DigitsSwitch:
    def __init__(self, seed: int) -> None:
        self.data = SyntheticDigits(seed)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.stream(step)


@dataclass(frozen=True)
class Config:
    name: str
    model: Callable[[], nn.Module]
    optimizer: str  # "sgd" (momentum 0.9) or "adam"
    lr: float
    seed: int
    data: Callable[[int], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]
    steps: int = 200
    half: bool = False  # float16 weights and activations (no loss scaler): a 65504 ceiling

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
        torch.manual_seed(self.seed)
        model = self.model()
        if self.half:
            model = model.half()
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        else:  # eps 1e-4: 1e-8 is 0 in float16
            opt = torch.optim.Adam(model.parameters(), lr=self.lr, eps=1e-4 if self.half else 1e-8)
        data = self.data(self.seed)
        if self.half:
            inner = data
            data = lambda step: (lambda xy: (xy[0].half() if xy[0].is_floating_point() else xy[0], xy[1]))(inner(step))  # noqa: E731
        return model, opt, data


def _narrow_cnn() -> nn.Module:
    return DemoCNN(width=8, hidden=32)


def _leaky(depth: int) -> Callable[[], nn.Module]:
    return lambda: leaky_mlp(depth)


def _clusters(gain: float) -> Callable[[int], Clusters]:
    return lambda seed: Clusters(seed, 80, gain)


def _tokens(seed: int) -> Tokens:
    return Tokens(seed, 80)


CONFIGS: list[Config] = [
    Config("MLP relu, SGD-m lr 0.2, switch x10, seed 0", mlp, "sgd", 0.2, 0, _clusters(10.0)),
    Config("MLP leaky 4, SGD-m lr 0.05, switch x5, seed 0", _leaky(4), "sgd", 0.05, 0, _clusters(5.0)),
    Config("MLP leaky 4, SGD-m lr 0.1, switch x5, seed 0", _leaky(4), "sgd", 0.1, 0, _clusters(5.0)),
    Config("MLP leaky 4, SGD-m lr 0.1, switch x5, seed 1", _leaky(4), "sgd", 0.1, 1, _clusters(5.0)),
    Config("MLP leaky 4, SGD-m lr 0.2, switch x5, seed 0", _leaky(4), "sgd", 0.2, 0, _clusters(5.0)),
    Config("MLP leaky 6 fp16, Adam lr 0.03, switch x5, seed 0", _leaky(6), "adam", 0.03, 0, _clusters(5.0), half=True),
    Config("MLP leaky 6 fp16, Adam lr 0.03, switch x5, seed 1", _leaky(6), "adam", 0.03, 1, _clusters(5.0), half=True),
    Config(
        "CNN (demo, narrow), SGD-m lr 0.08, switch x3, seed 0", _narrow_cnn, "sgd", 0.08, 0, DigitsSwitch, steps=120
    ),
    Config("tiny transformer, SGD-m lr 0.1, seed 0", TinyTransformer, "sgd", 0.1, 0, _tokens),
    Config("tiny transformer, SGD-m lr 0.2, seed 0", TinyTransformer, "sgd", 0.2, 0, _tokens),
    Config("tiny transformer, SGD-m lr 0.3, seed 0", TinyTransformer, "sgd", 0.3, 0, _tokens),
    Config("tiny transformer, SGD-m lr 1, seed 1", TinyTransformer, "sgd", 1.0, 1, _tokens),
    Config("tiny transformer fp16, Adam lr 0.1, seed 0", TinyTransformer, "adam", 0.1, 0, _tokens, half=True),
]


# ---------------------------------------------------------------------------- runs
def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    return loss.detach()


def run_plain(cfg: Config) -> dict:
    """No Monitor: the step of the first non-finite loss (None: none) and the last losses."""
    model, opt, data = cfg.build()
    losses = []
    for step in range(cfg.steps):
        x, y = data(step)
        loss = float(_train_step(model, opt, x, y))
        losses.append(loss)
        if not math.isfinite(loss):
            return {"first_nan": step, "steps": step + 1}
    return {"first_nan": None, "steps": cfg.steps, "median_last10": statistics.median(losses[-10:])}


def run_monitored(cfg: Config, policy: str = "recover") -> dict:
    """With a Monitor under `policy`; the loop stops on `report.should_stop` like a user's would."""
    model, opt, data = cfg.build()
    losses: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        mon = Monitor(model, opt, policy=policy, run_dir=tmp)
        stopped = None
        for step in range(cfg.steps):
            x, y = data(step)
            loss = _train_step(model, opt, x, y)
            report = mon.post_step(loss, batch=(x, y))
            losses.append(float(loss))
            if report.should_stop:
                stopped = step
                break
        mon.close()
    finite_weights = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    actions = [r["action"] for r in mon.recoveries]
    return {
        "steps": len(losses),
        "stopped": stopped,
        "all_losses_finite": all(map(math.isfinite, losses)),
        "ends_finite": stopped is None and finite_weights and math.isfinite(losses[-1]),
        "rollbacks": actions.count("rollback"),
        "skips": actions.count("skip"),
        "median_last10": statistics.median(losses[-10:]),
        "first_nonfinite_loss": next((i for i, v in enumerate(losses) if not math.isfinite(v)), None),
    }


def table(configs: list[Config] = CONFIGS) -> tuple[str, int, int]:
    """The markdown table; (text, saved, runaways): saved = NaN without recovery and finite with it."""
    rows = [
        "| configuration | steps | without recovery: first NaN loss | with `recover`: end | rollbacks | skipped updates | median loss, last 10 |",
        "|---|---|---|---|---|---|---|",
    ]
    saved = runaways = 0
    for cfg in configs:
        plain = run_plain(cfg)
        rec = run_monitored(cfg)
        nan = plain["first_nan"]
        runaways += nan is not None
        saved += nan is not None and rec["ends_finite"]
        end = (
            "finite"
            if rec["ends_finite"]
            else f"stopped at step {rec['stopped']}"
            if rec["stopped"] is not None
            else "non-finite"
        )
        if rec["ends_finite"] and not rec["all_losses_finite"]:
            end += f" (a skipped step's loss was non-finite at {rec['first_nonfinite_loss']})"
        rows.append(
            f"| {cfg.name} | {cfg.steps} | {'step ' + str(nan) if nan is not None else 'none (finite)'} | {end} "
            f"| {rec['rollbacks']} | {rec['skips']} | {rec['median_last10']:.3g} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows) + "\n", saved, runaways


def demo_with_recovery(
    policy: str = "recover", seed: int = 0, steps: int = 120, lr: float = 0.02, run_dir: str | None = None
) -> dict:
    """The demo's scenario (DemoCNN, SGD momentum 0.9, classes 0-4 then 5-9 at 3x contrast from
    step 60, batch 64) under `policy`, run to the end (the stop signal is reported, not obeyed)."""
    torch.manual_seed(seed)
    model = DemoCNN()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = SyntheticDigits(seed)
    losses: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        mon = Monitor(model, opt, policy=policy, run_dir=run_dir or tmp)
        stop_at = None
        for step in range(steps):
            x, y = data.stream(step)
            loss = _train_step(model, opt, x, y)
            report = mon.post_step(loss, batch=(x, y))
            losses.append(float(loss))
            if report.should_stop and stop_at is None:
                stop_at = step
            if not math.isfinite(losses[-1]):
                break
        mon.close()
    return {
        "policy": policy,
        "steps": len(losses),
        "first_nonfinite": next((i for i, v in enumerate(losses) if not math.isfinite(v)), None),
        "all_finite": all(map(math.isfinite, losses)),
        "median_last10": statistics.median(losses[-10:]),
        "should_stop_at": stop_at,
        "recoveries": [{k: v for k, v in r.items() if k != "flight_record"} for r in mon.recoveries],
        "rollback_messages": [a.message for a in mon.alerts if a.details.get("recovery") == "rollback"],
    }


def snapshot_cost(steps: int = 20, device: str = "cpu") -> dict:
    """Step time of the demo CNN (batch 64) and the time of one snapshot, measured interleaved;
    the cost of a snapshot every 50 steps as a fraction of step time."""
    from nummon._monitor.recovery import Snapshot

    torch.manual_seed(0)
    dev = torch.device(device)
    model = DemoCNN().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
    data = SyntheticDigits(0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step_s, snap_s = [], []
    snap = None
    for step in range(steps + 3):
        x, y = (t.to(dev) for t in data.stream(step, healthy=True))
        sync()
        t0 = time.perf_counter()
        _train_step(model, opt, x, y)
        sync()
        t1 = time.perf_counter()
        snap = Snapshot.take(model, opt, step)
        if snap.event is not None:
            snap.event.synchronize()
        t2 = time.perf_counter()
        if step >= 3:  # warm-up
            step_s.append(t1 - t0)
            snap_s.append(t2 - t1)
    step_med, snap_med = statistics.median(step_s), statistics.median(snap_s)
    return {
        "device": device,
        "step_ms": step_med * 1e3,
        "snapshot_ms": snap_med * 1e3,
        "snapshot_mb": snap.nbytes / 2**20,
        "every_50_fraction": snap_med / 50 / step_med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="the demo scenario with and without recovery")
    ap.add_argument("--cost", action="store_true", help="snapshot cost on the demo CNN")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cost:
        print(snapshot_cost(device=args.device))
        return
    if args.demo:
        for policy in ("default", "recover"):
            print(demo_with_recovery(policy))
        return
    text, saved, runaways = table()
    text += f"\n{saved} of {runaways} runaway configurations end finite with recovery.\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

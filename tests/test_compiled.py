"""A `torch.compile`d model: measured as the eager one, with no graph break and no recompile per
step from nummon's hooks (`fullgraph=True` raises on a break), names without `_orig_mod.`, and
the forward's mechanism probes off, said once (they would break or recompile the graph).

`aot_eager` traces and functionalises like inductor, without compiling kernels (seconds, not a
minute per model on this CPU)."""
import math

import pytest
import torch
from torch import nn

import nummon

dynamo = pytest.importorskip("torch._dynamo")

QUIET = {"recorder": {"write": False}, "alerts": {"stop_on_critical": False}, "mechanisms": {"every": 1}}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.blocks = nn.Sequential(*[Block(32) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)))


def _train(how, steps=8, poison_at=None):
    """Records of `steps` AdamW steps on one seeded model, data and Monitor; `how`: "eager",
    "before" (torch.compile, then the Monitor), "after" (the Monitor, then torch.compile) or
    "block" (one block compiled in place). At `poison_at` a weight of blocks.1.fc goes Inf."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model
    if how == "before":
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
    if how == "block":
        model.blocks[0].compile(backend="aot_eager", fullgraph=True)
    mon = nummon.Monitor(run, opt, policy=QUIET)
    if how == "after":
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    recs = []
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if step == poison_at:
            with torch.no_grad():
                model.blocks[1].fc.weight[0, 0] = math.inf
        opt.zero_grad()
        loss = nn.functional.cross_entropy(run(x), y)
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    mon.close()
    return recs, dynamo.utils.counters["stats"]["unique_graphs"]


def _same(a, b, rel=1e-5):
    return a == pytest.approx(b, rel=rel, nan_ok=True)


@pytest.mark.parametrize("how", ["before", "after"])
def test_a_compiled_model_is_measured_as_the_eager_one(how):
    eager, _ = _train("eager")
    with pytest.warns(UserWarning, match="compiled .* mechanism probes .* are off") as said:
        compiled, graphs = _train(how)
    assert [w.filename for w in said] == [__file__]  # once, at the user's line (Monitor(...) or post_step)
    assert graphs <= 2  # the first forward makes the activation buffers, the second reuses them: no recompile after
    for e, c in zip(eager, compiled):
        assert list(c.layer_grad_norms) == list(e.layer_grad_norms) == [n for n, _ in Net().named_parameters()]
        assert c.layer_activation_max.keys() == e.layer_activation_max.keys()
        for name, value in e.layer_activation_max.items():
            assert _same(c.layer_activation_max[name], value), (c.step, name)
        assert _same(c.grad_norm, e.grad_norm) and _same(c.loss, e.loss)
        assert (c.adam_ratio_rms is None) is (e.adam_ratio_rms is None)  # the optimizer's probe works
        if e.adam_ratio_rms is not None:
            assert _same(c.adam_ratio_rms, e.adam_ratio_rms, rel=1e-4)
    assert eager[-1].output_logsumexp_mean is not None and compiled[-1].output_logsumexp_mean is None


def test_the_first_non_finite_module_of_a_compiled_model_is_named():
    eager, _ = _train("eager", steps=4, poison_at=2)
    with pytest.warns(UserWarning, match="compiled"):
        compiled, _ = _train("before", steps=4, poison_at=2)
    assert eager[2].nonfinite_location == "output of `blocks.1.fc` (forward)"
    assert [r.nonfinite_location for r in compiled] == [r.nonfinite_location for r in eager]


def test_a_block_compiled_in_place_turns_the_forward_probes_off():
    with pytest.warns(UserWarning, match="compiled"):
        recs, _ = _train("block", steps=3)
    assert recs[-1].output_logsumexp_mean is None and recs[-1].layer_activation_max


def test_explain_nonfinite_names_the_operator_and_module_inside_a_compiled_model():
    from nummon.diagnose import explain_nonfinite

    dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    run = torch.compile(model, backend="aot_eager")
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    nn.functional.cross_entropy(run(x), y).backward()  # compiled and run once
    with torch.no_grad():
        model.blocks[1].ln.weight.fill_(math.inf)
    report = explain_nonfinite(lambda: nn.functional.cross_entropy(run(x), y))
    assert (report.module, report.op) == ("blocks.1.ln", "aten::native_layer_norm")  # not `_orig_mod.blocks.1.ln`


def test_the_hugging_face_trainer_with_torch_compile_is_watched(tmp_path):
    """`TrainingArguments(torch_compile=True)`: the Trainer compiles the model itself; the
    callback's records carry the model's own names, activations and Adam's statistics, and the
    forward probes are off, said once."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer

    from nummon.integrations.transformers import NummonCallback
    from transformers_runs import RandomTokens, optimizers, tiny_gpt2, training_args

    dynamo.reset()
    model = tiny_gpt2()
    cb = NummonCallback(policy=QUIET, console=False)
    args = training_args(tmp_path, steps=6, torch_compile=True, torch_compile_backend="aot_eager")
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), optimizers=optimizers(model, False),
                      callbacks=[cb])
    with pytest.warns(UserWarning, match="compiled .* mechanism probes .* are off") as said:
        trainer.train()
    assert len([w for w in said if "nummon" in str(w.message)]) == 1
    rec = cb.last_report.record
    assert list(rec.layer_grad_norms) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert rec.layer_activation_max and all(not n.startswith("_orig_mod") for n in rec.layer_activation_max)
    assert rec.adam_ratio_rms is not None and rec.output_logsumexp_mean is None

"""The verdict's re-run is the step's own computation or no verdict at all: every micro-batch of an
accumulated step, every random generator as each forward found it (F.dropout, Python's `random`,
NumPy), and the generators put back after it, so training goes on bitwise as it would without nummon."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from nummon import MicroBatches, Monitor, NummonError


class DropNet(nn.Module):
    """Dropout through the functional API: no nn.Dropout module to find."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(nn.functional.dropout(torch.relu(self.fc1(x)), 0.5, self.training))


class StochasticDepthNet(DropNet):
    """A forward that draws from Python's `random` (a layer skipped at random, as stochastic depth does)."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h * (1.0 if random.random() < 0.8 else 0.5))


def _policy(tmp_path, **extra):
    return {"sinks": {"console": False}, "recorder": {"directory": str(tmp_path)}, **extra}


def _data(steps, micro=1):
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(micro)] for _ in range(steps)
    ]


def _critical(reports):
    return [a for r in reports for a in r.alerts if a.severity.value == "critical" and not a.cleared]


def _blowup(tmp_path, recompute_of, micro=1, steps=60, net=DropNet):
    """SGD at lr 3 in the callbacks' order (post_step before the update) until it is critical."""
    torch.manual_seed(0)
    random.seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=3.0)
    reports = []
    with Monitor(model, opt, policy=_policy(tmp_path)) as mon:
        for batches in _data(steps, micro):
            opt.zero_grad()
            losses = []
            for x, y in batches:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / len(batches)).backward()
                losses.append(loss.detach())
            step_loss = sum(losses[1:], losses[0]) / len(losses)
            r = mon.post_step(step_loss, recompute=recompute_of(model, batches))
            opt.step()
            reports.append(r)
            if r.should_stop:
                break
    return mon, reports


def _last_micro_batch(model, batches):
    x, y = batches[-1]
    return lambda: nn.functional.mse_loss(model(x), y)


def _every_micro_batch(model, batches):
    return MicroBatches([lambda x=x, y=y: nn.functional.mse_loss(model(x), y) for x, y in batches])


def test_a_functional_dropout_step_re_runs_bitwise(tmp_path):
    mon, reports = _blowup(tmp_path, _last_micro_batch)
    crit = _critical(reports)
    assert crit and mon._steps.verdicts, [a.message for a in crit]
    assert all(v.verdict == "reproducible" and v.bitwise for v in mon._steps.verdicts), [
        v.sentence() for v in mon._steps.verdicts
    ]


def test_a_forward_drawing_from_pythons_random_re_runs_bitwise_once_an_incident_is_open(tmp_path):
    # the run warns before it is critical: from then on each forward keeps Python's and NumPy's
    # generators too, and the re-run draws what the step drew
    mon, reports = _blowup(tmp_path, _last_micro_batch, net=StochasticDepthNet)
    crit = _critical(reports)
    assert crit and mon._steps.verdicts, [a.details.get("verdict_unavailable") for a in crit]
    assert all(v.verdict == "reproducible" and v.bitwise for v in mon._steps.verdicts), [
        v.sentence() for v in mon._steps.verdicts
    ]


def test_an_accumulated_step_re_run_in_full_is_reproducible_bitwise(tmp_path):
    mon, reports = _blowup(tmp_path, _every_micro_batch, micro=2)
    assert _critical(reports) and mon._steps.verdicts
    assert all(v.verdict == "reproducible" and v.bitwise for v in mon._steps.verdicts), [
        v.sentence() for v in mon._steps.verdicts
    ]


def test_a_re_run_of_one_micro_batch_of_two_gives_no_verdict_and_says_why(tmp_path):
    mon, reports = _blowup(tmp_path, _last_micro_batch, micro=2)
    crit = _critical(reports)
    assert crit and mon._steps.verdicts == []
    assert all("verdict" not in a.details for a in crit)
    why = crit[0].details["verdict_unavailable"]
    assert "forward 1 time(s) and the step 2" in why and "every micro-batch" in why


def test_a_recompute_that_draws_random_numbers_before_the_forward_gives_no_verdict(tmp_path):
    def augmented(model, batches):
        x, y = batches[-1]
        return lambda: nn.functional.mse_loss(model(x + 0.01 * torch.randn_like(x)), y)

    mon, reports = _blowup(tmp_path, augmented)
    crit = _critical(reports)
    assert crit and mon._steps.verdicts == []
    assert "drew random numbers before the model's forward" in crit[0].details["verdict_unavailable"]


def _train_skipping_nonfinite(tmp_path, with_nummon, augmented, steps=14, poison_at=4):
    """Dropout, augmentation from Python's `random` and NumPy inside the step; a poisoned batch
    at `poison_at` (critical: a verdict's re-run) whose update the loop skips."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = DropNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, policy=_policy(tmp_path, alerts={"stop_on_critical": False})) if with_nummon else None

    def augment(x):
        return x * random.uniform(0.9, 1.1) + float(np.random.normal(0, 0.01)) if augmented else x

    for step, ((x, y),) in enumerate(_data(steps)):
        if step == poison_at:
            x = x.clone()
            x[3, 2] = float("inf")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(augment(x)), y)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        if mon is not None:
            mon.post_step(loss, batch=(x, y), recompute=lambda x=x, y=y: nn.functional.mse_loss(model(augment(x)), y))
    if mon is not None:
        mon.close()
    return model, mon, (torch.rand(4), random.random(), float(np.random.rand()))


@pytest.mark.parametrize("augmented", [False, True])
def test_training_after_a_verdict_is_bitwise_the_run_without_nummon(tmp_path, augmented):
    model, mon, after = _train_skipping_nonfinite(tmp_path, True, augmented)
    plain, _, plain_after = _train_skipping_nonfinite(tmp_path, False, augmented)
    if augmented:  # the re-run ran, and said why it gives no verdict: it drew from Python's and
        # NumPy's generators, whose states a healthy step does not keep (30 µs a forward)
        why = [a.details.get("verdict_unavailable", "") for a in mon.alerts]
        assert any("drew from Python's or NumPy's random generator" in w for w in why), why
        assert not mon._steps.verdicts
    else:
        assert [v.verdict for v in mon._steps.verdicts] == ["reproducible"]
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(after[0], plain_after[0]) and after[1:] == plain_after[1:]


@pytest.mark.parametrize("micro", [1, 3])
def test_micro_batches_combine_the_loss_as_the_step_did(micro):
    torch.manual_seed(0)
    values = [torch.rand(()) for _ in range(micro)]
    steps = MicroBatches([lambda v=v: v for v in values])
    total = values[0]
    for v in values[1:]:
        total = total + v
    assert torch.equal(steps.combine(values), total / micro)
    assert torch.equal(MicroBatches([lambda: 0] * micro, share=True).combine(values), total)


@pytest.mark.parametrize("parts", [[], [1]])
def test_micro_batches_refuse_what_is_not_a_list_of_functions(parts):
    with pytest.raises(NummonError, match="MicroBatches needs one or more functions"):
        MicroBatches(parts)


class Holder(nn.Module):
    """Lightning's `training_step` calling `self.net(x)`: the model's own forward never runs."""

    def __init__(self):
        super().__init__()
        self.net = DropNet()


def _holder_run(tmp_path, steps, poison_at=None, lr=3.0):
    torch.manual_seed(0)
    holder = Holder()
    opt = torch.optim.SGD(holder.parameters(), lr=lr)
    reports = []
    with Monitor(holder, opt, policy=_policy(tmp_path)) as mon:
        for step, ((x, y),) in enumerate(_data(steps)):
            if step == poison_at:
                x = x.clone()
                x[0, 0] = float("inf")
            opt.zero_grad()
            loss = nn.functional.mse_loss(holder.net(x), y)
            loss.backward()
            r = mon.post_step(loss, batch=(x, y), recompute=lambda x=x, y=y: nn.functional.mse_loss(holder.net(x), y))
            opt.step()
            reports.append(r)
            if r.should_stop:
                break
    return mon, reports


def test_a_loop_that_calls_only_a_submodule_gets_a_bitwise_verdict(tmp_path):
    mon, reports = _holder_run(tmp_path, 60)
    assert _critical(reports) and mon._steps.verdicts, [
        a.details.get("verdict_unavailable") for a in _critical(reports)
    ]
    assert all(v.verdict == "reproducible" and v.bitwise for v in mon._steps.verdicts)


def test_a_critical_first_step_says_no_forward_was_seen(tmp_path):
    mon, reports = _holder_run(tmp_path, 3, poison_at=0, lr=0.05)
    crit = _critical(reports)
    assert crit and mon._steps.verdicts == []
    assert crit[0].details["verdict_unavailable"].startswith("no forward of the model was seen in this step")

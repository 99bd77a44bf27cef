"""The statistics collector on real models: late-added parameters, dtypes, complex parameters,
argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.models import Deep
from torch import nn

from nummon import AlertKind, Health, Monitor, NummonError

# every statistic every step: these tests pin what is measured, not the cadence (test_sampling_cadence)
QUIET = {
    "recorder": {"write": False},
    "alerts": {"stop_on_critical": False},
    "sampling": {"params_every": 1, "optimizer_every": 1, "activations_every": 1},
}


def _step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def test_a_module_added_after_the_monitor_is_watched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy=QUIET)
    x = torch.randn(8, 4)
    assert mon.post_step(_step(model, opt, x)).health is Health.HEALTHY
    model.append(nn.Linear(4, 2))
    opt.add_param_group({"params": model[1].parameters()})
    r = mon.post_step(_step(model, opt, x))
    assert "1.weight" in r.record.layer_grad_norms  # its output is hooked from the next forward on
    loss = _step(model, opt, x)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")  # after the step: only the new parameter is bad
    r = mon.post_step(loss)
    mon.close()
    assert r.health is Health.NONFINITE and r.record.nonfinite_location == "parameters (optimizer step)"
    assert "1" in r.record.layer_activation_max


def test_a_parameter_group_added_to_the_optimizer_only_is_watched():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy=QUIET)
    x = torch.randn(8, 4)
    mon.post_step(_step(model, opt, x))
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra]})
    loss = _step(model, opt, x)
    with torch.no_grad():
        extra[1] = float("inf")
    r = mon.post_step(loss)
    mon.close()
    assert r.health is Health.NONFINITE and math.isinf(r.record.param_norm)


def test_a_float64_loss_is_judged_against_float64():
    model = nn.Linear(4, 1).double()
    mon = Monitor(model, policy=QUIET)
    r = mon.post_step(torch.tensor(1.4e34, dtype=torch.float64))
    mon.close()
    assert r.record.headroom_dtype == "float64" and r.record.headroom > 200
    assert not [a for a in r.alerts if a.kind is AlertKind.EXTREME]


def test_a_float32_loss_near_its_limit_still_warns():
    mon = Monitor(nn.Linear(4, 1), policy=QUIET)
    r = mon.post_step(torch.tensor(1.4e37))
    mon.close()
    assert r.record.headroom_dtype == "float32" and r.record.headroom < 2


def test_complex_parameters_are_measured():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.SGD([w], lr=0.01, momentum=0.9)
    mon = Monitor(None, opt, policy=QUIET)
    x = torch.randn(5, 4, dtype=torch.complex64)
    for _ in range(2):
        opt.zero_grad()
        loss = (x @ w).abs().square().mean()
        loss.backward()
        opt.step()
        rec = mon.post_step(loss).record
    mon.close()
    assert rec.grad_norm == pytest.approx(torch.linalg.vector_norm(w.grad).item(), rel=1e-5)
    assert rec.param_norm == pytest.approx(torch.linalg.vector_norm(w.detach()).item(), rel=1e-5)
    assert rec.optim_state_norm == pytest.approx(
        torch.linalg.vector_norm(opt.state[w]["momentum_buffer"]).item(), rel=1e-5
    )
    assert rec.grad_max == pytest.approx(torch.view_as_real(w.grad).abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("scaler", ["x", 1.0, object()])
def test_a_grad_scaler_that_is_not_one_is_rejected_at_construction(scaler):
    with pytest.raises(NummonError, match="grad_scaler must be a torch.amp.GradScaler"):
        Monitor(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), grad_scaler=scaler)


def test_dtype_name_is_the_one_table():
    from nummon._stats import dtype_name

    assert [dtype_name(d) for d in (torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.int8)] == [
        "float64",
        "bfloat16",
        "float16",
        "float32",
        "float32",
    ]


def test_a_model_on_the_meta_device_is_a_one_line_error():
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    with pytest.raises(NummonError, match="meta device .*first: weight.*to_empty"):
        Monitor(model)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "fused,device",
    [(False, "cpu"), (True, "cpu"), pytest.param(None, "cuda", marks=CUDA)],
    ids=["grouped (CPU)", "fused foreach on CPU", "fused foreach on CUDA"],
)
def test_grouped_kernels_equal_per_tensor_norms_and_maxima(fused, device):
    # shapes that share a group, 0-d and empty tensors, a half tensor, large ones measured alone
    # (float32, half, a non-contiguous view), a small non-contiguous view, and NaN in one of a group;
    # a group of MIN_GROUP same-shape tensors and a smaller one (measured in the loop), mid-size
    # tensors (the loop's norms: one with Inf, one bfloat16) and one above LOOP_NUMEL (a dot), and two
    # above it that a dot cannot read where they lie (bfloat16, a transposed view: the loop's)
    from nummon._stats.kernel_plan import DIRECT_NUMEL, LOOP_NUMEL, MIN_GROUP, SMALL_NUMEL
    from nummon._stats.kernels import NormKernels

    torch.manual_seed(0)
    ts = [
        torch.randn(3, 4),
        torch.randn(3, 4) * 5,
        torch.randn(()),
        torch.randn(0),
        torch.randn(7).half(),
        torch.randn(SMALL_NUMEL + 1),
        torch.randn(4, 3).t(),
        torch.randn(3, 4),
        torch.randn(SMALL_NUMEL + 3).half() * 7,  # large ones that are not dense float32
        torch.randn(80, 60).t(),
        *(torch.randn(9) * (i + 1) for i in range(MIN_GROUP)),
        torch.randn(2, 5),
        torch.randn(2, 5),
        torch.randn(4 * SMALL_NUMEL) * 3,
        torch.randn(4 * SMALL_NUMEL),
        torch.randn(2 * SMALL_NUMEL).bfloat16(),
        torch.randn(LOOP_NUMEL + 5),
        torch.randn(LOOP_NUMEL + 7).bfloat16(),  # above LOOP_NUMEL, yet no dot reads them: the loop's
        torch.randn(300, 200).t(),
        torch.randn(DIRECT_NUMEL + 1),  # a dot, and no single loop for the whole list: the plan runs
    ]
    nan = [7]
    ts[7][1, 2] = float("nan")
    ts[-6][17] = float("inf")
    ts = [t.to(device) for t in ts]
    k = NormKernels(fused=fused)
    for _ in range(2):  # the second call reuses the plan
        norms, absmax = k.norms_and_absmax(ts, key="t")
        only = k.l2_norms(ts, key="n")  # a plan whose steps want the norms alone
        for i, t in enumerate(ts):
            want_n = t.double().norm().item()
            want_m = t.double().abs().max().item() if t.numel() else 0.0
            if i in nan:
                assert math.isnan(norms[i]) and math.isnan(absmax[i]) and math.isnan(only[i])
            else:
                assert norms[i].item() == pytest.approx(want_n, rel=1e-3), i
                assert only[i].item() == pytest.approx(want_n, rel=1e-3), i
                assert absmax[i].item() == pytest.approx(want_m, rel=1e-3), i
    if not fused:  # the large ones a dot cannot read where they lie are measured by the loop
        plan, n = k._plans["n"], len(ts)
        assert not plan.direct and set(plan.big[plan.loop :]) == {n - 4, n - 1} and {n - 3, n - 2} <= set(plan.big)
    ts[0] = torch.randn(5, device=device)  # shape changes re-plan: one that breaks the concatenation,
    ts[1] = torch.randn(6, 4, device=device)  # one that concatenates but changes the group's size
    for i in (0, 1):
        assert k.l2_norms(ts, key="t")[i].item() == pytest.approx(ts[i].norm().item(), rel=1e-5)


def test_a_deep_model_hooks_block_boundaries_and_names_the_first_nonfinite_module():
    from nummon._stats.probes import block_boundaries

    torch.manual_seed(0)
    model = Deep()
    x = torch.randn(16, 4)
    mon = Monitor(model, policy={**QUIET, "sampling": {"activations_every": 1, "activations_all_every": 1000}})
    names = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    bounds = block_boundaries(model, names)
    assert bounds[0] == "inp" and bounds[-1] == "head" and "blocks.39" in bounds and len(bounds) <= 2 + 32

    def step():  # no optimizer step: the weights stay as set
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return mon.post_step(loss)

    step()
    rec = step().record  # boundaries only
    assert set(rec.layer_activation_max) == set(bounds)
    assert rec.activation_max == max(rec.layer_activation_max.values())
    with torch.no_grad():
        model.blocks[20][2].weight.fill_(float("inf"))
    bad = step().record
    # the first non-finite boundary: the block itself, or the next hooked one
    assert bad.nonfinite_location.startswith("output of `blocks.2"), bad.nonfinite_location
    assert "blocks.20.2" not in bad.layer_activation_max
    # after a non-finite step every module is hooked: the exact module is named
    with torch.no_grad():
        model.blocks[20][2].weight.fill_(float("nan"))
    rec = step().record
    assert rec.nonfinite_location == "output of `blocks.20.2` (forward)"
    assert "blocks.7.0" in rec.layer_activation_max
    mon.close()


def test_pre_clip_statistics_use_a_few_anchor_hooks():
    from nummon._stats.preclip import ANCHORS

    model = Deep()
    mon = Monitor(model)
    n_params = sum(1 for _ in model.parameters())
    assert n_params > ANCHORS and len(mon._stats.preclip._handles) == ANCHORS
    x = torch.randn(16, 4)
    model(x).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    rec = mon.post_step(1.0).record
    assert rec.grad_norm == pytest.approx(norm.item(), rel=1e-5)  # the unclipped norm
    assert rec.clip_ratio == pytest.approx(1e-3 / norm.item(), rel=1e-4)
    mon.close()


def test_the_clip_ratio_of_a_small_model_is_exact_without_a_second_read_of_its_largest_gradient():
    """The demo CNN has 8 tensors: the 8 smallest would be all of them, fc1's 1.6M elements
    included; the clip ratio comes from the small ones."""
    from nummon._stats.families.gradients import CLIP_ANCHOR_ELEMENTS
    from nummon._stats.kernel_plan import SMALL_NUMEL
    from nummon._tools.demo_model import DemoCNN

    torch.manual_seed(0)
    model = DemoCNN()
    mon = Monitor(model)
    F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,))).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
    rec = mon.post_step(1.0).record
    params = list(model.parameters())
    anchors = mon._stats.anchors.cache[1]
    assert sum(params[i].numel() for i in anchors) <= CLIP_ANCHOR_ELEMENTS and len(anchors) > 1
    assert all(params[i] is not model.fc1.weight for i in anchors)
    assert all(params[i].numel() <= SMALL_NUMEL for i in anchors)  # one kernel call for them all, no dot each
    assert rec.grad_norm == pytest.approx(norm.item(), rel=1e-4)  # float32 sums over 1.6M squares, two orders
    assert rec.clip_ratio == pytest.approx(1e-2 / norm.item(), rel=1e-4)
    mon.close()


def test_a_short_list_is_measured_in_one_loop_and_a_long_one_in_groups():
    # norms only on CPU: a list whose groups would hold few tensors is measured by one
    # _foreach_norm straight into list order (`direct`); many same-shape small tensors or a very
    # large one keep the plan. Both give each tensor's own norm, in order, and a dtype the loop
    # cannot take re-plans
    from nummon._stats.kernel_plan import DIRECT_GROUPED, DIRECT_NUMEL, MIN_GROUP
    from nummon._stats.kernels import NormKernels

    torch.manual_seed(0)
    short = [
        torch.randn(3, 4) * 3,
        torch.randn(0),
        torch.randn(7).half(),
        torch.randn(5).bfloat16() * 2,
        torch.randn(80, 60).t(),
        *(torch.randn(9) * (i + 1) for i in range(MIN_GROUP)),  # a group's worth: 8 grouped, under the limit
        torch.randn(4 << 12),
    ]
    many = [*(torch.randn(9) * (i + 1) for i in range(DIRECT_GROUPED + 1)), torch.randn(3)]
    large = [torch.randn(3), torch.randn(DIRECT_NUMEL + 1)]
    k = NormKernels(fused=False)
    for key, ts, direct in (("short", short, True), ("many", many, False), ("large", large, False)):
        for _ in range(2):  # the second call reuses the plan
            got = k.l2_norms(ts, key=key).tolist()
            assert k._plans[key].direct is direct, key
            assert got == pytest.approx([t.double().norm().item() for t in ts], rel=1e-3), key
    short[2] = torch.randn(7, dtype=torch.float64) * 4  # the loop measures in float32: not a float64
    got = k.l2_norms(short, key="short").tolist()
    assert k._plans["short"].direct is False
    assert got == pytest.approx([t.double().norm().item() for t in short], rel=1e-3)


def test_norms_past_a_dots_float32_range_are_exact():
    # gradients, parameters and SGD's momentum of 2^16 and 2^19 elements (each measured by a BLAS
    # dot, whose float32 sum of squares overflows) at ~1e17-1e18, ~1e20 and ~1e17-1e18, all finite: the
    # record shows their exact norms, not inf (recomputed in float64 where they overflowed)
    from nummon._stats.kernel_plan import DIRECT_NUMEL, LOOP_NUMEL

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 2048, bias=False))
    sizes = [p.numel() for p in model.parameters()]
    assert all(n > LOOP_NUMEL for n in sizes) and max(sizes) > DIRECT_NUMEL  # a dot each, in the plan
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    mon = Monitor(model, opt, policy=QUIET)
    opt.zero_grad()
    loss = (model(torch.randn(8, 256)) * 1e17).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e20)
    opt.step()  # lr 0: the parameters stay; the momentum starts as the gradients
    rec = mon.post_step(loss).record
    grads = [p.grad.double() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].double() for p in model.parameters()]
    assert max(g.abs().max().item() for g in grads) < 1e19 and min(g.abs().max().item() for g in grads) > 1e16
    assert rec.grad_norm == pytest.approx(math.hypot(*(g.norm().item() for g in grads)), rel=1e-5)
    assert rec.param_norm == pytest.approx(
        math.hypot(*(p.double().norm().item() for p in model.parameters())), rel=1e-5
    )
    assert rec.optim_state_norm == pytest.approx(math.hypot(*(v.norm().item() for v in momentum)), rel=1e-5)
    mon.close()


@pytest.mark.parametrize("replaced", ["state", "moment"])
def test_the_optimizer_state_norm_reads_state_made_anew_under_the_same_parameter(replaced):
    # `opt.state[p] = {}` (Adam makes it again at the next step) or a moment replaced under its key:
    # the state mapping keeps its length, and the norm must still be the live state's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, policy={"sampling": {"params_every": 1, "optimizer_every": 1}})
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def step():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return mon.post_step(loss).record

    for _ in range(5):
        step()
    first = model[0].weight
    if replaced == "state":
        opt.state[first] = {}
    else:
        opt.state[first]["exp_avg"] = opt.state[first]["exp_avg"] * 3.0
    for _ in range(2):
        rec = step()
        live = [opt.state[p]["exp_avg"].double().norm().item() for p in model.parameters()]
        assert rec.optim_state_norm == pytest.approx(math.hypot(*live), rel=1e-5)
    mon.close()

"""The hot path's contract: one host read per step on CPU, no synchronisation on CUDA."""

import pytest
import torch
from helpers.models import CNN, data, train_step
from torch.overrides import TorchFunctionMode

from nummon import Monitor

HOST_READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}


class CountHostReads(TorchFunctionMode):
    """Instrumentation seam: counts every tensor->host read made while active."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        elif name == "to" and any(isinstance(a, (str, torch.device)) and str(a).startswith("cpu") for a in args[1:]):
            self.reads.append("to(cpu)")
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_cpu_hot_path_reads_the_host_once_per_step():
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data()
    mon = Monitor(model, opt)
    for _ in range(2):
        mon.post_step(train_step(model, opt, x, y))
    per_step = []
    for _ in range(5):
        loss = train_step(model, opt, x, y)
        with CountHostReads() as c:
            mon.post_step(loss, batch=(x, y))
        per_step.append(c.reads)
    mon.close()
    assert per_step == [["tolist"]] * 5


def test_instrumentation_seam_sees_a_per_parameter_monitor():
    # the seam itself must be able to fail: a naive monitor makes one read per parameter
    model = CNN()
    x, y = data()
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), x, y)
    with CountHostReads() as c:
        [p.grad.norm().item() for p in model.parameters()]
    assert len(c.reads) == len(list(model.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_path_never_synchronises():
    torch.manual_seed(0)
    model = CNN().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = (t.cuda() for t in data())
    mon = Monitor(model, opt)
    for _ in range(3):  # warm-up: lazy optimizer state, pinned buffers
        mon.post_step(train_step(model, opt, x, y), batch=(x, y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            loss = train_step(model, opt, x, y)
            r = mon.post_step(loss, batch=(x, y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert r.step == 6  # the report is one step behind: read without waiting
    last = mon.flush()
    assert last.step == 7 and last.record.grad_norm > 0
    mon.close()


def test_a_deep_model_reads_the_host_once_per_step_on_and_off_the_full_cadence():
    # 80 watched modules: block boundaries most steps, every module every 2nd step
    from helpers.models import Deep

    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    mon = Monitor(model, opt, policy={"sampling": {"activations_all_every": 2}})

    def step():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(2):
        mon.post_step(step())
    per_step, hooked = [], []
    for _ in range(4):
        loss = step()
        with CountHostReads() as c:
            rec = mon.post_step(loss).record
        per_step.append(c.reads)
        hooked.append(len(rec.layer_activation_max))
    mon.close()
    assert per_step == [["tolist"]] * 4
    assert len(set(hooked)) == 2 and max(hooked) >= 80  # boundaries, then every module

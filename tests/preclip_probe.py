"""Does the Monitor report gradient statistics from before clipping (issue 14, item 1)?

A plain loop that clips to 1e-3 before `optimizer.step()` and calls `post_step` after it: the
reported norm is the unclipped one only when the Monitor measures gradients as backward left them.
The framework tests that need it are xfail (strict) until it does.
"""
import functools


@functools.lru_cache(maxsize=None)
def monitor_sees_unclipped_gradients() -> bool:
    import torch

    from nummon import Monitor

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, policy="default")
    try:
        loss = model(torch.randn(8, 4)).pow(2).sum() * 100
        loss.backward()
        unclipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        opt.step()
        reported = mon.post_step(loss.detach()).record.grad_norm
    finally:
        mon.close()
    return abs(reported - unclipped) <= 1e-5 * unclipped

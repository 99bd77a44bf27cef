"""Small real models shared by the tests."""

import torch
from torch import nn


def CNN(width: int = 8, hidden: int = 32) -> nn.Module:
    """The motivating model (the demo's: conv1, conv2, fc1, fc2, LeakyReLU), narrow for speed."""
    from nummon._tools.demo_model import DemoCNN

    return DemoCNN(width=width, hidden=hidden)


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def data(n=32, size=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def runaway_run(sinks, tmp_path, steps=80, policy=None):
    """A real two-layer linear model on SGD+momentum whose LR makes it run away (~step 40)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 8) * 2, torch.randn(64, 1)
    from nummon import Health, Monitor

    mon = Monitor(model, opt, policy=policy, sinks=sinks, run_dir=tmp_path)
    reports = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        r = mon.post_step(loss)
        reports.append(r)
        if r.health is Health.NONFINITE:
            break
    mon.close()
    return mon, reports


class Deep(nn.Module):
    """A 40-block stack of two Linears each: 80 watched modules, more than are hooked in full."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(40))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)

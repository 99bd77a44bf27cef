"""Small real models shared by the tests."""
import torch
from torch import nn


class CNN(nn.Module):
    """The motivating model: two conv layers, fc1, fc2, LeakyReLU, no normalisation."""

    def __init__(self, width: int = 8, hidden: int = 32, size: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * (size // 2) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc2(x)


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

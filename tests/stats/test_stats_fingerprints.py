"""Batch fingerprints: every bit of every element counts, 64-bit dtypes included."""

import pytest
import torch
from torch import nn

from nummon import Monitor


def fingerprint(batch):
    mon = Monitor(nn.Linear(2, 1), policy={"recorder": {"write": False}})
    try:
        return mon.post_step(1.0, batch=batch).record.fingerprint
    finally:
        mon.close()


@pytest.mark.parametrize(
    "a, b",
    [
        # these two hashed alike when only the low 31 bits of each element were kept
        (torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([4.0, 0.5, -7.0], dtype=torch.float64)),
        # an exponent-only change (the high word) must show
        (torch.tensor([1.5, 3.0], dtype=torch.float64), torch.tensor([3.0, 3.0], dtype=torch.float64)),
        (torch.tensor([1, 2], dtype=torch.int64), torch.tensor([1 + 2**40, 2], dtype=torch.int64)),
        (torch.tensor([-1], dtype=torch.int64), torch.tensor([2**31 - 1], dtype=torch.int64)),
    ],
)
def test_64_bit_values_that_differ_anywhere_hash_differently(a, b):
    assert fingerprint(a) != fingerprint(b)


def test_identical_batches_hash_alike_and_order_matters():
    x = torch.randn(5, dtype=torch.float64)
    ids = torch.arange(7)
    assert fingerprint((x, ids)) == fingerprint((x.clone(), ids.clone()))
    assert fingerprint((x, ids)) != fingerprint((x.flip(0), ids))
    assert len(fingerprint((x, ids)).split("-")) == 2  # one hash per tensor

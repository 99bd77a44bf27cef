"""`nummon diagnose`: the debugging checklist (`nummon.diagnose.run_all`) on the demo model and
data, to show the report format. Exit 1 when a diagnostic fails."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import seed

__all__ = ["LOADER_BATCHES", "OVERFIT_STEPS", "add_parser", "run"]

LOADER_BATCHES = 4
OVERFIT_STEPS = 60


def add_parser(sub: Any) -> None:
    dg = sub.add_parser("diagnose", help="run the debugging checklist on the demo model and data")
    dg.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of the model's initialisation and the data, from 0 to 2**63 - 1 (default: 0)",
    )
    dg.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch
    from torch import nn

    from .._tools.demo_model import DemoCNN, SyntheticDigits
    from .._tools.diagnose_common import Status
    from ..diagnose import run_all

    torch.manual_seed(args.seed)
    data = SyntheticDigits(args.seed)
    loader = [data.batch(range(0, 10)) for _ in range(LOADER_BATCHES)]
    diag = run_all(DemoCNN(), loader, nn.functional.cross_entropy, num_classes=10, overfit_steps=OVERFIT_STEPS)
    print(diag)
    return 0 if diag.status is not Status.FAIL else 1

"""The input batch: the count of its non-finite elements, and a fingerprint of each of its
tensors (which batch a record came from, to replay or skip it)."""

from __future__ import annotations

import torch

from ..distributed import Reduce
from ..fingerprints import tensors_in
from ..transport import Segment
from .family import Collecting, LaunchStep, RecordBuild, StatFamily, rules

__all__ = ["FAMILY", "decode_inputs", "launch_batch"]


def launch_batch(c: Collecting, s: LaunchStep) -> list[Segment]:
    """The batch's non-finite element count (floating tensors) and one fingerprint per tensor."""
    s.batch_tensors = tensors_in(s.batch) if s.batch is not None else None
    if not s.batch_tensors:
        return []
    segs = []
    fl = [t for t in s.batch_tensors if t.is_floating_point() or t.is_complex()]
    if fl:
        bad = torch.stack([(~torch.isfinite(t)).sum() for t in fl]).sum().reshape(1)
        segs.append(Segment("input_nonfinite", bad, Reduce.SUM))
    segs.append(Segment("fingerprint", torch.stack([c.fingerprint(t) for t in s.batch_tensors]), Reduce.LOCAL))
    return segs


def decode_inputs(b: RecordBuild) -> None:
    """`rec.input_nonfinite` (elements; left None at 0) and `rec.fingerprint`."""
    inp, fp = b.get("input_nonfinite"), b.get("fingerprint")
    if inp is not None and inp[0]:
        b.rec.input_nonfinite = int(inp[0])
    if fp is not None:
        b.rec.fingerprint = "-".join(f"{int(v):013x}" for v in fp)


FAMILY = StatFamily(
    "inputs", rules(input_nonfinite=Reduce.SUM, fingerprint=Reduce.LOCAL), launch_batch, (decode_inputs,)
)

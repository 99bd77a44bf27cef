"""Packing: one vector holding every segment, float32 unless a segment (or `wide`) needs
float64; the layout made once per combination of segments and the same values every time."""

from __future__ import annotations

import pytest
import torch

from nummon._stats.distributed import Reduce
from nummon._stats.transport import Segment, Slot, pack

CPU = torch.device("cpu")


def _segments(kind: str) -> list[Segment]:
    g = torch.Generator().manual_seed(len(kind))
    f32 = [
        Segment("loss", torch.randn(1, generator=g), Reduce.MEAN),
        Segment("norms", torch.rand(5, generator=g), (Reduce.MAX,) * 5),
    ]
    if kind == "plain":
        return f32
    if kind == "half":
        return [*f32, Segment("acts", torch.randn(4, generator=g).half(), Reduce.LOCAL)]
    if kind == "counts":  # integer and float64 segments widen the whole vector
        return [
            Segment("fp", torch.tensor([2**40 + 1, 3], dtype=torch.int64), Reduce.LOCAL),
            *f32,
            Segment("loss64", torch.randn(1, dtype=torch.float64, generator=g), Reduce.MEAN),
        ]
    raise ValueError(kind)


def _expected(segments: list[Segment], wide: bool) -> tuple[list[float], dict[str, Slot]]:
    narrow = [s for s in segments if s.tensor.is_floating_point() and s.tensor.dtype != torch.float64]
    rest = [s for s in segments if s not in narrow]
    widen = wide or bool(rest)
    vals: list[float] = []
    layout: dict[str, Slot] = {}
    for s in narrow + rest:
        t = s.tensor.float() if s in narrow else s.tensor
        t = t.double() if widen else t
        layout[s.name] = Slot(len(vals), len(vals) + t.numel(), s.reduce)
        vals += t.tolist()
    return vals, layout


@pytest.mark.parametrize("kind", ["plain", "half", "counts"])
@pytest.mark.parametrize("wide", [False, True])
def test_a_packed_vector_holds_every_segment_where_its_layout_says_every_time(kind, wide):
    segments = _segments(kind)
    vals, layout = _expected(segments, wide)
    for _ in range(3):  # the first packing plans, the others reuse the plan
        packed, got = pack(segments, CPU, wide=wide)
        assert got == layout
        assert packed.tolist() == vals
        assert packed.dtype == (torch.float64 if wide or kind == "counts" else torch.float32)


def test_a_packed_vector_is_a_copy_of_reused_buffers():
    buf = torch.ones(3)
    packed, _ = pack([Segment("only", buf, Reduce.MAX)], CPU)
    buf.fill_(2.0)
    assert packed.tolist() == [1.0, 1.0, 1.0]


def test_a_segment_that_changed_shape_is_packed_with_its_new_size():
    a, _ = pack([Segment("x", torch.ones(2), Reduce.MAX), Segment("y", torch.zeros(1), Reduce.MAX)], CPU)
    b, layout = pack([Segment("x", torch.ones(3), Reduce.MAX), Segment("y", torch.zeros(1), Reduce.MAX)], CPU)
    assert b.tolist() == [1.0, 1.0, 1.0, 0.0] and layout["y"] == Slot(3, 4, Reduce.MAX)


def test_nothing_to_pack_is_an_empty_vector():
    packed, layout = pack([], CPU, wide=True)
    assert packed.numel() == 0 and packed.dtype == torch.float64 and layout == {}


@pytest.mark.parametrize("reduce", ["avg", (Reduce.MAX, "avg")])
def test_a_segment_with_an_unknown_reduction_is_refused(reduce):
    with pytest.raises(ValueError, match="unknown reduction"):
        Segment("bad", torch.zeros(2), reduce)

"""TensorBoard views a new user can read with TensorBoard's defaults: state
charts whose range shows every state with "ignore outliers" on, per-layer charts that name
their layers (one custom-scalars chart per layer group), no linear histogram whose axis would
be an unreadable string of digits. Read back from the real event files of a real runaway."""

import math
import re

import pytest
from helpers.models import runaway_run

from nummon._sinks.layout import HIST_LINEAR_MAX_ABS, custom_scalars_layout, layer_groups

pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nummon.integrations.tensorboard import TensorBoardSink

    folder = tmp_path_factory.mktemp("tb")
    mon, reports = runaway_run(
        [TensorBoardSink(folder / "tb", histogram_every=1)],
        folder,
        steps=120,
        policy={"alerts": {"stop_on_critical": False}},
    )
    acc = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return mon, reports, acc


def _layouts(acc):
    from tensorboard.plugins.custom_scalar import layout_pb2

    out = []
    for ev in acc.Tensors("custom_scalars__config__"):
        layout = layout_pb2.Layout()
        layout.ParseFromString(ev.tensor_proto.string_val[0])
        out.append({c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category})
    return out


def _tb_domain(values, ignore_outliers=True):
    """The y range TensorBoard's line chart scales to: with "ignore outliers" (its default) the
    5% and 95% quantiles of every value in the chart, else the min and max."""
    v = sorted(values)
    if not ignore_outliers:
        return v[0], v[-1]

    def q(p):
        return (
            v[0]
            if len(v) == 1
            else v[int(math.floor(p * (len(v) - 1)))]
            + (p * (len(v) - 1) % 1)
            * (v[min(len(v) - 1, int(math.floor(p * (len(v) - 1))) + 1)] - v[int(math.floor(p * (len(v) - 1)))])
        )  # noqa: E731

    return q(0.05), q(0.95)


@pytest.mark.slow  # the real TensorBoard run (tb_run) is written once for these, seconds
def test_incident_state_chart_shows_state_3_with_outliers_ignored(tb_run):
    mon, reports, acc = tb_run
    assert any(e.state.value == "nonfinite" for e in mon.incidents)
    chart = _layouts(acc)[-1]["nummon: health"]
    title = next(t for t in chart if t.startswith("incident state"))
    tags = [t for t in acc.Tags()["scalars"] if any(re.search(p, t) for p in chart[title])]
    assert sorted(tags) == ["nummon/incident_state", "nummon_state_range/max", "nummon_state_range/min"]
    state = [e.value for e in acc.Scalars("nummon/incident_state")]
    assert max(state) == 3.0
    values = [e.value for t in tags for e in acc.Scalars(t)]
    lo, hi = _tb_domain(values)
    assert lo <= 0.0 and hi >= 3.0  # with its range companions every state is inside the chart
    steps = [e.step for e in acc.Scalars("nummon/incident_state")]
    assert [e.step for e in acc.Scalars("nummon_state_range/max")] == steps
    assert {e.value for e in acc.Scalars("nummon_state_range/max")} == {3.0}


def test_state_companions_keep_rare_states_in_range():
    """A long healthy run, a short incident ending in NaN: alone, TensorBoard's default scaling
    clips the states 2 and 3 away; with the two constant companions at every step it cannot."""
    from nummon._sinks.layout import state_range_scalars

    state = [0.0] * 500 + [1.0] * 20 + [2.0] * 5 + [3.0]
    assert _tb_domain(state)[1] < 2.0
    companions = [v for _ in state for v in state_range_scalars().values()]
    assert _tb_domain(state + companions) == (0.0, 3.0)


@pytest.mark.slow
def test_per_layer_charts_name_their_layers(tb_run):
    _, _, acc = tb_run
    layouts = _layouts(acc)
    assert "nummon: layers by group" not in layouts[0]  # written before any layer was seen
    by_group = layouts[-1]["nummon: layers by group"]
    layer_tags = [
        t for t in acc.Tags()["scalars"] if t.startswith(("nummon_layers_grad_norm/", "nummon_layers_activation_max/"))
    ]
    assert layer_tags
    for tag in layer_tags:  # every layer series is drawn in exactly one named chart, its group's
        charts = [title for title, pats in by_group.items() if any(re.search(p, tag) for p in pats)]
        assert len(charts) == 1, (tag, charts)
        metric = "grad norm" if "grad_norm" in tag else "max |activation|"
        group = charts[0].split(": ", 1)[1]
        assert charts[0].startswith(metric) and tag.split("/", 1)[1].startswith(group)


def test_layer_groups_fit_and_cover():
    names = [f"model.blocks.{i}.attn.{p}.weight" for i in range(6) for p in "qkv"] + [
        "model.embed.weight",
        "lm_head.weight",
    ]
    groups = layer_groups(names)
    assert 4 <= len(groups) <= 16 and "model.blocks.3" in groups
    chart = custom_scalars_layout(5, {"grad_norm": names})["nummon: layers by group"]
    for n in names:
        assert sum(bool(re.search(p, f"nummon_layers_grad_norm/{n}")) for _, pats in chart.values() for p in pats) == 1
    many = [f"blocks.{i}.mlp.weight" for i in range(40)]
    assert layer_groups(many) == ["blocks"]


@pytest.mark.slow
def test_no_linear_histogram_past_the_readable_range(tb_run):
    _, _, acc = tb_run
    tags = acc.Tags()["histograms"]
    name = "nummon_hist_activations/0"
    assert name in tags and "nummon_hist_activations_log10abs/0" in tags
    linear = {e.step: e.histogram_value for e in acc.Histograms(name)}
    log10 = {e.step for e in acc.Histograms("nummon_hist_activations_log10abs/0")}
    assert set(linear) < log10  # the runaway's late steps: only the log10|x| view
    assert all(max(abs(h.min), abs(h.max)) <= HIST_LINEAR_MAX_ABS for h in linear.values())

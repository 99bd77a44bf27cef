"""The incident picture in TensorBoard (an image summary at each step an incident reaches
critical or goes non-finite, read back with TensorBoard's own EventAccumulator) and in W&B (the
picture as a wandb.Image and the Monitor's HTML report as a wandb.Html, in a real offline run's
files); without matplotlib a one-line hint and nothing else lost."""

import io
import logging
import sys

import pytest
from helpers.models import runaway_run
from helpers.pages import external_refs

from nummon._report.live import escalated_to_critical


def escalation_steps(mon):
    return [e.step for e in mon.incidents if escalated_to_critical([e])]


def near(rgb, color, tol=20):
    """Pixels of `rgb` (an H x W x 3 array) within `tol` of `color` ("#rrggbb") on each channel."""
    import numpy as np

    want = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb.astype(int) - want).max(axis=2) <= tol).sum())


def decode(png):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.mark.slow
def test_tensorboard_holds_the_incident_picture_at_each_escalation_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nummon._report.svg import MARK_COLORS
    from nummon.integrations.tensorboard import PICTURE_TAG, TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    mon, _ = runaway_run([sink], tmp_path / "run", steps=120)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images(PICTURE_TAG)
    steps = escalation_steps(mon)
    assert len(steps) == 2 and [i.step for i in images] == steps  # critical, then non-finite
    lost = decode(images[-1].encoded_image_string)
    assert lost.shape[:2] == (images[-1].height, images[-1].width) and lost.shape[1] >= 600
    assert len({tuple(p) for p in lost.reshape(-1, 3)[::7]}) > 20  # drawn, not blank
    for kind in ("warning", "critical", "nonfinite"):  # each marked step's line is on it
        assert near(lost, MARK_COLORS[kind]) > 200, kind
    first = decode(images[0].encoded_image_string)
    assert near(first, MARK_COLORS["critical"]) > 200 and near(first, MARK_COLORS["nonfinite"]) == 0  # not lost yet


@pytest.mark.slow
def test_wandb_offline_run_holds_the_picture_and_the_html_report(wandb_env, tmp_path):
    from nummon.integrations.wandb import WandbSink

    sink = WandbSink(project="pictures")
    files = sink.run.dir
    mon, _ = runaway_run([sink], tmp_path / "run", steps=120)
    from pathlib import Path

    pngs = sorted(Path(files).rglob("incident_picture*.png"))
    pages = sorted(Path(files).rglob("incident_report*.html"))
    assert len(pngs) == len(escalation_steps(mon)) == 2
    assert len(pages) == 2  # the report the Monitor wrote at each escalation, as it was then
    html = pages[-1].read_text()
    lost = next(e.step for e in mon.incidents if e.state.value == "nonfinite")
    assert f"first NaN/Inf</span><b>step {lost}</b>" in html and external_refs(html) == []  # passed through unchanged
    rgb = decode(pngs[-1].read_bytes())
    assert len({tuple(p) for p in rgb.reshape(-1, 3)[::7]}) > 20


@pytest.mark.slow
def test_without_matplotlib_the_picture_is_skipped_with_one_hint(tmp_path, monkeypatch, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nummon.integrations.tensorboard import PICTURE_TAG, TensorBoardSink

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    sink = TensorBoardSink(tmp_path / "tb")
    with caplog.at_level(logging.WARNING, logger="nummon"):
        mon, _ = runaway_run([sink], tmp_path / "run", steps=120)
    hints = [r.getMessage() for r in caplog.records if "incident picture skipped" in r.getMessage()]
    assert hints == ["nummon: incident picture skipped: pip install 'nummon[plot]' (matplotlib) to draw it"]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert PICTURE_TAG not in acc.Tags()["images"]
    assert any("nonfinite" in t for t in acc.Tags()["tensors"])  # the text entries are all there
    assert any(e.state.value == "nonfinite" for e in mon.incidents)

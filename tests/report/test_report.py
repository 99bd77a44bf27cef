"""`nummon report`: a self-contained HTML page per run, from a real Monitor run folder and from
every log format replay reads; nothing in it is fetched; headless Chromium draws it."""

import json
import math
import shutil
import subprocess

import pytest
from helpers.models import runaway_run
from helpers.pages import external_refs
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import StepRecord
from nummon._cli import main
from nummon._report import build_report, incidents_of, load_run
from nummon._report.svg import thin

LOSSES = [2.0 * 0.99**i for i in range(30)] + [2.0 * 6**k for k in range(1, 7)] + [float("nan")]


@pytest.fixture(scope="module")
def monitor_run(tmp_path_factory):
    """A real Monitor run (two linear layers, SGD+momentum) driven into a runaway until NaN, with
    its event log and flight record in the run folder."""
    from nummon import JsonlSink

    folder = tmp_path_factory.mktemp("run")
    mon, reports = runaway_run([JsonlSink(folder / "events.jsonl")], folder, steps=120)
    return folder, mon, reports


def test_report_of_a_monitor_run_names_its_incident_steps_and_first_nonfinite_tensor(monitor_run, capsys):
    folder, mon, reports = monitor_run
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(folder / "nummon-report.html")
    html = (folder / "nummon-report.html").read_text()
    opened = mon.incidents[0].opened_step
    crit = next(e.step for e in mon.incidents if e.state.value in ("critical", "nonfinite"))
    lost = next(e.step for e in mon.incidents if e.state.value == "nonfinite")
    nonfinite = next(a for a in mon.alerts if a.kind.value == "nonfinite")
    assert lost == reports[-1].step == nonfinite.step
    assert f"first warning</span><b>step {opened}</b>" in html
    assert f"critical</span><b>step {crit}</b>" in html
    assert f"first NaN/Inf</span><b>step {lost}</b>" in html
    assert f"lead: {lost - opened} steps" in html  # written on the timeline
    assert nonfinite.location and _esc(nonfinite.location) in html
    assert f"Run lost at step {lost}" in html
    assert "<svg" in html and external_refs(html) == []


def test_monitor_run_story_matches_the_events(monitor_run):
    """The report's facts are the Monitor's: incident steps, lead, countdown 'left' counts."""
    folder, mon, _ = monitor_run
    (v,) = incidents_of(load_run(folder))
    lost = next(e.step for e in mon.incidents if e.state.value == "nonfinite")
    assert (v.opened, v.nonfinite, v.lead) == (mon.incidents[0].opened_step, lost, lost - mon.incidents[0].opened_step)
    runaways = [a for a in mon.alerts if "steps_to_overflow" in a.details and not a.cleared]
    assert runaways and len(v.countdowns) == len({(a.metric, a.step) for a in runaways})
    for c in v.countdowns:
        assert c.left == lost - c.step
    assert v.hints and all(isinstance(h, str) for h in v.hints)


def _esc(text):
    from html import escape

    return escape(text)


def _tb(path, losses):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(path))
    for i, v in enumerate(losses):
        w.add_scalar("train/loss", v, i)
    w.close()
    return path


def _logs(tmp_path):
    """The same run as every log format replay reads (as tests/tools/test_replay_formats.py writes them)."""
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"step": i, "loss": str(v) if v != v else v}) + "\n" for i, v in enumerate(LOSSES))
    )
    hf = tmp_path / "hf" / "trainer_state.json"
    hf.parent.mkdir()
    hf.write_text(
        json.dumps({"global_step": len(LOSSES), "log_history": [{"step": i, "loss": v} for i, v in enumerate(LOSSES)]})
    )
    csv = tmp_path / "csv" / "metrics.csv"
    csv.parent.mkdir()
    csv.write_text("step,train_loss\n" + "".join(f"{i},{v}\n" for i, v in enumerate(LOSSES)))
    return {"jsonl": jsonl, "tensorboard": _tb(tmp_path / "tb", LOSSES), "hf": hf, "csv": csv}


def test_every_log_format_replay_reads_gives_the_same_incident(tmp_path, capsys):
    pages = {}
    for fmt, path in _logs(tmp_path).items():
        out = tmp_path / f"{fmt}.html"
        assert main(["report", str(path), "-o", str(out)]) == 0, fmt
        assert capsys.readouterr().out.strip() == str(out)
        pages[fmt] = html = out.read_text()
        assert external_refs(html) == [], fmt
    nan_step = len(LOSSES) - 1
    for fmt, html in pages.items():
        assert f"Run lost at step {nan_step}" in html, fmt
        assert f"first NaN/Inf</span><b>step {nan_step}</b>" in html, fmt


def test_wandb_offline_run_gives_a_page(wandb_env, tmp_path, capsys):
    from helpers.log_writers import runaway_rows, write_wandb

    run_file = write_wandb(runaway_rows())
    out = tmp_path / "wandb.html"
    assert main(["report", str(run_file), "-o", str(out)]) == 0
    html = out.read_text()
    assert "Run lost at step" in html and external_refs(html) == []


def test_a_healthy_run_says_so_on_one_screen(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    log.write_text(
        "".join(
            json.dumps({"type": "step", "step": i, "loss": 2.0 * 0.99**i, "grad_norm": 1.0 + 0.01 * (i % 7)}) + "\n"
            for i in range(300)
        )
    )
    assert main(["report", str(tmp_path)]) == 0
    html = (tmp_path / "nummon-report.html").read_text()
    assert "Healthy: no warning in 300 records (steps 0–299)" in html
    assert "Incident" not in html and html.count("<svg") == 1  # the curves, nothing else


@pytest.mark.parametrize(
    "args, names",
    [
        (["{tmp}/missing"], "missing"),
        (["{tmp}/notes.txt"], "notes.txt"),
        (["{tmp}/trace.jsonl", "-o", "{tmp}/no/such/dir/r.html"], "no/such/dir"),
        (["{tmp}/trace.jsonl", "-o", "{tmp}"], "{tmp}"),
    ],
)
def test_bad_paths_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args, names):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "trace.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["report", *[a.format(tmp=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nummon: error:") and names.format(tmp=tmp_path) in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e30, 1e30, allow_nan=False), min_size=1, max_size=3000),
    st.integers(0, 3000),
    st.integers(0, 200),
    st.integers(1, 50),
)
def test_thin_keeps_every_point_near_the_incident_and_each_buckets_extremes(ys, at, radius, budget):
    pts = [(float(i), y) for i, y in enumerate(ys)]
    keep = [(at - radius, at + radius)]
    got = thin(pts, keep, budget)
    assert set(got) <= set(pts) and got == sorted(got)  # nothing invented, still in step order
    assert {p for p in pts if at - radius <= p[0] <= at + radius} <= set(got)
    assert max(ys) in {y for _, y in got} and min(ys) in {y for _, y in got}
    assert len(got) <= 2 * budget + 2 * radius + 1 + 2 * budget or len(got) == len(pts)


@settings(max_examples=25, deadline=None)
@given(st.integers(20, 60), st.integers(2, 12), st.floats(2.0, 10.0))
def test_the_lead_and_steps_on_the_page_are_those_of_the_log(tmp_path_factory, healthy, grow, rate):
    """Whatever the run, the steps the page claims (warning, first NaN, lead) are the detectors'."""
    from nummon import replay

    losses = [2.0 * 0.99**i for i in range(healthy)] + [2.0 * rate**k for k in range(1, grow + 1)] + [math.nan]
    log = tmp_path_factory.mktemp("p") / "trace.jsonl"
    log.write_text(
        "".join(json.dumps({"step": i, "loss": str(v) if v != v else v}) + "\n" for i, v in enumerate(losses))
    )
    alerts = replay(log)
    loud = [a for a in alerts if a.severity.value in ("warning", "critical") and not a.cleared]
    html = build_report(log)
    nan_step = len(losses) - 1
    first = loud[0].step
    assert f"first warning</span><b>step {first}</b>" in html
    assert f"first NaN/Inf</span><b>step {nan_step}</b>" in html
    assert f"{nan_step - first} steps after the first warning (step {first})" in html


def test_headless_chromium_draws_the_page(monitor_run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    Image = pytest.importorskip("PIL.Image")
    folder, _, _ = monitor_run
    page = tmp_path / "r.html"
    page.write_text(build_report(folder))
    png = tmp_path / "r.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1040,1400",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    img = Image.open(png).convert("RGB")
    assert img.size == (1040, 1400)
    colors = img.getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 200  # text, curves and marks, not a blank or one-colour page
    # the verdict banner of a lost run is drawn (violet), and so are the curves' colours
    assert any(abs(r - 0x6D) < 12 and abs(g - 0x28) < 12 and abs(b - 0xD9) < 12 for _, (r, g, b) in colors)


def test_the_monitor_writes_the_report_on_critical_and_at_close_and_names_it(tmp_path, caplog):
    """The incident events from critical on name the report (so the console line, webhook and
    TensorBoard text do); the file is there at close, rebuilt from the whole event log."""
    import logging

    from nummon import ConsoleSink, JsonlSink

    with caplog.at_level(logging.INFO, logger="nummon"):
        mon, _ = runaway_run([JsonlSink(tmp_path / "events.jsonl"), ConsoleSink()], tmp_path, steps=120)
    report = tmp_path / "nummon-report.html"
    assert mon.report_path == report and report.is_file()
    states = {e.state.value: e for e in mon.incidents}
    assert states["open"].report is None  # a warning writes nothing: no cost before critical
    assert states["critical"].report == str(report) and states["nonfinite"].report == str(report)
    assert f"- report: `{report}`" in states["critical"].summary()
    assert f"report: {report}" in caplog.text  # the console line
    html = report.read_text()
    assert f"first NaN/Inf</span><b>step {states['nonfinite'].step}</b>" in html
    assert f"records, steps 0–{states['nonfinite'].step}" in html  # the whole event log, not the recorder's last steps


def test_report_enabled_false_writes_none(tmp_path):
    from nummon import JsonlSink, load_policy

    policy = load_policy("default").model_copy(
        update={"report": load_policy("default").report.model_copy(update={"enabled": False})}
    )
    mon, _ = runaway_run([JsonlSink(tmp_path / "events.jsonl")], tmp_path, steps=120, policy=policy)
    assert mon.report_path is None and not (tmp_path / "nummon-report.html").exists()
    assert all(e.report is None for e in mon.incidents)


def test_a_healthy_monitor_run_with_no_folder_makes_none(tmp_path, monkeypatch):
    """No run folder named and no incident: closing makes no folder just for a report."""
    import torch
    from torch import nn

    from nummon import Monitor

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt)
    for _ in range(5):
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        mon.post_step(loss)
    mon.close()
    assert mon.report_path is None and list(tmp_path.iterdir()) == []


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["loss", "grad_norm", "activation_max", "headroom", "adam_ratio_rms", "lr"]),
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(-(10**6), 10**6),
            st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity"]),
        ),
        max_size=6,
    ),
    st.integers(0, 10**6),
)
def test_the_fast_reader_reads_what_the_trace_reader_reads(values, step):
    """The report's lenient reader gives the values `replay`'s reader gives, for every line the
    latter accepts."""
    from nummon import TraceError
    from nummon._report.load import _lean_record

    obj = {"step": step, **values, "layer_grad_norms": {"a": 1.5, "b": "nan"}}
    try:
        want = StepRecord.from_dict(obj, "x", 0)
    except TraceError:
        return
    got = _lean_record(obj, 0)

    def same(a, b):
        return (a is None and b is None) or (a is not None and b is not None and (a == b or (a != a and b != b)))  # noqa: E731

    for k in list(values) + ["loss", "grad_norm"]:
        assert same(getattr(got, k), getattr(want, k)), k
    assert got.step == want.step and got.is_finite() == want.is_finite()
    assert list(got.layer_grad_norms) == list(want.layer_grad_norms)

"""`nummon replay` on damaged, foreign and hostile inputs: streaming, forgiving at the tail,
one-line errors (exit 2) and never a traceback."""

import contextlib
import io
import json
import subprocess

import pytest
from helpers.checkout import CORPUS, nummon_cmd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon import JsonlSink, load_policy, read_trace, replay
from nummon._cli import main
from nummon._engine.engine import HealthEngine

TRACE = CORPUS / "seq_cnn_lr0.1_s202.jsonl"  # 336 steps, a runaway with alerts


def cli(*args):
    return subprocess.run(nummon_cmd() + list(args), capture_output=True, text=True, timeout=300)


def run_main(*args):
    """The CLI in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def alert_lines(stdout):
    return [json.loads(l) for l in stdout.splitlines()]


@pytest.mark.slow
def test_torn_last_line_warns_and_keeps_every_alert(tmp_path):
    whole = cli("replay", "--format", "jsonl", str(TRACE))
    assert whole.returncode == 0 and whole.stdout
    torn = tmp_path / "torn.jsonl"
    torn.write_text(TRACE.read_text() + '{"step": 336, "loss": 2.3, "grad_no')  # what a full disk leaves
    p = cli("replay", "--format", "jsonl", str(torn))
    assert p.returncode == 0, p.stderr
    assert p.stdout == whole.stdout.replace(str(TRACE), str(torn))
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{torn}:337: last line ignored" in lines[0] and "Traceback" not in p.stderr


def test_broken_middle_lines_are_skipped_with_one_warning_and_every_alert_kept(tmp_path):
    """As the watcher does: unreadable lines in the middle (a torn write, a half record) are
    skipped; one warning names the first one's file:line and the count; the alerts are those
    of the trace without those lines."""
    rows = TRACE.read_text().splitlines()
    broken = {100: '{"step": 100, "loss": ]', 101: '{"step": 101, "loss": "abc"}', 110: "\x00\x00garbage"}
    bad = tmp_path / "mid.jsonl"
    bad.write_text("\n".join(broken.get(i, r) for i, r in enumerate(rows)) + "\n")
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(r for i, r in enumerate(rows) if i not in broken) + "\n")
    p = cli("replay", "--format", "jsonl", str(bad))
    assert p.returncode == 0, p.stderr
    expected = [(a.step, a.kind.value, a.severity.value) for a in replay(clean)]
    assert any(step > 110 for step, _, _ in expected)  # alerts after the broken lines are printed too
    assert [(a["step"], a["kind"], a["severity"]) for a in alert_lines(p.stdout)] == expected
    assert p.stderr.strip().splitlines() == [
        f"nummon: warning: {bad}:101: line skipped, not valid JSON (Expecting value at column 23); "
        "3 unreadable lines skipped in all, the last at line 111"
    ]


@pytest.mark.parametrize(
    "content,needle",
    [
        (
            '{"step": 0, "loss": "abc"}\n{"step": 1, "loss": \n',
            ":1: loss must be a number, got 'abc' (no readable step record in the file)",
        ),
        ('[1, 2]\n{"step": 1}\n', ":1: expected a JSON object, got list"),
    ],
)
def test_a_file_with_no_readable_record_is_an_error(tmp_path, content, needle):
    path = tmp_path / "none.jsonl"
    path.write_text(content)
    p = cli("replay", str(path))
    assert p.returncode == 2 and not p.stdout
    assert p.stderr.strip().splitlines() == [f"nummon: error: {path}{needle}"]


def test_replay_of_nummons_own_event_log_skips_alert_lines(tmp_path):
    """An events.jsonl written by the JsonlSink holds step and alert lines: the replay must see
    the same alerts as the run, not the alert lines as value-less steps."""
    engine = HealthEngine(load_policy("default"))
    events = tmp_path / "events.jsonl"
    sink = JsonlSink(events)
    run_alerts = []
    for rec in read_trace(TRACE):
        got = engine.step(rec)
        alerts, health = got.alerts, got.health
        sink.on_step(rec, health)
        for a in alerts:
            sink.on_alert(a)
        run_alerts += alerts
    sink.close()
    assert sum('"type": "alert"' in l for l in events.read_text().splitlines()) == len(run_alerts) > 0
    got = replay(events)
    assert [(a.step, a.kind, a.severity, a.cleared) for a in got] == [
        (a.step, a.kind, a.severity, a.cleared) for a in run_alerts
    ]


def test_steps_going_backwards_start_a_new_segment(tmp_path):
    """A restarted run appended to the same file: a warning names the line, and each segment
    gets exactly the alerts it gets alone."""
    text = TRACE.read_text()
    both = tmp_path / "resumed.jsonl"
    both.write_text(text + text)
    rc, out, err = run_main("replay", "--format", "jsonl", str(both))
    assert rc == 0
    alone = [(a.step, a.kind.value, a.severity.value) for a in replay(TRACE)]
    assert [(a["step"], a["kind"], a["severity"]) for a in alert_lines(out)] == alone + alone
    assert err.strip().splitlines() == [
        f"nummon: warning: {both}:337: step 0 after step 335: a new segment, detectors restarted"
    ]


def _tensorboard_event_file(tmp_path):
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    w = EventFileWriter(str(tmp_path / "tb"))
    w.close()
    return next((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_tensorboard_event_file_is_read_not_refused_and_its_emptiness_said(tmp_path):
    p = cli("replay", str(_tensorboard_event_file(tmp_path)))
    assert p.returncode == 2 and "no alerts" not in p.stdout
    (line,) = p.stderr.splitlines()
    assert "no step records read" in line and "not a log" not in line


@pytest.mark.parametrize(
    "make,needle",
    [
        (
            lambda d: (
                d.joinpath("latin1.jsonl").write_bytes(
                    '{"step": 0, "loss": 1.0, "run": "café"}\n{"step": 1}\n'.encode("latin-1")
                )
                and d / "latin1.jsonl"
            ),
            ":1: not UTF-8 text",
        ),
        (
            lambda d: (
                d.joinpath("big.jsonl").write_text('{"step": 0, "loss": ' + "7" * 5000 + "}\n{}\n") and d / "big.jsonl"
            ),
            ":1: not a usable JSON line",
        ),
        (
            lambda d: (
                d.joinpath("deep.jsonl").write_text('{"step": 0, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n{}\n")
                and d / "deep.jsonl"
            ),
            ":1: not a usable JSON line (nested too deeply)",
        ),
        (
            lambda d: d.joinpath("rand.bin").write_bytes(bytes(range(256)) * 40) and d / "rand.bin",
            "rand.bin: not a log nummon reads",
        ),
    ],
)
def test_foreign_files_give_one_line_errors(tmp_path, make, needle):
    path = make(tmp_path)
    p = cli("replay", str(path))
    assert p.returncode == 2, p.stdout
    assert needle in p.stderr and str(path) in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_strict_json_strings_and_bare_literals_read_alike(tmp_path):
    strict = tmp_path / "strict.jsonl"
    bare = tmp_path / "bare.jsonl"
    strict.write_text(
        '{"step": 0, "loss": 1.0}\n{"step": 1, "loss": "NaN", "grad_norm": "Infinity", "grad_max": "-Infinity"}\n'
    )
    bare.write_text(
        '{"step": 0, "loss": 1.0}\n{"step": 1, "loss": NaN, "grad_norm": Infinity, "grad_max": -Infinity}\n'
    )
    a, b = list(read_trace(strict)), list(read_trace(bare))
    assert (
        repr(a) == repr(b)
        and str(a[1].loss) == "nan"
        and a[1].grad_norm == float("inf")
        and a[1].grad_max == -float("inf")
    )
    assert [x.kind.value for x in replay(strict)] == [x.kind.value for x in replay(bare)] and replay(strict)


# ------------------------------------------------------------------ fuzz


def _assert_clean(rc, out, err):
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [l for l in lines if l.startswith("nummon: error: ")]
    assert len(errors) == (1 if rc == 2 else 0) and (rc == 0 or lines[-1] == errors[0])  # the error: one line, last
    assert all(l.startswith(("nummon: warning: ", "nummon: error: ")) for l in lines), err


_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.slow
@_FUZZ
@given(data=st.binary(max_size=400))
def test_fuzz_arbitrary_bytes_never_give_a_traceback(tmp_path, data):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    _assert_clean(*run_main("replay", str(path)))


_KEYS = st.sampled_from(
    [
        "step",
        "loss",
        "grad_norm",
        "grad_max",
        "activation_max",
        "param_norm",
        "lr",
        "headroom",
        "type",
        "dtype",
        "layer_grad_norms",
        "layer_activation_max",
        "nonfinite_location",
    ]
)
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["NaN", "Infinity", "-Infinity", "step", "alert", "\x1b[31m"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_LINE = st.one_of(
    st.dictionaries(_KEYS, _VALUES, max_size=6).map(lambda d: json.dumps(d)),
    st.builds(lambda s, v: json.dumps({"step": s, "loss": v}), st.integers(-3, 50), st.floats()),
    _VALUES.map(json.dumps),
    st.text(max_size=30),
)


@pytest.mark.slow
@_FUZZ
@given(lines=st.lists(_LINE, max_size=25), fmt=st.sampled_from(["text", "jsonl"]))
def test_fuzz_arbitrary_json_lines_never_give_a_traceback(tmp_path, lines, fmt):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    _assert_clean(*run_main("replay", "--format", fmt, str(path)))


def test_hostile_trace_through_the_real_console_entry(tmp_path):
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(
        b'{"step": 0, "loss": 1e999, "nonfinite_location": "\\u001b[2J\\ud800"}\n\xff\xfe{"step": 1}\n{"step": 2}\n'
    )
    p = cli("replay", str(path))
    assert p.returncode == 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        f"nummon: warning: {path}:2: line skipped, not UTF-8 text (a binary file, or another encoding?); 1 unreadable line skipped in all"
    ]
    assert "\x1b" not in p.stdout and "nonfinite" in p.stdout


def test_null_layer_values_are_not_measured(tmp_path):
    """Found by the fuzz test: a null per-layer value crashed the detectors with a TypeError."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "loss": 1.0, "layer_grad_norms": {"fc1": null, "fc2": 0.5}}\n')
    rec = next(read_trace(path))
    assert rec.layer_grad_norms == {"fc2": 0.5}
    assert run_main("replay", str(path))[0] == 0

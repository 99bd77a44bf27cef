"""Bad option values: every numeric option refuses nan, inf, zero and negatives where they mean
nothing, every path-like option refuses the empty string, seeds stay in torch's range, and a log
forced into a format it is not is refused. Each case: exit 2, one line on stderr naming the
option and the value, no traceback, nothing run. The cases run `main` in this process (a
traceback would be an exception here); one runs through the real console entry."""

import argparse
import contextlib
import io
import math
import os
import subprocess
from types import SimpleNamespace

import pytest
from helpers.checkout import nummon_cmd
from hypothesis import given
from hypothesis import strategies as st

from nummon._cli import main
from nummon._cli._common import MAX_SEED, seconds, seed


def cli(*args, cwd=None):
    """`nummon ARGS` run by `main` in this process: (returncode, stdout, stderr) as a subprocess
    would give them (0.7 s of interpreter start-up each, times 40 cases, otherwise)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's own errors
                code = e.code
    finally:
        os.chdir(here)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_a_bad_value_through_the_console_entry_is_one_line_and_exit_2(log):
    p = subprocess.run(
        nummon_cmd() + ["watch", "--once", str(log), "--interval=nan"], capture_output=True, text=True, timeout=120
    )
    assert_one_line_error(p, "argument --interval", "'nan'")


def assert_one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and not p.stdout
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("nummon: error: ")
    for n in needles:
        assert n in line, line


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": NaN}\n')
    return path


@pytest.mark.parametrize(
    "option,value",
    [
        ("--interval", "nan"),
        ("--interval", "inf"),
        ("--interval", "-inf"),
        ("--interval", "0"),
        ("--interval", "-1"),
        ("--interval", "1e-300"),
        ("--interval", "1e12"),
        ("--idle-timeout", "nan"),
        ("--idle-timeout", "inf"),
        ("--idle-timeout", "0"),
        ("--idle-timeout", "-5"),
    ],
)
def test_watch_numeric_options_refuse_meaningless_seconds(log, option, value):
    p = cli("watch", "--once", log, f"{option}={value}")  # "=": argparse reads a bare -inf as an option
    assert_one_line_error(p, f"argument {option}", repr(value))


@pytest.mark.parametrize(
    "argv,option",
    [
        (["watch", "--once", "{log}", "--state", ""], "--state"),
        (["watch", "--once", "{log}", "--metrics", ""], "--metrics"),
        (["watch", "--once", "{log}", "--shard", ""], "--shard"),
        (["watch", "--once", ""], "PATH"),
        (["replay", ""], "PATH"),  # would replay every *.jsonl of the current folder
        (["audit", ""], "CKPT"),
        (["demo", "--out", ""], "--out"),
        (["demo", "--device", ""], "--device"),
    ],
)
def test_empty_values_are_refused_not_ignored(log, tmp_path, argv, option):
    (tmp_path / "other.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    p = cli(*[a.format(log=log) for a in argv], cwd=tmp_path)
    assert_one_line_error(p, f"argument {option}", "empty value")
    assert not (tmp_path / "nummon-runs").exists()


@pytest.mark.parametrize("command", ["demo", "diagnose"])
@pytest.mark.parametrize("value", [str(10**23), str(2**63), "-1", "1.5", "x"])
def test_seeds_outside_torchs_range_are_refused(tmp_path, command, value):
    p = cli(command, f"--seed={value}", cwd=tmp_path)
    assert_one_line_error(p, "argument --seed", repr(value))
    assert not (tmp_path / "nummon-runs").exists()


@given(
    st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(["nan", "inf", "-inf", "NaN", "1e999", "x", ""])
)
def test_seconds_accepts_exactly_the_finite_values_in_its_range(value):
    parse = seconds(0.01, 86400.0)
    text = value if isinstance(value, str) else repr(value)
    try:
        expected = float(text)
    except ValueError:
        expected = math.nan
    if 0.01 <= expected <= 86400.0:
        assert parse(text) == expected
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="from 0.01 to 86400"):
            parse(text)


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_seed_accepts_exactly_0_to_2_63_minus_1(value):
    if 0 <= value <= MAX_SEED:
        assert seed(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            seed(str(value))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt,needle",
    [
        ("tensorboard", "not a TensorBoard event file"),
        ("hf", "not a hf log"),
        ("csv", "not a metrics CSV"),
        ("wandb", ""),
    ],
)
def test_replay_refuses_a_jsonl_log_forced_into_another_format(log, fmt, needle):
    """The log holds a NaN: read as what it is not, it must be refused, never "no alerts"."""
    p = cli("replay", "--input-format", fmt, log)
    assert_one_line_error(p, str(log), needle)


@pytest.mark.parametrize("fmt", ["tensorboard", "hf", "csv", "wandb"])
def test_watch_refuses_a_jsonl_log_forced_into_another_format(log, fmt):
    p = cli("watch", "--once", "--format", fmt, log)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "run lost" not in p.stdout and "nonfinite" not in p.stdout
    refused = [line for line in p.stderr.splitlines() if f"{log}: not a" in line]
    assert len(refused) == 1, p.stderr

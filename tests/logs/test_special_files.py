"""A log path that is a FIFO or a device, or a file whose read fails (EIO), is one line and exit 2
in every command that reads logs (`report` and `replay` share the readers' guard): never a wait
for a writer that never comes, a read that grows until memory runs out, or a traceback."""

import os
import resource
import subprocess

import pytest
from helpers.checkout import nummon_cmd

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _limited():
    """The child's address space is capped: a reader that floods fails fast instead of eating the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run(*args, cwd):
    return subprocess.run(
        nummon_cmd() + [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        preexec_fn=_limited,
    )


def assert_one_line(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("nummon: error: ")
    for n in needles:
        assert n in line, line


def _fifo(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _zero_link(path):
    os.symlink("/dev/zero", path)
    return path


@pytest.mark.parametrize(
    "make",
    [
        lambda d: _fifo(d / "x.jsonl"),
        lambda d: _fifo(d / "run" / "events.jsonl").parent,  # a folder whose only log is a FIFO
        lambda d: _zero_link(d / "x.jsonl"),
    ],
    ids=["fifo", "folder-of-a-fifo", "dev-zero"],
)
def test_report_refuses_a_fifo_or_device_in_one_line(tmp_path, make):
    path = make(tmp_path)
    p = run("report", path, "-o", tmp_path / "page.html", cwd=tmp_path)
    assert_one_line(p, "not a regular file")
    assert not (tmp_path / "page.html").exists()


@pytest.mark.parametrize(
    "make", [lambda d: _fifo(d / "x.jsonl"), lambda d: _zero_link(d / "x.jsonl")], ids=["fifo", "dev-zero"]
)
def test_replay_forced_to_jsonl_refuses_a_fifo_or_device_in_one_line(tmp_path, make):
    p = run("replay", "--input-format", "jsonl", make(tmp_path), cwd=tmp_path)
    assert_one_line(p, "not a regular file")


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="no /proc/self/mem (EIO on read) here")
@pytest.mark.parametrize(
    "args",
    [
        ("report", "/proc/self/mem"),
        ("replay", "/proc/self/mem"),
        ("replay", "--input-format", "jsonl", "/proc/self/mem"),
    ],
    ids=["report", "replay", "replay-forced-jsonl"],
)
def test_a_read_error_is_one_line_naming_the_file(tmp_path, args):
    p = run(*args, "-o", tmp_path / "page.html", cwd=tmp_path) if args[0] == "report" else run(*args, cwd=tmp_path)
    assert_one_line(p, "/proc/self/mem", "Input/output error")


@pytest.mark.parametrize("make", [_fifo, _zero_link])
def test_a_fifo_or_device_named_like_a_flight_record_is_skipped_and_named(tmp_path, make):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        '{"type": "step", "step": 0, "loss": 1.0}\n{"type": "step", "step": 1, "loss": 1.1}\n'
    )
    make(run_dir / "nummon-flight-record-step1.json")
    p = run("report", run_dir, "-o", tmp_path / "page.html", cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "nummon-flight-record-step1.json: flight record skipped (not a regular file" in p.stderr
    assert (tmp_path / "page.html").is_file()

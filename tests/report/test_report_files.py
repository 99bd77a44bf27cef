"""The files the report (and every other atomic writer) writes: a link planted in the folder is
never followed, an input is never written over, a name that is not UTF-8 gets its page."""

import json
import os

import pytest

from nummon._cli import main
from nummon._report import write_html


@pytest.fixture
def victim(tmp_path):
    """A file a planted link points at: it must keep its bytes."""
    f = tmp_path / "elsewhere" / "victim.txt"
    f.parent.mkdir()
    f.write_text("precious")
    return f


def _trace(path, n=40):
    path.write_text("".join(json.dumps({"step": i, "loss": 1.0 + 0.01 * (i % 3)}) + "\n" for i in range(n)))
    return path


def test_a_link_planted_at_the_reports_temporary_name_is_never_followed(tmp_path, victim):
    out = tmp_path / "reports" / "run-1234.html"
    out.parent.mkdir()
    os.symlink(victim, out.parent / f".{out.name}.tmp{os.getpid()}")
    write_html("<html>page</html>", out)
    assert victim.read_text() == "precious"
    assert out.read_text() == "<html>page</html>" and not out.is_symlink()
    assert sorted(p.name for p in out.parent.iterdir()) == [f".{out.name}.tmp{os.getpid()}", out.name]


def test_report_dash_o_never_follows_a_planted_link(tmp_path, victim, capsys):
    log = _trace(tmp_path / "trace.jsonl")
    out = tmp_path / "r.html"
    os.symlink(victim, tmp_path / f".r.html.tmp{os.getpid()}")
    assert main(["report", str(log), "-o", str(out)]) == 0
    assert victim.read_text() == "precious" and "<!DOCTYPE html>" in out.read_text()


def test_a_flight_record_never_follows_a_link_planted_at_its_temporary_name(tmp_path, victim):
    from nummon import Alert, AlertKind, Severity, StepRecord
    from nummon._monitor.recorder import FlightRecorder

    rec = FlightRecorder(4)
    rec.add(StepRecord(step=3, loss=1.0), None)
    path = tmp_path / "nummon-flight-record-step3.json"
    os.symlink(victim, tmp_path / (path.name + ".tmp"))
    rec.dump(path, Alert(step=3, kind=AlertKind.NONFINITE, severity=Severity.CRITICAL, message="nan", metric="loss"))
    assert victim.read_text() == "precious"
    assert json.loads(path.read_text())["records"][0]["step"] == 3


def test_the_page_keeps_the_permissions_a_reader_needs(tmp_path):
    out = write_html("x", tmp_path / "r.html")
    assert out.stat().st_mode & 0o044 == 0o044  # group and others may read, as with a plain write


@pytest.mark.parametrize(
    "target",
    ["{log}", "{folder}/events.jsonl", "{folder}/./events.jsonl", "{folder}/hard.jsonl", "{folder}/flight.json"],
)
@pytest.mark.parametrize("give_folder", [False, True])
def test_the_report_never_writes_over_what_it_reads(tmp_path, capsys, target, give_folder):
    folder = tmp_path / "run"
    folder.mkdir()
    log = _trace(folder / "events.jsonl")
    os.link(log, folder / "hard.jsonl")
    (folder / "flight.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    src = folder if give_folder else log
    out = target.format(log=log, folder=folder)
    if not give_folder and out.endswith("flight.json"):
        pytest.skip("a file beside a log given alone is not read")
    assert main(["report", str(src), "-o", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the report reads" in err[0]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_the_default_page_and_a_new_file_in_the_run_folder_are_written(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    _trace(folder / "events.jsonl")
    assert main(["report", str(folder)]) == 0
    assert main(["report", str(folder)]) == 0  # its own page, written again
    assert main(["report", str(folder), "-o", str(folder / "page.html")]) == 0
    assert {p.name for p in folder.iterdir()} == {"events.jsonl", "nummon-report.html", "page.html"}


def test_a_run_folder_whose_name_is_not_utf8_gets_its_page_and_no_temporary_file(tmp_path, capsys):
    folder = tmp_path / os.fsdecode(b"run\xff")
    folder.mkdir()
    _trace(folder / "events.jsonl")
    assert main(["report", str(folder)]) == 0
    assert sorted(os.listdir(os.fsencode(folder))) == [b"events.jsonl", b"nummon-report.html"]
    html = (folder / "nummon-report.html").read_bytes().decode("utf-8")  # valid UTF-8
    assert "run\\xff" in html  # the name as it is on disk, its byte spelled out

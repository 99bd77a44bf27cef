"""A log nummon read nothing from never reads as healthy: a W&B offline run folder (the one the
demo says to `wandb sync`) is read through its run file; an empty log is "no step records",
exit 2; alerts left out by --min-severity are counted, never hidden behind "no alerts"."""

import contextlib
import io
import json
from types import SimpleNamespace

from helpers.log_writers import runaway_rows, write_jsonl, write_wandb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon import replay
from nummon._cli import main


def cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _alerts(p):
    return [(a["step"], a["kind"], a["severity"]) for a in map(json.loads, p.stdout.splitlines())]


def test_a_wandb_offline_run_folder_gives_its_run_files_alerts(wandb_env, tmp_path):
    """The offline-run folder, the `wandb/` folder above it and the folder `wandb.init(dir=)` was
    given all give the run file's own alerts; a report over the run folder has its records."""
    run_file = write_wandb(runaway_rows())
    run_folder, wandb_folder = run_file.parent, run_file.parent.parent
    direct = cli("replay", "--format", "jsonl", run_file)
    assert direct.returncode == 0 and any(a[2] == "critical" for a in _alerts(direct))
    for folder in (run_folder, wandb_folder, wandb_folder.parent):
        p = cli("replay", "--format", "jsonl", folder)
        assert p.returncode == 0, p.stderr
        assert _alerts(p) == _alerts(direct)
        assert "no alerts" not in cli("replay", folder).stdout
    page = tmp_path / "page.html"
    p = cli("report", run_folder, "-o", page)
    assert p.returncode == 0, p.stderr
    assert "No step records" not in page.read_text()


def test_a_wandb_folder_of_two_runs_replays_each(wandb_env):
    first = write_wandb(runaway_rows())
    second = write_wandb(runaway_rows(healthy=30))
    assert first.parent.parent == second.parent.parent
    p = cli("replay", first.parent.parent)
    assert p.returncode == 0, p.stderr
    assert f"{first}: step" in p.stdout and f"{second}: step" in p.stdout
    assert p.stdout.splitlines()[-1].startswith("2 trace(s), ")


def test_an_empty_log_is_no_step_records_and_exit_2(tmp_path):
    empty = tmp_path / "run.jsonl"
    empty.write_text("")
    p = cli("replay", empty)
    assert p.returncode == 2
    (line,) = p.stderr.splitlines()
    assert (
        line
        == f"nummon: error: {empty}: no step records read (an empty log, or none nummon reads in it); nothing was checked"
    )
    assert "no alerts" not in p.stdout
    assert p.stdout.splitlines() == ["1 trace(s), 0 alert(s); 1 with no step records"]


def test_a_report_over_a_log_with_no_step_records_writes_no_page_and_exits_2(tmp_path):
    empty = tmp_path / "run.jsonl"
    empty.write_text("\n")
    out = tmp_path / "page.html"
    p = cli("report", empty, "-o", out)
    assert p.returncode == 2 and not out.exists()
    (line,) = p.stderr.splitlines()
    assert "no step records read" in line and "no report written" in line


def test_an_empty_log_beside_a_read_one_still_exits_2(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    write_jsonl(tmp_path / "b.jsonl", runaway_rows())
    p = cli("replay", "--format", "jsonl", tmp_path)
    assert p.returncode == 2 and _alerts(p)  # the read log's alerts are printed all the same
    assert p.stderr.count("no step records") == 1 and "a.jsonl" in p.stderr


def _spiky_trace(path, spikes):
    """A healthy, slowly falling loss with a one-record jump at each step of `spikes`."""
    with open(path, "w") as fh:
        for s in range(200):
            loss = 2.0 * 0.995**s * (30.0 if s in spikes else 1.0)
            fh.write(json.dumps({"step": s, "loss": loss, "grad_norm": 1.0, "lr": 1e-3}) + "\n")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spikes=st.sets(st.integers(60, 190), min_size=1, max_size=4))
def test_alerts_below_min_severity_are_counted_not_called_no_alerts(tmp_path, spikes):
    trace = tmp_path / "spiky.jsonl"
    _spiky_trace(trace, spikes)
    raised = replay(trace)
    p = cli("replay", "--min-severity", "critical", trace)
    assert p.returncode == 0
    if any(a.severity.value == "critical" for a in raised):
        return  # shown as usual
    n_warn = sum(a.severity.value == "warning" for a in raised)
    n_info = sum(a.severity.value == "info" for a in raised)
    assert n_warn + n_info > 0
    words = [f"{n_warn} warning{'s' * (n_warn != 1)}"] if n_warn else []
    words += [f"{n_info} info alert{'s' * (n_info != 1)}"] if n_info else []
    assert p.stdout.splitlines()[0] == f"{trace}: no alerts at or above critical ({', '.join(words)})"

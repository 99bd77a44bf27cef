"""`find_runs`: the one place that turns paths into runs, for `replay` and `report` (logs named
by a person: each path one run, unless a folder's top holds several) and `watch` (roots searched
deep, problems said rather than raised)."""

import os

import pytest

from nummon._core.errors import TraceError
from nummon._logs.discovery import find_runs

EVENTS = "events.out.tfevents.1700000000.host"


def _touch(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _ids(runs):
    return [(r.id, r.format) for r in runs]


def test_a_folder_of_traces_is_each_trace_named_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _touch(tmp_path / "logs" / "b.jsonl", '{"step": 0}\n')
    _touch(tmp_path / "logs" / "a.jsonl", '{"text": "a dataset line, still named"}\n')
    _touch(tmp_path / "logs" / "metrics.csv", "step,loss\n0,1\n")
    _touch(tmp_path / "logs" / "deeper" / "c.jsonl", '{"step": 0}\n')
    runs, problems = find_runs(["./logs/"])
    assert _ids(runs) == [("logs/a.jsonl", "jsonl"), ("logs/b.jsonl", "jsonl")] and problems == []
    # forced to another format, the folder is one run of that format
    assert _ids(find_runs(["logs"], "csv")[0]) == [("logs", "csv")]


def test_a_file_of_any_name_is_one_run_detected_when_read_and_a_path_given_twice_is_read_twice(tmp_path):
    log = _touch(tmp_path / "train.log", '{"step": 0}\n')
    runs, _ = find_runs([str(log), str(log)])
    assert _ids(runs) == [(str(log), None), (str(log), None)]


def test_a_tensorboard_logdir_is_each_run_folder_links_included(tmp_path):
    logdir = tmp_path / "tb"
    _touch(logdir / "run-a" / EVENTS)
    _touch(tmp_path / "elsewhere" / "run-b" / EVENTS)
    os.symlink(tmp_path / "elsewhere" / "run-b", logdir / "run-b")  # a run linked into the logdir
    runs, _ = find_runs([str(logdir)])
    assert _ids(runs) == [(str(logdir / "run-a"), "tensorboard"), (str(logdir / "run-b"), "tensorboard")]
    assert runs[1].files == [str(logdir / "run-b" / EVENTS)]
    # a run folder of its own (event files at its top) is one run, read as a whole
    assert _ids(find_runs([str(logdir / "run-a")])[0]) == [(str(logdir / "run-a"), None)]


def test_a_wandb_folder_of_several_runs_is_each_run_file(tmp_path):
    wandb = tmp_path / "wandb"
    first = _touch(wandb / "offline-run-1" / "run-1.wandb")
    second = _touch(wandb / "offline-run-2" / "run-2.wandb")
    assert _ids(find_runs([str(wandb)])[0]) == [(str(first), "wandb"), (str(second), "wandb")]
    assert _ids(find_runs([str(first.parent)])[0]) == [(str(first.parent), None)]  # one run: its folder


def test_a_missing_named_path_is_an_error_and_a_missing_root_a_problem_line(tmp_path):
    missing = tmp_path / "gone" / "trace.jsonl"
    with pytest.raises(TraceError, match=f"^trace not found: {missing}$"):
        find_runs([str(tmp_path), str(missing)])
    runs, problems = find_runs([str(missing)], roots=True)
    assert runs == [] and problems == [f"{missing}: not found"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_log_is_named_to_its_reader_but_never_a_run_under_a_root(tmp_path):
    os.mkfifo(tmp_path / "events.jsonl")
    assert _ids(find_runs([str(tmp_path)])[0]) == [(str(tmp_path / "events.jsonl"), "jsonl")]  # refused when read
    assert find_runs([str(tmp_path)], roots=True)[0] == []


def test_an_mlflow_run_is_one_run_as_given():
    source = "mlflow:http://127.0.0.1:1#abc"
    assert _ids(find_runs([source])[0]) == [(source, None)]
    assert _ids(find_runs([source], "mlflow")[0]) == [(source, "mlflow")]


def test_roots_are_searched_deep_and_the_logs_of_one_run_are_one_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = _touch(tmp_path / "root" / "a" / "b" / "run" / "events.jsonl", '{"type": "step", "step": 0}\n')
    _touch(own.parent / "tb" / EVENTS)  # the same run's TensorBoard log: not a run of its own
    _touch(tmp_path / "root" / "data.jsonl", '{"text": "a dataset"}\n')  # not a run
    notes = _touch(tmp_path / "root" / "notes.jsonl")
    runs, problems = find_runs(["root"], roots=True, exclude={str(notes)})
    assert _ids(runs) == [(str(own), "jsonl")] and problems == []
    assert runs[0].beside == ["tensorboard"] and runs[0].covered == [str(own.parent / "tb")]
    # named, the same folder means the JSONL files at its top, whatever they hold (replay says so)
    assert _ids(find_runs(["root"])[0]) == [("root/data.jsonl", "jsonl"), ("root/notes.jsonl", "jsonl")]

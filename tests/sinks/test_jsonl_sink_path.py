"""A JSONL event log whose path can never be a file is refused when the sink is made, in one
line naming the path: every event would otherwise be lost after one warning."""

import os

import pytest

from nummon import JsonlSink, NummonError


def _refused(path):
    with pytest.raises(NummonError) as e:
        JsonlSink(path)
    (line,) = str(e.value).splitlines()
    return line


def test_a_folder_is_refused_as_the_log(tmp_path):
    line = _refused(tmp_path)
    assert str(tmp_path) in line and "a folder, not a file" in line


def test_a_name_ending_in_a_separator_is_refused_and_a_file_in_it_accepted(tmp_path):
    line = _refused(str(tmp_path / "not-yet") + os.sep)
    assert "a folder, not a file" in line
    sink = JsonlSink(tmp_path / "not-yet" / "events-rank{rank}.jsonl")
    assert sink.path == tmp_path / "not-yet" / "events-rank0.jsonl"
    assert not (tmp_path / "not-yet").exists()  # nothing is made before the first write


def test_a_parent_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    line = _refused(tmp_path / "notes.txt" / "deeper" / "events.jsonl")
    assert f"{str(tmp_path / 'notes.txt')!r} is not a folder" in line

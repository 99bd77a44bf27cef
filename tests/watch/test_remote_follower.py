"""A remote source's reader on its own thread (`RemoteFollower`): every record is handed over
once and in order, the saved position is the one after the records handed over, and an error
the thread meets is raised on the watcher's side (the thread goes on asking)."""

import socket
import time

import pytest
from helpers.watching import two_incident_rows, write_lines

from nummon._logs.read_jsonl import JsonlFollower
from nummon._logs.read_mlflow import MlflowError, MlflowFollower
from nummon._watch.remote import RemoteFollower


def _drain(follower, until, what):
    got, deadline = [], time.monotonic() + 60
    while not until(got):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        got.extend(follower.poll())
        time.sleep(0.01)
    return got


def test_every_record_is_handed_over_once_in_order_with_its_position(tmp_path):
    rows = two_incident_rows()
    log = tmp_path / "events.jsonl"
    write_lines(log, rows[:50])
    inner = JsonlFollower(str(log))
    inner.poll_bytes = 1024  # several chunks: the thread reads on while the follower has more
    remote = RemoteFollower(inner, interval_s=0.01)
    try:
        assert remote.position() == JsonlFollower(str(log)).position()  # nothing handed over yet
        got = _drain(remote, lambda g: len(g) >= 50, "the first records")
        write_lines(log, rows[50:], mode="a")
        got += _drain(remote, lambda g: len(got) + len(g) >= len(rows), "the rest")
    finally:
        remote.close()
    assert [r.step for r in got] == [r["step"] for r in rows]
    alone = JsonlFollower(str(log))
    alone.poll_bytes = 1 << 30
    assert len(alone.poll()) == len(got)
    assert remote.position()["offset"] == alone.position()["offset"]


def test_an_error_of_the_thread_is_raised_by_poll_and_asked_again():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed: refused
    remote = RemoteFollower(MlflowFollower(f"mlflow:http://127.0.0.1:{port}#run"), interval_s=0.01)
    try:
        for _ in range(2):  # the thread asks again after an error
            with pytest.raises(MlflowError, match="not reachable"):
                _drain(remote, lambda g: False, "the refused request's error")
    finally:
        remote.close()

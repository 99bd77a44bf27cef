"""A stalled remote source holds only itself: with an MLflow server that never answers, a local
run's NaN is notified while the stalled request is still open (the remote run is read on a
thread of its own), and the watcher still stops at once on SIGTERM."""

import json
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers.watching import read_events, start_watch, stop, two_incident_rows, wait_for, write_lines


class StallingMlflow:
    """An HTTP server on 127.0.0.1 that takes every request and answers none until `release` is
    set; it counts the requests it took (`opened`) and those whose client gave up (`abandoned`)."""

    def __init__(self):
        self.release = threading.Event()
        self.opened = self.abandoned = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                owner._stall(self)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _stall(self, handler):
        with self.lock:
            self.opened += 1
        conn = handler.connection
        while not self.release.wait(0.05):
            readable, _, _ = select.select([conn], [], [], 0)
            if readable and not conn.recv(1, socket.MSG_PEEK):  # the client closed its end
                with self.lock:
                    self.abandoned += 1
                return
        body = json.dumps({"run": {"info": {"status": "RUNNING"}, "data": {"metrics": []}}}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stalling():
    server = StallingMlflow()
    yield server
    server.close()


@pytest.mark.parametrize("query", ["#stalled-run", "?experiment=stalled"], ids=["one-run", "search"])
def test_a_local_nan_is_notified_while_a_remote_request_stalls(tmp_path, stalling, query):
    local = tmp_path / "local" / "events.jsonl"
    local.parent.mkdir()
    write_lines(local, two_incident_rows())
    notes = tmp_path / "notes.jsonl"
    remote = f"mlflow:{stalling.uri}{query}"  # a run, or a search for an experiment's running runs
    proc = start_watch(remote, local.parent, "--interval", "0.2", "--notify", f"jsonl:{notes}", cwd=tmp_path)
    try:
        wait_for(
            lambda: any(e.get("state") == "nonfinite" for e in read_events(notes)),
            what="the local run's non-finite event",
        )
        with stalling.lock:
            opened, abandoned = stalling.opened, stalling.abandoned
    finally:
        rc, _, err = stop(proc)
    assert opened >= 1, "the remote source was never asked"
    assert abandoned == 0, "the local NaN waited for the stalled request to time out"
    assert {e["run"] for e in read_events(notes)} == {str(local)}
    assert rc == 0, err
    assert "stopped (SIGTERM)" in err

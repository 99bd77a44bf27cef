"""`mlflow:` sources against real HTTP servers on 127.0.0.1 that answer as a hostile or broken
tracking server would: a redirect to another origin, a trickle, page tokens that never end, a
page far larger than was asked for, values beyond float's range; and nummon's non-finite
markers read back as the values they mark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
from helpers.http_answers import AnswerServer, as_json, mlflow_run

from nummon._logs.read_mlflow import MlflowError, MlflowServer

FINITE = [(i, 2.0 * 0.98**i) for i in range(30)]


def replay(source: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nummon", "replay", "--format", "jsonl", source],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def servers():
    started: list[AnswerServer] = []

    def start(answer) -> AnswerServer:
        started.append(AnswerServer(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


def alerts(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    "rows",
    [
        {"train_loss": [*FINITE, (30, "1" + "0" * 400)]},  # a JSON integer too large for float
        {"train_loss": [*FINITE, (30, "1.7976931348623157e308")]},  # how MLflow stores +inf
        {"train_loss": [*FINITE, (30, "-1.7976931348623157e308")]},
        {"nummon/loss": FINITE, "nummon/nonfinite/loss": [(30, 2)]},  # nummon's marker of +inf
        {"nummon/loss": FINITE, "nummon/nonfinite/loss": [(30, 1)]},  # nummon's marker of NaN
    ],
    ids=["int-400-digits", "max-double", "minus-max-double", "marker-inf", "marker-nan"],
)
def test_an_overflow_as_mlflow_holds_it_is_read_as_the_loss_going_non_finite(servers, rows):
    rows = {**rows, "grad_norm": [(i, 1.0) for i in range(31)]}
    srv = servers(mlflow_run(rows))
    p = replay(f"mlflow:{srv.uri}#r1")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    found = alerts(p.stdout)
    first = next(a for a in found if a["kind"] == "nonfinite")
    assert first["step"] == 30 and first["location"] == "loss", found
    assert not [a for a in found if a["step"] == 30 and a["kind"] != "nonfinite"], found  # no "1e306x its median"


def _redirect_to(target: str):
    def answer(req):
        return 302, {"Location": target + req.path + "?" + urllib.parse.urlencode(req.query)}, b""

    return answer


@pytest.mark.parametrize(
    "env",
    [
        {"MLFLOW_TRACKING_TOKEN": "tok-s3cret"},
        {"MLFLOW_TRACKING_USERNAME": "me", "MLFLOW_TRACKING_PASSWORD": "tok-s3cret"},
    ],
    ids=["bearer", "basic"],
)
def test_a_redirect_to_another_origin_is_not_followed_and_never_gets_the_credentials(servers, env):
    other = servers(mlflow_run({"train_loss": FINITE}))  # another port on the same host: another origin
    first = servers(_redirect_to(other.uri))
    p = replay(f"mlflow:{first.uri}#r1", env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "redirect" in p.stderr and "another origin" in p.stderr and other.uri in p.stderr, p.stderr
    assert "tok-s3cret" not in p.stderr + p.stdout
    assert first.requests and first.requests[0].headers.get("authorization")  # the tracking server got them
    assert not [r for r in other.requests if "authorization" in r.headers]
    assert not other.requests  # nothing at all was sent there


def test_a_redirect_within_the_tracking_servers_origin_is_followed(servers):
    rows = mlflow_run({"train_loss": [*FINITE, (30, float("nan"))]})

    def answer(req):
        if req.path.startswith("/moved/"):
            return rows(req)
        return 307, {"Location": "/moved" + req.path + "?" + urllib.parse.urlencode(req.query)}, b""

    srv = servers(answer)
    p = replay(f"mlflow:{srv.uri}#r1", env={"MLFLOW_TRACKING_TOKEN": "tok"})
    assert p.returncode == 0, p.stderr
    moved = [r for r in srv.requests if r.path.startswith("/moved/")]
    assert moved and all(r.headers.get("authorization") == "Bearer tok" for r in moved)
    assert any(a["kind"] == "nonfinite" and a["step"] == 30 for a in alerts(p.stdout))


def _body_trickle(req):
    """Headers at once, then a body of one space every 0.2 s, forever."""

    def drip():
        while True:
            time.sleep(0.2)
            yield b" "

    return 200, {"Content-Type": "application/json", "Content-Length": "1000000"}, drip()


class _HeadTrickle:
    """A raw TCP server that answers every connection with its status line one byte every 0.2 s."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn) -> None:
        with conn:
            try:
                while not self.stop.is_set():
                    for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                        if self.stop.wait(0.2):
                            return
                        conn.sendall(bytes([b]))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("where", ["body", "head"])
def test_a_trickling_server_is_given_up_at_the_request_deadline(servers, where):
    """One byte every 0.2 s never trips the per-read timeout (1 s); the request's whole deadline
    (2 s) ends it, however the trickle is placed."""
    head = _HeadTrickle() if where == "head" else None
    uri = head.uri if head else servers(_body_trickle).uri
    got: list[BaseException] = []

    def ask() -> None:
        try:
            MlflowServer(uri, timeout_s=1.0, deadline_s=2.0).call("GET", "runs/get", {"run_id": "r1"})
        except BaseException as e:  # noqa: BLE001 - the test inspects what came back
            got.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(60)  # a bound for a hang, not a timing claim: the deadline is 2 s
    if head:
        head.close()
    assert not t.is_alive(), "the request outlived its deadline"
    assert len(got) == 1 and isinstance(got[0], MlflowError), got
    assert "runs/get did not answer within 2 s" in str(got[0])


@pytest.mark.parametrize("tokens", [["same"], ["a", "b"]], ids=["dropped-token", "cycle"])
def test_page_tokens_that_never_end_stop_the_read_in_one_line(servers, tokens):
    """A gateway that drops `page_token` answers the first page again, with the same next token,
    forever (or cycles between tokens)."""
    row = [{"key": "train_loss", "value": v, "step": s, "timestamp": 1} for s, v in FINITE]

    def answer(req):
        if req.path.endswith("/runs/get"):
            return as_json({"run": {"info": {"status": "FINISHED"}, "data": {"metrics": [row[-1]]}}})
        n = sum(r.path.endswith("get-history") for r in srv.requests)
        return as_json({"metrics": row, "next_page_token": tokens[(n - 1) % len(tokens)]})

    srv = servers(answer)
    p = replay(f"mlflow:{srv.uri}#r1", timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "same page token twice" in p.stderr, p.stderr
    assert sum(r.path.endswith("get-history") for r in srv.requests) <= len(tokens) + 2


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "streamed"])
def test_a_page_of_millions_of_rows_is_refused_in_one_line(servers, length):
    """1,000 rows were asked for; the server sends 1.5 million (about 80 MB)."""
    rows = 1_500_000
    block = b"".join(b'{"key": "train_loss", "value": 1.5, "step": %d, "timestamp": 1},' % i for i in range(10_000))

    def body():
        yield b'{"metrics": ['
        for _ in range(rows // 10_000):
            yield block
        yield b'{"key": "train_loss", "value": 1.5, "step": 0, "timestamp": 1}]}'

    size = 13 + len(block) * (rows // 10_000) + len(b'{"key": "train_loss", "value": 1.5, "step": 0, "timestamp": 1}]}')

    def answer(req):
        if req.path.endswith("/runs/get"):
            m = {"key": "train_loss", "value": 1.5, "step": 9999, "timestamp": 1}
            return as_json({"run": {"info": {"status": "FINISHED"}, "data": {"metrics": [m]}}})
        return 200, ({"Content-Length": str(size)} if length else {}), body()

    srv = servers(answer)
    p = replay(f"mlflow:{srv.uri}#r1")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "metrics/get-history answered more than 32 MB" in p.stderr, p.stderr

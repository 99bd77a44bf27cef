"""A real MLflow tracking server for tests: `mlflow server` with a SQLite backend and an artifact
folder under a temporary directory, on 127.0.0.1 and a free port, stopped by its PID (its process
group: the server runs uvicorn in a child); `shared_server` gives the session one of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`uri` serves until `stop()`; `log` is the server's output file."""

    def __init__(self, root: Path, startup_s: float = 240.0) -> None:
        pytest.importorskip("mlflow")
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "mlflow-server.log"
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no background job workers
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(exe) if exe.exists() else "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not up within {startup_s:.0f}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass(frozen=True)
class SharedServer:
    """Where the session's shared server listens (`shared_server`)."""

    uri: str
    port: int
    pid: int


#: stops a server's process group when the process that owns the test session is gone
_WATCHDOG = """
import os, signal, sys, time
owner, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(0.5)
    try:
        os.kill(owner, 0)
        os.killpg(group, 0)
    except ProcessLookupError:
        break
try:
    os.killpg(group, signal.SIGTERM)
except ProcessLookupError:
    pass
"""


def shared_server(tmp_path_factory: pytest.TempPathFactory) -> SharedServer:
    """One MLflow server for the whole test session, shared by the xdist workers (it costs
    seconds of CPU to start, once per worker before): the first worker to ask starts it, and a
    watchdog process stops it, by its process group, when the session's main process has exited
    (a worker cannot know it is the last one to need it)."""
    from helpers.shared_once import once_per_session

    def start(folder: Path) -> SharedServer:
        srv = MlflowServer(folder)
        # the session's main process: the xdist controller (each worker's parent), else this one
        owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(owner), str(srv.proc.pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return SharedServer(srv.uri, srv.port, srv.proc.pid)

    return once_per_session(tmp_path_factory, "mlflow-server", start)


class Relay:
    """A real TCP relay from a free port on 127.0.0.1 to `port`; `cut()` closes it and every
    connection through it, as a tracking server that goes away mid-run looks to its clients."""

    def __init__(self, port: int) -> None:
        import threading

        self._target = port
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.uri = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(): no connection after this
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass

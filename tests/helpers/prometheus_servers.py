"""Real Prometheus and Alertmanager servers for tests (the Debian packages' binaries): started on
127.0.0.1 with free ports and storage under the test's tmp_path, stopped by PID. Tests that need
a binary skip, naming it, only when it is absent."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
import yaml

from helpers import webhook_receiver

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "prometheus"
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")


def binary(*names: str) -> str:
    """The first of `names` on PATH, or skip the test naming them (apt-get install prometheus
    prometheus-alertmanager)."""
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    pytest.skip(f"needs {' or '.join(names)} on PATH (Debian: apt-get install prometheus prometheus-alertmanager)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    """Poll `cond` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except (OSError, urllib.error.URLError, ValueError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


class Server:
    """A server process listening on 127.0.0.1:port; `stop()` terminates it by PID."""

    def __init__(self, argv: list[str], port: int, log: Path, ready_path: str = "/-/ready") -> None:
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for(lambda: self._ready(ready_path), 30, f"{Path(argv[0]).name} to be ready ({log})")
        except BaseException:
            self.stop()
            raise

    def _ready(self, path: str) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{cast(list, self.proc.args)[0]} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            )
        with urllib.request.urlopen(self.url + path, timeout=2) as r:
            return r.status == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._fh.close()


def start_prometheus(
    tmp_path: Path, targets: list[str], rules: Sequence[Path] = (), alertmanager: str | None = None
) -> Server:
    """Prometheus scraping `targets` (host:port) every second, evaluating `rules` every second."""
    exe = binary("prometheus")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(r) for r in rules],
        "scrape_configs": [{"job_name": "nummon-watch", "static_configs": [{"targets": targets}]}],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config))
    argv = [
        exe,
        f"--config.file={cfg}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
    ]
    return Server(argv, port, tmp_path / "prometheus.log")


def shipped_alertmanager_config(receiver_url: str, webhook_url: str | None = None) -> dict:
    """configs/prometheus/alertmanager.yml, its Slack URL pointed at `receiver_url` and its
    timings shortened to a test's (group_wait 0s, group_interval 1s); with `webhook_url`, the
    same receiver also posts Alertmanager's own webhook payload there (one per message sent)."""
    config = yaml.safe_load((CONFIGS / "alertmanager.yml").read_text())
    for route in config["route"].get("routes", []):
        route.update(group_wait="0s", group_interval="1s", repeat_interval="1h")
    for r in config["receivers"]:
        for sc in r.get("slack_configs", []):
            sc["api_url"] = receiver_url
        if webhook_url and r.get("slack_configs"):
            r["webhook_configs"] = [{"url": webhook_url, "send_resolved": True}]
    return config


def start_alertmanager(tmp_path: Path, config: dict) -> Server:
    """Alertmanager alone (its cluster port off, so tests run in parallel)."""
    exe = binary(*ALERTMANAGER_BINARIES)
    port = free_port()
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    argv = [
        exe,
        f"--config.file={cfg}",
        f"--storage.path={tmp_path / 'alertmanager-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    return Server(argv, port, tmp_path / "alertmanager.log")


def prom_query(server: Server, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    got = get_json(f"{server.url}/api/v1/query?{q}")
    return got["data"]["result"] if got.get("status") == "success" else []


def prom_alerts(server: Server, name: str, state: str = "firing") -> list:
    got = get_json(f"{server.url}/api/v1/alerts")["data"]["alerts"]
    return [a for a in got if a["labels"].get("alertname") == name and a["state"] == state]


class Receiver(webhook_receiver.Receiver):
    """A Slack-compatible webhook on 127.0.0.1 recording each JSON body posted (Alertmanager's
    slack_configs post here)."""

    def __init__(self) -> None:
        super().__init__("/slack")

    def texts(self) -> list[str]:
        """Each message's attachments' titles and texts, one string per message."""
        out = []
        for b in self.bodies:
            parts = [str(b.get("text") or "")]
            for a in b.get("attachments") or []:
                parts += [str(a.get("title") or ""), str(a.get("text") or "")]
            out.append("\n".join(parts))
        return out

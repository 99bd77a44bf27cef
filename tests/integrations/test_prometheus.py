"""Prometheus metrics: `nummon watch --metrics` over watched runs, `PrometheusSink` in a real
training loop and a real Lightning run, and the real Prometheus scraping two shard watchers,
loading the shipped rules and firing the non-finite rule."""

import math
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from helpers.checkout import ROOT

pytest.importorskip("prometheus_client")
from helpers.prometheus_servers import CONFIGS, prom_alerts, prom_query, start_prometheus, wait_for  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nummon import load_policy
from nummon._core.json import dumps  # noqa: E402
from nummon._watch.metrics import FleetMetrics, MetricsObserver  # noqa: E402
from nummon._watch.watcher import Watcher, WatchSettings  # noqa: E402
from nummon.integrations.prometheus import METRICS, PrometheusSink, serve_metrics  # noqa: E402

WATCH = [sys.executable, "-m", "nummon", "watch"]


def rows(n=125, runaway_at=100, nan_at=None, layers=0):
    """Healthy steps, a runaway (loss x4, gradient x2 per step) from `runaway_at`, NaN at `nan_at`."""
    out = []
    for s in range(n):
        if nan_at is not None and s >= nan_at:
            loss, g = math.nan, math.inf
        elif s >= runaway_at:
            loss, g = 4.0 ** (s - runaway_at + 1), 2.0 ** (s - runaway_at + 1)
        else:
            loss, g = 2.0 * 0.99**s * (1 + 0.03 * math.sin(1.3 * s)), 1 + 0.1 * math.sin(s)
        r = {"type": "step", "step": s, "loss": loss, "grad_norm": g}
        if layers:
            r["layer_grad_norms"] = {f"blocks.{i}.mlp": g / layers for i in range(layers)}
        out.append(r)
    return out


def write_log(path, records, mode="w"):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as fh:
        for r in records:
            fh.write(dumps(r) + "\n")


def scrape(url):
    """{(name, frozenset(labels)): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples, name, **labels):
    want = frozenset(labels.items())
    got = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(got) <= 1, (name, labels, got)
    return got[0] if got else None


def test_watch_metrics_one_series_per_run_bounded_and_retired(tmp_path):
    root = tmp_path / "runs"
    away, calm = root / "away" / "events.jsonl", root / "calm" / "events.jsonl"
    write_log(away, rows(125, runaway_at=115))
    write_log(calm, rows(60, runaway_at=10**9, layers=40))  # 40 layers: still one series per metric
    fleet = FleetMetrics()
    server = serve_metrics(fleet, "127.0.0.1:0")
    watcher = Watcher(
        [str(root)], load_policy("default"), [], observer=MetricsObserver(fleet), errors=open(os.devnull, "w")
    )
    try:
        watcher.poll_once()
        got = scrape(server.url)
        a, c = {"run": str(away), "source": "nummon"}, {"run": str(calm), "source": "nummon"}
        assert value(got, "nummon_last_step", **a) == 124 and value(got, "nummon_last_step", **c) == 59
        assert value(got, "nummon_loss", **a) == 4.0**10 and value(got, "nummon_grad_norm", **a) == 2.0**10
        assert value(got, "nummon_incident_state", **a) == 2 and value(got, "nummon_incident_state", **c) == 0
        assert value(got, "nummon_health_state", **a) == 1 and value(got, "nummon_health_state", **c) == 0
        ov = value(got, "nummon_steps_to_overflow", **a)
        assert ov is not None and 0 < ov < 1000
        assert value(got, "nummon_steps_to_overflow", **c) is None  # nothing runs away there
        assert value(got, "nummon_incidents_total", **a) == 1
        assert value(got, "nummon_alerts_total", **a, kind="runaway", severity="critical") >= 1
        assert value(got, "nummon_watch_runs") == 2 and value(got, "nummon_watch_poll_duration_seconds") > 0
        # bounded: only nummon's metric names, no layer in any label
        names = {n for n, _ in got}
        assert names <= {m + s for m in METRICS for s in ("", "_total")}
        assert not any("blocks" in v for _, ls in got for _, v in ls)
        assert sum(1 for n, ls in got if dict(ls).get("run") == str(calm)) == 7  # one per per-run gauge
        # the runaway turns non-finite; the calm run goes idle and is retired: its series are gone
        watcher.idle_timeout_s = 0.0
        write_log(away, [{"type": "step", "step": 125, "loss": math.nan, "grad_norm": math.inf}], mode="a")
        watcher.poll_once()
        got = scrape(server.url)
        assert value(got, "nummon_incident_state", **a) == 3 and value(got, "nummon_health_state", **a) == 3
        assert math.isnan(value(got, "nummon_loss", **a))
        assert not any(dict(ls).get("run") == str(calm) for _, ls in got)
        assert value(got, "nummon_watch_runs") == 1
    finally:
        watcher.close()
        server.close()


def test_restarted_watcher_reports_the_saved_incident_and_the_log_time(tmp_path):
    log = tmp_path / "runs" / "a" / "events.jsonl"
    write_log(log, rows(125, runaway_at=115))
    state = tmp_path / "state.json"
    first = Watcher(
        [str(tmp_path / "runs")],
        load_policy("default"),
        [],
        settings=WatchSettings(state_path=str(state)),
        errors=open(os.devnull, "w"),
    )
    first.poll_once()
    first.close()
    fleet = FleetMetrics()
    again = Watcher(
        [str(tmp_path / "runs")],
        load_policy("default"),
        [],
        settings=WatchSettings(state_path=str(state)),
        observer=MetricsObserver(fleet),
        errors=open(os.devnull, "w"),
    )
    try:
        again.poll_once()
        (s,) = fleet.snapshot().runs
        assert s.incident == 2 and s.last_step == 124  # from the state file: nothing new was read
        assert s.health is None  # no record read since the restart: no health series
        assert s.last_record_ts == pytest.approx(log.stat().st_mtime)
    finally:
        again.close()


@pytest.mark.slow
def test_prometheus_sink_serves_a_training_run_live_then_stops(tmp_path):
    torch = pytest.importorskip("torch")
    from nummon import Monitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 8) * 2, torch.randn(64, 1)
    sink = PrometheusSink("127.0.0.1:0", run="job-7")
    mon = Monitor(model, opt, sinks=[sink], run_dir=tmp_path / "run")
    try:
        url = sink.url
        assert url is not None
        lbl = {"run": "job-7", "source": "nummon"}
        opened = None

        def scrape_with_incident():
            got = scrape(url)
            return got if value(got, "nummon_incident_state", **lbl) else None

        for step in range(120):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            r = mon.post_step(loss)
            if opened is None and mon.incidents:
                opened = step
                # served while the run goes on: the incident and the step that opened it
                got = wait_for(scrape_with_incident, 30, "the incident in the sink's metrics")
                assert value(got, "nummon_incident_state", **lbl) >= 1 and value(got, "nummon_run_open", **lbl) == 1
                assert value(got, "nummon_last_step", **lbl) == r.step
                assert value(got, "nummon_incidents_total", **lbl) == 1
            if not math.isfinite(loss.item()) or (opened is not None and step >= opened + 3):
                break
        assert opened is not None
    finally:
        mon.close()
    assert sink.url is None
    with pytest.raises(urllib.error.URLError):
        scrape(url)
    (s,) = sink.metrics.snapshot().runs
    assert s.open is False and s.last_step == r.step


def test_prometheus_sink_on_a_taken_port_warns_and_training_goes_on(tmp_path, caplog):
    import socket

    from helpers.models import runaway_run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sink = PrometheusSink(f"127.0.0.1:{port}", run="r")
        mon, reports = runaway_run([sink], tmp_path, steps=10)
    assert len(reports) == 10 and sink.url is None
    assert f"metrics endpoint 127.0.0.1:{port}" in caplog.text
    (s,) = sink.metrics.snapshot().runs
    assert s.last_step == reports[-1].step  # the numbers are kept; only the endpoint is missing


def test_prometheus_sink_serves_on_rank_0_only():
    from nummon import RunContext

    other = PrometheusSink("127.0.0.1:0")
    other.bind(RunContext(rank=1, world_size=2))
    assert other.url is None
    zero = PrometheusSink("127.0.0.1:0")
    zero.bind(RunContext(rank=0, world_size=2))
    try:
        assert zero.url is not None and zero.run == f"pid{os.getpid()}"
    finally:
        zero.close()


@pytest.mark.slow
def test_lightning_callback_accepts_the_prometheus_sink(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from helpers.lightning_runs import fit

    from nummon.integrations.lightning import NummonLightningCallback

    sink = PrometheusSink("127.0.0.1:0", run="pl-run")
    fit(tmp_path, [NummonLightningCallback(sinks=[sink])], runaway=True, steps=28)
    (s,) = sink.metrics.snapshot().runs
    assert s.run == "pl-run" and s.last_step is not None and s.last_step >= 5  # the callback stops it early
    assert s.steps_to_overflow is not None and s.steps_to_overflow > 0
    assert s.incidents_total >= 1 and s.incident >= 1 and s.open is False
    assert sink.url is None  # closed with the run


def test_missing_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"nummon\[prometheus\]"):
        PrometheusSink("127.0.0.1:0")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--metrics", "nohost"], "--metrics: 'nohost': expected HOST:PORT"),
        (["--metrics", "127.0.0.1:99999"], "expected HOST:PORT"),
        (["--shard", "2/2"], "--shard 2/2: expected I/N with 0 <= I < N"),
        (["--shard", "x"], "--shard 'x': expected I/N"),
    ],
)
def test_bad_metrics_or_shard_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    from helpers.watching import watch_main as main

    (tmp_path / "log.jsonl").write_text("")
    rc = main([str(tmp_path), "--once"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


# --- the real Prometheus -----------------------------------------------------------------------


def start_shard(root, shard, tmp_path):
    proc = subprocess.Popen(
        WATCH
        + [
            str(root),
            "--shard",
            shard,
            "--metrics",
            "127.0.0.1:0",
            "--interval",
            "0.2",
            "--notify",
            f"jsonl:{tmp_path / ('notes-' + shard.replace('/', 'of') + '.jsonl')}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    for line in proc.stderr:  # the first line names the endpoint
        m = re.search(r"serving metrics at http://([\d.]+:\d+)/metrics", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # never let the pipe fill
            return proc, m.group(1)
    raise AssertionError(f"shard {shard} did not start: exit {proc.wait()}")


@pytest.mark.slow
def test_prometheus_scrapes_two_shards_each_run_once_and_the_nonfinite_rule_fires(tmp_path):
    root = tmp_path / "runs"
    n = 24
    for i in range(n):
        write_log(root / f"team-{i % 3}" / f"run-{i:03d}" / "events.jsonl", rows(40, runaway_at=10**9))
    lost = root / "team-0" / "run-lost" / "events.jsonl"
    write_log(lost, rows(40, runaway_at=30, nan_at=38))
    shards = []
    try:
        shards = [start_shard(root, s, tmp_path) for s in ("0/2", "1/2")]
        prom = start_prometheus(tmp_path, [addr for _, addr in shards], rules=[CONFIGS / "nummon-rules.yml"])
        try:
            # every run is scraped, and from exactly one shard
            wait_for(
                lambda: (
                    prom_query(prom, "count(nummon_last_step)")
                    and int(float(prom_query(prom, "count(nummon_last_step)")[0]["value"][1])) == n + 1
                ),
                60,
                "every run in Prometheus",
            )
            per_run = prom_query(prom, "count by (run) (nummon_last_step)")
            assert len(per_run) == n + 1 and {r["value"][1] for r in per_run} == {"1"}
            per_shard = prom_query(prom, "sum by (instance) (nummon_watch_runs)")
            assert sorted(int(float(r["value"][1])) for r in per_shard) != [0, n + 1]  # both shards hold runs
            assert sum(int(float(r["value"][1])) for r in per_shard) == n + 1
            # the shipped rules are loaded and the lost run's rule fires, for that run only
            firing = wait_for(lambda: prom_alerts(prom, "NummonRunNonFinite"), 60, "NummonRunNonFinite to fire")
            assert [a["labels"]["run"] for a in firing] == [str(lost)]
            assert firing[0]["labels"]["severity"] == "critical"
            assert not prom_alerts(prom, "NummonWatchDeliveryFailing")
        finally:
            prom.stop()
    finally:
        for proc, _ in shards:
            proc.terminate()
            proc.wait(30)


def test_metrics_port_in_use_exits_2_naming_it(tmp_path, capsys):
    import socket

    from helpers.watching import watch_main as main

    (tmp_path / "log.jsonl").write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main([str(tmp_path), "--once", "--metrics", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--metrics: metrics endpoint 127.0.0.1:{port}:" in err and len(err.strip().splitlines()) == 1

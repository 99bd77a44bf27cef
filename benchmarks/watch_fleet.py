"""Fleet load of `nummon watch`: 1,000 runs under one root, watched by one watcher, or by 4
shards of 250 (`--shard I/4`), each with `--metrics` and `--notify alertmanager:URL` (a real
Alertmanager when `prometheus-alertmanager` is installed) plus a JSONL record of its events.

Every run (TensorBoard, HF trainer_state.json, Lightning CSV, nummon JSONL, mixed) logs one
step per second. While it runs, /metrics of every watcher is scraped every 5 seconds (time per
scrape, bytes, series); a non-finite step is planted in a few runs and the delay from its write
to the watcher's JSONL event and to the alert in Alertmanager's API is measured. CPU time and
peak memory come from the kernel's rusage of each watcher process. Configurations run
interleaved (one, shards, shards, one, ...) so the shared machine's load falls on both.

    flock /work/bench.lock python benchmarks/watch_fleet.py [--runs 1000] [--shards 4] [--seconds 90] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from watch_load import KINDS, JsonlRun, healthy  # noqa: E402

__all__ = ["main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_alertmanager(tmp: Path) -> tuple[subprocess.Popen | None, str | None]:
    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if not exe:
        return None, None
    port = free_port()
    cfg = tmp / "am.yml"
    cfg.write_text("route: {receiver: none, group_wait: 1s}\nreceivers: [{name: none}]\n")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={cfg}",
            f"--storage.path={tmp / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/-/ready", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    return None, None


def am_runs(url: str) -> set[str]:
    q = urllib.parse.urlencode({"filter": 'alertname="NummonIncident"'})
    with urllib.request.urlopen(f"{url}/api/v2/alerts?{q}", timeout=5) as r:
        return {a["labels"]["run"] for a in json.loads(r.read())}


def start_watchers(root: Path, tmp: Path, shards: int, am_url: str | None, interval: float):
    procs = []
    for i in range(shards):
        cmd = [
            sys.executable,
            "-m",
            "nummon",
            "watch",
            str(root),
            "--interval",
            str(interval),
            "--metrics",
            "127.0.0.1:0",
            "--state",
            str(tmp / f"state-{i}.json"),
            "--notify",
            f"jsonl:{tmp / f'notes-{i}.jsonl'}",
        ]
        if shards > 1:
            cmd += ["--shard", f"{i}/{shards}"]
        if am_url:
            cmd += ["--notify", f"alertmanager:{am_url}"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        addr = None
        for line in p.stderr:
            m = re.search(r"serving metrics at (http://\S+)", line)
            if m:
                addr = m.group(1)
                break
        threading.Thread(target=p.stderr.read, daemon=True).start()
        procs.append((p, addr))
    return procs


def scrape(url: str) -> tuple[float, int, int]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    dt = time.perf_counter() - t
    return dt, len(body), sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def one_round(args, shards: int, am_url: str | None, tag: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"nummon-fleet-{tag}-"))
    root = tmp / "runs"
    runs = [KINDS[i % len(KINDS)](root / f"team-{i % 10}" / f"run{i:04d}") for i in range(args.runs)]
    for i, r in enumerate(runs):
        for s in range(args.history):
            r.log(s, *healthy(s, i))
        r.flush()
    planted = [i for i, r in enumerate(runs) if isinstance(r, JsonlRun)][:: max(1, args.runs // 4 // args.plants)][
        : args.plants
    ]
    plant_at = {i: args.seconds * (0.35 + 0.5 * k / max(1, len(planted))) for k, i in enumerate(planted)}
    t0 = time.monotonic()
    procs = start_watchers(root, tmp, shards, am_url, args.interval)
    step, scrapes, written, seen_jsonl, seen_am = args.history, [], {}, {}, {}
    notes = [tmp / f"notes-{i}.jsonl" for i in range(shards)]
    run_id = {i: str(runs[i].fh.name) for i in planted}
    done = threading.Event()

    def scraper() -> None:  # every watcher's /metrics every 5 s, as a Prometheus would
        while not done.wait(5.0):
            for _, url in procs:
                if url:
                    try:
                        scrapes.append(scrape(url))
                    except OSError:
                        pass

    def delays() -> None:  # from each planted write to its event and to its alert, every 50 ms
        while not done.is_set() or (len(seen_jsonl) < len(written) and time.monotonic() - t0 < args.seconds + 60):
            for i, t in list(written.items()):
                if i not in seen_jsonl:
                    text = "".join(n.read_text() for n in notes if n.exists()).replace(" ", "")
                    if any(f'"run":"{run_id[i]}"' in line and '"nonfinite"' in line for line in text.splitlines()):
                        seen_jsonl[i] = time.time() - t
                if am_url and i not in seen_am:
                    try:
                        if run_id[i] in am_runs(am_url):
                            seen_am[i] = time.time() - t
                    except OSError:
                        pass
            time.sleep(0.05)

    threads = [threading.Thread(target=scraper, daemon=True), threading.Thread(target=delays, daemon=True)]
    for t in threads:
        t.start()
    ticks, tick_s = 0, []
    while time.monotonic() - t0 < args.seconds:  # every run logs one step per second (when the writer keeps up)
        tick = time.monotonic()
        for i, r in enumerate(runs):
            if i in plant_at and i not in written and tick - t0 >= plant_at[i]:
                r.log(step, math.nan, math.inf)
                r.flush()
                written[i] = time.time()
                continue
            r.log(step, *healthy(step, i))
            r.flush()
        step += 1
        ticks += 1
        tick_s.append(time.monotonic() - tick)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    done.set()
    threads[1].join()
    time.sleep(args.interval + 1)
    usage = []
    for p, _ in procs:
        p.send_signal(signal.SIGTERM)
        _, status, ru = os.wait4(p.pid, 0)
        usage.append((ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)))
    wall = time.monotonic() - t0
    watched = 0
    for i in range(shards):
        f = tmp / f"state-{i}.json"
        if f.exists():
            watched += len(json.loads(f.read_text())["runs"])
    times = [s[0] for s in scrapes]
    result = {
        "config": f"{shards} x {args.runs // shards}" if shards > 1 else f"1 x {args.runs}",
        "runs": args.runs,
        "runs_in_state_files": watched,
        "wall_s": round(wall, 1),
        "cpu_s_total": round(sum(u[0] for u in usage), 1),
        "cpu_percent_of_one_core_total": round(100 * sum(u[0] for u in usage) / wall, 1),
        "cpu_s_per_watcher_max": round(max(u[0] for u in usage), 1),
        "peak_rss_mb_per_watcher_max": round(max(u[1] for u in usage), 1),
        "peak_rss_mb_total": round(sum(u[1] for u in usage), 1),
        "scrapes": len(times),
        "scrape_s_median": round(statistics.median(times), 4) if times else None,
        "scrape_s_max": round(max(times), 4) if times else None,
        "scrape_kb_median": round(statistics.median(s[1] for s in scrapes) / 1024, 1) if scrapes else None,
        "series_per_scrape_median": statistics.median(s[2] for s in scrapes) if scrapes else None,
        "writer_ticks": ticks,
        "writer_tick_s_median": round(statistics.median(tick_s), 2),
        "planted": len(written),
        "delay_to_event_s": sorted(round(v, 2) for v in seen_jsonl.values()),
        "delay_to_alertmanager_s": sorted(round(v, 2) for v in seen_am.values()),
        "exit_codes": sorted({u[2] for u in usage}),
    }
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--history", type=int, default=200, help="steps each run already has when the watchers start")
    ap.add_argument(
        "--interval", type=float, default=5.0, help="the watchers' --interval (default: 5, as nummon watch)"
    )
    ap.add_argument("--plants", type=int, default=4, help="runs that get a non-finite step")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both configurations (order ABBA...)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="nummon-fleet-am-"))
    am, am_url = start_alertmanager(tmp)
    results = []
    try:
        order = []
        for r in range(args.rounds):
            order += [1, args.shards] if r % 2 == 0 else [args.shards, 1]
        for k, shards in enumerate(order):
            res = one_round(args, shards, am_url, f"{k}")
            print(json.dumps(res), flush=True)
            results.append(res)
    finally:
        if am is not None:
            am.terminate()
            am.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load test of `nummon watch`: N runs under one root (TensorBoard, HF trainer_state.json,
Lightning metrics.csv and nummon JSONL, mixed), each logging one step per second, polled every
second by one watcher process. Reports the watcher's CPU time and peak memory (from the kernel's
rusage of the child), records read and notifications sent.

    python benchmarks/watch_load.py [--runs 50] [--seconds 60] [--history 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]


class TbRun:
    def __init__(self, folder: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.w = EventFileWriter(str(folder))

    def log(self, step: int, loss: float, gn: float) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        vals = [
            summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in (("train/loss", loss), ("train/grad_norm", gn))
        ]
        self.w.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary_pb2.Summary(value=vals)))

    def flush(self) -> None:
        self.w.flush()


class HfRun:
    def __init__(self, folder: Path) -> None:
        self.folder, self.hist = folder, []

    def log(self, step: int, loss: float, gn: float) -> None:
        self.hist.append({"epoch": step / 1000, "grad_norm": gn, "learning_rate": 1e-4, "loss": loss, "step": step})

    def flush(self) -> None:  # Trainer-style save: the whole file rewritten
        ckpt = self.folder / "checkpoint-1000"  # one checkpoint folder, rewritten at each save
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "trainer_state.json").write_text(
            json.dumps({"global_step": self.hist[-1]["step"], "log_history": self.hist}, indent=2)
        )


class CsvRun:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.csv"
        self.path.write_text("grad_norm,step,train_loss\n")
        self.buf: list[str] = []

    def log(self, step: int, loss: float, gn: float) -> None:
        self.buf.append(f"{gn},{step},{loss}\n")

    def flush(self) -> None:
        with open(self.path, "a") as fh:
            fh.write("".join(self.buf))
        self.buf = []


class JsonlRun:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.fh = open(folder / "events.jsonl", "a")

    def log(self, step: int, loss: float, gn: float) -> None:
        self.fh.write(json.dumps({"type": "step", "step": step, "loss": loss, "grad_norm": gn}) + "\n")

    def flush(self) -> None:
        self.fh.flush()


KINDS = (TbRun, HfRun, CsvRun, JsonlRun)


def healthy(step: int, i: int) -> tuple[float, float]:
    return (0.5 + 3.0 * math.exp(-step / 200)) * (1 + 0.02 * math.sin(step + i)), 1.0 + 0.05 * math.sin(0.3 * step + i)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--history", type=int, default=1000, help="steps each run already has when the watcher starts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="nummon-watch-load-"))
    root = tmp / "runs"
    runs = [KINDS[i % len(KINDS)](root / f"run{i:03d}") for i in range(args.runs)]
    for i, r in enumerate(runs):
        for s in range(args.history):
            r.log(s, *healthy(s, i))
        r.flush()
    state, notes = tmp / "state.json", tmp / "notes.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "nummon",
        "watch",
        str(root),
        "--interval",
        "1",
        "--state",
        str(state),
        "--notify",
        f"jsonl:{notes}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    step = args.history
    while time.monotonic() - t0 < args.seconds:  # every run logs one step per second
        for i, r in enumerate(runs):
            r.log(step, *healthy(step, i))
            r.flush()
        step += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))
    time.sleep(2.0)  # let the last poll see the last step
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    err = proc.stderr.read()
    saved = json.loads(state.read_text())["runs"] if state.exists() else {}
    result = {
        "runs": args.runs,
        "runs_watched": len(saved),
        "seconds": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "cpu_percent_of_one_core": round(100 * (usage.ru_utime + usage.ru_stime) / wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "records_read": sum(r.get("records", 0) for r in saved.values()),
        "records_written": args.runs * step,
        "notifications": len(notes.read_text().splitlines()) if notes.exists() else 0,
        "state_file_kb": round(state.stat().st_size / 1024, 1) if state.exists() else 0,
        "exit_status": os.waitstatus_to_exitcode(status),
    }
    print(json.dumps(result, indent=2))
    if err.strip():
        print(err, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if os.environ.get("KEEP"):
        print(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

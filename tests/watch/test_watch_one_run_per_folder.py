"""The logs one run writes into one folder are one run: where a folder holds nummon's own event
log, the same run's TensorBoard and W&B logs there are not watched as runs of their own (one
incident, one set of notifications), and the watcher's first lines say which log it reads."""

import os
import subprocess
import sys

from helpers.log_writers import runaway_rows, write_jsonl, write_tensorboard
from helpers.watching import read_events, reference_ids

from nummon import load_policy
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher

WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_X_DISABLE_STATS": "true",
}


def _demo(root):
    """The demo's own folder, as a user gets it (every sink; hermetic offline W&B)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"} | WANDB_ENV
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        (root / var.lower()).mkdir()
        env[var] = str(root / var.lower())
    out = root / "run"
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert any(out.glob("tensorboard/*/events.out.tfevents.*")) and any(out.glob("wandb/offline-run-*/run-*.wandb"))
    return out


def test_the_demo_folder_is_watched_as_one_run_from_its_event_log(tmp_path):
    out = _demo(tmp_path)
    notes = tmp_path / "notes.jsonl"
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "watch", "--once", str(out), "--notify", f"jsonl:{notes}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    events = read_events(notes)
    assert {e["run"] for e in events} == {str(out / "events.jsonl")}
    assert [e["id"] for e in events] == reference_ids(out / "events.jsonl")
    lines = p.stderr.splitlines()
    assert lines[0].startswith(f"nummon watch: watching 1 run under {out} (jsonl)")
    assert lines[1] == (
        "nummon watch:   run events.jsonl (jsonl: nummon's own log, read in place of the same run's "
        "tensorboard and wandb logs in its folder)"
    )


def test_a_log_watched_before_its_runs_event_log_appeared_gives_way_to_it(tmp_path):
    rows = runaway_rows()
    run = tmp_path / "run"
    write_tensorboard(run / "tensorboard", rows[:20])
    notes, err = tmp_path / "notes.jsonl", tmp_path / "err.txt"
    with open(err, "w") as fh:
        w = Watcher([str(run)], load_policy("default"), [JsonlTarget(str(notes))], errors=fh)
        w.poll_once()
        assert [r.follower.format for r in w.runs.values()] == ["tensorboard"]
        write_jsonl(run / "events.jsonl", rows)
        w.poll_once(final=True)
        w.close()
    assert list(w.specs) == [str(run / "events.jsonl")]
    assert {e["run"] for e in read_events(notes)} == {str(run / "events.jsonl")}
    assert "run tensorboard: the same run as events.jsonl" in err.read_text()

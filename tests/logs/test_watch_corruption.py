"""What `nummon watch` / `replay` read from damaged, rewritten, rotated and re-run logs:
real TensorBoard event files and W&B offline runs written by their own packages,
real trainer_state.json and metrics.csv, each damaged as disks, killed writers and people do."""

import json
import math
import os
import subprocess
import sys

import pytest
from helpers.log_writers import hf_history, write_hf_run, write_tensorboard, write_wandb_records
from helpers.watching import read_events, two_incident_rows, write_lines

from nummon import load_policy
from nummon._watch import read_records
from nummon._watch.settings import WatchSettings
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher

CLI = [sys.executable, "-m", "nummon"]


def healthy(n, start=0):
    return [
        {
            "type": "step",
            "step": s,
            "loss": 2.0 * 0.99**s * (1 + 0.03 * math.sin(1.3 * s)),
            "grad_norm": 1 + 0.1 * math.sin(s),
        }
        for s in range(start, start + n)
    ]


def nan_at(rows, step):
    for r in rows:
        if r["step"] == step:
            r["loss"], r["grad_norm"] = math.nan, math.inf
    return rows


def watcher(root, tmp_path, **kw):
    notes = tmp_path / "notes.jsonl"
    errors = open(tmp_path / "watch.err", "a")
    return Watcher(
        [str(root)],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(exclude=frozenset({str(notes)}), **kw),
        errors=errors,
    ), notes


def nonfinite_events(notes):
    return [e for e in read_events(notes) if e["state"] == "nonfinite"]


def stderr_of(tmp_path):
    return (tmp_path / "watch.err").read_text()


# --- a step that is not an integer is that row's problem, never the watcher's exit --------


def _hf_state(rows_extra):
    rows = [(s, 1.0, 1.0) for s in range(30)]
    hist = hf_history(rows)
    hist += rows_extra
    hist += [{"loss": float("nan"), "grad_norm": float("inf"), "step": 40}]
    return {"log_history": hist, "global_step": 40}


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "1e400"])
def test_hf_step_that_is_not_an_integer_skips_the_row(tmp_path, bad):
    out = tmp_path / "out"
    out.mkdir()
    text = json.dumps(_hf_state([{"loss": 1.0, "step": 0.5}])).replace('"step": 0.5', f'"step": {bad}')
    (out / "trainer_state.json").write_text(text)
    recs = list(read_records(str(out)))
    assert recs[-1].step == 40 and math.isnan(recs[-1].loss)
    p = subprocess.run(CLI + ["replay", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "nonfinite" in p.stdout


def test_csv_step_inf_and_wandb_bad_step_do_not_stop_the_other_runs(tmp_path):
    root = tmp_path / "root"
    (root / "csv").mkdir(parents=True)
    (root / "csv" / "metrics.csv").write_text("step,train_loss\n0,1.0\ninf,1.0\nnan,1.0\n2,1.0\n")
    good = root / "good" / "events.jsonl"
    good.parent.mkdir()
    write_lines(good, two_incident_rows())
    (root / "wb").mkdir()
    write_wandb_records(
        root / "wb" / "run-bad.wandb",
        [
            [("_step", "0"), ("train/loss", "1.0")],
            [("_step", '"NaN"'), ("train/loss", "1.0")],
            [("_step", "2"), ("train/loss", "{not json")],
            [("_step", "3"), ("train/loss", "NaN")],
        ],
    )
    w, notes = watcher(root, tmp_path)
    w.poll_once(final=True)
    w.close()
    assert len([e for e in read_events(notes) if e["run"] == str(good)]) == 6  # the good run fully watched
    err = stderr_of(tmp_path)
    assert "is not an integer" in err and "Traceback" not in err
    assert [r.step for r in read_records(str(root / "csv" / "metrics.csv"))] == [0, 2]
    assert [r.step for r in read_records(str(root / "wb" / "run-bad.wandb"))] == [0, 3]  # step 2 holds no number


# --- a JSONL log rewritten in place or rotated --------------------------------------------


def test_jsonl_rewritten_in_place_is_read_again(tmp_path):
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    write_lines(log, healthy(100))
    w, notes = watcher(tmp_path / "run", tmp_path)
    w.poll_once()
    write_lines(log, nan_at(healthy(300), 20))  # same name, same inode, longer: the old offset lies inside
    w.poll_once()
    w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [20]
    assert "rewritten in place" in stderr_of(tmp_path)


def test_jsonl_rotated_is_read_from_the_new_file_start(tmp_path):
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    write_lines(log, healthy(100))
    w, notes = watcher(tmp_path / "run", tmp_path)
    w.poll_once()
    os.rename(log, str(log) + ".1")
    write_lines(log, nan_at(healthy(130, start=100), 120))
    w.poll_once()
    w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [120]
    assert "replaced by a new file" in stderr_of(tmp_path)


# --- a Hugging Face run re-run into the same output_dir -----------------------------------


@pytest.mark.slow
def test_hf_rerun_into_the_same_output_dir_is_watched(tmp_path):
    out = tmp_path / "out"
    old = [(s, 2.0 * 0.99**s, 1.0) for s in range(501)]
    write_hf_run(out, old, save_every=100)
    w, notes = watcher(out, tmp_path)
    w.poll_once()
    new = [(s, 2.0 * 0.99**s, 1.0) for s in range(100)] + [(100, math.nan, math.inf)]
    (out / "trainer_state.json").write_text(json.dumps({"log_history": hf_history(new), "global_step": 100}))
    w.poll_once()
    w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [100]
    assert "a new run in the same output folder" in stderr_of(tmp_path)


# --- a second TensorBoard run written into the same logdir --------------------------------


def test_second_tensorboard_run_in_the_same_logdir_is_watched(tmp_path):
    logdir = tmp_path / "tb"
    write_tensorboard(logdir, [(s, 2.0 * 0.99**s, 1.0) for s in range(200)])
    w, notes = watcher(logdir, tmp_path)
    w.poll_once()
    write_tensorboard(logdir, [(s, 2.0 * 0.99**s, 1.0) for s in range(50)] + [(50, math.nan, math.inf)])
    w.poll_once()
    w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [50]
    assert "a new segment" in stderr_of(tmp_path)


# --- TensorBoard records flipped and cut --------------------------------------------------


@pytest.fixture(scope="module")
def long_tb(tmp_path_factory):
    """A real event file: 2500 healthy steps, then NaN at step 2500."""
    logdir = tmp_path_factory.mktemp("tb") / "run"
    rows = [(s, 2.0 * 0.999**s * (1 + 0.02 * math.sin(s)), 1.0 + 0.1 * math.sin(s)) for s in range(2500)]
    write_tensorboard(logdir, rows + [(2500, math.nan, math.inf)])
    return next(logdir.glob("events.out.tfevents.*"))


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _replay(path):
    return subprocess.run(CLI + ["replay", str(path)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_tensorboard_flipped_byte_is_skipped_named_and_the_nan_still_found(long_tb, tmp_path):
    bad = tmp_path / "tb" / long_tb.name
    bad.parent.mkdir()
    bad.write_bytes(long_tb.read_bytes())
    _flip(bad, bad.stat().st_size // 2)  # mid-file, before the NaN at step 2500
    p = _replay(bad.parent)
    assert p.returncode == 0, p.stderr
    assert "corrupt record" in p.stderr and "at byte" in p.stderr and "Traceback" not in p.stderr
    assert "nonfinite" in p.stdout and "step 2500" in p.stdout
    w, notes = watcher(bad.parent, tmp_path)
    for _ in range(3):  # the watcher confirms a bad record once, then skips it (never stuck on it)
        w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [2500]


@pytest.mark.slow
def test_tensorboard_file_cut_by_7_bytes_warns_of_a_torn_tail(long_tb, tmp_path):
    cut = tmp_path / "tb" / long_tb.name
    cut.parent.mkdir()
    cut.write_bytes(long_tb.read_bytes()[:-7])
    p = _replay(cut.parent)
    assert p.returncode == 0 and "last record torn at byte" in p.stderr


# --- W&B blocks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """A real offline W&B run of more than 4 blocks (32 KiB each), NaN in the last block."""
    from helpers.log_writers import write_wandb

    base = tmp_path_factory.mktemp("wandb")
    env = {
        v: str(base / v.lower())
        for v in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")
    }
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONSOLE="off",
        WANDB_DISABLE_GIT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_X_DISABLE_STATS="true",
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            os.makedirs(v, exist_ok=True) if k != "WANDB_MODE" and "/" in v else None
            mp.setenv(k, v)
        mp.delenv("WANDB_API_KEY", raising=False)
        rows = [(s, 2.0 * 0.999**s, 1.0) for s in range(900)] + [(900, math.nan, math.inf)]
        f = write_wandb(rows)
    assert f.stat().st_size > 4 * 32768
    return f


@pytest.mark.slow
def test_wandb_flipped_byte_in_block_0_resumes_at_the_next_block(wandb_run, tmp_path):
    bad = tmp_path / wandb_run.name
    bad.write_bytes(wandb_run.read_bytes())
    _flip(bad, 20000)
    p = _replay(bad)
    assert p.returncode == 0, p.stderr
    assert "corrupt chunk at byte" in p.stderr and "next block at byte 32768" in p.stderr
    assert "nonfinite" in p.stdout and "step 900" in p.stdout


@pytest.mark.slow
def test_wandb_file_cut_mid_record_warns_of_a_torn_tail(wandb_run, tmp_path):
    cut = tmp_path / wandb_run.name
    data = wandb_run.read_bytes()
    cut.write_bytes(data[: len(data) - 40])
    p = _replay(cut)
    assert p.returncode == 0 and "last record torn at byte" in p.stderr


# --- a trainer_state.json caught half-written ---------------------------------------------


def test_half_written_trainer_state_is_read_once_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows = [(s, 2.0 * 0.99**s, 1.0) for s in range(60)] + [(60, math.nan, math.inf)]
    text = json.dumps({"log_history": hf_history(rows), "global_step": 60})
    (out / "trainer_state.json").write_text(text[: len(text) // 2])
    w, notes = watcher(out, tmp_path)
    for _ in range(3):
        w.poll_once()
    (out / "trainer_state.json").write_text(text)
    w.poll_once()
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [60]


# --- a long backlog streams in bounded memory ---------------------------------------------

PEAK = r"""
import resource, subprocess, sys
subprocess.run([sys.executable, "-m", "nummon", "watch", sys.argv[1], "--once", "--notify", "jsonl:" + sys.argv[2]],
               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB on Linux
"""


def _peak_kib(tmp_path, log):
    p = subprocess.run(
        [sys.executable, "-c", PEAK, str(log), str(tmp_path / f"{log.stem}.notes.jsonl")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip())


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_watch_once_over_a_long_log_holds_a_bounded_part_of_it(tmp_path):
    """Twice the backlog, the same peak: what is held does not grow with the log (it used to
    grow by several times the log's size)."""
    pad = "x" * 4000  # long lines: many bytes, few records, so the test stays quick
    half, full = tmp_path / "half.jsonl", tmp_path / "full.jsonl"
    for path, n in ((half, 6000), (full, 12000)):  # ~24 MB and ~48 MB
        with open(path, "w") as fh:
            for r in healthy(n):
                fh.write(json.dumps({**r, "pad": pad}) + "\n")
    extra = full.stat().st_size - half.stat().st_size
    grown = _peak_kib(tmp_path, full) - _peak_kib(tmp_path, half)
    assert extra > 22e6
    assert grown * 1024 < extra / 4, f"peak grew {grown} KiB for {extra >> 20} MiB more log"


def test_csv_replaced_while_the_watcher_was_down_is_read_again(tmp_path):
    """The saved position of a metrics.csv carries the file's identity: a file replaced between
    two watcher processes is read from its start (its NaN found), not from the old offset."""
    d = tmp_path / "run"
    d.mkdir()
    csv_path = d / "metrics.csv"
    csv_path.write_text("step,train_loss\n" + "".join(f"{s},{2.0 * 0.99**s}\n" for s in range(100)))
    state = tmp_path / "s.json"
    w, notes = watcher(d, tmp_path, state_path=str(state))
    w.poll_once(final=True)
    w.close()
    new = d / "metrics.csv.new"
    new.write_text("step,train_loss\n" + "".join(f"{s},{2.0 * 0.99**s if s != 20 else 'nan'}\n" for s in range(150)))
    os.replace(new, csv_path)
    w, notes = watcher(d, tmp_path, state_path=str(state))
    w.poll_once(final=True)
    w.close()
    assert [e["step"] for e in nonfinite_events(notes)] == [20]
    assert "replaced by a new file" in stderr_of(tmp_path)

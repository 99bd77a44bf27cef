"""Readers of `nummon watch` / `replay`: every format gives the same alerts as the equivalent
nummon JSONL trace; incremental polls see only new records; half-written tails are read again;
a file that is not a log is named in one line."""

import shutil
from pathlib import Path

import pytest
from helpers.log_writers import (
    LR,
    csv_logger,
    runaway_rows,
    write_csv,
    write_hf_checkpoint,
    write_hf_run,
    write_jsonl,
    write_tensorboard,
    write_wandb,
)

from nummon import load_policy, replay
from nummon._engine.engine import HealthEngine
from nummon._watch import KeyMap, NotALogError, make_follower, read_records


def alerts_of(records):
    engine = HealthEngine(load_policy("default"))
    out = []
    for rec in records:
        out.extend(a.to_dict() for a in engine.step(rec).alerts)
    return out


@pytest.fixture(scope="module")
def rows():
    return runaway_rows()


@pytest.fixture(scope="module")
def reference(rows, tmp_path_factory):
    """Alerts of `nummon replay` over the plain JSONL trace of the same run."""
    trace = write_jsonl(tmp_path_factory.mktemp("ref") / "trace.jsonl", rows, with_alert_lines=False)
    alerts = [a.to_dict() for a in replay(trace)]
    assert any(a["kind"] == "runaway" for a in alerts) and any(a["kind"] == "nonfinite" for a in alerts)
    return alerts


def test_jsonl_event_log_skips_alert_lines(rows, reference, tmp_path):
    log = write_jsonl(tmp_path / "events.jsonl", rows, with_alert_lines=True)
    recs = list(read_records(str(log)))
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert alerts_of(recs) == reference


@pytest.mark.slow
def test_tensorboard_same_alerts_as_jsonl(rows, reference, tmp_path):
    logdir = write_tensorboard(tmp_path / "tb", rows)
    recs = list(read_records(str(logdir)))
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert recs[0].lr == LR and recs[0].loss == rows[0][1]
    assert alerts_of(recs) == reference


def test_hf_trainer_state_same_alerts_and_nan_literals(rows, reference, tmp_path):
    out = write_hf_run(tmp_path / "out", rows)
    newest = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))[-1]
    assert "NaN" in newest.read_text()  # transformers writes bare NaN / Infinity literals
    recs = list(read_records(str(out)))  # the lineage: checkpoint-*/trainer_state.json
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert alerts_of(recs) == reference
    assert alerts_of(read_records(str(newest))) == reference  # one file given directly


@pytest.mark.slow
def test_lightning_csv_same_alerts(rows, reference, tmp_path):
    csv = write_csv(tmp_path / "logs", rows)
    recs = list(read_records(str(csv)))
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert alerts_of(recs) == reference


@pytest.mark.slow
def test_wandb_offline_run_same_alerts(rows, reference, wandb_env):
    run_file = write_wandb(rows)
    recs = list(read_records(str(run_file)))
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert alerts_of(recs) == reference


def _poll_all(follower, final=False):
    got = follower.poll(final=final)
    return [(r.step, r.loss) for r in got]


def test_tensorboard_incremental_and_half_written_record(rows, tmp_path):
    whole = write_tensorboard(tmp_path / "whole", rows)
    src = next(whole.glob("events.out.tfevents.*"))
    data = src.read_bytes()
    live = tmp_path / "live"
    live.mkdir()
    dst = live / src.name
    f = None
    seen = []
    cut = 0
    for frac in (0.3, 0.3001, 0.62, 0.9):  # each cut lands inside a record
        new = int(len(data) * frac)
        with open(dst, "ab") as fh:
            fh.write(data[cut:new])
        cut = new
        f = f or make_follower(str(live))
        seen += _poll_all(f)
    with open(dst, "ab") as fh:
        fh.write(data[cut:])
    seen += _poll_all(f)
    seen += _poll_all(f)  # a quiet poll completes the held-back last step
    expect = [(r.step, r.loss) for r in read_records(str(whole))]
    assert len(seen) == len(expect) and [s for s, _ in seen] == [s for s, _ in expect]


def test_tensorboard_position_restores_in_a_new_follower(rows, tmp_path):
    logdir = write_tensorboard(tmp_path / "tb", rows[:20])
    f1 = make_follower(str(logdir))
    first = f1.poll() + f1.poll()
    pos = f1.position()
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(logdir))  # a second event file, as after a training restart
    for s, loss, _g in rows[20:]:
        w.add_scalar("train/loss", loss, s)
    w.close()
    f2 = make_follower(str(logdir))
    f2.restore(pos)
    rest = f2.poll(final=True)
    assert [r.step for r in first + rest] == [s for s, _, _ in rows]


def test_jsonl_truncated_last_line_is_read_next_poll(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"type": "step", "step": 0, "loss": 1.0}\n{"type": "step", "st')
    f = make_follower(str(log))
    assert [r.step for r in f.poll()] == [0]
    with open(log, "a") as fh:
        fh.write('ep": 1, "loss": 2.0}\n')
    assert [(r.step, r.loss) for r in f.poll()] == [(1, 2.0)]


def test_csv_header_rewrite_keeps_reading_without_repeats(tmp_path):
    logger = csv_logger(tmp_path)
    f = None
    seen = []
    for s in range(12):
        metrics = {"train_loss": 1.0 + s}
        if s >= 5:  # new keys: CSVLogger rewrites the whole file with a new header
            metrics["grad_norm"] = 0.5
        if s >= 9:
            metrics["val_loss"] = 3.0
        logger.log_metrics(metrics, step=s)
        if f is None:
            f = make_follower(str(Path(logger.log_dir) / "metrics.csv"))
        seen += f.poll()
    seen += f.poll()
    assert [r.step for r in seen] == list(range(12))
    assert seen[4].grad_norm is None and seen[7].grad_norm == 0.5
    assert "val_loss" in (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0]


def test_hf_lineage_rewritten_at_each_save(rows, tmp_path):
    out = tmp_path / "out"
    f = None
    seen = []
    for upto in (10, 20, 30):
        write_hf_checkpoint(out, rows, upto)
        if upto == 30:  # save_total_limit: the oldest checkpoint goes
            shutil.rmtree(out / "checkpoint-10")
        f = f or make_follower(str(out))
        seen += f.poll()
    (out / "checkpoint-30" / "trainer_state.json").write_text('{"log_history": [{"loss": 1')  # mid-rewrite
    seen += f.poll()
    write_hf_checkpoint(out, rows, 30)
    assert [r.step for r in seen] == list(range(31))
    assert f.poll() == []


def test_wandb_half_written_file_reads_on(rows, wandb_env, tmp_path):
    run_file = write_wandb(rows)
    data = run_file.read_bytes()
    live = tmp_path / "run-live.wandb"
    f = None
    seen = []
    cut = 0
    for frac in (0.01, 0.25, 0.5, 0.75, 1.0):
        new = max(8, int(len(data) * frac))
        with open(live, "ab") as fh:
            fh.write(data[cut:new])
        cut = new
        f = f or make_follower(str(live))
        seen += f.poll()
    assert [r.step for r in seen] == [s for s, _, _ in rows]


@pytest.mark.parametrize(
    "name,content",
    [
        ("notes.csv", "a,b\n1,2\n"),
        ("trainer_state.json", '{"global_step": 3}'),
        ("events.out.tfevents.123.host", "this is not an event file at all"),
        ("run-abc.wandb", "plain text"),
        ("data.jsonl", "not json\n"),
        ("README", "hello\n"),
    ],
)
def test_not_a_log_names_the_file(tmp_path, name, content):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(NotALogError) as e:
        list(read_records(str(p)))
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_key_map_extends_and_validates():
    km = KeyMap({"my/loss": "loss"})
    assert km.record(3, {"my/loss": "NaN", "eval_loss": 1.0}).loss != km.record(3, {"my/loss": 1}).loss
    assert km.record(3, {"eval_loss": 1.0}) is None  # an eval-only row measures nothing
    with pytest.raises(ValueError, match="field must be one of"):
        KeyMap({"x": "not_a_field"})


def test_fsspec_memory_urls(rows):
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    with mem.open("/watchroot/a/trace.jsonl", "w") as fh:
        for s, loss, g in rows[:10]:
            fh.write(f'{{"step": {s}, "loss": {loss}, "grad_norm": {g}}}\n')
    recs = list(read_records("memory://watchroot/a/trace.jsonl"))
    assert [r.step for r in recs] == list(range(10))
    from nummon._logs.discovery import find_runs

    runs, problems = find_runs(["memory://watchroot"], roots=True)
    assert problems == [] and [s.format for s in runs] == ["jsonl"]
    assert list(read_records(runs[0].id)) == recs

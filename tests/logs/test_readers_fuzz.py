"""Fuzz: every reader over corrupted and truncated TensorBoard, W&B, Hugging Face, CSV and JSONL
files (real files from each writer, then bytes flipped, cut, inserted and zeroed) ends in
records or a one-line NummonError, never a traceback; in a watcher it never stops the watching."""

import math
import re
import shutil

import pytest
from helpers.log_writers import runaway_rows, write_csv, write_hf_run, write_jsonl, write_tensorboard
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import NummonError, load_policy
from nummon._watch import make_follower, read_records
from nummon._watch.watcher import Watcher

pytestmark = pytest.mark.slow  # real files from every writer, then hundreds of damaged copies read

ROWS = runaway_rows(healthy=30, runaway=8)
WANDB_REPEATS = 40  # the W&B file holds the rows this many times over: several 32 KiB blocks


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    base = tmp_path_factory.mktemp("orig")
    out = {}
    out["jsonl"] = write_jsonl(base / "events.jsonl", ROWS)
    write_tensorboard(base / "tb", ROWS)
    out["tensorboard"] = next((base / "tb").glob("events.out.tfevents.*"))
    write_hf_run(base / "hf", ROWS, save_every=40)
    out["hf"] = sorted((base / "hf").glob("checkpoint-*/trainer_state.json"))[-1]
    out["csv"] = write_csv(base / "csv", ROWS)
    from helpers.log_writers import write_wandb_records

    items = [
        [
            ("_step", str(s)),
            ("train/loss", repr(l) if math.isfinite(l) else "NaN"),
            ("train/grad_norm", repr(g) if math.isfinite(g) else "Infinity"),
        ]
        for s, l, g in ROWS
    ]
    out["wandb"] = base / "run-fuzz.wandb"
    write_wandb_records(out["wandb"], items * WANDB_REPEATS)  # several 32 KiB blocks
    return out


edits = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.floats(0, 1), st.just(0)),
        st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("zero"), st.floats(0, 1), st.integers(1, 4096)),
        # a number of the file's text (a step, a value) replaced by what writers and people put there
        st.tuples(
            st.just("token"),
            st.floats(0, 1),
            st.sampled_from(
                [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"inf", b"-1", b'"x"', b"{", b"2.5", b"null", b"true"]
            ),
        ),
    ),
    min_size=1,
    max_size=4,
)

_NUMBER = re.compile(rb"-?\d+(\.\d+)?(e-?\d+)?")


def damage(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, where, arg in ops:
        if not b:
            break
        i = min(int(where * len(b)), len(b) - 1)
        if op == "token":
            found = list(_NUMBER.finditer(bytes(b)))
            if found:
                m = found[min(int(where * len(found)), len(found) - 1)]
                b[m.start() : m.end()] = arg
        elif op == "flip":
            b[i] ^= arg
        elif op == "cut":
            del b[i:]
        elif op == "insert":
            b[i:i] = arg
        else:
            b[i : i + arg] = bytes(len(b[i : i + arg]))
    return bytes(b)


def read_all(path):
    """Replay's reading and a watcher's incremental polling of the same file: ("records", the
    records replay read) or ("error", the one-line NummonError replay raised)."""
    try:
        outcome = ("records", list(read_records(str(path))))
    except NummonError as e:
        outcome = ("error", str(e))
    try:
        f = make_follower(str(path))
        for _ in range(3):
            f.poll()
            while getattr(f, "more", False):
                f.poll()
        f.poll(final=True)
    except NummonError as e:
        assert "\n" not in str(e)
    return outcome


def assert_records_sound(recs):
    """What every reader promises of a record it returns, whatever the file held: an int step and
    float (or unmeasured) values."""
    for r in recs:
        assert isinstance(r.step, int) and not isinstance(r.step, bool), r
        for value in (r.loss, r.grad_norm):
            assert value is None or isinstance(value, float), r


FORMATS = ["jsonl", "tensorboard", "hf", "csv", "wandb"]
FUZZ = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_read_every_undamaged_original(originals, fmt):
    """The fuzz's baseline: each writer's intact file reads back as every row it was written with
    (so a reader that fails on everything cannot pass the fuzz as "a one-line error")."""
    rows = ROWS * WANDB_REPEATS if fmt == "wandb" else ROWS
    kind, recs = read_all(originals[fmt])
    assert kind == "records", recs
    assert_records_sound(recs)
    assert [r.step for r in recs] == [s for s, _, _ in rows]
    assert [r.loss for r in recs if math.isfinite(r.loss)] == [l for _, l, _ in rows if math.isfinite(l)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_survive_any_damage(originals, tmp_path, fmt):
    """Each damaged file gives sound records or a one-line NummonError (anything else raised
    fails the example); both outcomes are counted, so the records' checks provably ran."""
    src = originals[fmt]
    seen = {"records": 0, "error": 0}

    @FUZZ
    @given(ops=edits)
    def one_damaged_copy(ops):
        d = tmp_path / f"case-{fmt}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        dst = d / src.name
        dst.write_bytes(damage(src.read_bytes(), ops))
        kind, got = read_all(dst)
        seen[kind] += 1
        if kind == "records":
            assert_records_sound(got)
        else:
            assert got and "\n" not in got

    one_damaged_copy()
    assert seen["records"] > 0, seen  # some damaged copies still read: their records were checked


def test_watcher_keeps_watching_past_every_damaged_file(originals, tmp_path):
    """One damaged copy of each format under one root, next to an intact run: the intact run's
    events are all delivered, whatever the others hold."""
    import random

    rnd = random.Random(7)
    root = tmp_path / "root"
    for fmt, src in originals.items():
        for k in range(3):
            d = root / f"{fmt}-{k}"
            d.mkdir(parents=True)
            data = src.read_bytes()
            ops = [(rnd.choice(["flip", "cut", "zero"]), rnd.random(), rnd.randint(1, 255)) for _ in range(3)]
            (d / src.name).write_bytes(damage(data, ops))
    good = root / "good"
    good.mkdir()
    write_jsonl(good / "events.jsonl", ROWS)
    from helpers.watching import read_events

    from nummon._watch.targets import JsonlTarget

    notes = tmp_path / "notes.jsonl"
    with open(tmp_path / "err.txt", "w") as err:
        w = Watcher([str(root)], load_policy("default"), [JsonlTarget(str(notes))], errors=err)
        w.poll_once()
        w.poll_once(final=True)
        w.close()
    assert "Traceback" not in (tmp_path / "err.txt").read_text()
    assert any(e["run"] == str(good / "events.jsonl") and e["state"] == "nonfinite" for e in read_events(notes))

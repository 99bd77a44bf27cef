"""`nummon watch --shard I/N`: a stable partition of the runs under a root, whatever path the
root is mounted at; N watchers cover every run exactly once; a restarted shard resumes."""

import json
import math
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import load_policy
from nummon._core.json import dumps
from nummon._watch.settings import WatchSettings
from nummon._watch.shard import Shard, parse_shard, run_key, shard_of
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher


@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=50, unique=True), st.integers(1, 9))
@settings(max_examples=50, deadline=None)
def test_every_key_is_in_exactly_one_shard(keys, n):
    owners = {k: [i for i in range(n) if Shard(i, n).owns(k, [])] for k in keys}
    assert all(len(o) == 1 for o in owners.values())


def test_the_hash_is_stable_across_processes_and_versions():
    # pinned values (sha256, not Python's per-process hash()): a change here moves runs to
    # other shards, and a restarted fleet would re-read them from the start
    assert [shard_of(k, 4) for k in ("a", "b/c", "exp1/events.jsonl", "team-0/run-000", "x")] == [2, 1, 0, 0, 0]
    assert [shard_of(f"r{i}", 7) for i in range(10)] == [3, 1, 3, 5, 2, 3, 2, 5, 1, 5]


def test_the_key_is_the_path_under_the_root_wherever_it_is_mounted():
    assert run_key("/mnt/a/runs/x/y", ["/mnt/a/runs"]) == run_key("/data/runs/x/y", ["/data/runs/"]) == "x/y"
    assert run_key("/data/runs/x/y", ["/data", "/data/runs"]) == "x/y"  # the deepest root
    assert run_key("/elsewhere/z", ["/data/runs"]) == "/elsewhere/z"


def test_parse_shard():
    s = parse_shard("3/4")
    assert (s.index, s.count) == (3, 4)


def healthy(n, start=0):
    return [
        {"type": "step", "step": s, "loss": 2.0 * 0.99**s * (1 + 0.03 * math.sin(1.3 * s)), "grad_norm": 1.0}
        for s in range(start, n)
    ]


def lost(n):
    rows = healthy(n - 1)
    rows.append({"type": "step", "step": n - 1, "loss": math.nan, "grad_norm": math.inf})
    return rows


def write(path, rows, mode="w"):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as fh:
        fh.writelines(dumps(r) + "\n" for r in rows)


def test_shards_watch_every_run_exactly_once_and_resume_after_a_restart(tmp_path):
    root = tmp_path / "runs"
    n = 60
    for i in range(n):  # every fifth run is lost: each shard must notify its own, only
        write(root / f"group-{i % 4}" / f"run-{i}" / "events.jsonl", lost(40) if i % 5 == 0 else healthy(40))
    quiet = open(os.devnull, "w")

    def watcher(i, k=3):
        notes = JsonlTarget(str(tmp_path / f"notes-{i}.jsonl"))
        return Watcher(
            [str(root)],
            load_policy("default"),
            [notes],
            settings=WatchSettings(state_path=str(tmp_path / f"state-{i}.json"), shard=Shard(i, k)),
            errors=quiet,
        )

    shards = [watcher(i) for i in range(3)]
    for w in shards:
        w.poll_once()
    watched = [set(w.runs) for w in shards]
    assert sum(len(s) for s in watched) == n and set().union(*watched) == {
        str(root / f"group-{i % 4}" / f"run-{i}" / "events.jsonl") for i in range(n)
    }
    assert all(watched)  # each shard holds some
    for w in shards:
        w.close()
    notified = [json.loads(line)["run"] for i in range(3) for line in open(tmp_path / f"notes-{i}.jsonl")]
    assert sorted(set(notified)) == sorted(
        str(root / f"group-{i % 4}" / f"run-{i}" / "events.jsonl") for i in range(0, n, 5)
    )
    # a restart of shard 1 resumes from its state file: nothing is read or notified again;
    # records written since are read once
    before = (tmp_path / "notes-1.jsonl").read_text()
    mine = sorted(watched[1])
    write(type(root)(mine[0]), healthy(45, start=40), mode="a")
    again = watcher(1)
    try:
        again.poll_once()
        assert set(again.runs) == watched[1]
        assert again.runs[mine[0]].last_step == 44 and again.runs[mine[0]].records == 45
        assert (tmp_path / "notes-1.jsonl").read_text() == before
    finally:
        again.close()

"""`nummon watch` end to end: real writer processes, a real watcher process, a webhook receiver
on 127.0.0.1, SIGKILL and restart with the same state file."""

import json
import socket
import subprocess
import sys

import pytest
from helpers import webhook_receiver
from helpers.watching import (
    WATCH,
    read_events,
    reference_ids,
    slow_writer,
    start_watch,
    stop,
    two_incident_rows,
    wait_for,
    write_lines,
)

from nummon import load_policy
from nummon._watch import make_follower
from nummon._watch.runs import WatchedRun


class Receiver(webhook_receiver.Receiver):
    def ids(self):
        return [b["nummon"]["id"] for b in self.bodies]


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_webhook_gets_exactly_one_message_per_incident_event(tmp_path, receiver):
    log = tmp_path / "events.jsonl"
    write_lines(log, two_incident_rows())
    notes = tmp_path / "notes.jsonl"
    p = subprocess.run(
        WATCH + [str(log), "--once", "--notify", f"webhook:{receiver.url}", "--notify", f"jsonl:{notes}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    expect = reference_ids(log)
    assert [e.split(":", 1)[1] for e in expect] == [
        "opened:1",
        "escalated:2",
        "resolved:0",
        "opened:1",
        "escalated:2",
        "escalated:3",
    ]
    assert receiver.ids() == expect  # one message per event, no more, none lost
    for b in receiver.bodies:  # Slack mrkdwn in the block, plain text in the fallback, the same id
        rich = b["blocks"][0]["text"]["text"]
        assert rich.startswith("*nummon: run") and "**" not in rich and "on " + socket.gethostname() in rich
        assert b["text"].startswith("nummon: run") and "*" not in b["text"] and "`" not in b["text"]
        assert b["event_id"] == b["nummon"]["event_id"] and len(b["event_id"]) == 32
    assert [e["id"] for e in read_events(notes)] == expect


def test_dead_webhook_never_blocks_reading_and_jsonl_holds_every_event(tmp_path):
    blackhole = socket.socket()  # accepts connections into its backlog, never answers
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)
    url = f"http://127.0.0.1:{blackhole.getsockname()[1]}/hook"
    rows = two_incident_rows()
    log = tmp_path / "events.jsonl"
    notes = tmp_path / "notes.jsonl"
    write_lines(log, rows[:50])
    proc = start_watch(log, "--interval", "0.2", "--notify", f"webhook:{url}", "--notify", f"jsonl:{notes}")
    try:
        wait_for(lambda: len(read_events(notes)) >= 2, what="incident 1 in the JSONL log")
        write_lines(log, rows[50:], mode="a")  # the webhook is still hanging on incident 1
        wait_for(lambda: len(read_events(notes)) >= 6, what="every event in the JSONL log")
    finally:
        rc, out, err = stop(proc)
        blackhole.close()
    assert rc == 0, err
    assert [e["id"] for e in read_events(notes)] == reference_ids(log)


@pytest.mark.slow
def test_sigkill_and_restart_no_duplicate_no_missed_record(tmp_path, receiver):
    rows = two_incident_rows()
    full = tmp_path / "full.jsonl"
    write_lines(full, rows)
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    log.touch()
    writer = slow_writer(full, log, pause_s=0.05)
    state = tmp_path / "watch-state.json"
    notes = tmp_path / "notes.jsonl"
    args = (
        tmp_path / "run",
        "--interval",
        "0.1",
        "--state",
        state,
        "--notify",
        f"webhook:{receiver.url}",
        "--notify",
        f"jsonl:{notes}",
    )
    watcher = start_watch(*args)
    try:
        wait_for(lambda: len(receiver.bodies) >= 3, what="incident 1 resolved at the receiver")
        wait_for(lambda: state.exists() and json.loads(state.read_text())["outbox"] == [], what="state after sending")
        watcher.kill()  # SIGKILL: no cleanup at all
        watcher.wait(timeout=30)
        lines_at_kill = len(log.read_text().splitlines())
        wait_for(lambda: len(log.read_text().splitlines()) >= lines_at_kill + 10, what="records written while down")
        watcher = start_watch(*args)
        writer.wait(timeout=120)
        wait_for(lambda: len(receiver.bodies) >= 6, what="incident 2 at the receiver")
    finally:
        writer.kill()
        rc, out, err = stop(watcher)
    assert rc == 0, err
    assert receiver.ids() == reference_ids(log)  # nothing sent twice, nothing missed
    saved = json.loads(state.read_text())["runs"][str(log.resolve())]
    assert saved["records"] == len(rows) and saved["last_step"] == rows[-1]["step"]


FORMATS_LIVE = ["tensorboard", "csv", "hf"]
# One training loop written live in each format at once (one torch process, one watcher): each
# format's run lives under OUT/<format>/, and the loop waits, before it writes its first non-finite
# step, until the watcher has opened an incident for every one of them.
TRAINER = r"""
import json, math, shutil, sys, time
from pathlib import Path
import torch

out, notify, marker = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
x = torch.randn(64, 8)
y = x @ torch.randn(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

from torch.utils.tensorboard import SummaryWriter
tb = SummaryWriter(str(out / "tensorboard" / "runs" / "exp1"))
def write_tensorboard(step, loss, gn, lr):
    tb.add_scalar("train/loss", loss, step)
    tb.add_scalar("train/grad_norm", gn, step)
    tb.add_scalar("train/learning_rate", lr, step)
    tb.flush()

from lightning.fabric.loggers import CSVLogger
logger = CSVLogger(str(out / "csv"), name="lightning_logs", flush_logs_every_n_steps=1)
def write_csv(step, loss, gn, lr):
    logger.log_metrics({"train_loss": loss, "grad_norm": gn, "lr-SGD": lr}, step=step)

from transformers.trainer_callback import TrainerState
state = TrainerState(max_steps=400)
def write_hf(step, loss, gn, lr):  # Trainer-style: log every step, save every 2 (rewrite)
    state.log_history.append({"epoch": step / 100, "grad_norm": gn, "learning_rate": lr, "loss": loss, "step": step})
    state.global_step = step
    if step % 2 == 0:
        ckpt = out / "hf" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True, exist_ok=True)
        state.save_to_json(str(ckpt / "trainer_state.json"))
        for old in sorted((out / "hf").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old)

WRITERS = {"tensorboard": write_tensorboard, "csv": write_csv, "hf": write_hf}

def opened():
    # the formats whose run has an opened incident in the watcher's event log
    try:
        events = [json.loads(l) for l in open(notify) if l.strip()]
    except OSError:
        return set()
    return {f for f in WRITERS for e in events if e["transition"] == "opened" and in_run_of(e, f)}

def in_run_of(event, fmt):  # the run is the format's folder (hf) or a file or folder below it
    return (event["run"] + "/").startswith(f"{out}/{fmt}/")

before, bad_step = None, None
for step in range(400):
    if step == 15:
        for g in opt.param_groups:
            g["lr"] = 3.0  # the run goes bad
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    l = float(loss)
    if bad_step is None and not (math.isfinite(l) and math.isfinite(gn)):
        bad_step = step  # before writing the first non-finite step: has the watcher warned?
        deadline = time.time() + 120
        while opened() != set(WRITERS) and time.time() < deadline:
            time.sleep(0.1)
        before = sorted(opened())
    for write in WRITERS.values():
        write(step, l, gn, opt.param_groups[0]["lr"])
    opt.step()
    time.sleep(0.05)
    if bad_step is not None and step >= bad_step + 4:
        break
json.dump({"notified_before_nonfinite": before, "nonfinite_step": bad_step}, open(marker, "w"))
"""


@pytest.mark.slow
def test_live_runs_in_each_format_warned_before_their_first_nonfinite_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    notes = tmp_path / "notes.jsonl"
    marker = tmp_path / "marker.json"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    watcher = start_watch(out, "--interval", "0.2", "--notify", f"jsonl:{notes}", "--notify", "console")
    trainer = subprocess.Popen([sys.executable, str(script), str(out), str(notes), str(marker)])

    def in_run_of(event, fmt):  # the run is the format's folder (hf) or a file or folder below it
        return (event["run"] + "/").startswith(f"{out}/{fmt}/")

    def escalated():
        return {f for f in FORMATS_LIVE for e in read_events(notes) if e["state"] == "nonfinite" and in_run_of(e, f)}

    try:
        assert trainer.wait(timeout=300) == 0
        wait_for(lambda: escalated() == set(FORMATS_LIVE), what="the non-finite escalation of every format's run")
    finally:
        trainer.kill()
        rc, stdout, err = stop(watcher)
    assert rc == 0, err
    got = json.loads(marker.read_text())
    assert got["nonfinite_step"] is not None and got["notified_before_nonfinite"] == sorted(FORMATS_LIVE)
    events = read_events(notes)
    for fmt in FORMATS_LIVE:
        mine = [e for e in events if in_run_of(e, fmt)]
        assert mine[0]["transition"] == "opened" and mine[0]["step"] < got["nonfinite_step"], (fmt, mine[0])
        assert len({e["id"] for e in mine}) == len(mine), fmt
    assert len({e["run"] for e in events}) == len(FORMATS_LIVE)  # one run each, no other
    assert stdout.count("nummon: run unstable") >= len(FORMATS_LIVE)


def test_not_a_log_is_named_once_and_the_others_are_watched(tmp_path):
    good = tmp_path / "good" / "events.jsonl"
    good.parent.mkdir()
    write_lines(good, two_incident_rows())
    bad_tb = tmp_path / "bad" / "events.out.tfevents.1.host"
    bad_tb.parent.mkdir()
    bad_tb.write_text("not an event file, just text that is long enough")
    p = subprocess.run(WATCH + [str(tmp_path), "--once"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [
        l
        for l in p.stderr.splitlines()
        if l.strip()
        and "watching" not in l
        and not l.startswith("nummon watch:   run ")
        and not l.startswith("nummon watch: stopped (")
    ]
    assert len(lines) == 1 and str(bad_tb) in lines[0] and "Traceback" not in p.stderr
    assert p.stdout.count("nummon: run unstable") == 2


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["{log}", "--notify", "pager:me"], "--notify 'pager:me'"),
        (["{log}", "--notify", "webhook:ftp://x"], "webhook URL"),
        (["{tmp}/missing.jsonl"], "missing.jsonl: not found"),
        (["{log}", "--interval", "0"], "--interval"),
        (["{log}", "--policy", "nope"], "unknown policy preset"),
        (["{log}", "--key", "x"], "TAG=FIELD"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    from helpers.watching import watch_main as main

    log = tmp_path / "events.jsonl"
    write_lines(log, two_incident_rows()[:3])
    rc = main([a.format(log=log, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_new_runs_picked_up_idle_runs_retired_and_revived(tmp_path):
    from nummon._watch.targets import JsonlTarget
    from nummon._watch.watcher import Watcher, WatchSettings

    rows = two_incident_rows()
    a = tmp_path / "a" / "events.jsonl"
    a.parent.mkdir()
    write_lines(a, rows[:60])
    notes = tmp_path / "notes.jsonl"
    w = Watcher(
        [str(tmp_path)],
        load_policy("default"),
        [JsonlTarget(str(notes))],
        settings=WatchSettings(idle_timeout_s=60, exclude=frozenset({str(notes)})),
    )
    w.poll_once()
    assert list(w.runs) == [str(a)]
    b = tmp_path / "b" / "events.jsonl"
    b.parent.mkdir()
    write_lines(b, rows[:45])
    w.runs[str(a)].last_activity -= 120  # a has been quiet for two minutes (no sleep: no race with the timeout)
    w.poll_once()  # b is new; a had nothing new for longer than the idle timeout
    assert list(w.runs) == [str(b)]
    write_lines(a, rows[60:], mode="a")
    w.poll_once()  # a wakes up where it stopped: its detectors re-warmed, nothing re-read
    assert str(a) in w.runs and w.runs[str(a)].records == len(rows)
    w.close()
    ids = [e["id"] for e in read_events(notes)]
    assert [i for i in ids if i.startswith(str(a))] == reference_ids(a)


@pytest.mark.slow
def test_wandb_target_sends_one_alert_per_event(tmp_path, wandb_env):
    from helpers.wandb_reader import alerts, find_run_file, read_records
    from helpers.watching import watch_main as main

    log = tmp_path / "events.jsonl"
    write_lines(log, two_incident_rows())
    assert main([str(log), "--once", "--notify", "wandb:watch-test"]) == 0
    import wandb

    wandb.teardown()
    sent = alerts(read_records(find_run_file(wandb_env / "wandb_dir")))
    run = WatchedRun(str(log.resolve()), make_follower(str(log)), load_policy("default"))
    expect = [e.title for e in run.poll(final=True)]
    assert len(expect) == 6 and expect[0].startswith("nummon: run unstable") and "non-finite" in expect[-1]
    assert [a.title for a in sent] == expect

"""State shared between the training thread and the sink threads: records are deeply read-only,
the dispatcher's per-sink counters and flags are written under a lock, and a SIGTERM that lands
in the middle of a Monitor call is acted on once that call is over."""

import json
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from nummon import BaseSink, Monitor, StepRecord, load_policy
from nummon._engine.engine import HealthEngine


class Reader(BaseSink):
    """A sink on its own thread that keeps what it read of each record's per-layer values and
    tries to change them (as a careless sink might)."""

    def __init__(self):
        self.seen = {}
        self.changed = 0

    def on_step(self, record, health):
        self.seen[record.step] = {k: dict(v) for k, v in vars(record).items() if k.startswith("layer_")}
        for v in (record.layer_grad_norms, record.layer_activation_max):
            try:
                v["mine"] = 0.0
                self.changed += 1
            except TypeError:
                pass


class Failing(BaseSink):
    def on_step(self, record, health):
        raise RuntimeError("sink down")


class Slow(BaseSink):
    """Slower than the step: its flushes time out, so the training thread marks it stuck while
    its worker clears the mark."""

    def __init__(self):
        self.stop = threading.Event()

    def on_step(self, record, health):
        self.stop.wait(0.002)


STEPS = 20


def test_sink_threads_and_a_scraper_under_a_tiny_switch_interval(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    readers, failing, slow = [Reader(), Reader()], Failing(), Slow()
    policy = {"sinks": {"queue_size": 4, "when_full": "drop", "flush_timeout_s": 0.001}}
    mon = Monitor(model, opt, policy=policy, sinks=[*readers, failing, slow])
    stats, done = [], threading.Event()

    def scrape():  # a metrics scrape reading the counters while the sinks write them
        while not done.is_set():
            stats.append(mon.sink_stats)
            done.wait(1e-4)

    scraper = threading.Thread(target=scrape)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    records = {}
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        scraper.start()
        for _ in range(STEPS):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            rec = mon.post_step(loss).record
            records[rec.step] = {k: dict(v) for k, v in vars(rec).items() if k.startswith("layer_")}
            if rec.step % 5 == 0:
                mon.flush()  # bounded waits the slow sink misses: the training thread marks it
        mon.flush()
    finally:
        done.set()
        scraper.join()
        sys.setswitchinterval(old)
        slow.stop.set()
        mon.close()
    for r in readers:
        assert r.changed == 0  # no sink could change a record another sink reads
        for step, layers in r.seen.items():
            assert layers == records[step]  # ... nor the training thread after it was handed over
    final = mon.sink_stats
    # every step of the failing sink counted: failed in it, or dropped at its full queue (4) when
    # its thread fell behind the training thread (the machine's load decides which)
    assert final["Failing"]["errors"] + final["Failing"]["dropped"] == STEPS
    assert final["Failing"]["errors"] >= 1
    assert sum("sink Failing failed" in m for m in caplog.messages) == 1  # logged once
    assert stats and all(s["Failing"]["errors"] <= STEPS for s in stats)


def test_a_frozen_record_is_read_only_all_the_way_down():
    rec = StepRecord(step=0, loss=1.0, layer_grad_norms={"fc1.weight": 2.0})
    HealthEngine(load_policy("default")).step(rec)
    for change in (
        lambda d: d.__setitem__("x", 1.0),
        lambda d: d.pop("fc1.weight"),
        lambda d: d.update(x=1.0),
        lambda d: d.clear(),
        lambda d: d.setdefault("x", 1.0),
        lambda d: d.__delitem__("fc1.weight"),
    ):
        with pytest.raises(TypeError):
            change(rec.layer_grad_norms)
        with pytest.raises(TypeError):
            change(rec.layer_output_rms)
    assert rec.layer_grad_norms == {"fc1.weight": 2.0} and isinstance(rec.layer_grad_norms, dict)
    assert json.loads(json.dumps(rec.to_dict()))["layer_grad_norms"] == {"fc1.weight": 2.0}
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(rec)).layer_grad_norms == {"fc1.weight": 2.0}
    assert copy.deepcopy(rec).layer_grad_norms == {"fc1.weight": 2.0}


SIGTERM_SCRIPT = """
import os, signal, sys, torch
from torch import nn
from nummon import BaseSink, JsonlSink, Monitor

class Terminating(BaseSink):
    '''On the training thread: sends the process a SIGTERM from inside post_step at step 5.'''
    synchronous = True
    in_step = False
    def on_step(self, record, health):
        self.in_step = True
        if record.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, between two bytecodes
                pass
        print("step", record.step, flush=True)
        self.in_step = False
    def close(self):
        print("close in_step" if self.in_step else "close", flush=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 8), torch.randn(64, 1)
mon = Monitor(model, opt, sinks=[Terminating(), JsonlSink("events.jsonl")])
for step in range(20):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    mon.post_step(loss)
    print("returned", step, flush=True)
"""


@pytest.mark.slow
def test_sigterm_inside_post_step_is_acted_on_after_it(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SIGTERM_SCRIPT))
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    lines = proc.stdout.splitlines()
    # step 5 finished (its sink call, its record queued), then the monitor closed, and the
    # process died of SIGTERM before post_step returned to the loop
    assert lines[-2:] == ["step 5", "close"]  # not "close in_step": the handler did not re-enter post_step
    events = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(6))

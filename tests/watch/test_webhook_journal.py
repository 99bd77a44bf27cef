"""A webhook delivery is journalled before the next post: a watcher killed just after a post was
answered does not post that event again after its restart (a post still unanswered at a kill is
sent again: at least once), and every post names its event in a header and in its body."""

import signal
import time

import pytest
from helpers.watching import reference_ids, start_watch, two_incident_rows, write_lines
from helpers.webhook_receiver import Receiver

pytestmark = pytest.mark.slow  # a real watcher process killed and restarted several times

ANSWER_S = 0.3  # the endpoint's time to answer: a kill lands between two posts


def test_a_watcher_killed_just_after_each_answered_post_does_not_post_it_again(tmp_path):
    log = tmp_path / "run" / "events.jsonl"
    log.parent.mkdir()
    write_lines(log, two_incident_rows())
    expect = reference_ids(log)
    receiver = Receiver(delay_s=ANSWER_S)
    state = tmp_path / "state.json"
    args = (tmp_path / "run", "--interval", "0.1", "--state", state, "--notify", f"webhook:{receiver.url}")
    kills = 0
    try:
        while len(set(receiver.answered)) < len(expect) and kills < 15:
            before = len(receiver.answered)
            watcher = start_watch(*args)
            deadline = time.monotonic() + 60
            while len(receiver.answered) == before and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)  # the answer is back at the watcher; its state file is not yet rewritten
            watcher.send_signal(signal.SIGKILL)
            watcher.communicate(timeout=30)
            kills += 1
    finally:
        receiver.close()
    by_body = {b["event_id"]: b["nummon"]["id"] for b in receiver.bodies}
    assert sorted(by_body[e] for e in set(receiver.answered)) == sorted(expect) and kills >= 3, kills
    assert receiver.event_ids == [b["event_id"] for b in receiver.bodies]  # the header names the event
    repeats = len(receiver.answered) - len(set(receiver.answered))
    assert repeats == 0, (kills, receiver.answered)  # an answered post is never sent again

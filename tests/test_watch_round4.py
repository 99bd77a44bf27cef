"""`nummon watch` under the fourth round of attacks (issue 36 items 8-12, 20-22, the webhook
target's counters shared with the metrics thread) and what it says of the runs it picks up
(issue 35 point 10): real files, real watcher processes and signals, real HTTP receivers."""
import json
import os
import subprocess
import sys
import threading

import pytest

from nummon._policy import load_policy
from nummon._watch.command import main
from nummon._watch.targets import JsonlTarget
from nummon._watch.watcher import Watcher
from test_watch import WATCH, read_events, reference_ids, start_watch, stop, two_incident_rows, wait_for, write_lines


# --- 36.22: a misspelled target kind never prints the URL's secrets ------------------------

@pytest.mark.parametrize("spec", [
    "slack:https://hooks.slack.com/services/T0SECRET/B0SECRET/tok3nSECRET",
    "Webhook:https://user:pa55SECRET@example.com/hook?token=SECRET",
    "alertmanger:http://admin:SECRETpw@am-0:9093,http://admin:SECRETpw@am-1:9093/SECRET",
    "webhok:user:SECRET@host/x",
])
def test_a_misspelled_target_kind_names_scheme_and_host_only(tmp_path, capsys, spec):
    assert main([str(tmp_path), "--once", "--notify", spec]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "expected one of" in err
    assert "SECRET" not in err
    kind = spec.split(":", 1)[0]
    assert f"--notify '{kind}:" in err  # the misspelled kind itself is shown
    if "://" in spec:
        assert "://" in err and ("example.com" in err or "hooks.slack.com" in err or "am-0:9093" in err)


def test_a_near_miss_kind_gets_a_hint(tmp_path, capsys):
    assert main([str(tmp_path), "--once", "--notify", "alertmanger:http://am:9093"]) == 2
    assert "did you mean alertmanager:?" in capsys.readouterr().err

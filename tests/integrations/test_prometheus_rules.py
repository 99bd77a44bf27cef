"""The shipped Prometheus configuration: promtool accepts the rules and their unit tests pass
(configs/prometheus/nummon-rules.test.yml), amtool accepts the Alertmanager route, and every
series the rules read is one nummon serves."""

import re
import subprocess

import yaml
from helpers.prometheus_servers import CONFIGS, binary

RULES = CONFIGS / "nummon-rules.yml"


def run(argv):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=CONFIGS)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_promtool_checks_the_rules():
    out = run([binary("promtool"), "check", "rules", str(RULES)])
    assert "SUCCESS: 7 rules found" in out


def test_promtool_unit_tests_of_the_rules_pass():
    out = run([binary("promtool"), "test", "rules", str(CONFIGS / "nummon-rules.test.yml")])
    assert "SUCCESS" in out


def test_promtool_unit_tests_fail_on_a_wrong_threshold(tmp_path):
    """The unit tests can fail: the overflow threshold moved from 100 to 50 steps breaks them."""
    (tmp_path / "nummon-rules.yml").write_text(
        RULES.read_text().replace("nummon_steps_to_overflow < 100", "nummon_steps_to_overflow < 50")
    )
    (tmp_path / "nummon-rules.test.yml").write_text((CONFIGS / "nummon-rules.test.yml").read_text())
    p = subprocess.run(
        [binary("promtool"), "test", "rules", "nummon-rules.test.yml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode != 0 and "NummonOverflowSoon" in p.stdout + p.stderr


def test_amtool_checks_the_alertmanager_route():
    out = run([binary("amtool"), "check-config", str(CONFIGS / "alertmanager.yml")])
    assert "SUCCESS" in out and "3 inhibit rules" in out


def test_every_rule_reads_series_nummon_serves():
    from nummon.integrations.prometheus import METRICS

    served = {m + s for m in METRICS for s in ("", "_total")} | {"up"}
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    for r in rules:
        used = set(re.findall(r"\b(nummon_[a-z_]+|up)\b", r["expr"]))
        assert used and used <= served, (r["alert"], used - served)
        assert r["labels"]["severity"] in ("warning", "critical")

"""A policy YAML with a key given twice is refused, naming the key and both lines:
the last value used to win silently and `policy validate` said "valid"."""

import subprocess
import sys

import pytest

from nummon import PolicyError, load_policy

DUP = """\
spike:
  loss_factor: 3.0
runaway:
  warning_steps: 3
spike:
  loss_factor: 9.0
"""

NESTED = """\
spike:
  loss_factor: 3.0
  loss_factor: 9.0
"""


@pytest.mark.parametrize("text,key,lines", [(DUP, "spike", (5, 1)), (NESTED, "loss_factor", (3, 2))])
def test_duplicate_keys_are_refused_naming_the_key_and_both_lines(tmp_path, text, key, lines):
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(str(p))
    assert f"duplicate key {key!r} at line {lines[0]} (first given at line {lines[1]})" in str(e.value)
    r = subprocess.run(
        [sys.executable, "-m", "nummon", "policy", "validate", str(p)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "duplicate key" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_same_key_in_two_sections_is_fine(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("spike:\n  enabled: true\nrunaway:\n  enabled: true\n")
    assert load_policy(str(p)).spike.enabled

"""What a user sees first: --version, each command's description and argument help, the policy
checker's suggestions, the LICENSE, and the README's chart legend."""
import contextlib
import io
import re

import pytest

from conftest import ROOT
from nummon import Health, __version__
from nummon._cli import build_parser, main


def run_main(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_version():
    rc, out, _ = run_main("--version")
    assert rc == 0 and out.strip() == f"nummon {__version__}"


def _subparsers():
    p = build_parser()
    (sub,) = [a for a in p._actions if a.dest == "command"]
    return sub.choices


def test_every_command_has_a_description_line():
    for name, parser in _subparsers().items():
        assert parser.description and len(parser.description) > 20, name
        assert parser.format_help().split("\n\n")[1].strip(), name  # the line under the usage


@pytest.mark.parametrize("name", ["demo", "audit", "policy", "diagnose"])
def test_every_argument_has_help(name):
    parser = _subparsers()[name]
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert not missing, missing


def test_policy_validate_suggests_the_closest_key(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("spike:\n  grad_factr: 3\nrunaway:\n  min_grwth: 2\n  nothing_like_it: 1\n")
    rc, _, err = run_main("policy", "validate", f)
    assert rc == 2
    assert "spike.grad_factr: unknown key (did you mean grad_factor?)" in err
    assert "runaway.min_grwth: unknown key (did you mean min_growth?)" in err
    assert re.search(r"runaway\.nothing_like_it: unknown key$", err, re.M), err


def test_the_license_is_the_apache_2_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10000
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_the_readme_chart_table_names_every_health_code():
    row = next(l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith("| `health` |"))
    for h in Health:
        assert f"{h.code:g} = {h.value.replace('nonfinite', 'non-finite')}" in row, (h, row)

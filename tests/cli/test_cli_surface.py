"""What a user sees first: --version, each command's description and argument help, the policy
checker's suggestions, the LICENSE, and the chart legend in the documentation."""

import argparse
import contextlib
import io
import re
import subprocess

import pytest
from helpers.checkout import ROOT, nummon_cmd

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


def _all_parsers(parser, name="nummon"):
    """(name, parser) for the top-level parser and every subcommand's, recursively."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_option_of_every_command_has_help_naming_its_choices():
    """Walks every parser: each argument has a help text, and one with choices names them all."""
    missing, unlisted = [], []
    for name, parser in _all_parsers(build_parser()):
        formatter = parser._get_formatter()
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                continue
            if not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{name} {a.option_strings or a.dest}")
            elif a.choices is not None:
                text = formatter._expand_help(a).lower()
                unlisted += [f"{name} {a.option_strings}: {c}" for c in a.choices if str(c).lower() not in text]
    assert not missing and not unlisted, (missing, unlisted)
    assert len(list(_all_parsers(build_parser()))) == 8  # nummon and its seven commands: the walk saw them


def test_bare_nummon_prints_usage_and_each_command_on_one_line():
    """Exit 2, as argparse's own usage errors: a script whose command is empty must fail."""
    p = subprocess.run(nummon_cmd(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not p.stdout and "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert lines[0].startswith("usage: nummon")
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    for action in sub._choices_actions:  # each command once, with its whole help on its line
        (line,) = [l for l in lines if l.split()[:1] == [action.dest]]
        assert line.split(None, 1) == [action.dest, action.help], line
    assert "nummon COMMAND --help" in p.stderr


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


def test_the_chart_legend_names_every_health_code():
    row = next(
        l for l in (ROOT / "docs" / "guides" / "views.md").read_text().splitlines() if l.startswith("| `health` |")
    )
    for h in Health:
        assert f"{h.code:g} = {h.value.replace('nonfinite', 'non-finite')}" in row, (h, row)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["watch", "--once"], ["replay"], ["demo", "--out"]])
def test_every_command_with_a_policy_gives_the_did_you_mean_hint(tmp_path, command):
    """The same one-line error as `policy validate`, hint included; exit 2; nothing created."""
    policy = tmp_path / "typo.yaml"
    policy.write_text("spike:\n  grad_factr: 3\n")
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 0, "loss": 1.0}\n')
    target = [str(tmp_path / "demo-out")] if command[0] == "demo" else [str(log)]
    p = subprocess.run(
        nummon_cmd() + command + target + ["--policy", str(policy)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [
        f"nummon: error: invalid policy {policy}: spike.grad_factr: unknown key (did you mean grad_factor?)"
    ]
    assert not (tmp_path / "demo-out").exists()

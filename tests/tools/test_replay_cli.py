"""`nummon replay` and the CLI's error handling, through the real console entry point."""

import json
import subprocess
import sys

import pytest
from helpers.checkout import CORPUS, DATA, ROOT, nummon_cmd


def cli(*args, **kw):
    return subprocess.run(nummon_cmd() + list(args), capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.slow
def test_dev_corpus_scores_clean():
    """The project's yardstick: every expectation met, median lead >= 5 steps, no false alarm."""
    shared = ROOT.parent / "shared" / "corpus" / "score.py"
    script = shared if shared.exists() else DATA / "score.py"  # a copy, for checkouts without shared/
    p = subprocess.run(
        [sys.executable, str(script), str(CORPUS), "--cmd", f"{sys.executable} -m nummon replay"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "19/19 expectations met" in p.stdout


def test_motivating_table_warns_at_40_and_is_critical_by_44():
    p = cli("replay", "--format", "jsonl", str(DATA / "batch39_46.jsonl"))
    assert p.returncode == 0, p.stderr
    alerts = [json.loads(l) for l in p.stdout.splitlines()]
    warn = [a for a in alerts if a["severity"] in ("warning", "critical")]
    assert min(a["step"] for a in warn) == 40
    assert min(a["step"] for a in alerts if a["severity"] == "critical") <= 44
    assert all(a["source"].endswith("batch39_46.jsonl") for a in alerts)


@pytest.mark.slow
def test_directory_and_text_format():
    p = cli("replay", str(CORPUS))
    assert p.returncode == 0
    assert "19 trace(s)" in p.stdout


def test_replay_does_not_import_torch():
    code = (
        "import sys; from nummon._cli import main; "
        f"main(['replay', {str(DATA / 'batch39_46.jsonl')!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'; print('NO_TORCH')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "NO_TORCH" in p.stdout, p.stderr


def test_nan_tokens_in_both_spellings(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": NaN}\n{"step": 2, "loss": "Infinity"}\n')
    p = cli("replay", "--format", "jsonl", str(t))
    kinds = [json.loads(l)["kind"] for l in p.stdout.splitlines()]
    assert "nonfinite" in kinds


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"step": 0, "loss": 1.0, "x": \n{"step": 2, "loss": 1.0}\n', ":1: not valid JSON"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ('{"step": 0, "loss": "abc"}\n', ":1: loss must be a number"),
    ],
)
def test_broken_trace_names_the_line(tmp_path, content, needle):
    t = tmp_path / "bad.jsonl"
    t.write_text(content)
    p = cli("replay", str(t))
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["replay", "/no/such/trace.jsonl"], "trace not found"),
        (["replay", "--policy", "nope", str(DATA / "batch39_46.jsonl")], "unknown policy preset 'nope'"),
        (["replay", "--format", "xml", "x"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, needle):
    p = cli(*args)
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_policy_show_and_validate(tmp_path):
    p = cli("policy", "show", "strict")
    assert p.returncode == 0 and "name: strict" in p.stdout and "# " in p.stdout
    good = tmp_path / "good.yaml"
    good.write_text("spike: {grad_factor: 12}\n")
    assert cli("policy", "validate", str(good)).returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("spike: {grad_factr: 12, window: -1}\nstall: {window: x}\n")
    p = cli("policy", "validate", str(bad))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert any("spike.grad_factr: unknown key" in l for l in lines)
    assert any("spike.window" in l for l in lines) and any("stall.window" in l for l in lines)


@pytest.mark.slow
def test_policy_show_output_round_trips(tmp_path):
    """What `policy show` prints is itself a valid policy equal to the one shown."""
    import nummon

    for name in ("default", "strict"):
        text = cli("policy", "show", name).stdout
        f = tmp_path / f"{name}.yaml"
        f.write_text(text)
        assert cli("policy", "validate", str(f)).returncode == 0
        assert nummon.load_policy(str(f)) == nummon.load_policy(name)


def test_the_policy_reference_lists_every_field_of_the_default_policy_as_policy_show_prints_it():
    """The generated policy reference (docs/gen_ref.py) ends with the default policy as YAML:
    exactly what `nummon policy show default` prints."""
    import importlib.util

    from helpers.checkout import ROOT

    spec = importlib.util.spec_from_file_location("nummon_docs_gen_ref", ROOT / "docs" / "gen_ref.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = gen.policy_page()
    block = page[page.index("## The default policy as YAML") :]
    block = block[block.index("```yaml\n") + len("```yaml\n") :]
    assert block[: block.index("```")] == cli("policy", "show", "default").stdout


def test_min_severity_filter():
    p = cli("replay", "--format", "jsonl", "--min-severity", "critical", str(DATA / "batch39_46.jsonl"))
    sev = {json.loads(l)["severity"] for l in p.stdout.splitlines()}
    assert sev == {"critical"}

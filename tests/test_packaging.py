"""A normal (non-editable) install ships every subpackage: CI installs that way."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"nummon"} | {
        "nummon." + ".".join(p.parent.relative_to(ROOT / "nummon").parts)
        for p in (ROOT / "nummon").rglob("__init__.py") if p.parent != ROOT / "nummon"
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_cli_runs_from_the_checkouts_root():
    """From the repository root the source tree shadows the install: integrations/ and configs/
    must still import as nummon.integrations / nummon.configs."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "nummon", "policy", "show", "strict"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "name: strict" in p.stdout, p.stderr[-500:]
    p = subprocess.run([sys.executable, "-c", "import nummon.integrations.tensorboard, nummon.configs"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-500:]

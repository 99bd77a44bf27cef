"""A normal (non-editable) install ships every module: CI installs that way."""

import pytest
from helpers.checkout import ROOT


def test_the_cli_runs_from_the_checkouts_root():
    """From the repository root the source tree shadows the install: integrations/ and configs/
    must still import as nummon.integrations / nummon.configs."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "nummon", "policy", "show", "strict"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "name: strict" in p.stdout, p.stderr[-500:]
    p = subprocess.run(
        [sys.executable, "-c", "import nummon.integrations.tensorboard, nummon.configs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-500:]


@pytest.mark.slow
def test_the_wheel_ships_every_module_py_typed_and_the_configs(tmp_path):
    """A wheel built from the sources holds every module of nummon/ and integrations/ (setup.py
    finds the packages), nummon/py.typed (PEP 561: users' type checkers read nummon's
    annotations) and the presets and Prometheus rules. Built without isolation from a
    copy of what the wheel is made of, so nothing is written into the checkout."""
    import shutil
    import subprocess
    import sys
    import zipfile

    pytest.importorskip("build")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("nummon", "integrations", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    (wheel,) = (tmp_path / "dist").glob("nummon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "nummon/py.typed" in names
    assert {"nummon/configs/default.yaml", "nummon/configs/prometheus/nummon-rules.yml"} <= names
    modules = {f"nummon/{p.relative_to(ROOT / 'nummon').as_posix()}" for p in (ROOT / "nummon").rglob("*.py")}
    modules |= {f"nummon/integrations/{p.name}" for p in (ROOT / "integrations").glob("*.py")}
    assert modules <= names, f"not in the wheel: {sorted(modules - names)}"

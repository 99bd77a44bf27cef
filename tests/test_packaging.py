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

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus"


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Hermetic offline W&B: every directory in tmp, nothing reaches a server."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        d = tmp_path / var.lower()
        d.mkdir()
        monkeypatch.setenv(var, str(d))
    for var, val in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
    }.items():
        monkeypatch.setenv(var, val)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def nummon_cmd():
    """The CLI as a subprocess command (the installed console script's module)."""
    return [sys.executable, "-m", "nummon"]


try:  # hypothesis keeps no example database in the checkout
    from hypothesis import settings

    settings.register_profile("nummon", database=None, deadline=None)
    settings.load_profile("nummon")
except ImportError:
    pass

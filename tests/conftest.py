import os
import platform
import tempfile

# hypothesis keeps its caches outside the checkout (tests write only into temporary folders)
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "nummon-tests-hypothesis"))
# One intra-op thread per process, set before torch is imported so that every subprocess and
# spawned gloo rank inherits it: the suite runs as 2 xdist workers on 2 cores, and each of the
# demo's or a rank's torch processes taking 2 more threads oversubscribes the cores (the demo
# model's 120 training steps took 43 s of CPU with 2 threads, 24 s with 1, on a loaded 2-core box).
# In-process tests already ran on one thread: test_recovery.py sets it when it is imported.
# An OMP_NUM_THREADS the caller set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One instruction set for torch's CPU kernels, whatever the machine: ATen, MKL (BLAS) and oneDNN
# (convolutions) pick their kernels by CPU, and kernels of another vector width sum in another
# order, and a runaway amplifies that last bit: on an AVX-512 machine the demo overflows first in
# `fc1` instead of `fc2`, where the quickstart's excerpt (printed with AVX2 kernels, and checked
# line by line against a fresh run) says `fc2`. Every other test passes on either (checked with
# ATEN_CPU_CAPABILITY=avx512 MKL_CBWR=AUTO ONEDNN_MAX_CPU_ISA=ALL, which override these), and
# the demo's story is checked on the machine's own kernels too (tests/tools/test_demo.py).
if platform.machine().lower() in ("x86_64", "amd64"):  # the names are x86's (elsewhere torch warns)
    for _var, _isa in (("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_CBWR", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        os.environ.setdefault(_var, _isa)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder: a Monitor given no run folder writes its
    flight record under ./nummon-runs/ (by design, tested in test_reliability.py), never into
    the checkout."""
    monkeypatch.chdir(tmp_path)


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


try:  # hypothesis keeps no example database in the checkout, and draws the same examples on every run
    # (CI judges a commit, not a dice roll; NUMMON_HYPOTHESIS_RANDOM=1 explores new ones locally)
    from hypothesis import settings

    settings.register_profile(
        "nummon", database=None, deadline=None, derandomize=not os.environ.get("NUMMON_HYPOTHESIS_RANDOM")
    )
    settings.load_profile("nummon")
except ImportError:
    pass

"""`nummon audit` on real checkpoints: census, comparison, and files that are not checkpoints."""

import contextlib
import fractions
import io
import json
import subprocess
import sys

import pytest
import torch
from helpers.checkout import nummon_cmd
from torch import nn

from nummon._cli import main


def cli(*args, timeout=300):
    return subprocess.run(nummon_cmd() + list(args), capture_output=True, text=True, timeout=timeout)


# Each exit status (0 clean, 1 non-finite, 2 refused or unreadable) is checked once through a real
# `python -m nummon audit` process (its exit code and everything on its stderr); the other checks
# call the same `main` in-process, which spares a torch import per check.


def run_main(*args):
    """The CLI in-process (torch is already imported here): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ audit


@pytest.fixture
def ckpts(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(6, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 6)).sum().backward()
    opt.step()
    good = {"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}
    torch.save(good, tmp_path / "a.pt")
    torch.save(good, tmp_path / "a_copy.pt")
    bad_sd = {k: v.clone() for k, v in m.state_dict().items()}
    bad_sd["weight"][0, :3] = float("nan")
    bad_sd["weight"][1, 0] = float("inf")
    bad_sd["bias"][:2] = -float("inf")
    torch.save({"model": bad_sd, "optimizer": opt.state_dict(), "epoch": 3}, tmp_path / "b.pt")
    moved = {k: v + 0.5 for k, v in m.state_dict().items()}
    moved["extra"] = torch.zeros(2)
    torch.save({"model": moved}, tmp_path / "c.pt")
    return tmp_path


@pytest.mark.slow
def test_audit_counts_injected_nan_inf_exactly(ckpts):
    p = cli("audit", str(ckpts / "b.pt"), "--format", "json")
    assert p.returncode == 1
    data = json.loads(p.stdout)
    by = {t["key"]: t for t in data["tensors"]}
    assert (by["model.weight"]["nan"], by["model.weight"]["posinf"], by["model.weight"]["neginf"]) == (3, 1, 0)
    assert (by["model.bias"]["nan"], by["model.bias"]["posinf"], by["model.bias"]["neginf"]) == (0, 0, 2)
    assert by["optimizer.state.0.momentum_buffer"]["nan"] == 0
    assert data["summary"]["nonfinite_tensors"] == 2 and data["summary"]["nan"] == 3
    rc, text, _ = run_main("audit", ckpts / "b.pt")
    assert rc == 1 and "2 with non-finite values (3 NaN, 1 +Inf, 2 -Inf)" in text


@pytest.mark.slow
def test_audit_clean_checkpoint_exit_0(ckpts):
    p = cli("audit", str(ckpts / "a.pt"))
    assert p.returncode == 0 and "0 with non-finite values" in p.stdout


def test_audit_compares_identical_and_different(ckpts):
    rc, same, _ = run_main("audit", ckpts / "a.pt", ckpts / "a_copy.pt", "--format", "json")
    assert rc == 0 and json.loads(same)["comparison"]["identical"] is True
    diff = json.loads(run_main("audit", ckpts / "a.pt", ckpts / "c.pt", "--format", "json")[1])["comparison"]
    assert diff["identical"] is False
    assert "model.extra" in diff["only_in_b"] and "optimizer.state.0.momentum_buffer" in diff["only_in_a"]
    assert {d["key"]: d["max_abs_diff"] for d in diff["different"]}["model.weight"] == pytest.approx(0.5)
    nf = json.loads(run_main("audit", ckpts / "a.pt", ckpts / "b.pt", "--format", "json")[1])["comparison"]
    assert {n["key"] for n in nf["nonfinite_in_one_only"]} == {"model.weight", "model.bias"}


@pytest.mark.slow
def test_audit_refuses_pickled_code_unless_trusted(tmp_path):
    torch.save({"w": torch.ones(2), "frac": fractions.Fraction(1, 3)}, tmp_path / "p.pt")
    p = cli("audit", str(tmp_path / "p.pt"))
    assert p.returncode == 2 and "needs pickled code" in p.stderr and "--trust" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "\x1b" not in p.stderr and "\\x1b" not in p.stderr  # torch's bold escape, neither raw nor quoted
    assert "fractions.Fraction" in p.stderr  # what was refused
    rc, out, _ = run_main("audit", tmp_path / "p.pt", "--trust")
    assert rc == 0 and "w " in out


@pytest.mark.slow
def test_audit_truncated_and_missing_files(ckpts):
    data = (ckpts / "a.pt").read_bytes()
    (ckpts / "t.pt").write_bytes(data[: len(data) // 2])
    p = cli("audit", str(ckpts / "t.pt"))  # a real process: nothing else reaches its stderr
    assert p.returncode == 2 and "truncated" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    rc, _, err = run_main("audit", ckpts / "nope.pt")
    assert rc == 2 and "checkpoint not found" in err and len(err.strip().splitlines()) == 1


def test_audit_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = torch.ones(3, 3)
    t[0, 0] = float("nan")
    st.save_file({"w": t}, str(tmp_path / "m.safetensors"))
    rc, out, _ = run_main("audit", tmp_path / "m.safetensors", "--format", "json")
    assert rc == 1 and json.loads(out)["tensors"][0]["nan"] == 1


# ------------------------------------------------------------------ exact comparisons


def compare_files(tmp_path, a, b):
    torch.save(a, tmp_path / "x.pt")
    torch.save(b, tmp_path / "y.pt")
    rc, out, err = run_main("audit", tmp_path / "x.pt", tmp_path / "y.pt", "--format", "json")
    assert rc in (0, 1), err
    return json.loads(out)


def test_complex_tensors_compare_both_parts(tmp_path):
    cmp = compare_files(tmp_path, {"z": torch.tensor([1 + 1j])}, {"z": torch.tensor([1 + 2j])})["comparison"]
    assert cmp["identical"] is False
    assert cmp["different"] == [{"key": "z", "max_abs_diff": 1.0, "nonfinite_mismatch": 0}]


def test_int64_differences_above_2_pow_53_are_exact(tmp_path):
    big = 2**60
    cmp = compare_files(tmp_path, {"n": torch.tensor([big, 5])}, {"n": torch.tensor([big + 1, 5])})["comparison"]
    assert cmp["identical"] is False and cmp["different"] == [{"key": "n", "max_abs_diff": 1}]
    extreme = compare_files(tmp_path, {"n": torch.tensor([-(2**63)])}, {"n": torch.tensor([2**63 - 1])})["comparison"]
    assert extreme["different"][0]["max_abs_diff"] == 2**64 - 1


def test_int64_minimum_shows_its_magnitude(tmp_path):
    torch.save({"n": torch.tensor([-(2**63), 3])}, tmp_path / "m.pt")
    rc, out, _ = run_main("audit", tmp_path / "m.pt", "--format", "json")
    assert rc == 0 and json.loads(out)["tensors"][0]["max_abs"] == 2**63
    rc, text, _ = run_main("audit", tmp_path / "m.pt")
    assert "9223372036854775808" in text and "-9.2" not in text


def test_dotted_keys_do_not_collide_with_nesting(tmp_path):
    t, u = torch.zeros(2), torch.ones(2)
    report = compare_files(tmp_path, {"a.b": t, "a": {"b": u}}, {"a": {"b": u}, "a.b": t})
    assert len({r["key"] for r in report["tensors"]}) == 2 and report["comparison"]["identical"] is True
    cmp = compare_files(tmp_path, {"a.b": t}, {"a": {"b": t}})["comparison"]
    assert cmp["identical"] is False and cmp["only_in_a"] == ['["a.b"]'] and cmp["only_in_b"] == ["a.b"]


@pytest.mark.slow
def test_a_large_checkpoint_is_read_memory_mapped_and_in_chunks(tmp_path):
    """Peak memory of auditing a 256 MB checkpoint stays near its size: the mapped pages plus
    chunk temporaries (measured 1.5x; it was 4.3x, fully loaded and copied three times)."""
    size = 64 * 2**20  # float32 elements: 256 MB
    w = torch.randn(size)
    w[7] = float("nan")
    torch.save({"w": w}, tmp_path / "big.pt")
    del w
    code = (
        "import resource, sys, torch; from nummon._cli import main; "
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "rc = main(sys.argv[1:]); "
        "print(rc, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "audit", str(tmp_path / "big.pt")], capture_output=True, text=True, timeout=600
    )
    rc, grown = map(int, p.stdout.strip().splitlines()[-1].split())
    assert rc == 1, p.stderr
    assert grown < 2.0 * size * 4, f"peak grew by {grown / 2**20:.0f} MB for a 256 MB checkpoint"


# ------------------------------------------------------------------ special tensors


def test_float8_meta_sparse_and_quantized_tensors(tmp_path):
    f8 = torch.tensor([1.0, float("nan"), 300.0]).to(torch.float8_e4m3fn)
    csr = torch.tensor([[0.0, float("nan")], [2.0, 0.0]]).to_sparse_csr()
    q = torch.quantize_per_tensor(torch.tensor([1.0, -2.0]), 0.1, 0, torch.qint8)
    torch.save({"f8": f8, "csr": csr, "q": q}, tmp_path / "special.pt")
    rc, out, err = run_main("audit", tmp_path / "special.pt", "--format", "json")
    assert rc == 1 and not err, err
    by = {t["key"]: t for t in json.loads(out)["tensors"]}
    assert by["f8"]["nan"] == 1 and by["f8"]["max_abs"] == 288.0 and by["f8"]["headroom"] > 0  # 300 rounds to 288
    assert by["csr"]["nan"] == 1 and "sparse (csr)" in by["csr"]["note"]
    assert by["q"]["nan"] == 0 and by["q"]["max_abs"] == pytest.approx(2.0) and "quantized" in by["q"]["note"]
    meta = {"w": torch.empty(3, 4, device="meta")}
    from nummon._tools.audit import audit_object, compare

    row = audit_object(meta)[0]
    assert row.note == "meta tensor: no data to check" and row.shape == [3, 4]
    cmp = compare(meta, meta)
    assert cmp["not_compared"] == [{"key": "w", "reason": "meta tensor: no data to check"}] and not cmp["identical"]
    rc, text, err = run_main("audit", tmp_path / "special.pt", tmp_path / "special.pt")
    assert rc == 1 and "note: csr: sparse (csr)" in text and "identical" in text


def test_auditing_a_quantized_checkpoint_prints_no_torch_deprecation(tmp_path):
    # a fresh process: torch says each warning once per process, so only here is the first time certain
    import warnings

    with warnings.catch_warnings():  # torch's own deprecation of quantized tensors, said at creation too
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.tensor([1.0, -2.0]), 0.1, 0, torch.qint8)
    torch.save({"q": q}, tmp_path / "q.pt")
    p = subprocess.run(
        [sys.executable, "-m", "nummon", "audit", str(tmp_path / "q.pt")], capture_output=True, text=True
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr


# ------------------------------------------------------------------ files that are not checkpoints


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("notes.pt", b"epoch 3: loss 0.25\nall good\n", "is not a PyTorch checkpoint: it is a text file"),
        (
            "noise.pt",
            bytes((i * 97 + 13) % 256 for i in range(4096)),
            "is not a PyTorch checkpoint: neither a torch zip archive",
        ),
        ("arr.pt", b"\x93NUMPY\x01\x00" + b"\x00" * 100, "it looks like a NumPy .npy array"),
        ("empty.pt", b"", "the file is empty"),
    ],
)
def test_files_that_are_not_checkpoints_are_named_not_trusted(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    rc, out, err = run_main("audit", tmp_path / name)
    assert rc == 2 and needle in err and "--trust" not in err and "pickled code" not in err
    assert len(err.strip().splitlines()) == 1


def test_safetensors_named_pt_is_read_as_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = torch.ones(2, 2)
    t[1, 1] = float("inf")
    st.save_file({"w": t}, str(tmp_path / "model.pt"))
    rc, out, err = run_main("audit", tmp_path / "model.pt", "--format", "json")
    data = json.loads(out)
    assert rc == 1 and data["format"] == "safetensors" and data["tensors"][0]["posinf"] == 1


@pytest.mark.slow
def test_a_healthy_lightning_checkpoint_passes_and_its_metadata_is_listed(tmp_path):
    """Lightning's ModelCheckpoint keeps kth_value = +Inf in its callback state: listed, not failing."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16))
    (ckpt,) = tmp_path.rglob("*.ckpt")
    rc, out, err = run_main("audit", ckpt)
    assert rc == 0, out + err
    assert "kth_value" in out and "trainer metadata" in out, out
    # a long key does not blow the table's width
    rows = [line for line in out.splitlines() if " float32 " in line or " int64 " in line]
    assert rows and max(len(line) for line in rows) <= 120, out
    assert any("kth_value" in line and line.endswith("(metadata)") for line in rows), out
    # a NaN in the weights still fails it
    state = torch.load(ckpt, weights_only=True)
    next(iter(state["state_dict"].values()))[0] = float("nan")
    torch.save(state, tmp_path / "bad.ckpt")
    rc, out, _ = run_main("audit", tmp_path / "bad.ckpt")
    assert rc == 1

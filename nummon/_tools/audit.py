"""Checkpoint audit: NaN/Inf census of checkpoints, and an exact comparison of two.

Files are recognised by their first bytes (torch zip archive, legacy pickle, safetensors; other
known formats and text are named in the error). Torch checkpoints load with
``torch.load(..., weights_only=True, mmap=True)`` where the format allows, and tensors are read
in chunks, so a 1 GB checkpoint needs little more than its own pages. A file that needs pickled
code is refused unless the caller passes ``trust=True``. Printing is the CLI's job.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._core.errors import NummonError
from .._core.json import json_safe
from .._core.maths import headroom_decades
from .._core.text import clean_text
from .audit_compare import compare, iter_tensors, key_name, numeric_chunks, numeric_view

__all__ = [
    "METADATA_ROOTS",
    "AuditReport",
    "CheckpointAudit",
    "TensorAudit",
    "audit",
    "audit_object",
    "audit_tensor",
    "compare",
    "iter_tensors",
    "key_name",
    "load_checkpoint",
    "report_json",
    "sniff_format",
]


@dataclass
class TensorAudit:
    """Census of one tensor (counts exact; max_abs over finite values, exact for integers;
    headroom in decades below the dtype's largest finite value; `note` for special tensors)."""

    key: str
    shape: list[int]
    dtype: str
    numel: int
    nan: int
    posinf: int
    neginf: int
    max_abs: float | int | None
    headroom: float | None
    note: str | None = None
    metadata: bool = False  # trainer metadata (callback / loop state): listed, does not decide the verdict

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


#: Top-level keys of trainer checkpoints that hold the trainer's own bookkeeping, not the model or
#: optimizer: Lightning's `ModelCheckpoint` keeps `kth_value = +Inf` there in a healthy run.
METADATA_ROOTS = frozenset(
    {
        "callbacks",
        "loops",
        "hyper_parameters",
        "hparams",
        "datamodule_hyper_parameters",
        "lr_schedulers",
        "trainer_state",
    }
)


@dataclass
class CheckpointAudit:
    """One file's census: its format and one row per tensor."""

    path: str
    format: str
    tensors: list[TensorAudit] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, Any]:
        heads = [r.headroom for r in self.tensors if r.headroom is not None]
        return {
            "tensors": len(self.tensors),
            "elements": sum(r.numel for r in self.tensors),
            # weights, buffers and optimizer state decide; non-finite metadata is counted apart
            "nonfinite_tensors": sum(r.nonfinite > 0 and not r.metadata for r in self.tensors),
            "nonfinite_metadata": sum(r.nonfinite > 0 and r.metadata for r in self.tensors),
            "nan": sum(r.nan for r in self.tensors if not r.metadata),
            "posinf": sum(r.posinf for r in self.tensors if not r.metadata),
            "neginf": sum(r.neginf for r in self.tensors if not r.metadata),
            "min_headroom": min(heads) if heads else None,
        }


@dataclass
class AuditReport:
    """The census of one or two checkpoints and, for two, their comparison."""

    first: CheckpointAudit
    second: CheckpointAudit | None = None
    comparison: dict[str, Any] | None = None

    @property
    def nonfinite_tensors(self) -> int:
        """Tensors of weights, buffers or optimizer state holding NaN/Inf over both files (the
        CLI exits 1 when > 0); trainer metadata does not count."""
        return sum(c.summary["nonfinite_tensors"] for c in (self.first, self.second) if c is not None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: strict JSON, non-finite floats as "NaN" / "Infinity" / "-Infinity" (nummon's one encoding)."""
        out: dict[str, Any] = {
            "checkpoint": self.first.path,
            "format": self.first.format,
            "tensors": [asdict(r) for r in self.first.tensors],
            "summary": self.first.summary,
        }
        if self.second is not None:
            out.update(
                {
                    "checkpoint2": self.second.path,
                    "format2": self.second.format,
                    "tensors2": [asdict(r) for r in self.second.tensors],
                    "summary2": self.second.summary,
                    "comparison": self.comparison,
                }
            )
        return json_safe(out)


# ------------------------------------------------------------------ loading

_OTHER_FORMATS = (
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras .h5?)"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"GGUF", "a GGUF model file"),
    (b"\x89PNG", "a PNG image"),
    (b"%PDF", "a PDF document"),
)


def sniff_format(path: Path) -> str:
    """'zip' (torch.save), 'pickle' (legacy torch.save), 'safetensors', 'text', or a description
    of another known format / 'unknown'."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(512)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) >= 10 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    for magic, what in _OTHER_FORMATS:
        if head.startswith(magic):
            return what
    if not head:
        return "empty"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None  # a multi-byte character cut at 512 bytes still reads as text below
        try:
            text = head[:-4].decode("utf-8") if len(head) == 512 else None
        except UnicodeDecodeError:
            pass
    if text is not None and all(c.isprintable() or c in "\r\n\t" for c in text):
        return "text"
    return "unknown"


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal colour / bold sequences in torch's messages


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message, with terminal escapes removed."""
    text = _ANSI.sub("", str(e)).strip()
    return clean_text(text.splitlines()[0]) if text else type(e).__name__


def _refusal_reason(e: BaseException) -> str | None:
    """What weights_only refused ("Unsupported global: GLOBAL fractions.Fraction ..."), or None
    when the error is not a weights_only refusal."""
    text = _ANSI.sub("", str(e))
    for line in text.splitlines():
        if "Unsupported global" in line or "Unsupported operand" in line:
            reason = line.strip().removeprefix("WeightsUnpickler error:").strip()
            return clean_text(reason.split(" was not an allowed global")[0])
    return "weights_only refused it" if "weights only load failed" in text.lower() else None


def _load_safetensors(p: Path) -> Any:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise NummonError(
            f"{p} is a safetensors file; reading it needs the safetensors package: pip install 'nummon[safetensors]'"
        ) from None
    try:
        return load_file(str(p))
    except Exception as e:
        raise NummonError(f"cannot read safetensors file {p}: {_first_line(e)[:160]}") from None


def load_checkpoint(path: str | Path, trust: bool = False) -> tuple[Any, str]:
    """(loaded object, format) of a checkpoint, safely (weights_only unless `trust`, memory-
    mapped for zip archives); NummonError with one line on any failure."""
    p = Path(path)
    if not p.exists():
        raise NummonError(f"checkpoint not found: {p}")
    if p.is_dir():
        raise NummonError(f"checkpoint is a directory: {p}")
    try:
        fmt = sniff_format(p)
    except OSError as e:
        raise NummonError(f"cannot read checkpoint {p}: {e.strerror}") from None
    if fmt == "safetensors":
        return _load_safetensors(p), fmt
    if fmt == "empty":
        raise NummonError(f"{p} is not a PyTorch checkpoint: the file is empty")
    if fmt == "text":
        raise NummonError(f"{p} is not a PyTorch checkpoint: it is a text file")
    if fmt == "unknown":
        raise NummonError(
            f"{p} is not a PyTorch checkpoint: neither a torch zip archive, a pickle nor a safetensors file"
        )
    if fmt not in ("zip", "pickle"):
        raise NummonError(f"{p} is not a PyTorch checkpoint: it looks like {fmt}")
    try:
        with warnings.catch_warnings():
            # torch's own deprecations, said while it rebuilds a quantized tensor (TypedStorage,
            # quantize_per_tensor): nothing the checkpoint's user did or can change
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            return torch.load(p, map_location="cpu", weights_only=not trust, mmap=fmt == "zip"), fmt
    except pickle.UnpicklingError as e:
        reason = None if trust else _refusal_reason(e)
        if reason is not None:
            raise NummonError(
                f"checkpoint {p} needs pickled code to load and was refused (weights_only=True); "
                f"pass --trust only if you trust its source ({reason[:120]})"
            ) from None
        raise NummonError(
            f"cannot read checkpoint {p}: file is truncated or corrupt ({_first_line(e)[:160]})"
        ) from None
    except Exception as e:  # truncated zip, EOF, a torch version that cannot read it: one message
        raise NummonError(
            f"cannot read checkpoint {p}: file is truncated or corrupt ({_first_line(e)[:160]})"
        ) from None


# ------------------------------------------------------------------ census


def _headroom(max_abs: float, dtype: torch.dtype) -> float:
    """Decades between the largest finite magnitude and the dtype's largest finite value."""
    return headroom_decades(max_abs, float(torch.finfo(dtype).max))


def audit_tensor(key: str, t: torch.Tensor) -> TensorAudit:
    """Exact NaN/+Inf/-Inf counts and max |finite value| of one tensor, read in chunks."""
    t = t.detach()
    dtype = str(t.dtype).replace("torch.", "")
    shape = list(t.shape)
    data, note = numeric_view(t)
    if data is None:
        return TensorAudit(key, shape, dtype, t.numel(), 0, 0, 0, None, None, note)
    nan = posinf = neginf = 0
    top: float | int | None = None
    if data.is_floating_point():
        for c in numeric_chunks(data):
            nan += int(torch.isnan(c).sum())
            posinf += int(torch.isposinf(c).sum())
            neginf += int(torch.isneginf(c).sum())
            fin = torch.where(torch.isfinite(c), c.abs(), torch.zeros((), dtype=c.dtype))
            if fin.numel():
                m = float(fin.max())
                top = m if top is None else max(top, m)
        headroom = (
            _headroom(top, t.dtype if t.dtype.is_floating_point or t.is_complex() else torch.float32)
            if top is not None and not t.is_quantized
            else None
        )
        if nan + posinf + neginf == data.numel():
            top = headroom = None  # no finite value: nothing to measure
    elif data.dtype == torch.bool:
        headroom = None
    else:
        for c in numeric_chunks(data):
            if c.numel():
                values = c.tolist() if c.dtype == torch.uint64 else (int(c.min()), int(c.max()))
                m = max(abs(int(v)) for v in values)  # Python ints: |int64 min| does not overflow
                top = m if top is None else max(top, m)
        headroom = None
    return TensorAudit(key, shape, dtype, t.numel(), nan, posinf, neginf, top, headroom, note)


def audit_object(obj: Any) -> list[TensorAudit]:
    """One row per tensor of a loaded checkpoint object; those under a trainer's metadata
    (METADATA_ROOTS, in a checkpoint that is a dict of sections) are marked `metadata`."""
    rows = []
    for k, t in iter_tensors(obj):
        row = audit_tensor(key_name(k), t)
        row.metadata = len(k) > 1 and isinstance(k[0], str) and k[0] in METADATA_ROOTS
        rows.append(row)
    return rows


def audit(path: str | Path, second: str | Path | None = None, trust: bool = False) -> AuditReport:
    """Census of `path` (and `second`, with their comparison); NummonError on unreadable input."""
    obj, fmt = load_checkpoint(path, trust=trust)
    report = AuditReport(CheckpointAudit(str(path), fmt, audit_object(obj)))
    if second is not None:
        obj2, fmt2 = load_checkpoint(second, trust=trust)
        report.second = CheckpointAudit(str(second), fmt2, audit_object(obj2))
        report.comparison = compare(obj, obj2)
    return report


def report_json(report: AuditReport) -> str:
    """The report as strict JSON text."""
    return json.dumps(report.to_dict(), indent=1, allow_nan=False, default=str)

"""Threshold policies: every threshold and window of every detector, validated strictly.

A policy is a pydantic model with ``extra="forbid"`` everywhere, so a typo is an error rather
than a silently ignored setting. Presets live as YAML in ``configs/`` (installed as
``nummon.configs``) and load by name. The sections live in ``sections`` (the record
detectors, and what every section shares), ``mechanism_sections`` and ``runtime``; every
name is re-exported here.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from .._core.errors import NummonError
from .mechanism_sections import (  # noqa: F401  (re-exported: the mechanism sections)
    AdamMomentPolicy,
    AttentionPolicy,
    MechanismsPolicy,
    OutputLogitsPolicy,
)
from .runtime import (  # noqa: F401  (re-exported: the runtime sections)
    AlertPolicy,
    ForensicsPolicy,
    RecorderPolicy,
    RecoveryPolicy,
    ReplicasPolicy,
    ReportPolicy,
    SamplingPolicy,
    SinkPolicy,
)
from .sections import (  # noqa: F401  (re-exported: the detector sections)
    MAX_WINDOW,
    Decades,
    DivergencePolicy,
    FloatDtype,
    HeadroomPolicy,
    NonfinitePolicy,
    OscillationPolicy,
    RunawayPolicy,
    SpikePolicy,
    StallPolicy,
    TrendPolicy,
    VanishingPolicy,
    _Section,
)

__all__ = [
    "FloatDtype",
    "Policy",
    "PolicyError",
    "PolicyLike",
    "MAX_POLICY_BYTES",
    "MAX_WINDOW",
    "NonfinitePolicy",
    "SpikePolicy",
    "RunawayPolicy",
    "HeadroomPolicy",
    "DivergencePolicy",
    "TrendPolicy",
    "StallPolicy",
    "OscillationPolicy",
    "VanishingPolicy",
    "MechanismsPolicy",
    "AttentionPolicy",
    "OutputLogitsPolicy",
    "AdamMomentPolicy",
    "AlertPolicy",
    "SamplingPolicy",
    "RecorderPolicy",
    "SinkPolicy",
    "load_policy",
    "policy_from_mapping",
    "policy_yaml",
    "preset_names",
    "validate_policy_file",
    "validation_messages",
]

#: Policy files above this size are refused before parsing (a real policy is a few hundred bytes).
MAX_POLICY_BYTES = 1_000_000

#: Keys that moved to another section, so an old policy file gets a pointer, not just "unknown key".
_MOVED: dict[tuple[str, ...], str] = {
    ("stall", "window"): "trend.min_span",
    ("oscillation", "window"): "trend.min_span",
    ("divergence", "baseline_steps"): "trend.baseline_records",
}


class PolicyError(NummonError):
    """A policy could not be loaded or is invalid; the message is one line per problem."""


class Policy(_Section):
    """Every threshold and window nummon uses. Load presets with ``load_policy("strict")``."""

    name: str = Field("custom", description="a label for reports")
    nonfinite: NonfinitePolicy = NonfinitePolicy()
    spike: SpikePolicy = SpikePolicy()
    runaway: RunawayPolicy = RunawayPolicy()
    headroom: HeadroomPolicy = HeadroomPolicy()
    divergence: DivergencePolicy = DivergencePolicy()
    trend: TrendPolicy = TrendPolicy()
    stall: StallPolicy = StallPolicy()
    oscillation: OscillationPolicy = OscillationPolicy()
    vanishing: VanishingPolicy = VanishingPolicy()
    attention: AttentionPolicy = AttentionPolicy()
    output_logits: OutputLogitsPolicy = OutputLogitsPolicy()
    adam_moment: AdamMomentPolicy = AdamMomentPolicy()
    mechanisms: MechanismsPolicy = MechanismsPolicy()
    alerts: AlertPolicy = AlertPolicy()
    sampling: SamplingPolicy = SamplingPolicy()
    recorder: RecorderPolicy = RecorderPolicy()
    sinks: SinkPolicy = SinkPolicy()
    recovery: RecoveryPolicy = RecoveryPolicy()
    forensics: ForensicsPolicy = ForensicsPolicy()
    replicas: ReplicasPolicy = ReplicasPolicy()
    report: ReportPolicy = ReportPolicy()

    @model_validator(mode="after")
    def _windows(self) -> Policy:
        if self.spike.min_history > self.spike.window:
            raise ValueError("spike.min_history must be <= spike.window")
        return self


PolicyLike = Union[Policy, str, "os.PathLike[str]", dict, None]


def preset_names() -> list[str]:
    """Names of the presets shipped in ``configs/``."""
    return sorted(p.name[:-5] for p in resources.files("nummon.configs").iterdir() if p.name.endswith(".yaml"))


def _read_mapping(path: Path) -> dict[str, Any]:
    """The mapping in a policy file; every failure is one line naming the file and the problem."""
    try:
        size = path.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError(f"policy file {path} is {size:,} bytes; a policy is at most {MAX_POLICY_BYTES:,}")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"policy file not found: {path}") from None
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"policy file {path} is not UTF-8 text (byte {e.start})") from None
    return _parse_mapping(text, path.suffix.lower(), str(path))


def _parse_mapping(text: str, suffix: str, origin: str) -> dict[str, Any]:
    """Parse policy text by suffix (.json, .toml, else YAML) into a mapping."""
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = _yaml_load(text)
    except PolicyError as e:
        raise PolicyError(f"cannot parse policy {origin}: {e}") from None
    except RecursionError:
        raise PolicyError(f"cannot parse policy {origin}: nested too deeply") from None
    except Exception as e:  # parser errors differ per format; one line with a position is what the user needs
        raise PolicyError(f"cannot parse policy {origin}: {_parse_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy {origin} must hold a mapping, got {type(data).__name__}")
    return data


def _yaml_load(text: str) -> Any:
    """YAML through a safe loader that refuses a key given twice in one mapping (the last value
    would win silently): PolicyError naming the key and both lines."""
    import yaml

    class _UniqueKeyLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise PolicyError(f"duplicate key {key!r} at line {line} (first given at line {first})")
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    _UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _parse_problem(e: Exception) -> str:
    """One line: the parser's problem and, where it knows it, the line and column (1-based)."""
    mark = getattr(e, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        problem = getattr(e, "problem", None) or getattr(e, "context", None) or type(e).__name__
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}, column {e.colno}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _loc_part(p: Any) -> str:
    """A field path element as the user typed it; odd keys (spaces, newlines) quoted."""
    text = str(p)
    return text if isinstance(p, int) or text.replace("_", "a").isalnum() else repr(text)


def validation_messages(err: ValidationError) -> list[str]:
    """One line per problem, each with its field path."""
    out = []
    for e in err.errors():
        loc = ".".join(_loc_part(p) for p in e["loc"]) or "(policy)"
        msg = e["msg"].replace("\n", " ")
        if e["type"] == "extra_forbidden":
            moved = _MOVED.get(tuple(str(p) for p in e["loc"]))
            msg = f"unknown key (moved to {moved})" if moved else "unknown key"
        out.append(f"{loc}: {msg}")
    return out


def policy_from_mapping(data: dict[str, Any], origin: str = "policy") -> Policy:
    """Validate a mapping into a Policy; every problem in one line."""
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        msgs = validation_messages(e)
        raise PolicyError(f"invalid {origin}: " + "; ".join(msgs)) from None
    except RecursionError:
        raise PolicyError(f"invalid {origin}: nested too deeply") from None


def load_policy(source: PolicyLike = None) -> Policy:
    """Resolve a preset name, a file path, a mapping or a Policy into a validated Policy."""
    if source is None:
        source = "default"
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return policy_from_mapping(source)
    if isinstance(source, (str, os.PathLike)):
        data, origin = _source_mapping(source)
        return policy_from_mapping(data, origin)
    raise PolicyError(f"policy must be a preset name, a path, a mapping or nummon.Policy, got {type(source).__name__}")


def _source_mapping(source: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(mapping, origin) of a preset name or a policy file path."""
    text = os.fspath(source)
    if "\0" in text:
        raise PolicyError("policy path contains a NUL byte")
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".toml", ".json") or os.sep in text or path.exists():
        return _read_mapping(path), f"policy {path}"
    names = preset_names()
    if text not in names:
        raise PolicyError(
            f"unknown policy preset {text!r} (presets: {', '.join(names)}; or give a .yaml/.toml/.json path)"
        )
    preset = resources.files("nummon.configs").joinpath(f"{text}.yaml").read_text("utf-8")
    return _parse_mapping(preset, ".yaml", f"preset {text!r}"), f"preset {text!r}"


def policy_yaml(policy: Policy, with_descriptions: bool = True) -> str:
    """The effective policy as YAML, each field preceded by its description as a comment."""
    lines: list[str] = []

    def emit(model: BaseModel, indent: int) -> None:
        pad = "  " * indent
        for name, info in type(model).model_fields.items():
            value = getattr(model, name)
            if with_descriptions and info.description:
                lines.append(f"{pad}# {info.description}")
            if isinstance(value, BaseModel):
                lines.append(f"{pad}{name}:")
                emit(value, indent + 1)
            else:
                import yaml

                dumped = yaml.safe_dump(
                    {name: list(value) if isinstance(value, tuple) else value}, default_flow_style=True, sort_keys=False
                ).strip()
                if dumped.startswith("{") and dumped.endswith("}"):
                    dumped = dumped[1:-1]
                lines.append(f"{pad}{dumped}")

    emit(policy, 0)
    return "\n".join(lines) + "\n"


def validate_policy_file(path: str | os.PathLike[str]) -> list[str]:
    """Every validation error of a policy file or preset name, each with its field path (empty:
    valid). A file that cannot be read or parsed raises PolicyError (one line)."""
    data, _ = _source_mapping(path)
    try:
        Policy.model_validate(data)
    except ValidationError as e:
        return validation_messages(e)
    except RecursionError:
        return ["(policy): nested too deeply"]
    return []

"""The reference pages of the documentation site, generated from the code at build time.

mkdocs runs this file as a hook (``hooks:`` in mkdocs.yml): ``on_files`` adds every page of
``PAGES`` to the site as a generated file, so the reference can never drift from the code. Run
it by hand to see the pages: ``python docs/gen_ref.py OUT_DIR`` writes them as Markdown.

Sources: the pydantic policy (every field's default, unit and description), the ``AlertKind``
enum with each kind's detector and hint, the argparse parsers of the CLI, ``nummon.__all__``
(rendered by mkdocstrings), the Prometheus metric table and the shipped rule files.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's nummon, also when mkdocs runs from elsewhere
    sys.path.insert(0, str(ROOT))

__all__ = [
    "PAGES",
    "alert_kinds_page",
    "api_page",
    "cli_page",
    "metrics_page",
    "modules_page",
    "policy_keys",
    "policy_page",
    "rules_page",
    "on_files",
    "write_pages",
]

#: Units a policy description may end with, in parentheses: "(steps)", "(loss units; default: unknown)".
_UNITS = (
    "steps",
    "records",
    "ratio",
    "fraction",
    "seconds",
    "samples",
    "count",
    "multiple",
    "skips",
    "nats",
    "log10 units",
    "loss units",
)
_TRAILING_PAREN = re.compile(r"\s*\(([^()]*)\)\s*$")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    """Inline code for a table cell; backticks inside get a longer fence."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# --- the policy ---------------------------------------------------------------------------------


def _split_unit(description: str) -> tuple[str, str]:
    """(meaning, unit) of a field description whose last parenthesis names a unit; else (description, "")."""
    m = _TRAILING_PAREN.search(description)
    if m and m.group(1).split(";")[0].strip().startswith(_UNITS):
        return description[: m.start()].rstrip(), m.group(1)
    return description, ""


def _yaml_value(value: Any) -> str:
    """A default as it is written in a policy file (YAML flow style)."""
    import yaml

    if isinstance(value, tuple):
        value = list(value)
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):  # an enum
        value = value.value
    dumped = yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
    return dumped.removesuffix("\n...").removesuffix("...").strip()


def _bounds(info: Any) -> str:
    """The allowed range of a field from its pydantic constraints: ">= 1, <= 100000"."""
    parts = []
    for meta in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                parts.append(f"{sign} {bound:g}" if isinstance(bound, float) else f"{sign} {bound}")
    return ", ".join(parts)


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"nummon\.[\w.]+\.", "", text)


def _sections() -> Iterator[tuple[str, Any, Any]]:
    """(section name, its pydantic class, its default instance) for each section of the Policy."""
    from pydantic import BaseModel

    from nummon._policy.policy import Policy

    default = Policy()
    for name in Policy.model_fields:
        value = getattr(default, name)
        if isinstance(value, BaseModel):
            yield name, type(value), value


def policy_keys() -> list[str]:
    """Every key of the policy as its dotted path: "name", "spike.window", ..."""
    from pydantic import BaseModel

    from nummon._policy.policy import Policy

    keys = [n for n, i in Policy.model_fields.items() if not isinstance(getattr(Policy(), n), BaseModel)]
    for section, cls, _ in _sections():
        keys += [f"{section}.{k}" for k in cls.model_fields]
    return keys


def policy_page() -> str:
    """Every section and key of `nummon.Policy`: default, unit, allowed range, meaning."""
    from nummon._policy.policy import Policy, load_policy, policy_yaml, preset_names

    out = [
        "# Policy reference",
        "",
        'Every threshold and window nummon uses is a field of `nummon.Policy` (pydantic, `extra="forbid"`: '
        "a misspelt key is an error, with the closest known key suggested). This page is generated from the "
        "policy's own field descriptions; `nummon policy show default` prints the same as commented YAML.",
        "",
        "A policy file holds only what differs from the defaults:",
        "",
        "```yaml",
        "# my-policy.yaml",
        "name: my-run",
        "spike: {grad_factor: 20.0, window: 100}",
        "alerts: {stop_on_critical: false, cooldown_steps: 50}",
        "```",
        "",
        "Pass a preset name, a YAML/TOML/JSON file, a dict or a `Policy` wherever a policy is taken "
        "(`Monitor(policy=...)`, the callbacks, `--policy` on the command line); "
        "`nummon policy validate FILE` prints each error with its field path (exit 2).",
        "",
        "Presets shipped in `nummon/configs/`: " + ", ".join(f"`{n}`" for n in preset_names()) + ".",
        "",
        "Units: *steps* are optimizer steps; *records* are rows of a log (one per step in a live run, one "
        "per logged step in replay and watch); *samples* are the sampled steps of a probe; a *ratio* is a "
        "multiple of a reference value; a *fraction* lies between 0 and 1.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    top = {n: i for n, i in Policy.model_fields.items() if n not in {s for s, _, _ in _sections()}}
    for name, info in top.items():
        out.append(f"| `{name}` | {_code(_yaml_value(info.default))} | {_cell(info.description or '')} |")
    for section, cls, value in _sections():
        doc = inspect.cleandoc(cls.__doc__ or "") if cls.__doc__ and "BaseModel" not in cls.__doc__ else ""
        out += ["", f"## `{section}`", ""]
        if doc:
            out += [doc, ""]
        out += ["| key | default | unit | allowed | meaning |", "|---|---|---|---|---|"]
        for key, info in cls.model_fields.items():
            meaning, unit = _split_unit(info.description or "")
            if not unit and info.annotation is bool:
                unit = "on/off"
            allowed = _bounds(info) or _type_name(info.annotation)
            out.append(
                f"| `{section}.{key}` | {_code(_yaml_value(getattr(value, key)))} | {_cell(unit)} | "
                f"{_cell(allowed)} | {_cell(meaning)} |"
            )
    for name in preset_names():
        if name == "default":
            continue
        preset = load_policy(name)
        changed = _differences(Policy(), preset)
        out += ["", f"## Preset `{name}`", "", "What it changes from the defaults:", "", "```yaml"]
        out += changed or ["# nothing"]
        out += ["```"]
    out += ["", "## The default policy as YAML", "", "```yaml", policy_yaml(load_policy("default")).rstrip(), "```", ""]
    return "\n".join(out)


def _differences(base: Any, other: Any) -> list[str]:
    """Lines "section.key: value" where `other` differs from `base` (the name excepted)."""
    from pydantic import BaseModel

    lines = []
    for name in type(base).model_fields:
        a, b = getattr(base, name), getattr(other, name)
        if isinstance(a, BaseModel):
            lines += [
                f"{name}.{k}: {_yaml_value(getattr(b, k))}"
                for k in type(a).model_fields
                if getattr(a, k) != getattr(b, k)
            ]
        elif a != b and name != "name":
            lines.append(f"{name}: {_yaml_value(b)}")
    return lines


# --- alert kinds ----------------------------------------------------------------------------------


def alert_kinds_page() -> str:
    """Every `AlertKind`: the detector that raises it, its policy section, what it watches, its hint."""
    from nummon._core.types import INSTABILITY_KINDS, AlertKind
    from nummon._engine.detectors import DETECTORS
    from nummon._engine.hints import _BASE

    owner = {kind: det for det in DETECTORS for kind in det.kinds}
    out = [
        "# Alert kinds",
        "",
        "Every alert has a `kind` (`nummon.AlertKind`), a `severity` (`info`, `warning`, `critical`), the "
        "metric, value, threshold and location, and a `hint`: what to try. This page is generated from the "
        "enum, the detectors that raise each kind and the hints in `nummon/_engine/hints.py`; the hint shown is a "
        "kind's general one, which an alert makes more specific when it knows more (the optimizer, the dtype, "
        "the stage that overflowed).",
        "",
        "Each condition raises one alert while it holds (deduplicated per kind, metric and location), a new "
        "one when it escalates from warning to critical, and an `info` alert when it clears; the same "
        "condition is not announced again within `alerts.cooldown_steps`. Alerts are grouped into one "
        "incident per run (see [the training loop](../guides/training-loop.md#incidents-one-message-per-incident)).",
        "",
        "| kind | class | detector (policy section) |",
        "|---|---|---|",
    ]
    for kind in AlertKind:
        det = owner.get(kind)
        where = f"`{det.__name__}` ([`{det.section}`](policy.md#{det.section.replace('_', '_')}))" if det else "—"
        cls = "instability" if kind in INSTABILITY_KINDS else "not learning"
        if kind is AlertKind.REPLICA_MISMATCH:
            cls, where = "hardware", "`nummon/_forensics/replicas.py` ([`replicas`](policy.md#replicas))"
        out.append(f"| [`{kind.value}`](#{kind.value}) | {cls} | {where} |")
    for kind in AlertKind:
        det = owner.get(kind)
        out += ["", f"## `{kind.value}`", ""]
        if det is not None:
            out += [
                _user_doc(det.__doc__),
                "",
                f"Raised by `{det.__name__}`, configured by the policy section "
                f"[`{det.section}`](policy.md#{det.section}).",
                "",
            ]
        elif kind is AlertKind.REPLICA_MISMATCH:
            out += [
                "Data-parallel replicas whose gradients or parameters are not bit-identical across ranks "
                "(see [Hardware or algorithm?](../guides/hardware-or-algorithm.md)).",
                "",
                "Raised by `nummon/_forensics/replicas.py` (it compares ranks, not records), configured by the policy "
                "section [`replicas`](policy.md#replicas).",
                "",
            ]
        hint = _BASE.get(kind)
        if hint:
            out += [f"**Hint**: {hint}", ""]
    return "\n".join(out)


def _user_doc(doc: str | None) -> str:
    """A detector's docstring for users: without the "Shared value(s): ..." notes on its wiring."""
    text = re.sub(r"\s*Shared values?:.*?(?=\n\n|\Z)", "", inspect.cleandoc(doc or ""), flags=re.S)
    return text.strip()


# --- the command line -----------------------------------------------------------------------------


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
            name = ", ".join(f"{o}{metavar}" for o in action.option_strings)
        else:
            name = formatter._format_args(action, action.dest)
        help_text = formatter._expand_help(action) if action.help else ""
        if action.choices and not isinstance(action.choices, dict) and "{" not in name:
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        default = action.default
        shown = (
            ""
            if default in (None, False, argparse.SUPPRESS) or action.nargs == 0
            else _code(repr(default) if not isinstance(default, str) else default)
        )
        rows.append(f"| {_code(name)} | {shown} | {_cell(help_text)} |")
    return rows


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """Every `nummon` subcommand's parser, by name, from the CLI's own build_parser()."""
    from nummon._cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def cli_page() -> str:
    """`nummon` and each subcommand: usage, description, every option with its default and help."""
    from nummon._cli import build_parser

    out = [
        "# Command line",
        "",
        "Generated from the argparse parsers of `nummon` (`nummon COMMAND --help` prints the same). "
        "Exit status: 0 fine, 1 a finding (audit: NaN/Inf; watch `--once`: a notification lost), "
        "2 bad input (one line on stderr, no traceback).",
        "",
    ]
    top = build_parser()
    out += ["```text", _usage(top), "```", ""]
    for name, parser in cli_commands().items():
        out += [f"## `nummon {name}`", "", _cell(parser.description or ""), "", "```text", _usage(parser), "```", ""]
        out += ["| argument | default | meaning |", "|---|---|---|"] + _option_rows(parser)
        if parser.epilog:
            out += ["", "```text", parser.epilog.strip(), "```"]
        out.append("")
    return "\n".join(out)


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line, wrapped at a fixed width whatever the terminal."""
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


# --- the public API -------------------------------------------------------------------------------


def _api_path(name: str) -> str:
    """The dotted path mkdocstrings reads `nummon.<name>` from: where it is defined in the source
    (public classes report `__module__ == "nummon"`; integrations/ is a top-level package in the checkout)."""
    import nummon

    obj = getattr(nummon, name)
    if inspect.ismodule(obj):
        return obj.__name__
    source = Path(inspect.getsourcefile(obj) or "").resolve()
    if source.is_relative_to(ROOT) and ".venv" not in source.relative_to(ROOT).parts:
        parts = source.relative_to(ROOT).with_suffix("").parts
    else:  # an installed nummon (CI builds the site beside a non-editable install): the checkout's names
        parts = source.with_suffix("").parts
        parts = parts[len(parts) - 1 - parts[::-1].index("nummon") :]
        if parts[:2] == ("nummon", "integrations"):  # the checkout keeps integrations/ at the top
            parts = parts[1:]
    module = ".".join(parts).removesuffix(".__init__")
    return f"{module}.{obj.__qualname__}"


def api_page() -> str:
    """`nummon.__all__`, each entry rendered from its docstrings by mkdocstrings."""
    import nummon

    out = [
        "# Public API",
        "",
        "Everything importable from `nummon` (its `__all__`), rendered from the docstrings. Anything "
        "else is internal and may change. `Monitor` and the framework sinks import torch or their "
        "framework on first use; the rest (replay, the policy, the plain data types) runs without torch.",
        "",
        "Framework callbacks live in their own modules: `nummon.integrations.lightning.NummonLightningCallback` and "
        "`nummon.integrations.transformers.NummonTrainerCallback` (see [the callbacks guide](../guides/callbacks.md)).",
        "",
    ]
    for name in sorted(nummon.__all__, key=lambda n: (n != "Monitor", n.lower())):
        out += [
            f"## `nummon.{name}`",
            "",
            f"::: {_api_path(name)}",
            "    options:",
            "      show_root_heading: false",
            "      heading_level: 3",
            "",
        ]
    return "\n".join(out)


# --- Prometheus -----------------------------------------------------------------------------------


def metrics_page() -> str:
    """Every series `nummon watch --metrics` and `PrometheusSink` serve, from the metric table."""
    from nummon.integrations.prometheus import IDLE_TIMEOUT_S, MAX_CONNECTIONS, METRICS

    out = [
        "# Prometheus metrics",
        "",
        "The series served at `/metrics` by `nummon watch --metrics HOST:PORT` (every watched run) and by "
        '`nummon.PrometheusSink("HOST:PORT")` (one run, from inside its training process). Generated from '
        "`METRICS` in `nummon/integrations/prometheus.py`. Counters carry Prometheus' `_total` suffix. "
        "Per-run series have the labels `run` (the run's path) and `source` (its log format); never one "
        "series per layer.",
        "",
        f"The endpoint serves at most {MAX_CONNECTIONS} connections at once and drops a client silent for "
        f"{IDLE_TIMEOUT_S:g} s.",
        "",
        "| series | type | what |",
        "|---|---|---|",
    ]
    for name, (kind, doc) in METRICS.items():
        shown = f"{name}_total" if kind == "counter" else name
        out.append(f"| `{shown}` | {kind} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def rules_page() -> str:
    """The shipped Prometheus rules and Alertmanager route, from configs/prometheus/."""
    import yaml

    folder = ROOT / "configs" / "prometheus"
    rules = yaml.safe_load((folder / "nummon-rules.yml").read_text())
    out = [
        "# Shipped rules",
        "",
        "`configs/prometheus/` (installed as `nummon/configs/prometheus/`) holds alert rules over "
        "[nummon's metrics](metrics.md), their `promtool` unit tests and an Alertmanager route. "
        "This page is generated from those files.",
        "",
        "## Alert rules (`nummon-rules.yml`)",
        "",
        "Load with `rule_files: [nummon-rules.yml]`; test with `promtool test rules nummon-rules.test.yml`.",
        "",
        "| alert | severity | for | expression | description |",
        "|---|---|---|---|---|",
    ]
    for group in rules["groups"]:
        for rule in group["rules"]:
            labels, notes = rule.get("labels", {}), rule.get("annotations", {})
            out.append(
                f"| `{rule['alert']}` | {labels.get('severity', '')} | {rule.get('for', '')} | "
                f"{_code(rule['expr'])} | {_cell(notes.get('description', ''))} |"
            )
    for title, fname in (
        ("The rules file", "nummon-rules.yml"),
        ("Alertmanager route (`alertmanager.yml`)", "alertmanager.yml"),
    ):
        out += ["", f"## {title}", "", "```yaml", (folder / fname).read_text().rstrip(), "```"]
    return "\n".join(out) + "\n"


# --- the source tree -----------------------------------------------------------------------------


def _summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


#: Where docs/architecture.md holds the folder table (between these lines, written by
#: `python docs/gen_ref.py --architecture`; tests/docs/test_docs.py checks it is current).
FOLDERS_BEGIN = "<!-- folders: generated from each folder's docstring by `python docs/gen_ref.py --architecture` -->"
FOLDERS_END = "<!-- /folders -->"


def folder_docs() -> dict[str, tuple[str, list[str]]]:
    """{folder: (what it owns, the folders it may import)} from each package's docstring, lowest
    first (a folder after every folder it may import; ties by name)."""
    import ast
    import re

    found: dict[str, tuple[str, list[str]]] = {}
    inits = sorted((ROOT / "nummon").glob("_*/__init__.py")) + [ROOT / "nummon" / "_support.py"]
    for init in inits + [ROOT / "integrations" / "__init__.py"]:
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        owns = " ".join(doc.split("\n\n")[0].split())
        rule = " ".join(doc.split()).partition("May import: ")[2]
        names = [] if rule.startswith("nothing else") else re.findall(r"`([\w.]+)`", rule.split(".")[0])
        found[init.stem if init.stem != "__init__" else init.parent.name] = (owns, names)
    ordered: dict[str, tuple[str, list[str]]] = {}
    while len(ordered) < len(found):
        ready = sorted(
            f for f, (_, deps) in found.items() if f not in ordered and set(deps) & set(found) <= set(ordered)
        )
        if not ready:  # a circle in the docstrings: list the rest as they are (the import test fails)
            ready = sorted(set(found) - set(ordered))
        ordered.update({f: found[f] for f in ready})
    return ordered


def folders_table() -> str:
    """The folder table of docs/architecture.md: one row a folder, lowest layer first."""
    rows = ["| folder | what it owns | may import |", "|---|---|---|"]
    for folder, (owns, deps) in folder_docs().items():
        where = {"integrations": "integrations/", "_support": "nummon/_support.py"}.get(folder, f"nummon/{folder}/")
        rows.append(f"| `{where}` | {_cell(owns)} | {', '.join(f'`{d}`' for d in deps) or 'nothing else'} |")
    return "\n".join(rows) + "\n"


def write_architecture(path: Path = ROOT / "docs" / "architecture.md") -> None:
    """Rewrite the folder table between FOLDERS_BEGIN and FOLDERS_END in `path`."""
    text = path.read_text(encoding="utf-8")
    head, _, rest = text.partition(FOLDERS_BEGIN + "\n")
    _, _, tail = rest.partition(FOLDERS_END)
    path.write_text(head + FOLDERS_BEGIN + "\n" + folders_table() + FOLDERS_END + tail, encoding="utf-8")


def modules_page() -> str:
    """Every module of the package (nummon/, integrations/, configs/) with its docstring's summary."""
    out = [
        "# Modules",
        "",
        "Every module of the source tree with the first paragraph of its docstring, generated at build "
        "time (see [How it is built](../architecture.md) for how they fit together). `integrations/` and "
        "`configs/` import as `nummon.integrations` and `nummon.configs`.",
    ]
    for top in ("nummon", "integrations", "configs"):
        folders: dict[Path, list[Path]] = {}
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                folders.setdefault(path.parent, []).append(path)
        for folder, paths in folders.items():
            out += ["", f"## `{folder.relative_to(ROOT).as_posix()}/`", "", "| module | what it is |", "|---|---|"]
            out += [f"| `{p.name}` | {_cell(_summary(p)) or '—'} |" for p in paths]
    return "\n".join(out) + "\n"


#: site path -> the function that writes it
PAGES: dict[str, Callable[[], str]] = {
    "reference/policy.md": policy_page,
    "reference/alerts.md": alert_kinds_page,
    "reference/cli.md": cli_page,
    "reference/api.md": api_page,
    "reference/metrics.md": metrics_page,
    "reference/rules.md": rules_page,
    "reference/modules.md": modules_page,
}


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated reference pages to the site."""
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def write_pages(out_dir: Path) -> list[Path]:
    """Write every generated page under `out_dir` (for a look without mkdocs, and the tests)."""
    written = []
    for uri, make in PAGES.items():
        path = Path(out_dir) / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make(), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    if sys.argv[1:] == ["--architecture"]:
        write_architecture()
        raise SystemExit(0)
    if len(sys.argv) != 2:
        print("usage: python docs/gen_ref.py OUT_DIR | --architecture", file=sys.stderr)
        raise SystemExit(2)
    print(json.dumps([str(p) for p in write_pages(Path(sys.argv[1]))], indent=1))

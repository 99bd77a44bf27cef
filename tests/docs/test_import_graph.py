"""The import graph of nummon/ and integrations/, built from the source (every import statement,
those inside functions and under TYPE_CHECKING included): no circle, and no edge from a lower
layer to a higher one (README, "How it is built")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.checkout import ROOT

PACKAGES = {"nummon": ROOT / "nummon", "nummon.integrations": ROOT / "integrations"}

# lowest first; a module's layer is that of its longest listed prefix
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "types",
        (
            "_core.errors",
            "_core.files",
            "_core.json",
            "_core.maths",
            "_core.text",
            "_core.types",
            "_core.alert_text",
            "_core.events",
            "_core.format",
            "_sinks.layout",
            "_core.lazy",
            "_policy.sections",
            "_policy.policy",
            "_policy.mechanism_sections",
            "_policy.runtime",
            "_engine.hints",
            "_logs.trace",
            "_tools.demo_config",
            "_core",
            "_policy",
            "_engine",
            "_monitor",
            "_sinks",
            "_tools",
        ),
    ),
    (
        "detectors / statistics / sinks",
        (
            "_engine.detectors",
            "_stats",
            "_stats.distributed",
            "_forensics.replicas",
            "_engine.incidents",
            "_sinks.builtin",
            "_sinks.dispatch",
            "_monitor.recorder",
            "_monitor.shutdown",
            "_forensics",
            "_tools.audit_compare",
            "_tools.diagnose_common",
            "_tools.demo_model",
        ),
    ),
    (
        "stages and tools",
        (
            "_engine.engine",
            "_engine.segments",
            "_engine.outcome",
            "_monitor.recovery",
            "_tools.replay",
            "_watch",
            "_logs",
            "_tools.audit",
            "_tools.overfit",
            "_report",
        ),
    ),
    ("monitor", ("_monitor.monitor", "_monitor.pipeline", "_monitor.checks", "_monitor.sink_wiring", "diagnose")),
    ("CLI and integrations", ("", "__main__", "_cli", "integrations", "_tools.demo", "_cli.watch")),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The nummon modules `name` imports."""
    targets: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` depends on pkg.sub; `from mod import name` on mod
            candidates = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for m in candidates:
            while m and m not in known:
                m = m.rpartition(".")[0]
            if m and m != name:
                targets.add(m)
    return targets


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(module: str) -> int:
    rel = module.replace("nummon.integrations", "integrations", 1)
    rel = "" if rel == "nummon" else rel.removeprefix("nummon.")
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (rel == p or rel.startswith(p + ".") or (p == "" and rel == "")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"{module} has no layer: add it to LAYERS in tests/docs/test_import_graph.py")
    return level


def test_every_module_has_a_layer():
    for m in graph():
        layer_of(m)


def test_no_import_goes_from_a_lower_layer_to_a_higher_one():
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph().items()
        for b in targets
        if layer_of(b) > layer_of(a)
    ]
    assert upward == []


def test_the_import_graph_has_no_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    assert circles == []


@pytest.mark.parametrize("backend", ["lightning", "transformers", "wandb.sdk", "torch.utils.tensorboard", "mlflow"])
def test_only_integrations_import_the_training_frameworks_and_loggers(backend):
    offenders = []
    for name, path in modules().items():
        if name.startswith("nummon.integrations"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            )
            offenders += [f"{name}: {n}" for n in names if n == backend or n.startswith(backend + ".")]
    assert offenders == []


def test_the_checker_sees_a_circle_and_an_upward_edge(tmp_path, monkeypatch):
    """The graph test can fail: a planted circle and upward import are found."""
    pkg = tmp_path / "nummon"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for sub in ("_core", "_monitor"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "_core" / "types.py").write_text("from .._monitor.monitor import Monitor\n")  # types -> monitor: upward
    (pkg / "_monitor" / "monitor.py").write_text("def f():\n    from .._core import types\n")  # and back: a circle
    monkeypatch.setitem(PACKAGES, "nummon", pkg)
    monkeypatch.setitem(PACKAGES, "nummon.integrations", tmp_path / "none")
    g = graph()
    assert g["nummon._core.types"] == {"nummon._monitor.monitor"} and g["nummon._monitor.monitor"] == {
        "nummon._core.types"
    }
    with pytest.raises(AssertionError):
        test_no_import_goes_from_a_lower_layer_to_a_higher_one()
    with pytest.raises(AssertionError):
        test_the_import_graph_has_no_circle()


# --- sizes: no room so crowded that a reader loses the thread (issue 37, "short rooms") ----------

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

#: Offenders being split right now, each at its size when it was listed: one may shrink, none may
#: grow, and an entry that fits again must be deleted (the list only shrinks). Keys: a module's
#: path, or "path:qualified.function".
OVERSIZE_ALLOWED: dict[str, int] = {}


def function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """{qualified name ("Class.method", "outer.inner"): lines from its `def` to its last line,
    decorators left out} of every function under `tree`."""
    out: dict[str, int] = {}
    for child in ast.iter_child_nodes(tree):
        name = prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                out[name] = (child.end_lineno or child.lineno) - child.lineno + 1
            name += "."
        out.update(function_lengths(child, name))
    return out


def oversize() -> dict[str, int]:
    """Every module over MAX_MODULE_LINES and every function over MAX_FUNCTION_LINES in nummon/ and
    integrations/: {"path" or "path:function": lines}."""
    found: dict[str, int] = {}
    for path in sorted(modules().values()):
        key = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        text = path.read_text(encoding="utf-8")
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            found[key] = n
        for name, n in function_lengths(ast.parse(text)).items():
            if n > MAX_FUNCTION_LINES:
                found[f"{key}:{name}"] = n
    return found


def test_no_module_or_function_outgrows_its_room():
    too_long = {
        k: f"{n} lines (allowed {OVERSIZE_ALLOWED.get(k, MAX_FUNCTION_LINES if ':' in k else MAX_MODULE_LINES)})"
        for k, n in oversize().items()
        if n > OVERSIZE_ALLOWED.get(k, 0)
    }
    assert too_long == {}, "split these (or, while one is being split, it may not grow)"


def test_the_oversize_list_only_shrinks():
    fits_now = sorted(set(OVERSIZE_ALLOWED) - set(oversize()))
    assert fits_now == [], "these fit their room now: delete them from OVERSIZE_ALLOWED"


def test_the_size_check_sees_a_long_function_and_a_long_module(tmp_path, monkeypatch):
    """The size test can fail: a planted long module and long method are found, with their sizes."""
    pkg = tmp_path / "nummon"
    pkg.mkdir()
    long_body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "_long.py").write_text("class C:\n    def f(self):\n" + long_body)
    (pkg / "_big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "_fine.py").write_text("def g():\n" + "    y = 1\n" * (MAX_FUNCTION_LINES - 1))
    monkeypatch.setitem(PACKAGES, "nummon", pkg)
    monkeypatch.setitem(PACKAGES, "nummon.integrations", tmp_path / "none")
    found = {k.rpartition("/")[2]: n for k, n in oversize().items()}
    assert found == {"_long.py:C.f": MAX_FUNCTION_LINES + 1, "_big.py": MAX_MODULE_LINES + 1}
    with pytest.raises(AssertionError):
        test_no_module_or_function_outgrows_its_room()


# --- one meaning per name -------------------------------------------------------------------
#: A command's front end in nummon/_cli/ shares its name with what it runs, and a package may
#: hold a module of its own name: those pairs mean one thing. Any other two modules or packages
#: called alike (engine and _stats/engine, replay and _stats/replay, ...) mean two.
SAME_THING = {"_cli/"}


def names_used_twice(roots: dict[str, Path] = PACKAGES) -> dict[str, list[str]]:
    """{name without leading underscores: the modules and packages called so} where two or more
    that are neither a command and its front end nor a package and its own module share it."""
    places: dict[str, list[str]] = {}
    for root in roots.values():
        for p in sorted(root.rglob("*")):
            if "__pycache__" in p.parts or not (p.is_dir() or p.suffix == ".py"):
                continue
            if p.stem in ("__init__", "__main__"):
                continue
            rel = p.relative_to(root.parent).as_posix() + ("/" if p.is_dir() else "")
            if any(part in rel for part in SAME_THING):
                continue
            places.setdefault(p.stem.lstrip("_"), []).append(rel)
    clash = {}
    for name, where in places.items():
        # a package's own module (_recovery/_recovery.py) is the package
        alone = [w for w in where if not (not w.endswith("/") and w.rsplit("/", 2)[-2].lstrip("_") == name)]
        if len(alone) > 1:
            clash[name] = where
    return clash


def test_no_two_modules_share_a_name():
    assert names_used_twice() == {}, "rename one of each pair: a name means one thing"


def test_the_name_check_sees_two_modules_called_alike(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "_stats").mkdir(parents=True)
    (pkg / "_recovery").mkdir()
    for f in ("__init__.py", "_engine.py", "_stats/__init__.py", "_stats/engine.py", "_recovery/_recovery.py"):
        (pkg / f).write_text("")
    assert names_used_twice({"pkg": pkg}) == {"engine": ["pkg/_engine.py", "pkg/_stats/engine.py"]}

"""The import graph of nummon/ and integrations/, built from the source (every import statement,
those inside functions and under TYPE_CHECKING included): each folder imports only the folders
its line in FOLDERS names, and there is no circle (README, "How it is built")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.checkout import ROOT

PACKAGES = {"nummon": ROOT / "nummon", "nummon.integrations": ROOT / "integrations"}

_BELOW_MONITOR = ("_core", "_policy", "_logs", "_sinks", "_stats", "_engine", "_forensics", "_report")
_BELOW_CLI = (*_BELOW_MONITOR, "_monitor", "_watch", "_support", "integrations", "_tools")

#: The import rule, one line a folder, lowest first: what each may import besides itself. A line
#: names only folders above it, so nothing runs back up but BACK_UP. `nummon` is the package's
#: public face (nummon/__init__.py): it imports the integrations only lazily (by name, and under
#: TYPE_CHECKING for their types), so the integrations may import the public names from it, as
#: users do.
FOLDERS: dict[str, tuple[str, ...]] = {
    "_core": (),
    "_policy": ("_core",),
    "_logs": ("_core",),
    "_sinks": ("_core",),
    "_stats": ("_core", "_policy"),
    "_engine": ("_core", "_policy"),
    "_forensics": ("_core", "_policy", "_stats"),
    "_report": ("_core", "_policy", "_engine", "_logs"),
    "_monitor": _BELOW_MONITOR,
    "_watch": ("_core", "_policy", "_engine", "_logs", "_report"),
    "_support": (*_BELOW_MONITOR, "_monitor", "_watch"),
    "integrations": ("_support", "nummon"),
    "_tools": (*_BELOW_MONITOR, "_monitor", "_watch", "_support", "integrations"),
    "diagnose": _BELOW_CLI,
    "_cli": (*_BELOW_CLI, "diagnose"),
    "__main__": ("_cli",),
    "nummon": (*_BELOW_CLI, "diagnose"),
}
BACK_UP = {("integrations", "nummon")}


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


def folder_of(module: str) -> str:
    """The FOLDERS key a module belongs to: `nummon._engine.detectors.spike` -> `_engine`."""
    if module.startswith("nummon.integrations"):
        return "integrations"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nummon"


def test_every_module_sits_in_a_folder_with_a_rule():
    assert sorted({folder_of(m) for m in graph()} - set(FOLDERS)) == []


def test_the_rule_names_only_folders_above_each_line():
    order = list(FOLDERS)
    back = [
        f"{f} -> {t}"
        for f, allowed in FOLDERS.items()
        for t in allowed
        if order.index(t) >= order.index(f) and (f, t) not in BACK_UP
    ]
    assert back == []


def test_each_folder_imports_only_what_its_line_names():
    offenders = sorted(
        f"{a} -> {b}"
        for a, targets in graph().items()
        for b in targets
        if folder_of(a) != folder_of(b)
        and folder_of(b) not in FOLDERS[folder_of(a)]
        and not (folder_of(a) == "nummon" and a == "nummon")
    )
    assert offenders == []


def test_only_the_integrations_reach_their_private_modules():
    """The rest of nummon draws pictures and checks credentials through the integrations' public
    classes (`TensorBoardSink.warm_imports`, `WandbSink.has_credentials`), not their insides."""
    private = sorted(
        f"{a} -> {b}"
        for a, targets in graph().items()
        for b in targets
        if b.startswith("nummon.integrations._") and not a.startswith("nummon.integrations")
    )
    assert private == []


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module defines itself (functions, classes, assignments, also under if/try)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def second_hand_imports() -> list[str]:
    """Imports of a name from a plain module that only imports it too: a name is imported from
    where it is defined, or from a folder's face (its `__init__`), the package's, or `_support`."""
    known = modules()
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in known.items()}
    faces = {m for m, p in known.items() if p.name == "__init__.py"} | {"nummon._support"}
    found = []
    for m, tree in trees.items():
        pkg = m if known[m].name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = pkg.split(".")[: len(pkg.split(".")) - max(node.level - 1, 0)] if node.level else []
            src = (
                ".".join(base + [node.module])
                if node.level and node.module
                else (".".join(base) if node.level else node.module or "")
            )
            if src not in known or src in faces:
                continue
            defined = _top_level_names(trees[src])
            found += [
                f"{m}: {a.name} from {src}"
                for a in node.names
                if a.name not in defined and f"{src}.{a.name}" not in known
            ]
    return sorted(found)


def test_a_name_is_imported_from_where_it_is_defined():
    assert second_hand_imports() == []


def _may_import_line(doc: str) -> set[str] | None:
    """The folders a package docstring's "May import: `_core`, `_policy`." sentence names."""
    m = re.search(r"May import: ([^.]*)\.", " ".join(doc.split()))
    if m is None:
        return None
    return set() if m.group(1).strip() == "nothing else of nummon" else set(re.findall(r"`([\w.]+)`", m.group(1)))


@pytest.mark.parametrize(
    "folder",
    [f for f in FOLDERS if f.startswith("_") and not f.startswith("__")] + ["integrations"],
)
def test_each_folder_says_what_it_owns_and_what_it_may_import(folder):
    init = (ROOT / "integrations" if folder == "integrations" else ROOT / "nummon" / folder) / "__init__.py"
    if folder == "_support":  # one module: the integrations' reach into the package
        init = ROOT / "nummon" / "_support.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    assert doc, f"{init}: a docstring saying what the folder owns"
    assert _may_import_line(doc) == set(FOLDERS[folder]), f"{init}: its 'May import:' sentence and FOLDERS differ"


def test_the_graph_has_no_circle():
    g = graph()
    g["nummon"] = {t for t in g["nummon"] if not t.startswith("nummon.integrations")}  # TYPE_CHECKING names
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
    (pkg / "_core" / "types.py").write_text("from .._monitor.monitor import Monitor\n")  # core -> monitor: upward
    (pkg / "_monitor" / "monitor.py").write_text("def f():\n    from .._core import types\n")  # and back: a circle
    monkeypatch.setitem(PACKAGES, "nummon", pkg)
    monkeypatch.setitem(PACKAGES, "nummon.integrations", tmp_path / "none")
    g = graph()
    assert g["nummon._core.types"] == {"nummon._monitor.monitor"}
    assert g["nummon._monitor.monitor"] == {"nummon._core.types"}
    with pytest.raises(AssertionError, match="_core.types -> nummon._monitor.monitor"):
        test_each_folder_imports_only_what_its_line_names()
    with pytest.raises(AssertionError, match="circle|->"):
        test_the_graph_has_no_circle()
    monkeypatch.setitem(FOLDERS, "_core", ("_monitor",))
    with pytest.raises(AssertionError, match="_core -> _monitor"):
        test_the_rule_names_only_folders_above_each_line()


# --- sizes: no room so crowded that a reader loses the thread ---------------------------------

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250

#: Offenders being split right now, each at its size when it was listed: one may shrink, none may
#: grow, and an entry that fits again must be deleted (the list only shrinks). Keys: a module's
#: path, or "path:qualified.function".
OVERSIZE_ALLOWED: dict[str, int] = {}


def function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """{qualified name ("Class", "Class.method", "outer.inner"): lines from its `def` or `class`
    to its last line, decorators left out} of every class and function under `tree`."""
    out: dict[str, int] = {}
    for child in ast.iter_child_nodes(tree):
        name = prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
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
        tree = ast.parse(text)
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for name, n in function_lengths(tree).items():
            if n > (MAX_CLASS_LINES if name.rpartition(".")[2] in classes else MAX_FUNCTION_LINES):
                found[f"{key}:{name}"] = n
    return found


def test_no_module_or_function_outgrows_its_room():
    too_long = {
        k: f"{n} lines (allowed {OVERSIZE_ALLOWED.get(k, 'a class 250, a function 60' if ':' in k else MAX_MODULE_LINES)})"
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
    (pkg / "_wide.py").write_text("class W:\n" + "".join(f"    def f{i}(self):\n        pass\n" for i in range(125)))
    monkeypatch.setitem(PACKAGES, "nummon", pkg)
    monkeypatch.setitem(PACKAGES, "nummon.integrations", tmp_path / "none")
    found = {k.rpartition("/")[2]: n for k, n in oversize().items()}
    assert found == {"_long.py:C.f": MAX_FUNCTION_LINES + 1, "_big.py": MAX_MODULE_LINES + 1, "_wide.py:W": 251}
    with pytest.raises(AssertionError):
        test_no_module_or_function_outgrows_its_room()


#: A signature longer than this wants a settings object (the watcher's WatchSettings): the
#: longest today are the public checklist's keyword options (nummon.diagnose.lr_range_test, 11).
MAX_PARAMETERS = 12


def long_signatures(roots: dict[str, Path] = PACKAGES) -> dict[str, int]:
    """{"path:function": parameters, self and cls left out} of every function over MAX_PARAMETERS."""
    found = {}
    for root in roots.values():
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                    n = len([x for x in names if x not in ("self", "cls")])
                    if n > MAX_PARAMETERS:
                        found[f"{path.relative_to(root.parent).as_posix()}:{node.name}"] = n
    return found


def test_no_signature_outgrows_a_settings_object(tmp_path):
    assert long_signatures() == {}
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "_wide.py").write_text(
        "def f(self, " + ", ".join(f"a{i}" for i in range(MAX_PARAMETERS + 1)) + "):\n    pass\n"
    )
    assert long_signatures({"pkg": pkg}) == {"pkg/_wide.py:f": MAX_PARAMETERS + 1}


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

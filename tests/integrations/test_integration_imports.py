"""The integrations import nummon's public names (``nummon``) and, for everything else, the one
list of what they need beyond them (``nummon._support``): no other private module of nummon, so a
change to the package's insides that reaches an integration shows in that one list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.checkout import ROOT

import nummon
import nummon._support

#: The integrations' own modules import each other relatively (``from ._callback_common import``).
ALLOWED = {"nummon", "nummon._support"}


def private_imports(folder: Path) -> list[str]:
    """Every absolute import of a nummon module other than ``nummon`` and ``nummon._support``
    in the .py files of `folder` (those inside functions and under TYPE_CHECKING included), as
    "file:line: module"."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
                if node.module == "nummon":  # `from nummon import _core` is a private module too
                    modules += [f"nummon.{a.name}" for a in node.names if a.name.startswith("_")]
            else:
                continue
            found += [
                f"{path.name}:{node.lineno}: {m}"
                for m in modules
                if (m == "nummon" or m.startswith("nummon.")) and m not in ALLOWED
            ]
    return found


def test_integrations_import_only_public_names_and_the_support_module():
    assert private_imports(ROOT / "integrations") == []


def test_what_they_import_from_nummon_is_public_and_support_holds_what_it_lists():
    public, support = set(nummon.__all__), set(nummon._support.__all__)
    for path in sorted((ROOT / "integrations").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in ALLOWED:
                names = {a.name for a in node.names}
                listed = public if node.module == "nummon" else support
                assert names <= listed, (
                    f"{path.name}:{node.lineno}: {sorted(names - listed)} not in {node.module}.__all__"
                )
    assert all(hasattr(nummon._support, n) for n in support)


@pytest.mark.parametrize(
    "line",
    [
        "from nummon._core.types import Alert\n",
        "import nummon._sinks.layout\n",
        "def f():\n    from nummon._monitor.monitor import Monitor\n",
        "from nummon import _core\n",
    ],
)
def test_the_check_sees_a_private_import(tmp_path, line):
    """The check can fail: a planted private import is found, wherever it sits."""
    (tmp_path / "fine.py").write_text(
        "from nummon import Alert\nfrom nummon._support import require\nfrom ._x import y\n"
    )
    (tmp_path / "planted.py").write_text(line)
    found = private_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("planted.py:")

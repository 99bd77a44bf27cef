"""The tests read as the package: each test folder is named after the nummon/ folder whose code it
tests (tests/engine <-> nummon/_engine), except the few that test across it; no test module
imports conftest (shared code lives in tests/helpers); test files and test names say the
behaviour, never the issue or review round that asked for it."""

import ast
import re

from helpers.checkout import ROOT

TESTS = ROOT / "tests"
#: folders that test across the package, not one folder of it
ACROSS = {"docs", "helpers", "integrations", "cli", "tools"}
#: not a test folder: the logs and corpora the tests read
DATA = {"data"}
#: "round" followed by a digit (round4, round_4) or "issue", in any case
DIARY_NAME = re.compile(r"round_?\d|issue", re.IGNORECASE)


def folders_under_tests():
    return sorted(d for d in TESTS.iterdir() if d.is_dir() and d.name not in DATA and not d.name.startswith((".", "_")))


def modules_under_tests():
    return sorted(p for p in TESTS.rglob("*.py") if DATA.isdisjoint(p.relative_to(TESTS).parts[:1]))


def folders_without_a_package_folder(folders, package):
    """The test folders (outside ACROSS) with no nummon/_<name> folder beside them."""
    return [d.name for d in folders if d.name not in ACROSS and not (package / f"_{d.name}").is_dir()]


def conftest_imports(source):
    """Lines of `source` that import conftest (`import conftest`, `from conftest import ...`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "conftest" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "conftest":
            lines.append(node.lineno)
    return lines


def diary_names(filename, source):
    """The file's name and its test functions' and test classes' names that name an issue or a round."""
    names = [filename] if DIARY_NAME.search(filename) else []
    for node in ast.walk(ast.parse(source)):
        is_test = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
        if (is_test or (isinstance(node, ast.ClassDef) and node.name.startswith("Test"))) and DIARY_NAME.search(
            node.name
        ):
            names.append(node.name)
    return names


def test_every_test_folder_names_a_folder_of_the_package():
    folders = folders_under_tests()
    assert {d.name for d in folders} >= ACROSS, "a folder of ACROSS is gone: drop it from the list"
    assert folders_without_a_package_folder(folders, ROOT / "nummon") == []
    assert list(TESTS.glob("test_*.py")) == [], "a test module sits in a folder of its own"


def test_every_package_folder_has_its_test_folder():
    package = sorted(d.name[1:] for d in (ROOT / "nummon").iterdir() if d.is_dir() and re.fullmatch(r"_[a-z]+", d.name))
    assert [name for name in package if not (TESTS / name).is_dir()] == []


def test_every_folder_but_helpers_holds_tests():
    assert [d.name for d in folders_under_tests() if d.name != "helpers" and not list(d.glob("test_*.py"))] == []


def test_no_test_module_imports_conftest():
    found = {str(p.relative_to(TESTS)): conftest_imports(p.read_text()) for p in modules_under_tests()}
    assert {k: v for k, v in found.items() if v} == {}


def test_test_files_and_test_names_say_the_behaviour_not_the_ticket_or_review_round():
    found = {str(p.relative_to(TESTS)): diary_names(p.name, p.read_text()) for p in modules_under_tests()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_checks_find_what_they_look_for(tmp_path):
    """Each check fails on a planted case and passes its near misses."""
    (tmp_path / "_engine").mkdir()
    assert folders_without_a_package_folder(
        [tmp_path / "engine", tmp_path / "detectors", tmp_path / "cli"], tmp_path
    ) == ["detectors"]
    assert conftest_imports("from conftest import start_ranks\nimport os\n") == [1]
    assert conftest_imports("import conftest\n") == [1]
    assert conftest_imports("from helpers.ranks import start_ranks\nimport conftest_like\n") == []
    planted = "def test_issue_37_holds():\n    pass\n\nclass TestRound5:\n    def test_a(self):\n        pass\n"
    assert diary_names("test_watch_round4.py", planted) == ["test_watch_round4.py", "test_issue_37_holds", "TestRound5"]
    near = "def test_policy_show_output_round_trips():\n    pass\n\ndef _issue_helper():\n    pass\n"
    assert diary_names("test_policy.py", near) == []

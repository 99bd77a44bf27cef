"""The documentation site: the generated reference is complete, and no page reads as a diary.

The pages come from `docs/gen_ref.py` (the mkdocs hook) run here into a temporary folder; the
full `mkdocs build --strict` (links, anchors, mkdocstrings) runs in `.ci/run`.
"""

import argparse
import importlib.util
import re

import pytest
import yaml
from helpers.checkout import ROOT

#: Development-diary wording: work sessions, issue numbers, review rounds, "before this change".
DIARY = [
    r"\bsessions? \d",
    r"\bsession of \d",
    r"\bthis session\b",
    r"\bissue #?\d+",
    r"\bround \d",
    r"\bwork period",
    r"\bmeasured before this\b",
    r"\bbefore this (session|change|issue)",
]


def diary_phrases(text: str) -> list[str]:
    """The diary phrases in `text`, with a little context."""
    found = []
    for pattern in DIARY:
        for m in re.finditer(pattern, text, flags=re.IGNORECASE):
            found.append(text[max(0, m.start() - 30) : m.end() + 30].replace("\n", " "))
    return found


def _load_generator():
    spec = importlib.util.spec_from_file_location("nummon_docs_gen_ref", ROOT / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _load_generator()


@pytest.fixture(scope="module")
def pages(gen, tmp_path_factory):
    """Every generated page, by its site path, written the way `python docs/gen_ref.py DIR` does."""
    out = tmp_path_factory.mktemp("site-src")
    gen.write_pages(out)
    return {p.relative_to(out).as_posix(): p.read_text(encoding="utf-8") for p in out.rglob("*.md")}


@pytest.mark.slow
def test_every_policy_key_has_a_row_with_its_default(pages, gen):
    from nummon import Policy

    page = pages["reference/policy.md"]
    default = Policy()
    missing = [k for k in gen.policy_keys() if f"| `{k}` |" not in page]
    assert not missing, f"policy keys missing from the reference: {missing}"
    # the default shown is the model's: spot-check every scalar of one section
    for key in type(default.spike).model_fields:
        shown = getattr(default.spike, key)
        assert f"| `spike.{key}` | `{str(shown).lower() if isinstance(shown, bool) else shown}` |" in page


def test_policy_keys_cover_every_section_of_the_model(gen):
    from pydantic import BaseModel

    from nummon import Policy

    keys = set(gen.policy_keys())
    for name in Policy.model_fields:
        value = getattr(Policy(), name)
        if isinstance(value, BaseModel):
            assert {f"{name}.{k}" for k in type(value).model_fields} <= keys, name
        else:
            assert name in keys


def test_a_unit_is_split_from_the_meaning_only_when_it_is_a_unit(gen):
    assert gen._split_unit("steps of history (steps)") == ("steps of history", "steps")
    assert gen._split_unit("the class count's log (loss units; default: unknown)")[1] == "loss units; default: unknown"
    assert gen._split_unit("robust deviations (sigma = 1.4826 * MAD)") == (
        "robust deviations (sigma = 1.4826 * MAD)",
        "",
    )


def test_every_alert_kind_has_a_section_with_its_detector_and_hint(pages):
    from nummon import AlertKind
    from nummon._engine.detectors import DETECTORS
    from nummon._engine.hints import _BASE

    page = pages["reference/alerts.md"]
    owner = {kind: det for det in DETECTORS for kind in det.kinds}
    for kind in AlertKind:
        section = page.split(f"## `{kind.value}`\n", 1)
        assert len(section) == 2, f"no section for alert kind {kind.value}"
        body = section[1].split("\n## ", 1)[0]
        if kind is AlertKind.REPLICA_MISMATCH:  # no detector: nummon/_forensics/replicas.py compares ranks
            assert "policy.md#replicas" in body and _BASE[kind] in body
            continue
        assert owner[kind].__name__ in body and f"policy.md#{owner[kind].section}" in body, kind
        assert _BASE[kind] in body, f"hint of {kind.value} missing"


def test_every_cli_command_and_option_appears(pages, gen):
    page = pages["reference/cli.md"]
    commands = gen.cli_commands()
    assert {"replay", "watch", "demo", "audit", "policy", "diagnose"} <= set(commands)
    for name, parser in commands.items():
        section = page.split(f"## `nummon {name}`\n", 1)
        assert len(section) == 2, f"no section for nummon {name}"
        body = section[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            # an option by its flags; a positional by its choices (`{show,validate}`), else its metavar
            names = action.option_strings or [str(c) for c in action.choices or []] or [action.metavar or action.dest]
            for option in names:
                assert option in body, f"nummon {name}: {option} missing from the CLI reference"


def test_every_metric_rule_and_public_name_is_referenced(pages):
    import nummon
    from nummon.integrations.prometheus import METRICS

    for name, (kind, _) in METRICS.items():
        shown = f"`{name}_total`" if kind == "counter" else f"`{name}`"
        assert shown in pages["reference/metrics.md"], name
    rules = yaml.safe_load((ROOT / "configs" / "prometheus" / "nummon-rules.yml").read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        assert f"| `{rule['alert']}` |" in pages["reference/rules.md"], rule["alert"]
    for name in nummon.__all__:
        assert f"## `nummon.{name}`" in pages["reference/api.md"], name
    assert pages["reference/api.md"].count("\n::: ") == len(nummon.__all__)


def test_every_module_is_listed(pages):
    page = pages["reference/modules.md"]
    for path in [*(ROOT / "nummon").rglob("*.py"), *(ROOT / "integrations").glob("*.py")]:
        assert f"## `{path.parent.relative_to(ROOT).as_posix()}/`" in page and f"| `{path.name}` |" in page, path


def test_nav_lists_every_page_and_only_pages_that_exist(gen):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # BaseLoader: !!python tags

    def entries(nav):
        for item in nav:
            for value in item.values():
                yield from (entries(value) if isinstance(value, list) else [value])

    listed = set(entries(config["nav"]))
    written = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert listed == written | set(gen.PAGES), listed ^ (written | set(gen.PAGES))


def test_the_diary_patterns_catch_diary_wording():
    # the README's wording the site was cleaned of: a pattern that matches none of it is no check
    for phrase in (
        "measured before this session's changes",
        "Session 7: where the rest goes",
        "(issue 26, CPU)",
        "after session 6",
        "round 4",
        "in work period 3",
    ):
        assert diary_phrases(phrase), phrase
    assert not diary_phrases("20 rounds x 5 steps; `--rounds 12`; a sessions-free sentence")


def test_no_page_reads_as_a_development_diary(pages):
    texts = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md")}
    texts.update({f"(generated) {k}": v for k, v in pages.items()})
    for name in ("CONTRIBUTING.md", "README.md", "benchmarks/RESULTS.md"):
        texts[name] = (ROOT / name).read_text(encoding="utf-8")
    found = {name: diary_phrases(text) for name, text in texts.items()}
    assert not {k: v for k, v in found.items() if v}


def test_the_readme_is_short_with_the_loop_example_early_and_its_links_resolve():
    """A newcomer's minute: at most 200 lines, the training-loop example in the first 80, and
    every relative link pointing at a file that exists (the pages the rest moved to)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)
    assert any("nummon.Monitor(" in l for l in lines[:80]) and any(".post_step(" in l for l in lines[:80])
    shown = re.sub(r"<!--.*?-->", "", "\n".join(lines), flags=re.S)  # a commented-out slot is no link
    links = [m.group(1) for m in re.finditer(r"\]\(([^)#:]+)(?:#[^)]*)?\)", shown)]
    assert len(links) >= 15 and not [x for x in links if not (ROOT / x).is_file()], links


def test_the_architecture_page_draws_the_folders_from_the_tree():
    """docs/architecture.md's folder table is the one the folders' docstrings give (regenerate it
    with `python docs/gen_ref.py --architecture`)."""
    gen = _load_generator()
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page.partition(gen.FOLDERS_BEGIN + "\n")[2].partition(gen.FOLDERS_END)[0]
    assert table == gen.folders_table(), "stale: run python docs/gen_ref.py --architecture"
    listed = set(re.findall(r"^\| `(?:nummon/)?([\w.]+)/?` \|", table, re.M))
    folders = {p.parent.name for p in (ROOT / "nummon").glob("_*/__init__.py")} | {"integrations", "_support.py"}
    assert listed == folders


def test_every_path_the_architecture_page_names_exists():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:nummon|integrations|tests|benchmarks|configs|docs)/[\w./-]*)`", page))
    assert paths, "the page names no path: the pattern is wrong"
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []

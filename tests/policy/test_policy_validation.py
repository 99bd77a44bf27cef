"""Validation is the only gate: nothing accepted can switch a detector off or
crash later; every problem is one line."""

import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon import Policy, PolicyError, load_policy
from nummon._policy.policy import MAX_POLICY_BYTES, validate_policy_file


@pytest.mark.parametrize(
    "bad,where",
    [
        ({"headroom": {"warning_decades": {"float32": math.nan}}}, "headroom.warning_decades.float32"),
        ({"headroom": {"critical_decades": {"float32": -1.0}}}, "headroom.critical_decades.float32"),
        ({"spike": {"loss_factor": math.inf}}, "spike.loss_factor"),
        ({"runaway": {"critical_total_factor": math.inf}}, "runaway.critical_total_factor"),
        ({"divergence": {"critical_factor": math.nan}}, "divergence.critical_factor"),
        ({"stall": {"min_improvement": math.nan}}, "stall.min_improvement"),
        ({"spike": {"window": 1e30}}, "spike.window"),
        ({"trend": {"min_span": 10**12}}, "trend.min_span"),
        ({"vanishing": {"patience": 10**9}}, "vanishing.patience"),
    ],
)
def test_values_that_switch_detectors_off_or_crash_later_are_rejected(bad, where):
    with pytest.raises(PolicyError, match=where.replace(".", r"\.")) as e:
        load_policy(bad)
    assert "\n" not in str(e.value)


def test_runaway_metric_names_are_checked_and_the_valid_ones_listed():
    with pytest.raises(PolicyError, match=r"runaway\.metrics: .*unknown metric 'lss'.*valid: loss, grad_norm"):
        load_policy({"runaway": {"metrics": ["lss"]}})
    assert load_policy({"runaway": {"metrics": ["loss", "lr"]}}).runaway.metrics == ("loss", "lr")


def test_huge_window_from_a_json_file_is_refused_not_an_overflow_later(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"spike": {"window": 1e30}}))
    assert any(line.startswith("spike.window") for line in validate_policy_file(p))


def test_oversized_policy_file_is_refused_before_parsing(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("name: x\n" + "# padding\n" * (MAX_POLICY_BYTES // 10 + 10))
    with pytest.raises(PolicyError, match="bytes; a policy is at most") as e:
        load_policy(p)
    assert "\n" not in str(e.value)


def test_validate_accepts_preset_names():
    assert validate_policy_file("default") == [] and validate_policy_file("strict") == []
    with pytest.raises(PolicyError, match="unknown policy preset 'nope'"):
        validate_policy_file("nope")


def test_malformed_yaml_names_the_line(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("name: x\nspike:\n  window: 10\n   loss_factor: [1, 2\n")
    with pytest.raises(PolicyError, match=r"line \d+, column \d+") as e:
        load_policy(p)
    assert "\n" not in str(e.value)
    j = tmp_path / "p.json"
    j.write_text('{"spike":\n {"window": }}')
    with pytest.raises(PolicyError, match=r"line 2, column"):
        load_policy(j)


def test_non_utf8_policy_is_one_line(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_bytes(b"name: \xff\xfe caf\xe9\n")
    for call in (load_policy, validate_policy_file):
        with pytest.raises(PolicyError, match="not UTF-8") as e:
            call(p)
        assert "\n" not in str(e.value)


def test_moved_keys_point_to_their_new_place():
    with pytest.raises(PolicyError, match=r"stall\.window: unknown key \(moved to trend\.min_span\)"):
        load_policy({"stall": {"window": 50}})


# ------------------------------------------------------------------ fuzz: a Policy or a PolicyError, nothing else

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
section_keys = st.sampled_from(
    [
        "spike",
        "runaway",
        "headroom",
        "divergence",
        "trend",
        "stall",
        "oscillation",
        "vanishing",
        "alerts",
        "sampling",
        "recorder",
        "sinks",
        "name",
        "bogus",
    ]
)
field_keys = st.sampled_from(
    [
        "enabled",
        "window",
        "loss_factor",
        "metrics",
        "warning_decades",
        "critical_decades",
        "default_dtype",
        "min_span",
        "patience",
        "cooldown_steps",
        "queue_size",
        "x",
    ]
)
mappings = st.dictionaries(section_keys, st.dictionaries(field_keys, json_values, max_size=4) | json_values, max_size=5)


@settings(max_examples=150, deadline=None)
@given(mappings)
def test_fuzz_mappings_give_a_policy_or_a_one_line_policy_error(data):
    try:
        p = load_policy(data)
    except PolicyError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(p, Policy)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300).map(str.encode),
        mappings.map(lambda d: yaml.safe_dump(d).encode()),
    ),
    st.sampled_from([".yaml", ".json", ".toml"]),
)
def test_fuzz_policy_files_give_a_policy_or_a_one_line_policy_error(tmp_path, raw, suffix):
    p = tmp_path / f"fuzz{suffix}"
    p.write_bytes(raw)
    for call in (load_policy, validate_policy_file):
        try:
            got = call(p)
        except PolicyError as e:
            assert "\n" not in str(e)
            continue
        assert isinstance(got, (Policy, list))

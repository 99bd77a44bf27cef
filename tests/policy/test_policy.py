"""Policy validation, presets and files."""

import json

import pydantic
import pytest
from pydantic import BaseModel

from nummon import Policy, PolicyError, load_policy, preset_names


def test_presets_load_by_name_and_differ():
    assert {"default", "strict"} <= set(preset_names())
    d, s = load_policy("default"), load_policy("strict")
    assert d.name == "default" and s.name == "strict"
    assert s.spike.grad_factor < d.spike.grad_factor


def test_unknown_key_is_an_error_with_its_path(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("spike:\n  windw: 10\n")
    with pytest.raises(PolicyError, match=r"spike\.windw: unknown key"):
        load_policy(p)


def test_negative_window_and_cross_field_checks():
    with pytest.raises(PolicyError, match="stall.window"):
        load_policy({"stall": {"window": -5}})
    with pytest.raises(PolicyError, match="critical_decades"):
        load_policy({"headroom": {"warning_decades": {"float32": 3}, "critical_decades": {"float32": 5}}})
    with pytest.raises(PolicyError, match="critical_steps"):
        load_policy({"runaway": {"warning_steps": 4, "critical_steps": 2}})
    with pytest.raises(PolicyError, match="min_history"):
        load_policy({"spike": {"window": 5, "min_history": 6}})


@pytest.mark.parametrize(
    "suffix,text",
    [
        (".json", json.dumps({"spike": {"grad_factor": 20}})),
        (".toml", "[spike]\ngrad_factor = 20\n"),
        (".yaml", "spike: {grad_factor: 20}\n"),
    ],
)
def test_policy_files_in_each_format(tmp_path, suffix, text):
    p = tmp_path / f"p{suffix}"
    p.write_text(text)
    assert load_policy(str(p)).spike.grad_factor == 20


def test_errors_are_one_line():
    for bad in ("nope", {"spike": {"grad_factor": "x"}}, "/no/such/file.yaml", 3):
        with pytest.raises(PolicyError) as e:
            load_policy(bad)
        assert "\n" not in str(e.value)


def test_policy_is_immutable_and_every_field_described():
    p = Policy()
    with pytest.raises(pydantic.ValidationError):
        p.spike = None  # frozen
    from nummon._policy.policy import policy_yaml

    text = policy_yaml(load_policy("default"))
    assert "loss_factor: 8.0" in text and "(ratio)" in text

    # every leaf field carries a description with a unit or meaning
    def leaves(model):
        for name, info in type(model).model_fields.items():
            v = getattr(model, name)
            if isinstance(v, BaseModel):
                yield from leaves(v)
            else:
                yield name, info

    missing = [n for n, i in leaves(p) if not i.description and n not in ("enabled", "name")]
    assert missing == []

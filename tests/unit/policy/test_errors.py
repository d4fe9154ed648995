"""The wording of a refused policy (policy/errors.py): PyYAML's and pydantic's complaints as one line a
user can act on.

test_policy.py reads that wording through parse_policy for the policy's own keys; these pin the
rewriting down on small models of the same strictness, one kind of complaint at a time, so that a
new pydantic error type or a changed path notation shows here first.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from webhook.policy.errors import DNS_LABEL, DNS_SUBDOMAIN, describe_errors, field_path, yaml_problem


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Entry(Strict):
    names: list[Annotated[str, Field(pattern=DNS_LABEL)]] = []
    mode: Literal["enforce", "warn"] = "enforce"


class Limits(Strict):
    seconds: int = 1
    group: Annotated[str, Field(pattern=DNS_SUBDOMAIN)] = "example.com"

    @field_validator("seconds")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("seconds must be at least 1")
        return value


class Config(Strict):
    entries: list[Entry] = []
    limits: Limits | None = None
    modes: dict[Literal["priority", "guard"], bool] = {}
    required: str


def problems(data: object) -> str:
    with pytest.raises(ValidationError) as raised:
        Config.model_validate(data)
    return describe_errors(raised.value, Config)


@pytest.mark.parametrize(
    ("location", "path"),
    [
        pytest.param(("namespaces", 1, "names"), "namespaces[1].names", id="index-and-keys"),
        pytest.param((3,), "[3]", id="index-first"),
        pytest.param(("resources", "nvidia.com/gpu"), 'resources["nvidia.com/gpu"]', id="quoted-key"),
        pytest.param(("ids", 'say "hi"'), 'ids["say \\"hi\\""]', id="quote-escaped"),
        pytest.param((), "", id="root"),
    ],
)
def test_a_location_is_written_in_one_notation(location: tuple[int | str, ...], path: str) -> None:
    assert field_path(location) == path


def test_an_unknown_key_in_a_list_item_suggests_the_closest_field() -> None:
    assert problems({"required": "x", "entries": [{}, {"mood": "warn"}]}) == (
        "entries[1].mood: unknown key; did you mean 'mode'?"
    )


def test_an_unknown_key_nothing_resembles_lists_the_fields_of_the_model_it_is_in() -> None:
    assert problems({"required": "x", "limits": {"zzz": 1}}) == (
        "limits.zzz: unknown key (expected one of: seconds, group)"
    )


def test_an_unknown_value_names_the_allowed_ones_and_the_closest() -> None:
    assert problems({"required": "x", "entries": [{"mode": "enforced"}]}) == (
        "entries[0].mode: unknown value 'enforced', expected 'enforce' or 'warn'; did you mean 'enforce'?"
    )


def test_an_unknown_key_of_a_mapping_is_reported_at_the_key_as_a_key() -> None:
    assert problems({"required": "x", "modes": {"prority": True}}) == (
        "modes.prority: unknown key 'prority', expected 'priority' or 'guard'; did you mean 'priority'?"
    )


def test_a_validators_own_message_is_kept_as_written() -> None:
    assert (
        problems({"required": "x", "limits": {"seconds": 0}}) == "limits.seconds: seconds must be at least 1"
    )


def test_a_missing_key_is_required() -> None:
    assert problems({}) == "required: required"


def test_a_name_pattern_is_worded_as_the_kubernetes_api_words_it() -> None:
    assert problems({"required": "x", "entries": [{"names": ["Kube-System"]}]}) == (
        "entries[0].names[0]: 'Kube-System' is not a valid name: lower-case letters, digits and '-', "
        "starting and ending with a letter or digit"
    )
    assert problems({"required": "x", "limits": {"group": "Example.com"}}) == (
        "limits.group: 'Example.com' is not a valid name: lower-case letters, digits, '-' and '.', "
        "starting and ending with a letter or digit"
    )


def test_any_other_complaint_says_what_it_must_be_and_what_it_got() -> None:
    assert problems({"required": "x", "limits": {"seconds": "3600"}}) == (
        "limits.seconds: must be a valid integer, got '3600'"
    )


def test_every_problem_is_on_the_one_line() -> None:
    assert problems({"entries": [{"mood": "warn"}]}) == (
        "entries[0].mood: unknown key; did you mean 'mode'?; required: required"
    )


def test_a_yaml_problem_says_where_without_pyyamls_source_name() -> None:
    with pytest.raises(yaml.YAMLError) as raised:
        yaml.safe_load("rules: [priority\nmode: warn\n")
    # Where it failed, and where the unclosed `[` began.
    assert yaml_problem(raised.value) == (
        "line 2, column 5: while parsing a flow sequence (from line 1, column 8), "
        "expected ',' or ']', but got ':'"
    )
    assert "<unicode string>" in str(raised.value)  # what is left out, as PyYAML words it


def test_a_yaml_problem_at_the_place_its_construct_began_names_it_once() -> None:
    with pytest.raises(yaml.YAMLError) as raised:
        yaml.safe_load("mode: warn\n  rules: 1\n")
    assert yaml_problem(raised.value) == "line 2, column 8: mapping values are not allowed here"


def test_a_yaml_problem_without_a_place_is_its_own_message() -> None:
    assert yaml_problem(yaml.YAMLError("stream too deep")) == "stream too deep"

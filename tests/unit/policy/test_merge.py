"""A policy's text over the embedded default (policy/merge.py): what validation then sees.

A policy names only what it changes, so the merge decides what every other key is: mappings merge key
by key, lists and scalars replace, and the namespace overrides keep the default's exemptions for
every namespace the policy does not name. parse_policy's own tests (test_policy.py) see the outcome
through the whole model; these pin the merge itself down on plain mappings.
"""

from __future__ import annotations

import copy
from typing import Any

from webhook.policy.merge import over_default

JSON = dict[str, Any]

DEFAULT: JSON = {
    "mode": "enforce",
    "rules": {
        "priority": {"mode": "warn", "className": "gpu-default"},
        "readinessTolerations": {"batchSeconds": 60, "servingSeconds": 300},
    },
    "accelerators": {"resources": ["nvidia.com/gpu", "amd.com/gpu"]},
    "namespaces": [
        {"names": ["kube-system", "gpu-operator"], "mode": "off"},
        {"names": ["monitoring"], "mode": "audit"},
        {"selector": {"matchLabels": {"gpuguard.io/exempt": "true"}}, "mode": "off"},
    ],
}


def test_an_empty_policy_is_the_default() -> None:
    assert over_default(DEFAULT, {}) == DEFAULT


def test_mappings_merge_key_by_key_at_every_depth() -> None:
    merged = over_default(DEFAULT, {"rules": {"priority": {"mode": "enforce"}}})
    assert merged["rules"] == {
        "priority": {"mode": "enforce", "className": "gpu-default"},
        "readinessTolerations": {"batchSeconds": 60, "servingSeconds": 300},
    }
    assert merged["mode"] == "enforce"


def test_a_list_replaces_the_defaults_whole() -> None:
    merged = over_default(DEFAULT, {"accelerators": {"resources": ["example.com/tpu"]}})
    assert merged["accelerators"]["resources"] == ["example.com/tpu"]


def test_a_value_of_another_shape_replaces_the_default_for_validation_to_judge() -> None:
    # A scalar where the default has a mapping is not merged into it: validation must see what was written.
    assert over_default(DEFAULT, {"rules": "none"})["rules"] == "none"
    assert over_default(DEFAULT, {"mode": {"nested": 1}})["mode"] == {"nested": 1}


def test_merging_leaves_the_default_as_it_was() -> None:
    before = copy.deepcopy(DEFAULT)
    given: JSON = {"rules": {"priority": {"mode": "off"}}, "namespaces": [{"names": ["kube-system"]}]}
    over_default(DEFAULT, given)
    assert before == DEFAULT


def test_the_policys_namespaces_come_first_and_the_default_exemptions_stay() -> None:
    team: JSON = {"names": ["ml"], "mode": "warn"}
    assert over_default(DEFAULT, {"namespaces": [team]})["namespaces"] == [team, *DEFAULT["namespaces"]]


def test_a_namespace_the_policy_names_leaves_the_default_entry_that_named_it() -> None:
    # The policy's own word for kube-system wins; gpu-operator keeps the default's exemption.
    kube_system: JSON = {"names": ["kube-system"], "mode": "audit"}
    merged = over_default(DEFAULT, {"namespaces": [kube_system]})["namespaces"]
    assert merged == [
        kube_system,
        {"names": ["gpu-operator"], "mode": "off"},
        {"names": ["monitoring"], "mode": "audit"},
        DEFAULT["namespaces"][2],
    ]


def test_a_default_entry_left_with_no_name_goes_but_a_selector_entry_stays() -> None:
    given: JSON = {"names": ["monitoring", "kube-system", "gpu-operator"], "mode": "enforce"}
    merged = over_default(DEFAULT, {"namespaces": [given]})["namespaces"]
    assert merged == [given, DEFAULT["namespaces"][2]]


def test_malformed_namespace_entries_name_nothing_and_are_left_for_validation() -> None:
    given: list[Any] = ["kube-system", {"names": "monitoring"}, {"names": [7, "gpu-operator"]}]
    merged = over_default(DEFAULT, {"namespaces": given})["namespaces"]
    assert merged == [
        *given,
        {"names": ["kube-system"], "mode": "off"},
        {"names": ["monitoring"], "mode": "audit"},
        DEFAULT["namespaces"][2],
    ]


def test_namespaces_that_are_not_a_list_replace_the_default_for_validation_to_refuse() -> None:
    assert over_default(DEFAULT, {"namespaces": {"names": ["ml"]}})["namespaces"] == {"names": ["ml"]}

"""webhook.policy.model: parsing, load-time refusals that name the field, and mode resolution."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.harness.manifests import make_policy
from webhook.policy.model import (
    MUTATING_RULES,
    RULE_IDS,
    VALIDATING_RULES,
    Mode,
    PolicyError,
    RuleId,
    default_policy,
    default_policy_text,
    parse_policy,
)


def test_embedded_default_parses_and_matches_its_documentation() -> None:
    policy = default_policy()
    assert policy.enabled is True
    assert policy.mode == "enforce"
    assert policy.rules.readinessTolerations.apiServerDefaultSeconds == 300
    assert policy.rules.priority.className in policy.priorityClasses
    assert policy.mode_for("priority", "kube-system") == "off"
    assert len(policy.hash) == 12


def test_empty_text_is_the_default_policy() -> None:
    assert parse_policy("").hash == default_policy().hash
    assert parse_policy(default_policy_text()).hash == default_policy().hash


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param("bogus: 1\n", "bogus: unknown key (expected one of: enabled, mode,", id="top-level"),
        pytest.param(
            "rules:\n  priority:\n    bogus: 1\n", "rules.priority.bogus: unknown key", id="nested-rule"
        ),
        pytest.param("accelerators:\n  gpus: [x]\n", "accelerators.gpus: unknown key", id="accelerators"),
        pytest.param(
            "namespaces:\n- names: [a]\n  mood: warn\n",
            "namespaces[0].mood: unknown key; did you mean 'mode'?",
            id="namespace",
        ),
        pytest.param(
            "rules:\n  podFailurePolicy:\n    deviceFailureExitCodes: [0, 74]\n",
            "rules.podFailurePolicy.deviceFailureExitCodes[0]: must be greater than or equal to 1, got 0",
            id="exit-code-zero",
        ),
        pytest.param(
            "rules:\n  podFailurePolicy:\n    nonRetriableExitCodes: [1, 256]\n",
            "rules.podFailurePolicy.nonRetriableExitCodes[1]",
            id="exit-code-too-big",
        ),
        pytest.param("mode: loud\n", "mode: unknown value 'loud', expected 'enforce'", id="unknown-mode"),
        pytest.param(
            "mode: enforced\n",
            "mode: unknown value 'enforced', expected 'enforce', 'warn', 'audit' or 'off'; did you mean 'enforce'?",
            id="misspelt-mode",
        ),
        pytest.param(
            "rules:\n  podFailurePolicy:\n    deviceFailureAction: Retry\n",
            "rules.podFailurePolicy.deviceFailureAction",
            id="unknown-action",
        ),
        pytest.param(
            "priorityClasses: {huge: 1000000001}\n", "priorityClasses.huge", id="priority-above-user-max"
        ),
        pytest.param(
            "rules:\n  readinessTolerations:\n    batchSeconds: -1\n",
            "rules.readinessTolerations.batchSeconds",
            id="negative-seconds",
        ),
        pytest.param(
            "namespaces:\n- names: [a]\n  rules: {quota: warn}\n",
            "namespaces[0].rules.quota: unknown key 'quota'",
            id="unknown-rule",
        ),
        pytest.param(
            "rules:\n  priorty: {className: x}\n",
            "rules.priorty: unknown key; did you mean 'priority'?",
            id="misspelt-rule",
        ),
        pytest.param(
            "namespaces:\n- names: [a]\n- names: [b]\n  selector: {matchLabels: {x: y}}\n",
            "namespaces[1]: give exactly one of names and selector",
            id="names-and-selector",
        ),
        pytest.param(
            "priorityClasses: {gpu.high: lots}\n",
            'priorityClasses["gpu.high"]: must be a valid integer',
            id="dotted-key",
        ),
    ],
)
def test_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(PolicyError, match="invalid policy") as caught:
        parse_policy(text)
    assert field in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("mode: [enforce\n", "not valid YAML", id="unclosed-flow"),
        pytest.param("a: b: c\n", "not valid YAML", id="nested-colon"),
        pytest.param("\tmode: warn\n", "not valid YAML", id="tab-indent"),
        pytest.param("- enforce\n", "policy must be a mapping, got list", id="list"),
        pytest.param("enforce\n", "policy must be a mapping, got str", id="scalar"),
        pytest.param("42\n", "policy must be a mapping, got int", id="number"),
    ],
)
def test_bad_yaml_and_non_mappings_are_refused(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(text)


@pytest.mark.parametrize(
    ("text", "rule", "namespace"),
    [
        pytest.param("mode: off\n", "priority", "default", id="global"),
        pytest.param("rules:\n  priority:\n    mode: off\n", "priority", "default", id="rule"),
        pytest.param("namespaces:\n- names: [ml]\n  mode: off\n", "priority", "ml", id="namespace"),
        pytest.param(
            "namespaces:\n- names: [ml]\n  rules: {priority: off}\n", "priority", "ml", id="namespace-rule"
        ),
    ],
)
def test_unquoted_off_means_off(text: str, rule: RuleId, namespace: str) -> None:
    # YAML 1.1 reads a bare `off` as false; whoever wrote it meant the mode.
    assert yaml.safe_load(text) != yaml.safe_load(text.replace("off", '"off"'))
    assert parse_policy(text).mode_for(rule, namespace) == "off"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"rules": {"gracefulTermination": {"preStop": {"seconds": 90}, "minGracePeriodSeconds": 60}}},
            "preStop.seconds (90) must be shorter than minGracePeriodSeconds (60)",
            id="prestop-longer-than-grace",
        ),
        pytest.param(
            {"rules": {"gracefulTermination": {"preStop": {"seconds": 60}, "minGracePeriodSeconds": 60}}},
            "preStop.seconds (60) must be shorter than minGracePeriodSeconds (60)",
            id="prestop-equal-to-grace",
        ),
        pytest.param(
            {"rules": {"gracefulTermination": {"preStop": {"action": "exec", "command": []}}}},
            "command is required when action is exec",
            id="exec-without-command",
        ),
        pytest.param(
            {"rules": {"gracefulTermination": {"preStop": {"action": "sleep", "command": ["sh"]}}}},
            "command is only used when action is exec",
            id="sleep-with-command",
        ),
        pytest.param(
            {"rules": {"priority": {"className": "system-cluster-critical"}}},
            "system-* classes are never assigned",
            id="system-class",
        ),
        pytest.param(
            {"rules": {"priority": {"className": "system-node-critical"}}},
            "system-* classes are never assigned",
            id="system-node-class",
        ),
        pytest.param(
            {
                "rules": {
                    "podFailurePolicy": {"deviceFailureExitCodes": [74], "nonRetriableExitCodes": [74, 1]}
                }
            },
            "exit codes [74] are in both",
            id="overlapping-exit-codes",
        ),
        pytest.param(
            {"namespaces": [{"names": ["ml"], "mode": "warn"}, {"names": ["ml"], "mode": "audit"}]},
            "namespace 'ml' is listed twice",
            id="namespace-twice",
        ),
    ],
)
def test_combinations_the_api_server_would_reject_are_refused(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        make_policy(overrides)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "class_name",
    [
        pytest.param("GPU-Workload", id="uppercase"),
        pytest.param("gpu workload", id="space"),
    ],
)
def test_priority_class_name_must_be_a_dns_subdomain(class_name: str) -> None:
    # Pod validation rejects a priorityClassName that is not a lowercase RFC 1123 subdomain: a policy
    # naming one would make every GPU pod gpuguard touches fail with 422, so it must fail at load time.
    with pytest.raises(PolicyError, match=r"rules\.priority"):
        make_policy({"rules": {"priority": {"className": class_name}}})


def test_exit_codes_are_sorted_and_unique() -> None:
    policy = make_policy({"rules": {"podFailurePolicy": {"deviceFailureExitCodes": [75, 74, 75, 3]}}})
    assert policy.rules.podFailurePolicy.deviceFailureExitCodes == [3, 74, 75]


def test_fields_left_out_come_from_the_default_and_lists_replace() -> None:
    policy = make_policy(
        {"accelerators": {"resources": ["example.com/tpu"]}, "rules": {"priority": {"className": "ml"}}}
    )
    default = default_policy()
    assert policy.accelerators.resources == ["example.com/tpu"]  # replaced, not merged
    assert policy.accelerators.taintKeys == default.accelerators.taintKeys  # sibling kept
    assert policy.rules.priority.className == "ml"
    assert policy.rules.podFailurePolicy == default.rules.podFailurePolicy


def test_hash_names_the_effective_policy() -> None:
    assert make_policy({"mode": "warn"}).hash == make_policy({"mode": "warn"}).hash
    assert make_policy({"mode": "warn"}).hash != make_policy({"mode": "audit"}).hash
    # The same effective policy written differently is the same policy.
    assert parse_policy("mode: warn\n").hash == parse_policy("mode: 'warn'  # comment\n").hash


def test_policy_is_frozen() -> None:
    policy = default_policy()
    with pytest.raises(ValueError, match="frozen"):
        policy.mode = "off"


# --- mode resolution -------------------------------------------------------------------------------------

SPECIFICITY_POLICY: dict[str, Any] = {
    "mode": "audit",
    "rules": {"priority": {"mode": "warn"}},
    "namespaces": [
        {"names": ["team-a"], "mode": "off"},
        {
            "names": ["team-b"],
            "mode": "warn",
            "rules": {"priority": "enforce", "gracefulTermination": "audit"},
        },
        {"names": ["team-c"], "rules": {"podFailurePolicy": "off"}},
    ],
}


@pytest.mark.parametrize(
    ("rule", "namespace", "expected"),
    [
        pytest.param("readinessTolerations", "default", "audit", id="global"),
        pytest.param("priority", "default", "warn", id="rule-beats-global"),
        pytest.param("priority", None, "warn", id="no-namespace"),
        pytest.param("priority", "team-a", "off", id="namespace-beats-rule"),
        pytest.param("readinessTolerations", "team-a", "off", id="namespace-beats-global"),
        pytest.param("priority", "team-b", "enforce", id="namespace-rule-beats-namespace"),
        pytest.param("gracefulTermination", "team-b", "audit", id="namespace-rule-beats-namespace-2"),
        pytest.param("readinessTolerations", "team-b", "warn", id="namespace-for-other-rules"),
        pytest.param("podFailurePolicy", "team-c", "off", id="namespace-rule-only"),
        pytest.param("priority", "team-c", "warn", id="namespace-without-mode-falls-to-rule"),
        pytest.param("acceleratorNodeGuard", "team-c", "audit", id="namespace-without-mode-falls-to-global"),
    ],
)
def test_most_specific_mode_wins(rule: RuleId, namespace: str | None, expected: Mode) -> None:
    assert make_policy(SPECIFICITY_POLICY).mode_for(rule, namespace) == expected


@pytest.mark.parametrize("rule", RULE_IDS)
def test_disabled_turns_every_rule_off(rule: RuleId) -> None:
    policy = make_policy({**SPECIFICITY_POLICY, "enabled": False})
    for namespace in ("default", "team-a", "team-b", "team-c", None):
        assert policy.mode_for(rule, namespace) == "off"


@pytest.mark.parametrize("rule", RULE_IDS)
def test_a_rule_mode_applies_to_that_rule_only(rule: RuleId) -> None:
    policy = make_policy({"rules": {rule: {"mode": "warn"}}})
    assert {other: policy.mode_for(other, "default") for other in RULE_IDS} == {
        other: "warn" if other == rule else "enforce" for other in RULE_IDS
    }
    assert set(RULE_IDS) == {*MUTATING_RULES, *VALIDATING_RULES}


# --- namespace overrides merge with the default ones --------------------------------------------------

INFRASTRUCTURE = ("kube-system", "kube-node-lease", "gpu-operator", "gpu-operator-resources")


def test_a_policy_adding_a_team_keeps_the_infrastructure_exemptions() -> None:
    policy = make_policy({"namespaces": [{"names": ["research"], "mode": "audit"}]})
    assert policy.mode_for("priority", "research") == "audit"
    assert [policy.mode_for("priority", namespace) for namespace in INFRASTRUCTURE] == ["off"] * 4


def test_a_namespace_the_policy_names_leaves_the_default_entry() -> None:
    policy = make_policy(
        {"namespaces": [{"names": ["kube-system"], "rules": {"acceleratorNodeGuard": "warn"}}]}
    )
    assert policy.mode_for("acceleratorNodeGuard", "kube-system") == "warn"
    assert (
        policy.mode_for("priority", "kube-system") == "enforce"
    )  # the default "off" entry no longer covers it
    assert policy.mode_for("priority", "gpu-operator") == "off"
    assert policy.namespaces[0].names == ["kube-system"]  # the given entries come first


def test_every_rule_has_its_code() -> None:
    from webhook.policy.rules import MUTATORS, VALIDATORS

    assert tuple(MUTATORS) == MUTATING_RULES
    assert set(VALIDATORS) == set(VALIDATING_RULES)


SELECTOR_POLICY = {
    "namespaces": [{"selector": {"matchLabels": {"tier": "batch"}}, "rules": {"priority": "off"}}]
}


@pytest.mark.parametrize(
    ("overrides", "labels"),
    [
        pytest.param(SPECIFICITY_POLICY, None, id="names"),
        pytest.param(SELECTOR_POLICY, {"tier": "batch"}, id="selector-matching"),
        pytest.param(SELECTOR_POLICY, {"tier": "web"}, id="selector-not-matching"),
        pytest.param(SELECTOR_POLICY, None, id="selector-labels-unknown"),
    ],
)
def test_modes_for_every_rule_agree_with_mode_for_each_and_again_when_remembered(
    overrides: dict[str, Any], labels: dict[str, str] | None
) -> None:
    policy = make_policy(overrides)
    for namespace in ("default", "team-a", "team-b", "team-c", None):
        expected = {rule: policy.mode_for(rule, namespace, labels) for rule in RULE_IDS}
        assert dict(policy.modes_for(namespace, labels)) == expected
        assert dict(policy.modes_for(namespace, labels)) == expected  # the remembered answer, where kept


def test_modes_for_follows_a_namespaces_labels_as_they_change() -> None:
    policy = make_policy(SELECTOR_POLICY)
    assert policy.modes_for("jobs", {"tier": "batch"})["priority"] == "off"
    assert policy.modes_for("jobs", {"tier": "web"})["priority"] == policy.mode_for("priority", "jobs")
    assert policy.modes_for("jobs", {"tier": "batch"})["priority"] == "off"

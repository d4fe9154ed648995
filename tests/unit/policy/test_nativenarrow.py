"""Which requests gpuguard's webhooks still see in each `admission.mode`, the regions of namespaces a
webhook is split into, and the patch that says so in their configurations (the leader's order of writes
is test_nativesync.py's). What the API server does with them is tests/e2e/test_hybrid.py's."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from tests.harness.manifests import make_policy
from webhook.policy import nativegaps
from webhook.policy.model import MUTATING_RULES, LabelSelector, Policy
from webhook.policy.native import NAME_LABEL, compile_policy, unwatched_namespaces
from webhook.policy.nativenarrow import (
    CONDITION_NAME,
    CONFIGURATION_KINDS,
    MAX_PARTS,
    UNNARROWED,
    Part,
    configuration_patch,
    narrowing,
    shaped,
)
from webhook.policy.nativesync import namespace_owner
from webhook.policy.workload import JSON

MUTATING, VALIDATING = CONFIGURATION_KINDS
HYBRID = {"admission": {"mode": "hybrid"}}
OWNER = namespace_owner("gpuguard", "6c1f0e4e-uid")


DEPLOYED = {
    doc["kind"]: doc
    for doc in yaml.safe_load_all((Path(__file__).parents[3] / "deploy/base/webhooks.yaml").read_text())
}
# deploy/'s: never the control plane's namespaces nor gpuguard's.
UNWATCHED = unwatched_namespaces()
WATCHED = {"matchExpressions": [{"key": NAME_LABEL, "operator": "NotIn", "values": UNWATCHED}]}


def configuration(kind: str, *conditions: JSON) -> JSON:
    webhook: JSON = {"name": f"{kind.lower()}.gpuguard.io", "clientConfig": {}, "namespaceSelector": WATCHED}
    if conditions:
        webhook["matchConditions"] = list(conditions)
    return {"kind": kind, "metadata": {"name": "gpuguard", "resourceVersion": "7"}, "webhooks": [webhook]}


def test_no_native_policy_binds_where_deploys_webhooks_never_call_and_gpuguards_namespace_moves_with_it() -> (
    None
):
    """The bindings leave out the namespaces deploy/'s webhooks do (the chart's `namespace` replacing
    gpuguard's), so in hybrid a request there still reaches the webhook alone, never a native policy."""
    assert DEPLOYED[MUTATING]["webhooks"][0]["namespaceSelector"] == WATCHED
    policy = make_policy({"admission": {"mode": "hybrid"}})
    moved = ["kube-system", "kube-node-lease", "gpu-system", "gpuguard-node"]
    bindings = [o for o in compile_policy(policy, "gpu-system").objects if o["kind"].endswith("Binding")]
    assert bindings
    for binding in bindings:
        assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][-1] == {
            "key": NAME_LABEL,
            "operator": "NotIn",
            "values": moved,
        }
    for parts in narrowing(policy, "gpu-system").parts.values():
        assert [p.requirements for p in parts if p.unwatched] == [
            [{"key": NAME_LABEL, "operator": "In", "values": moved}]
        ]


def test_webhook_mode_leaves_the_webhooks_as_registered_and_native_mode_calls_none() -> None:
    assert narrowing(make_policy({})).conditions == {MUTATING: None, VALIDATING: None}
    assert narrowing(make_policy({"admission": {"mode": "native"}})).conditions == {
        MUTATING: "false",
        VALIDATING: "false",
    }


def test_hybrid_sends_the_webhooks_what_needs_cluster_facts_or_the_webhooks_own_warnings() -> None:
    found = narrowing(make_policy(HYBRID))
    assert all(isinstance(c, str) and c not in ("true", "false") for c in found.conditions.values())
    assert "other workload kinds" in found.sent[MUTATING]
    validated = " ".join(found.sent[VALIDATING])
    for what in ("naming a node", "priority class the policy does not list", "DRA claims", "driver minimum"):
        assert what in validated


def test_a_mutating_rule_in_a_mode_no_mutating_policy_has_everywhere_leaves_the_mutating_webhook_whole() -> (
    None
):
    found = narrowing(make_policy({**HYBRID, "rules": {"priority": {"mode": "warn"}}}))
    assert found.parts[MUTATING] == [Part([], None)]
    assert found.sent[MUTATING] == ["everything: priority is in warn mode"]
    assert isinstance(found.conditions[VALIDATING], str)


def test_in_hybrid_a_native_policy_stands_aside_where_the_webhook_would_answer_otherwise() -> None:
    def conditions(mode: str) -> dict[tuple[str, str], list[str]]:
        policy = make_policy({"admission": {"mode": mode}})
        # A MAP's rules stand aside each within its one condition (test_native.py shows each alone).
        asides = [
            f"!({nativegaps.stand_aside(nativegaps.mutating(policy), rule)})" for rule in MUTATING_RULES
        ]
        return {
            (o["kind"], o["metadata"]["name"]): [c["name"] for c in o["spec"]["matchConditions"]]
            + (
                ["not-left-to-the-webhook"]
                if any(a in o["spec"]["matchConditions"][-1]["expression"] for a in asides)
                else []
            )
            for o in compile_policy(policy).objects
            if "matchConditions" in o["spec"]
        }

    hybrid, native = conditions("hybrid"), conditions("native")
    aside = {key for key, found in hybrid.items() if "not-left-to-the-webhook" in found}
    # Every one: a DRA claim's device class decides whether a workload is an accelerator one for each
    # rule but trusted device software, which stands aside for updates and '..' hostPaths.
    assert aside == set(hybrid)
    # Native mode has no webhook to leave anything to: the same policies, none standing aside.
    assert set(native) == set(hybrid)
    assert not any("not-left-to-the-webhook" in found for found in native.values())


# --- regions: a webhook split by namespaces where what it must see differs ------------------------

REGIONS = {
    **HYBRID,
    "namespaces": [
        {"names": ["team-a"], "rules": {"priority": "warn"}},
        {"selector": {"matchLabels": {"tier": "dev"}}, "mode": "audit"},
        {"selector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]}, "mode": "enforce"},
        {
            "selector": {"matchExpressions": [{"key": "lab", "operator": "In", "values": ["x", "y"]}]},
            "mode": "warn",
        },
    ],
}
# Namespaces by name and labels: named ones, each selector alone and together (the first matching wins),
# none, gpuguard's own and the control plane's.
NAMESPACES = [
    (name, labels)
    for name in ("team-a", "gpu-operator", "ml", "kube-system", "gpuguard")
    for labels in (
        {},
        {"tier": "dev"},
        {"tier": "prod"},
        {"team": "x"},
        {"team": "x", "tier": "dev"},
        {"lab": "x"},
        {"lab": "z", "team": "y"},
        {"lab": "y", "tier": "dev", "team": "x"},
    )
]


def _matches(selector: JSON, name: str, labels: dict[str, str]) -> bool:
    """A namespaceSelector as the API server reads it: the name is the label it sets on every namespace."""
    return LabelSelector.model_validate(selector).matches({**labels, NAME_LABEL: name})


def _condition(webhook: JSON) -> str | None:
    return next(
        (c["expression"] for c in webhook.get("matchConditions", []) if c["name"] == CONDITION_NAME), None
    )


def _webhook_sees_everything(policy: Policy, name: str, labels: dict[str, str]) -> bool:
    """Where the mutating webhook must see every request: no native policy binds there, or a mutating
    rule's mode there is one no MutatingAdmissionPolicy has (as the webhook itself decides the mode)."""
    modes = {policy.mode_for(rule, name, labels) for rule in MUTATING_RULES}
    return name in UNWATCHED or bool(modes & {"warn", "audit"})


def _idle(policy: Policy, name: str, labels: dict[str, str]) -> bool:
    """Where no mutating rule acts: whatever the webhook is sent there, it does nothing."""
    return {policy.mode_for(rule, name, labels) for rule in MUTATING_RULES} == {"off"}


@pytest.mark.parametrize("kind", CONFIGURATION_KINDS)
def test_each_request_reaches_one_entry_of_each_webhook_and_every_one_does_where_the_policy_needs_it(
    kind: str,
) -> None:
    policy = make_policy(REGIONS)
    found = narrowing(policy)
    stored = {**copy.deepcopy(DEPLOYED[kind]), "metadata": {"name": "gpuguard", "resourceVersion": "3"}}
    split = jsonpatch.apply_patch(stored, configuration_patch(stored, found.parts[kind]))
    narrowed = next(part.condition for part in found.parts[kind] if part.condition is not None)
    for name, labels in NAMESPACES:
        for deployed in DEPLOYED[kind]["webhooks"]:
            entries = [w for w in split["webhooks"] if w["name"].endswith(deployed["name"])]
            # The webhook as deployed, but for gpuguard's condition: its selector is untouched.
            assert {k: v for k, v in entries[0].items() if k != "matchConditions"} == {
                k: v for k, v in deployed.items() if k != "matchConditions"
            }
            met = [w for w in entries if _matches(w["namespaceSelector"], name, labels)]
            if not _matches(deployed["namespaceSelector"], name, labels):
                assert met == [], (name, labels, deployed["name"])
                continue
            for entry in met:  # everything the webhook had besides: rules, client, its own conditions
                assert {
                    k: v
                    for k, v in entry.items()
                    if k not in ("name", "namespaceSelector", "matchConditions")
                } == {
                    k: v
                    for k, v in deployed.items()
                    if k not in ("name", "namespaceSelector", "matchConditions")
                }
                assert [c for c in entry["matchConditions"] if c["name"] != CONDITION_NAME] == deployed[
                    "matchConditions"
                ]
            conditions = [_condition(entry) for entry in met]
            if name in UNWATCHED or (kind == MUTATING and _webhook_sees_everything(policy, name, labels)):
                # Two entries, one sending what the other does not: every request, once.
                assert conditions in ([None], [narrowed, f"!({narrowed})"]), (name, labels)
            else:
                assert conditions == [narrowed] or _idle(policy, name, labels), (name, labels)
    # Entries added where the regions differ only: the mutating webhook (warn and audit regions), not
    # the validating ones (kube-system's sees everything, the other leaves it out).
    names = [w["name"] for w in split["webhooks"]]
    if kind == MUTATING:
        assert names[0] == "mutate.gpuguard.io" and len(names) > 2
        assert names[1:] == [f"region-{i}.mutate.gpuguard.io" for i in range(1, len(names))]
    else:
        assert names == [w["name"] for w in DEPLOYED[kind]["webhooks"]]
        assert [_condition(w) for w in split["webhooks"]] == [narrowed, None]


def test_un_narrowing_restores_the_configuration_as_deployed_in_one_write() -> None:
    stored = {**copy.deepcopy(DEPLOYED[MUTATING]), "metadata": {"name": "gpuguard", "resourceVersion": "3"}}
    parts = narrowing(make_policy(REGIONS)).parts[MUTATING]
    split = jsonpatch.apply_patch(stored, configuration_patch(stored, parts))
    split["metadata"]["resourceVersion"] = "4"
    assert configuration_patch(split, parts) == []  # as wanted: nothing to write
    operations = configuration_patch(split, UNNARROWED.parts[MUTATING])
    assert operations[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "4"}
    whole = jsonpatch.apply_patch(split, operations)
    assert whole["webhooks"] == DEPLOYED[MUTATING]["webhooks"]
    # Another resourceVersion: the patch fails instead of writing over what was read.
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(
            {**split, "metadata": {**split["metadata"], "resourceVersion": "5"}}, operations
        )


def test_the_entries_added_follow_the_webhooks_selector_as_deploy_changes_it() -> None:
    stored = {**copy.deepcopy(DEPLOYED[MUTATING]), "metadata": {"name": "gpuguard", "resourceVersion": "3"}}
    parts = narrowing(make_policy(REGIONS)).parts[MUTATING]
    split = jsonpatch.apply_patch(stored, configuration_patch(stored, parts))
    # `kubectl apply -k deploy/` of a newer deploy/ that also leaves out namespace `sandbox`.
    newer: JSON = {"matchExpressions": [{"key": NAME_LABEL, "operator": "NotIn", "values": ["sandbox"]}]}
    split["webhooks"][0]["namespaceSelector"] = newer
    again = jsonpatch.apply_patch(split, configuration_patch(split, parts))
    assert again["webhooks"][0]["namespaceSelector"] == newer
    assert not any(_matches(w["namespaceSelector"], "sandbox", {}) for w in again["webhooks"])
    # kube-system, which the newer one no longer leaves out: an entry of its own sends it everything.
    assert [
        _condition(w) is None
        for w in again["webhooks"]
        if _matches(w["namespaceSelector"], "kube-system", {})
    ] == [
        False,
        False,
    ]


def test_past_the_most_regions_a_webhook_is_split_into_it_stays_un_narrowed() -> None:
    # Outside a selector of two labels is two regions: four such selectors make 1 + 2 + 4 + 8 + 16.
    many = [{"selector": {"matchLabels": {f"a{i}": "x", f"b{i}": "x"}}, "mode": "warn"} for i in range(4)]
    found = narrowing(make_policy({**HYBRID, "namespaces": many}))
    assert found.parts[MUTATING] == [Part([], None)]
    assert f"more than the {MAX_PARTS} entries" in found.sent[MUTATING][0]


@pytest.mark.parametrize(
    ("present", "expression", "result"),
    [
        ((), "x", [{"name": CONDITION_NAME, "expression": "x"}]),
        (
            ({"name": "theirs", "expression": "a"},),
            "x",
            [{"name": "theirs", "expression": "a"}, {"name": CONDITION_NAME, "expression": "x"}],
        ),
        (
            ({"name": CONDITION_NAME, "expression": "old"},),
            "x",
            [{"name": CONDITION_NAME, "expression": "x"}],
        ),
        (
            ({"name": "theirs", "expression": "a"}, {"name": CONDITION_NAME, "expression": "x"}),
            None,
            [{"name": "theirs", "expression": "a"}],
        ),
    ],
)
def test_the_patch_touches_gpuguards_condition_alone_at_the_version_read(
    present: tuple[JSON, ...], expression: str | None, result: list[JSON]
) -> None:
    stored = configuration(MUTATING, *present)
    parts = [Part([], expression)]
    operations = configuration_patch(stored, parts)
    assert operations[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "7"}
    assert {"op": "test", "path": "/webhooks/0/name", "value": stored["webhooks"][0]["name"]} in operations
    patched: Any = jsonpatch.apply_patch(stored, operations)
    assert patched["webhooks"][0].get("matchConditions", []) == result
    assert {k: v for k, v in patched["webhooks"][0].items() if k != "matchConditions"} == {
        k: v for k, v in stored["webhooks"][0].items() if k != "matchConditions"
    }
    assert configuration_patch(patched, parts) == []


def test_the_entries_of_a_webhook_deploy_renamed_go_with_it() -> None:
    stored = {**copy.deepcopy(DEPLOYED[MUTATING]), "metadata": {"name": "gpuguard", "resourceVersion": "3"}}
    parts = narrowing(make_policy(REGIONS)).parts[MUTATING]
    split = jsonpatch.apply_patch(stored, configuration_patch(stored, parts))
    # A newer deploy/ applied: the webhook is renamed, and kubectl apply deleted the old one.
    renamed = {**copy.deepcopy(DEPLOYED[MUTATING]["webhooks"][0]), "name": "mutate.v2.gpuguard.io"}
    split["webhooks"][0] = renamed
    names = [w["name"] for w in shaped(split, parts)]
    assert names[0] == "mutate.v2.gpuguard.io"
    assert all(name.endswith(".mutate.v2.gpuguard.io") for name in names[1:])

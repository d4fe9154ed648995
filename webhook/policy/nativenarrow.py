"""Which requests gpuguard's webhooks still see beside the native admission policies (`admission.mode`).

In `hybrid` the compiled policies (native.py) decide what CEL can decide from the object alone, and each
webhook of gpuguard's two configurations gets one match condition more, CONDITION_NAME, true exactly for
the requests the native policies cannot decide: other workload kinds, cluster facts (a pod naming a node,
a template naming a class the policy does not list, DRA claims whose device class matters), the webhook's
own warnings (a skipped Job, rules past the limit, no node with a new-enough driver), gangs. A rule in a
mode no MutatingAdmissionPolicy has (warn, audit) leaves the mutating webhook un-narrowed: a match
condition cannot read namespace labels, so it cannot tell the namespaces where that mode holds. In
`native` the condition is `false`: no webhook is called. In `webhook` it is absent.

The condition is written into the configurations as they are read, at the resourceVersion read, and
touches nothing else (`condition_patch`); the leader narrows only once the native objects are in force
(webhook.controllers.nativesync).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from webhook.policy import nativegaps
from webhook.policy.model import MUTATING_RULES, Mode, Policy, RuleId
from webhook.policy.native import regions
from webhook.policy.nativecel import TEMPLATE_RESOURCES, literal
from webhook.policy.workload import JSON

CONDITION_NAME = "gpuguard.io/admission-mode"
CONFIGURATION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")

# The resources the compiled policies match (nativemutating, nativevalidating), by API group.
_MUTATED = {"": ["pods"], **TEMPLATE_RESOURCES}
_VALIDATED = {
    "": ["pods"],  # pods/ephemeralcontainers is a subresource of pods
    "batch": TEMPLATE_RESOURCES["batch"],
    "apps": [*TEMPLATE_RESOURCES["apps"], "daemonsets"],
}


@dataclass(frozen=True)
class Narrowing:
    """The condition each configuration's webhooks get (None: none, every request they match is sent),
    and what is sent to them, in words."""

    conditions: dict[str, str | None]
    sent: dict[str, list[str]] = field(default_factory=dict)


def _other_kinds(groups: Mapping[str, list[str]]) -> str:
    covered = " || ".join(
        f"(request.resource.group == {literal(group)} && request.resource.resource in {literal(resources)})"
        for group, resources in groups.items()
    )
    return f"!({covered})"


def _modes(policy: Policy, rule: RuleId) -> set[Mode]:
    return {policy.mode_under(rule, region.override) for region in regions(policy)}


def _active(policy: Policy, rule: RuleId) -> bool:
    return _modes(policy, rule) != {"off"}


def _mutating(policy: Policy) -> tuple[str | None, list[str]]:
    for rule_id in MUTATING_RULES:
        unmatched = _modes(policy, rule_id) - {"off", "enforce"}
        if unmatched:
            return None, [f"everything: {rule_id} is in {', '.join(sorted(unmatched))} mode somewhere"]
    if _active(policy, "priority") and policy.priority_value(policy.rules.priority.className) is None:
        return None, ["everything: the priority class is not in the policy's priorityClasses"]
    reasons = [("other workload kinds", _other_kinds(_MUTATED))]
    reasons += [
        (left.what, left.expression) for left in nativegaps.mutating(policy) if _active(policy, left.rule)
    ]
    return _joined(reasons)


def _validating(policy: Policy) -> tuple[str | None, list[str]]:
    reasons = [("other workload kinds", _other_kinds(_VALIDATED))]
    reasons += [
        (left.what, left.expression) for left in nativegaps.validating(policy) if _active(policy, left.rule)
    ]
    return _joined(reasons)


def _joined(reasons: list[tuple[str, str]]) -> tuple[str | None, list[str]]:
    once = dict.fromkeys(reasons)  # a reason several rules leave to the webhook is sent once
    return " || ".join(f"({expression})" for _, expression in once), [what for what, _ in once]


def narrowing(policy: Policy) -> Narrowing:
    """The match condition gpuguard's webhooks get under `policy`."""
    mode = policy.admission.mode
    if mode == "webhook" or not policy.enabled:
        return Narrowing(dict.fromkeys(CONFIGURATION_KINDS))
    if mode == "native":
        return Narrowing(
            dict.fromkeys(CONFIGURATION_KINDS, "false"), {kind: [] for kind in CONFIGURATION_KINDS}
        )
    mutating, mutated = _mutating(policy)
    validating, validated = _validating(policy)
    return Narrowing(
        {CONFIGURATION_KINDS[0]: mutating, CONFIGURATION_KINDS[1]: validating},
        {CONFIGURATION_KINDS[0]: mutated, CONFIGURATION_KINDS[1]: validated},
    )


def condition_patch(configuration: Mapping[str, Any], expression: str | None) -> list[JSON]:
    """A JSON Patch giving every webhook of `configuration` CONDITION_NAME with `expression` (None: none),
    at the resourceVersion read and each webhook's name tested; empty when they already have it."""
    operations: list[JSON] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        conditions = webhook.get("matchConditions") or []
        at = next((i for i, c in enumerate(conditions) if c.get("name") == CONDITION_NAME), None)
        path = f"/webhooks/{index}/matchConditions"
        found = conditions[at].get("expression") if at is not None else None
        if found == expression:
            continue
        operations.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook["name"]})
        if expression is None:
            operations.append({"op": "remove", "path": f"{path}/{at}"})
        elif at is not None:
            operations.append({"op": "replace", "path": f"{path}/{at}/expression", "value": expression})
        elif "matchConditions" in webhook:
            operations.append(
                {
                    "op": "add",
                    "path": f"{path}/-",
                    "value": {"name": CONDITION_NAME, "expression": expression},
                }
            )
        else:
            operations.append(
                {"op": "add", "path": path, "value": [{"name": CONDITION_NAME, "expression": expression}]}
            )
    if not operations:
        return []
    version = {
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": configuration["metadata"]["resourceVersion"],
    }
    return [version, *operations]

"""The policy compiled into the API server's own admission policies: MutatingAdmissionPolicies (MAP),
ValidatingAdmissionPolicies (VAP) and their bindings, as plain dicts.

Each validating rule, or the part of it CEL can decide from the object alone, becomes one VAP; the
mutating rules enforced in the same namespaces share one MAP (one mutation for all, which the API server
runs far more cheaply than one per rule); the namespace modes become the bindings. What needs more (cluster facts, warnings from a mutation, the driver rule's
node-affinity merge) is named in `Compiled.gaps`, never dropped: those decisions stay the webhook's.

The expressions mirror webhook.policy.rules one to one and write what the webhook writes, the
`gpuguard.io/rules` and `gpuguard.io/policy` annotations included; tests/e2e/test_native.py proves
on a real API server that an object stored through these policies equals the one stored through the
webhook. Everything is JSON Patch: the policies match several kinds at once, and an apply
configuration would need each kind's own type.

This module puts the policy together (the policies, the namespace regions their bindings cover, the
gaps); the rules themselves are in nativemutating.py, nativevalidating.py and nativedriver.py, the
CEL text they share in nativecel.py. In `hybrid`, a rule's native part stands aside where nativegaps.py
leaves the rule to the webhook and the two would answer differently.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from webhook.policy import nativegaps
from webhook.policy.model import LabelSelector, Mode, NamespaceOverride, Policy, RuleId
from webhook.policy.nativecel import API_VERSION, MANAGED_BY, Cel
from webhook.policy.nativedriver import driver_compatibility, driver_compatibility_check
from webhook.policy.nativemutating import (
    RuleMutation,
    graceful_termination,
    mutating_policy,
    pod_failure_policy,
    priority,
    readiness_tolerations,
)
from webhook.policy.nativevalidating import accelerator_node_guard, trusted_device_software
from webhook.policy.workload import JSON

NAME_LABEL = "kubernetes.io/metadata.name"
DEFAULT_NAMESPACE = "gpuguard"  # deploy/'s, and the chart's default `namespace`
NODE_AGENT_NAMESPACE = "gpuguard-node"
MUTATIONS = "gpuguard-mutations"  # the MAP of the mutating rules (numbered from 2 past the first)
# A VAP's condition in hybrid; a MAP's rules stand aside each within its one condition.
NOT_LEFT_TO_THE_WEBHOOK = "not-left-to-the-webhook"
VALIDATION_ACTIONS: dict[Mode, list[str]] = {"enforce": ["Deny"], "warn": ["Warn"], "audit": ["Audit"]}

Requirement = dict[str, Any]  # a label selector requirement: key, operator, values


@dataclass(frozen=True)
class Gap:
    """A decision the native policies leave to the webhook."""

    rule: str
    what: str


@dataclass(frozen=True)
class Compiled:
    objects: list[JSON]  # every policy, then its bindings
    gaps: list[Gap]


def fail_closed(objects: list[JSON], kinds: Collection[str]) -> list[JSON]:
    """`objects` with the policies of `kinds` failing closed (`failurePolicy: Fail`: a request the
    policy cannot evaluate is refused); compiled, every policy fails open, as deploy/'s webhooks do."""
    return [
        {**obj, "spec": {**obj["spec"], "failurePolicy": "Fail"}} if obj["kind"] in kinds else obj
        for obj in objects
    ]


# --- bindings: the namespace modes as mutually exclusive selectors --------------------------------


def _requirements(selector: LabelSelector) -> list[Requirement]:
    return [{"key": k, "operator": "In", "values": [v]} for k, v in selector.matchLabels.items()] + [
        {"key": r.key, "operator": r.operator, **({"values": list(r.values)} if r.values else {})}
        for r in selector.matchExpressions
    ]


_NEGATED = {"In": "NotIn", "NotIn": "In", "Exists": "DoesNotExist", "DoesNotExist": "Exists"}


def _outside(selector: LabelSelector) -> list[list[Requirement]]:
    """Namespaces the selector does not match, as disjoint conjunctions: not r1, or r1 and not r2, ..."""
    requirements = _requirements(selector)
    return [
        [*requirements[:i], {**requirements[i], "operator": _NEGATED[requirements[i]["operator"]]}]
        for i in range(len(requirements))
    ]


@dataclass(frozen=True)
class Region:
    """Namespaces no other region holds, and the namespace entry that is most specific there."""

    requirements: list[Requirement]
    override: NamespaceOverride | None
    description: str


def regions(policy: Policy) -> list[Region]:
    """The namespaces split as Policy.namespace_override decides: a name first, then the first
    matching selector, then none; each region a conjunction of label requirements."""
    named = sorted({name for o in policy.namespaces for name in o.names})
    not_named = [{"key": NAME_LABEL, "operator": "NotIn", "values": named}] if named else []
    found = [
        Region(
            [{"key": NAME_LABEL, "operator": "In", "values": list(o.names)}],
            o,
            f"namespaces {', '.join(o.names)}",
        )
        for o in policy.namespaces
        if o.names
    ]
    earlier: list[list[list[Requirement]]] = []
    for index, override in enumerate(policy.namespaces):
        if override.selector is None:
            continue
        own = _requirements(override.selector)
        for parts in itertools.product(*earlier):
            found.append(
                Region(
                    [*not_named, *(r for part in parts for r in part), *own],
                    override,
                    f"namespaces[{index}].selector",
                )
            )
        earlier.append(_outside(override.selector))
    for parts in itertools.product(*earlier):
        found.append(
            Region([*not_named, *(r for part in parts for r in part)], None, "every other namespace")
        )
    return found


def unwatched_namespaces(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """The namespaces gpuguard's webhooks never see, so no native policy binds there either: the control
    plane's, the one gpuguard runs in (`namespace`: deploy/'s, or the chart's) and its node agent's."""
    return ["kube-system", "kube-node-lease", namespace, NODE_AGENT_NAMESPACE]


def _binding(
    kind: str, policy_name: str, index: int, region: Region, extra: JSON, unwatched_names: list[str]
) -> JSON:
    unwatched = {"key": NAME_LABEL, "operator": "NotIn", "values": unwatched_names}
    return {
        "apiVersion": API_VERSION,
        "kind": f"{kind}Binding",
        "metadata": {"name": f"{policy_name}-{index}", "labels": dict(MANAGED_BY)},
        "spec": {
            "policyName": policy_name,
            "matchResources": {"namespaceSelector": {"matchExpressions": [*region.requirements, unwatched]}},
            **extra,
        },
    }


def _enforced(policy: Policy, rule: RuleId, split: list[Region], gaps: list[Gap]) -> tuple[int, ...]:
    """The regions where a MAP applies `rule`: those where it enforces; warn and audit are named gaps."""
    found = []
    for index, region in enumerate(split):
        mode = policy.mode_under(rule, region.override)
        if mode == "enforce":
            found.append(index)
        elif mode != "off":
            gaps.append(
                Gap(
                    rule,
                    f"{mode} mode in {region.description}: a MutatingAdmissionPolicy cannot warn or record",
                )
            )
    return tuple(found)


def _mutating(
    policy: Policy, parts: list[RuleMutation], cel: Cel, gaps: list[Gap], unwatched: list[str]
) -> tuple[list[JSON], list[JSON]]:
    """One MAP per set of regions, carrying every rule enforced in exactly those, then its bindings.
    The first is gpuguard-mutations, the others numbered from 2 (most policies have one)."""
    split = regions(policy)
    groups: dict[tuple[int, ...], list[RuleMutation]] = {}
    for part in parts:
        where = _enforced(policy, part.rule, split, gaps)
        if where:
            groups.setdefault(where, []).append(part)
    policies, bindings = [], []
    for number, (where, grouped) in enumerate(groups.items(), start=1):
        name = MUTATIONS if number == 1 else f"{MUTATIONS}-{number}"
        policies.append(mutating_policy(name, grouped, policy, cel))
        bindings += [
            _binding("MutatingAdmissionPolicy", name, i, split[r], {}, unwatched) for i, r in enumerate(where)
        ]
    return policies, bindings


def _validating(policy: Policy, rule: RuleId, obj: JSON, unwatched: list[str]) -> list[JSON]:
    """The VAP's bindings: each region where `rule` is on, with its mode's actions."""
    name = str(obj["metadata"]["name"])
    modes = [(region, policy.mode_under(rule, region.override)) for region in regions(policy)]
    on = [(region, mode) for region, mode in modes if mode != "off"]
    return [
        _binding(
            "ValidatingAdmissionPolicy",
            name,
            index,
            region,
            {"validationActions": VALIDATION_ACTIONS[mode]},
            unwatched,
        )
        for index, (region, mode) in enumerate(on)
    ]


# --- the whole policy -----------------------------------------------------------------------------

# What no native policy decides, whatever the policy says: cluster facts and the webhook's own outputs.
ALWAYS_WEBHOOK = (
    Gap(
        "podFailurePolicy",
        "the warning on an OnFailure Job left alone (onFailureJobs: skip) and on rules left out past 20",
    ),
    Gap(
        "priority",
        "a pod already naming the cluster's globalDefault class, the class's existence and preemptionPolicy"
        " (cluster facts); pods get the value from the policy's priorityClasses",
    ),
    Gap("driverCompatibility", "the warning when no current node has a new-enough driver (cluster facts)"),
    Gap(
        "trustedDeviceSoftware",
        "a hostPath with a '..' component counts as device software whatever it resolves to (CEL resolves"
        " no paths); an update is excused per container (role, name, image), not per whole message",
    ),
    Gap(
        "acceleratorNodeGuard",
        "a pod naming an accelerator node (nodeName), classes the policy's priorityClasses do not list (taken"
        " as passing), DRA claims of any device class (every claim counts)",
    ),
)


def compile_policy(policy: Policy, namespace: str = DEFAULT_NAMESPACE) -> Compiled:
    """`policy` as native admission policies and their bindings, for a gpuguard installed in `namespace`
    (where no binding reaches, as no webhook does)."""
    gaps: list[Gap] = []
    unwatched = unwatched_namespaces(namespace)
    if not policy.enabled:
        return Compiled([], [Gap("all", "enabled is false: nothing to compile")])
    cel = Cel(policy)
    mutating: list[RuleMutation] = [
        readiness_tolerations(policy),
        pod_failure_policy(policy),
        graceful_termination(policy, cel),
    ]
    if policy.priority_value(policy.rules.priority.className) is not None:
        mutating.append(priority(policy))
    else:
        gaps.append(
            Gap("priority", "pods: the class is not in the policy's priorityClasses, so its value is unknown")
        )
    mutating.append(driver_compatibility(policy))
    validating: list[tuple[RuleId, JSON]] = [
        ("acceleratorNodeGuard", accelerator_node_guard(policy, cel)),
        ("driverCompatibility", driver_compatibility_check(policy, cel)),
        ("trustedDeviceSoftware", trusted_device_software(policy)),
    ]
    if policy.accelerators.resourceClaims:
        gaps.append(
            Gap(
                "mutating rules",
                "a workload's DRA claims count whatever their device class (a cluster fact): one whose claims"
                " ask for no accelerator is mutated as an accelerator workload",
            )
        )
    if policy.rules.driverCompatibility.multiNode.sameDriverVersion:
        gaps.append(
            Gap("driverCompatibility", "multiNode.sameDriverVersion: one driver version across a Job's pods")
        )
    gaps[:0] = ALWAYS_WEBHOOK
    # In hybrid the webhook decides what nativegaps leaves to it; a rule whose native policy would answer
    # otherwise stands aside there.
    hybrid = policy.admission.mode == "hybrid"
    left_mutating = nativegaps.mutating(policy) if hybrid else []
    left_validating = nativegaps.validating(policy) if hybrid else []
    for index, part in enumerate(mutating):
        aside = nativegaps.stand_aside(left_mutating, part.rule)
        if aside is not None:
            mutating[index] = part.guarded(f"!({aside})")
    policies, bindings = _mutating(policy, mutating, cel, gaps, unwatched)
    for rule, obj in validating:
        aside = nativegaps.stand_aside(left_validating, rule)
        if aside is not None:
            obj["spec"]["matchConditions"].append(
                {"name": NOT_LEFT_TO_THE_WEBHOOK, "expression": f"!({aside})"}
            )
        own = _validating(policy, rule, obj, unwatched)
        if own:
            policies.append(obj)
            bindings += own
    return Compiled(policies + bindings, gaps)

"""Which requests gpuguard's webhooks still see beside the native admission policies (`admission.mode`).

In `hybrid` the compiled policies (native.py) decide what CEL can decide from the object alone, and the
webhooks of gpuguard's two configurations get one match condition more, CONDITION_NAME, true exactly for
the requests the native policies cannot decide: other workload kinds, cluster facts (a pod naming a node,
a template naming a class the policy does not list, DRA claims whose device class matters), the webhook's
own warnings (a skipped Job, rules past the limit, no node with a new-enough driver), gangs. In `native`
the condition is `false`: no webhook is called. In `webhook` it is absent.

A match condition cannot read namespace labels, but a webhook's namespaceSelector can. Where the
namespaces differ in what a webhook must see (`Part`: a region of namespaces and its condition), the
webhook keeps its own entry, selector and all, with the condition of the narrowed regions, and gets one
entry more per region that needs every request, `region-<n>.<name>`, selected to that region and sending
exactly what the first one does not (the condition negated): each request reaches one of them. A mutating
rule in warn or audit mode (no MutatingAdmissionPolicy has them) makes such a region, and so do the
namespaces no native policy binds (native.unwatched_namespaces) where a webhook covers them. The regions
are native.regions', the ones the bindings cover: a namespace name first, then the first selector that
matches, as Policy.namespace_override decides. Past MAX_PARTS regions no entry is added: the webhook
stays un-narrowed.

The webhook's own entry is changed in gpuguard's condition alone, a member of a list `kubectl apply`
merges by name: applying deploy/ again leaves it and the added entries as they are. Everything is
written into the configurations as they are read, at the resourceVersion read (`configuration_patch`),
and un-narrowing removes the condition and the added entries: the configuration as deploy/ shaped it.
The leader narrows only once the native objects are in force (webhook.controllers.nativesync).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from webhook.policy import nativegaps
from webhook.policy.model import MUTATING_RULES, Policy, RuleId
from webhook.policy.native import (
    DEFAULT_NAMESPACE,
    NAME_LABEL,
    Region,
    Requirement,
    regions,
    unwatched_namespaces,
)
from webhook.policy.nativecel import TEMPLATE_RESOURCES, literal
from webhook.policy.workload import JSON

CONDITION_NAME = "gpuguard.io/admission-mode"
CONFIGURATION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
# The regions a webhook is split into at most: each entry carries the webhook's match conditions, which
# the API server compiles and keeps per entry.
MAX_PARTS = 16
_ADDED_ENTRY = re.compile(r"region-[0-9]+\..+")

# The resources the compiled policies match (nativemutating, nativevalidating), by API group.
_MUTATED = {"": ["pods"], **TEMPLATE_RESOURCES}
_VALIDATED = {
    "": ["pods"],  # pods/ephemeralcontainers is a subresource of pods
    "batch": TEMPLATE_RESOURCES["batch"],
    "apps": [*TEMPLATE_RESOURCES["apps"], "daemonsets"],
}


@dataclass(frozen=True)
class Part:
    """Namespaces (label requirements, which a webhook's own namespaceSelector narrows further) and the
    condition the webhook gets there (None: none, every request it matches is sent)."""

    requirements: list[Requirement]
    condition: str | None
    unwatched: bool = False  # the namespaces no native policy binds


@dataclass(frozen=True)
class Narrowing:
    """The parts each configuration's webhooks are split into, and what is sent to them, in words."""

    parts: dict[str, list[Part]]
    sent: dict[str, list[str]] = field(default_factory=dict)

    def narrows(self) -> bool:
        return any(part.condition is not None for parts in self.parts.values() for part in parts)

    @property
    def conditions(self) -> dict[str, str | None]:
        """The one condition each configuration's webhooks get wherever a native policy binds; None
        where that is none, or differs between namespaces."""
        found: dict[str, str | None] = {}
        for kind, parts in self.parts.items():
            watched = {part.condition for part in parts if not part.unwatched}
            found[kind] = watched.pop() if len(watched) == 1 else None
        return found


# Every request a webhook matches is sent to it, and the configurations are as deploy/ shaped them.
UNNARROWED = Narrowing({kind: [Part([], None)] for kind in CONFIGURATION_KINDS})


def _other_kinds(groups: Mapping[str, list[str]]) -> str:
    covered = " || ".join(
        f"(request.resource.group == {literal(group)} && request.resource.resource in {literal(resources)})"
        for group, resources in groups.items()
    )
    return f"!({covered})"


def _active(policy: Policy, rule: RuleId) -> bool:
    return any(policy.mode_under(rule, region.override) != "off" for region in regions(policy))


def _joined(reasons: list[tuple[str, str]]) -> tuple[str, list[str]]:
    once = dict.fromkeys(reasons)  # a reason several rules leave to the webhook is sent once
    return " || ".join(f"({expression})" for _, expression in once), [what for what, _ in once]


def _narrowed(
    policy: Policy, kinds: Mapping[str, list[str]], left: list[nativegaps.Left]
) -> tuple[str, list[str]]:
    reasons = [("other workload kinds", _other_kinds(kinds))]
    reasons += [(item.what, item.expression) for item in left if _active(policy, item.rule)]
    return _joined(reasons)


def _unmatched(policy: Policy, region: Region) -> str | None:
    """Why the mutating webhook must see every request in `region`, or None."""
    for rule in MUTATING_RULES:
        mode = policy.mode_under(rule, region.override)
        if mode not in ("off", "enforce"):
            return f"{rule} is in {mode} mode"
    return None


def _split(
    policy: Policy, condition: str, reasons: list[str], whole: dict[int, str], namespace: str
) -> tuple[list[Part], list[str]]:
    """The parts of one webhook: the unwatched namespaces (gpuguard's own in `namespace`) and the regions
    in `whole` (index: why; only the mutating webhook has any) get every request, the rest `condition`."""
    names = unwatched_namespaces(namespace)
    watched_only = [{"key": NAME_LABEL, "operator": "NotIn", "values": names}]
    unwatched_part = Part([{"key": NAME_LABEL, "operator": "In", "values": names}], None, unwatched=True)
    unwatched = f"everything in namespaces {', '.join(names)} where a webhook covers them (no native policy binds there)"
    if not whole:
        return [Part(watched_only, condition), unwatched_part], [*reasons, unwatched]
    found = regions(policy)
    # A region where no mutating rule acts has the webhook do nothing whatever it is sent: it goes with
    # the others rather than make a split.
    idle = {
        index
        for index, region in enumerate(found)
        if all(policy.mode_under(rule, region.override) == "off" for rule in MUTATING_RULES)
    }
    if len(whole.keys() | idle) == len(found):
        return [Part([], None)], ["everything: " + "; ".join(sorted(set(whole.values())))]
    if len(found) + 1 > MAX_PARTS:
        return [Part([], None)], [
            f"everything: the namespaces would be {len(found)} regions, more than the {MAX_PARTS} entries"
            " a webhook is split into (" + "; ".join(sorted(set(whole.values()))) + ")"
        ]
    parts = [
        Part([*region.requirements, *watched_only], None if index in whole else condition)
        for index, region in enumerate(found)
    ]
    sent = [f"everything in {found[index].description} ({why} there)" for index, why in whole.items()]
    return [*parts, unwatched_part], [
        *sent,
        unwatched,
        "elsewhere:",
        *(f"  {what}" for what in reasons),
    ]


def narrowing(policy: Policy, namespace: str = DEFAULT_NAMESPACE) -> Narrowing:
    """The parts gpuguard's webhooks are split into under `policy`, for a gpuguard installed in
    `namespace`, and their conditions."""
    mode = policy.admission.mode
    if mode == "webhook" or not policy.enabled:
        return UNNARROWED
    if mode == "native":
        return Narrowing(
            {kind: [Part([], "false")] for kind in CONFIGURATION_KINDS},
            {kind: [] for kind in CONFIGURATION_KINDS},
        )
    mutating, mutated = _narrowed(policy, _MUTATED, nativegaps.mutating(policy))
    if _active(policy, "priority") and policy.priority_value(policy.rules.priority.className) is None:
        whole = dict.fromkeys(
            range(len(regions(policy))), "the priority class is not in the policy's priorityClasses"
        )
    else:
        whole = {
            index: why
            for index, region in enumerate(regions(policy))
            if (why := _unmatched(policy, region)) is not None
        }
    mutating_parts, mutated = _split(policy, mutating, mutated, whole, namespace)
    validating, validated = _narrowed(policy, _VALIDATED, nativegaps.validating(policy))
    validating_parts, validated = _split(policy, validating, validated, {}, namespace)
    return Narrowing(
        {CONFIGURATION_KINDS[0]: mutating_parts, CONFIGURATION_KINDS[1]: validating_parts},
        {CONFIGURATION_KINDS[0]: mutated, CONFIGURATION_KINDS[1]: validated},
    )


# --- the configurations as the parts want them ----------------------------------------------------


def _conjoined(selector: JSON, requirements: list[Requirement]) -> JSON | None:
    """`selector` and `requirements` together; None when their namespace names leave none. The name
    requirements become one, where the first one was, so that a requirement the selector holds already
    changes nothing."""
    expressions: list[Requirement] = []
    named: list[str] | None = None  # In: one of these
    excluded: list[str] = []  # NotIn: none of these
    at: int | None = None
    for requirement in [*(selector.get("matchExpressions") or []), *requirements]:
        if requirement["key"] == NAME_LABEL and requirement["operator"] in ("In", "NotIn"):
            at = len(expressions) if at is None else at
            values = list(requirement.get("values") or [])
            if requirement["operator"] == "In":
                named = values if named is None else [name for name in named if name in values]
            else:
                excluded += [name for name in values if name not in excluded]
        elif requirement not in expressions:
            expressions.append(requirement)
    if at is not None:
        if named is not None:
            named = [name for name in named if name not in excluded]
            if not named:
                return None
            expressions.insert(at, {"key": NAME_LABEL, "operator": "In", "values": named})
        else:
            expressions.insert(at, {"key": NAME_LABEL, "operator": "NotIn", "values": excluded})
    conjoined = {key: value for key, value in selector.items() if key != "matchExpressions"}
    if expressions:
        conjoined["matchExpressions"] = expressions
    return conjoined


def _with_condition(webhook: JSON, expression: str | None) -> JSON:
    """`webhook` with gpuguard's condition set to `expression` (None: removed), where it was."""
    found = list(webhook.get("matchConditions") or [])
    at = next((i for i, c in enumerate(found) if c.get("name") == CONDITION_NAME), None)
    mine = {"name": CONDITION_NAME, "expression": expression}
    if expression is None:
        conditions = [c for c in found if c.get("name") != CONDITION_NAME]
    elif at is None:
        conditions = [*found, mine]
    else:
        conditions = [*found[:at], mine, *found[at + 1 :]]
    shaped = {key: value for key, value in webhook.items() if key != "matchConditions"}
    if conditions:  # the API server stores none as no field
        shaped["matchConditions"] = conditions
    return shaped


def _entries(webhook: JSON, parts: list[Part]) -> list[JSON]:
    """The entries `webhook` (as deployed, but for gpuguard's condition) becomes: itself, with the
    narrowed parts' condition, and one entry for each part that needs every request, sending it what
    that condition does not."""
    selector = webhook.get("namespaceSelector") or {}
    found = [
        (conjoined, part)
        for part in parts
        if (conjoined := _conjoined(selector, part.requirements)) is not None
    ]
    conditions = {part.condition for _, part in found}
    if len(conditions) == 1:  # one condition wherever it matches: the parts it meets cover its selector
        return [_with_condition(webhook, conditions.pop())]
    narrowed = conditions - {None}
    if len(narrowed) != 1:  # no part at all, or narrowed two ways (never made here): every request
        return [_with_condition(webhook, None)]
    condition = narrowed.pop()
    name = str(webhook["name"])
    whole = [conjoined for conjoined, part in found if part.condition is None]
    return [
        _with_condition(webhook, condition),
        *(
            _with_condition(
                {**webhook, "name": f"region-{index}.{name}", "namespaceSelector": conjoined},
                f"!({condition})",
            )
            for index, conjoined in enumerate(whole, start=1)
        ),
    ]


def shaped(configuration: Mapping[str, Any], parts: list[Part]) -> list[JSON]:
    """`configuration`'s webhooks as `parts` want them: each deployed webhook in its place, the entries
    added for it after them all (those of a webhook deploy/ renamed or removed go with it)."""
    deployed = [
        webhook
        for webhook in configuration.get("webhooks") or []
        if not _ADDED_ENTRY.fullmatch(str(webhook["name"]))
    ]
    entries = [_entries(webhook, parts) for webhook in deployed]
    return [own for own, *_ in entries] + [added for _, *more in entries for added in more]


def configuration_patch(configuration: Mapping[str, Any], parts: list[Part]) -> list[JSON]:
    """A JSON Patch taking `configuration` to `shaped`, at the resourceVersion read and each webhook's
    name tested; empty when it is so already. Only the entries that differ are written."""
    return patch_to(configuration, shaped(configuration, parts))


def patch_to(configuration: Mapping[str, Any], wanted: list[JSON]) -> list[JSON]:
    """configuration_patch, for a caller that already has the webhooks `shaped` wants."""
    stored: list[JSON] = list(configuration.get("webhooks") or [])
    operations: list[JSON] = []
    for index, (have, want) in enumerate(zip(stored, wanted, strict=False)):
        if have != want:
            operations += [
                {"op": "test", "path": f"/webhooks/{index}/name", "value": have["name"]},
                {"op": "replace", "path": f"/webhooks/{index}", "value": want},
            ]
    for index in reversed(range(len(wanted), len(stored))):
        operations += [
            {"op": "test", "path": f"/webhooks/{index}/name", "value": stored[index]["name"]},
            {"op": "remove", "path": f"/webhooks/{index}"},
        ]
    operations += [{"op": "add", "path": "/webhooks/-", "value": want} for want in wanted[len(stored) :]]
    if not operations:
        return []
    version = {
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": configuration["metadata"]["resourceVersion"],
    }
    return [version, *operations]


def narrowed(webhooks: list[JSON]) -> bool:
    """Whether one of `webhooks` carries gpuguard's condition."""
    return any(
        c.get("name") == CONDITION_NAME for webhook in webhooks for c in webhook.get("matchConditions") or []
    )

"""The pure policy engine: plain dicts and a policy in, a mutated copy and decisions out.

`mutate` and `validate` never touch the network, the clock or a framework, so the server, the CLI and
the tests all run the very same code. The caller builds the JSON Patch from `original` and `obj`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.model import Mode, Policy, RuleId
from webhook.policy.rules import MUTATORS, VALIDATORS, Report
from webhook.policy.workload import JSON, Workload, accelerator_requests, as_dict, locate

RULES_ANNOTATION = "gpuguard.io/rules"
POLICY_ANNOTATION = "gpuguard.io/policy"

Outcome = Literal["applied", "would-apply", "denied", "would-deny", "notice"]
OUTCOME_FOR_MODE: dict[tuple[bool, Mode], Outcome] = {
    (False, "enforce"): "applied",
    (False, "warn"): "would-apply",
    (False, "audit"): "would-apply",
    (True, "enforce"): "denied",
    (True, "warn"): "would-deny",
    (True, "audit"): "would-deny",
}


class NotConvergingError(RuntimeError):
    """A mutator keeps changing its own output: a bug, never a property of the input."""


@dataclass(frozen=True)
class Decision:
    rule: RuleId
    mode: Mode
    outcome: Outcome
    message: str


@dataclass(frozen=True)
class Result:
    original: Any
    obj: Any
    decisions: tuple[Decision, ...] = ()
    skipped: str | None = None

    @property
    def changed(self) -> bool:
        return self.obj is not self.original

    @property
    def applied_rules(self) -> list[RuleId]:
        return list(dict.fromkeys(d.rule for d in self.decisions if d.outcome == "applied"))

    @property
    def denials(self) -> list[str]:
        return [d.message for d in self.decisions if d.outcome == "denied"]

    @property
    def denied(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome == "denied"]


def clone(value: Any) -> Any:
    """A deep copy of JSON data, several times faster than copy.deepcopy."""
    if type(value) is dict:
        return {key: clone(item) for key, item in value.items()}
    if type(value) is list:
        return [clone(item) for item in value]
    return value


def _mutation_skip_reason(
    workload: Workload | None, policy: Policy, operation: str, facts: ClusterFacts
) -> str | None:
    if not policy.enabled:
        return "policy disabled"
    if operation != "CREATE":
        return f"{operation} is never mutated"
    if workload is None:
        return "kind not handled"
    if workload.is_pod:
        owner = workload.controller_kind()
        if owner == "DaemonSet":
            return "DaemonSet pod"
        if owner == "Job":
            return "pod of a Job: handled through the Job's template"
        if workload.is_mirror_pod():
            return "mirror pod"
    if not accelerator_requests(workload, policy.accelerators, facts):
        return "not an accelerator workload"
    return None


def _decisions(rule: RuleId, mode: Mode, report: Report, *, denial: bool) -> list[Decision]:
    outcome = OUTCOME_FOR_MODE[(denial, mode)]
    return [Decision(rule, mode, outcome, change) for change in report.changes] + [
        Decision(rule, mode, "notice", notice) for notice in report.notices
    ]


def _mark(obj: JSON, applied: list[RuleId], policy: Policy) -> None:
    """Names the rules applied and the policy's hash, cumulatively, so reinvocation converges."""
    metadata = obj.setdefault("metadata", {})
    if not isinstance(metadata, dict):
        return
    annotations = as_dict(metadata.get("annotations"))
    if annotations is None:
        annotations = metadata["annotations"] = {}
    previous = str(annotations.get(RULES_ANNOTATION, "")).split(",")
    annotations[RULES_ANNOTATION] = ",".join(r for r in MUTATORS if r in applied or r in previous)
    annotations[POLICY_ANNOTATION] = policy.hash


def mutate(
    obj: Any,
    policy: Policy,
    *,
    namespace: str | None = None,
    operation: str = "CREATE",
    group: str | None = None,
    kind: str | None = None,
    facts: ClusterFacts | None = None,
) -> Result:
    facts = facts or NO_FACTS
    workload = locate(obj, group=group, kind=kind, namespace=namespace) if isinstance(obj, dict) else None
    skipped = _mutation_skip_reason(workload, policy, operation, facts)
    if skipped is not None or workload is None:
        return Result(obj, obj, skipped=skipped)

    working = clone(obj)
    view = locate(working, group=workload.group, kind=workload.kind, namespace=workload.namespace)
    assert view is not None  # the clone has the same shape as the object that located
    labels = facts.labels_of(workload.namespace)
    decisions: list[Decision] = []
    enforced: list[RuleId] = []
    applied: list[RuleId] = []
    for rule, mutator in MUTATORS.items():
        mode = policy.mode_for(rule, workload.namespace, labels)
        if mode == "off":
            continue
        if mode == "enforce":
            enforced.append(rule)
            report = mutator(view, policy, facts)
            if report.changes:
                applied.append(rule)
        else:
            # Dry-run modes compute the change on a scratch copy and keep only the description.
            scratch = locate(
                clone(working), group=workload.group, kind=workload.kind, namespace=workload.namespace
            )
            assert scratch is not None
            report = mutator(scratch, policy, facts)
        decisions += _decisions(rule, mode, report, denial=False)

    # The rules are idempotent one by one; this proves the set converges on every request, cheaply.
    for _ in range(len(MUTATORS) + 1):
        if not any(MUTATORS[rule](view, policy, facts).changes for rule in enforced):
            break
    else:
        raise NotConvergingError(f"rules {enforced} do not converge on {workload.display_name}")

    if not applied:
        return Result(obj, obj, tuple(decisions))
    _mark(working, applied, policy)
    return Result(obj, working, tuple(decisions))


def validate(
    obj: Any,
    policy: Policy,
    *,
    namespace: str | None = None,
    operation: str = "CREATE",
    group: str | None = None,
    kind: str | None = None,
    old: Any = None,
    facts: ClusterFacts | None = None,
) -> Result:
    """Every validating rule on `obj`; on UPDATE each rule sees `old` too, to deny only what changed."""
    facts = facts or NO_FACTS
    workload = (
        locate(obj, group=group, kind=kind, namespace=namespace, daemonsets=True)
        if isinstance(obj, dict)
        else None
    )
    if operation not in ("CREATE", "UPDATE") or workload is None:
        return Result(obj, obj, skipped="nothing to validate")
    previous = None
    if operation == "UPDATE" and isinstance(old, dict):
        previous = locate(
            old, group=workload.group, kind=workload.kind, namespace=workload.namespace, daemonsets=True
        )
    labels = facts.labels_of(workload.namespace)
    decisions: list[Decision] = []
    for rule, validator in VALIDATORS.items():
        mode = policy.mode_for(rule, workload.namespace, labels)
        if mode != "off":
            decisions += _decisions(rule, mode, validator(workload, previous, policy, facts), denial=True)
    return Result(obj, obj, tuple(decisions))

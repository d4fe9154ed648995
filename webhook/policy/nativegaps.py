"""What each rule leaves to the webhook, as CEL over an admission request: the requests where a native
policy cannot decide as the webhook does (cluster facts, the webhook's own warnings, gangs).

nativenarrow.py sends these requests to gpuguard's webhooks in `hybrid`; native.py makes the rule's own
native policy stand aside there (`Left.exclusive`) where its answer would differ from the webhook's, so
that in `hybrid` one of the two decides each request, never both with different answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from webhook.policy.model import MUTATING_RULES, Policy, RuleId
from webhook.policy.nativecel import JOB, SPEC, literal
from webhook.policy.nativedriver import Driver
from webhook.policy.rules import GANG_ANNOTATION, MAX_POD_FAILURE_POLICY_RULES


@dataclass(frozen=True)
class Left:
    rule: RuleId
    what: str  # in words, for `gpuguard policy compile`
    expression: str  # CEL: true for a request the webhook decides for this rule
    # The native policy would answer otherwise (a gang's rules, a claim that is no accelerator, a path
    # CEL cannot resolve): in hybrid it stands aside. False where both answer alike and only the
    # webhook's warning is wanted.
    exclusive: bool


def _on_spec(condition: str) -> str:
    return f"[{SPEC}].exists(s, {condition})"


_CLAIMS = _on_spec("has(s.resourceClaims) && size(s.resourceClaims) > 0")


def _claims(policy: Policy, rules: tuple[RuleId, ...], whose: str) -> list[Left]:
    """Workloads with DRA claims, for each of `rules`: the native policies count every claim, the webhook
    only those of an accelerator device class (a cluster fact)."""
    if not policy.accelerators.resourceClaims:
        return []
    what = f"workloads with DRA claims (whether a claim's device class is an accelerator, for {whose}, is a cluster fact)"
    return [Left(rule, what, _CLAIMS, exclusive=True) for rule in rules]


def mutating(policy: Policy) -> list[Left]:
    rule = policy.rules.podFailurePolicy
    added = sum([rule.ignoreDisruptions, bool(rule.deviceFailureExitCodes), bool(rule.nonRetriableExitCodes)])
    job = "variables_job"
    checks = [
        f"(has({job}.podFailurePolicy) && has({job}.podFailurePolicy.rules) &&"
        f" size({job}.podFailurePolicy.rules) > {MAX_POD_FAILURE_POLICY_RULES - added})",
        # A gang: stated by annotation or Indexed (rules.is_gang), failed whole by FailJob rules.
        f"(has(object.metadata.annotations) && {literal(GANG_ANNOTATION)} in object.metadata.annotations)",
        "(request.kind.kind == 'CronJob' && has(object.spec.jobTemplate.metadata) &&"
        " has(object.spec.jobTemplate.metadata.annotations) &&"
        f" {literal(GANG_ANNOTATION)} in object.spec.jobTemplate.metadata.annotations)",
    ]
    if rule.gang.indexedJobs != "never":
        checks.append(f"(has({job}.completionMode) && {job}.completionMode == 'Indexed')")
    if rule.onFailureJobs == "skip":
        checks.append(
            f"(has({job}.template.spec.restartPolicy) && {job}.template.spec.restartPolicy == 'OnFailure')"
        )
    left = [
        # The Priority plugin has written the cluster's globalDefault class into a pod without one.
        Left(
            "priority",
            "pods naming a priority class other than the policy's (it may be the globalDefault)",
            "request.kind.kind == 'Pod' && "
            + _on_spec(
                "has(s.priorityClassName) && s.priorityClassName != ''"
                f" && s.priorityClassName != {literal(policy.rules.priority.className)}"
            ),
            exclusive=True,
        ),
        Left(
            "podFailurePolicy",
            "Jobs the webhook warns about (OnFailure skipped, rules past the limit) or treats as gangs",
            f"request.kind.kind in ['Job', 'CronJob'] && [{JOB}].exists({job}, {' || '.join(checks)})",
            exclusive=True,
        ),
    ]
    left += _claims(policy, MUTATING_RULES, "the mutations")
    if policy.rules.driverCompatibility.multiNode.sameDriverVersion:
        left.append(
            Left(
                "driverCompatibility",
                "workloads other than pods (multiNode.sameDriverVersion)",
                "request.kind.kind != 'Pod'",
                exclusive=False,
            )
        )
    return left


def validating(policy: Policy) -> list[Left]:
    classes = literal(sorted(policy.priorityClasses))
    driver = Driver(policy, "object")
    return [
        Left(
            "acceleratorNodeGuard",
            "pods naming a node (whether it is an accelerator node is a cluster fact)",
            "request.kind.kind == 'Pod' && " + _on_spec("has(s.nodeName) && s.nodeName != ''"),
            exclusive=True,
        ),
        Left(
            "acceleratorNodeGuard",
            "templates naming a priority class the policy does not list (its value is a cluster fact)",
            "request.kind.kind != 'Pod' && "
            + _on_spec(
                "has(s.priorityClassName) && s.priorityClassName != '' &&"
                f" !s.priorityClassName.startsWith('system-') && !(s.priorityClassName in {classes})"
            ),
            exclusive=True,
        ),
        *_claims(policy, ("acceleratorNodeGuard", "driverCompatibility"), "the guard and the driver check"),
        Left(
            "driverCompatibility",
            "workloads stating a driver minimum (the warning when no node has it is a cluster fact)",
            "true" if driver.by_image else driver.stated,
            exclusive=False,
        ),
        Left(
            "trustedDeviceSoftware",
            "updates of workloads mounting a hostPath, and hostPaths with '..' (resolved by the webhook)",
            _on_spec(
                "has(s.volumes) && s.volumes.exists(v, has(v.hostPath) && (request.operation == 'UPDATE' ||"
                " (has(v.hostPath.path) && v.hostPath.path.contains('..'))))"
            ),
            exclusive=True,
        ),
    ]


def stand_aside(left: list[Left], rule: RuleId) -> str | None:
    """CEL true for a request `rule`'s native policy must stand aside from (None: none); `left` is what the
    webhook of the policy's own kind decides (`mutating` for a MAP, `validating` for a VAP). A MAP
    carrying several rules applies the others there."""
    mine = [f"({item.expression})" for item in left if item.rule == rule and item.exclusive]
    return " || ".join(mine) or None

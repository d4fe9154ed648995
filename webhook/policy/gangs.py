"""Failure handling for a whole group of pods, where the group is the object: a JobSet, a LeaderWorkerSet.

When one member of a training gang loses its device, the others sit in a collective until a timeout,
and a static world cannot take a replacement anyway: the group must restart, from its last checkpoint,
without the restart counting as the user's failure.

- JobSet: each gang replicated Job fails at once (FailJob) on a disruption or a device exit code
  (rules.job_failure_rules), and a failurePolicy rule restarts the whole JobSet on exactly those
  failures with RestartJobSetAndIgnoreMaxRestarts. The Job controller's failure message names the
  index of the podFailurePolicy rule that matched ("... matching FailJob rule at index 2"), and
  gpuguard's rules come after the user's, so the pattern matches gpuguard's rules only: a user's own
  FailJob rule still fails the Job the way the user's JobSet rules say.
- LeaderWorkerSet: restartPolicy RecreateGroupOnPodRestart (its default since v0.4.0; v0.2 and v0.3
  defaulted to Default, the same as None) recreates the group when one pod fails.
"""

from __future__ import annotations

from collections.abc import Callable

from webhook.policy.facts import ClusterFacts
from webhook.policy.model import Policy, RuleId
from webhook.policy.rules import Report, is_gang, job_failure_rules
from webhook.policy.workload import JSON, Workload, as_dict, dicts, text

RULE_NAME_PREFIX = "gpuguard"
RESTART_RULE = "gpuguardDeviceFailure"
FAIL_RULE = "gpuguardNonRetriable"
JOB_FAILED_BY_POLICY = "PodFailurePolicy"  # the Job's Failed condition reason
LWS_GROUP_RESTART = "RecreateGroupOnPodRestart"
LWS_POD_RESTART = ("None", "Default")  # Default: the name before v0.4.0 of what None does

# Object-level mutators: they see every accelerator template of one object at once.
GroupMutator = Callable[[list[Workload], Policy, ClusterFacts], Report]


def _failure_patterns(indexes: list[int]) -> list[str]:
    # Anchored: index 1 must not match "index 12".
    return [f"matching FailJob rule at index {index}$" for index in indexes]


def _earlier_catch_all(rules: list[JSON], targets: list[str]) -> str | None:
    """The name of a user's JobSet rule that would match a device failure of these Jobs before ours."""
    for rule in rules:
        reasons = rule.get("onJobFailureReasons") or []
        targeted = rule.get("targetReplicatedJobs") or []
        if (
            (not reasons or JOB_FAILED_BY_POLICY in reasons)
            and not rule.get("onJobFailureMessagePatterns")
            and (not targeted or any(name in targeted for name in targets))
        ):
            return text(rule.get("name")) or "(unnamed)"
    return None


def jobset_failure_policy(views: list[Workload], policy: Policy, _: ClusterFacts) -> Report:
    report = Report()
    spec = as_dict(views[0].obj.get("spec"))
    if spec is None:
        return report
    failure_policy = spec.get("failurePolicy")
    if failure_policy is not None and not isinstance(failure_policy, dict):
        return report
    rules = (failure_policy or {}).get("rules")
    if rules is not None and not isinstance(rules, list):
        return report
    existing = list(dicts(rules or []))
    if any(text(rule.get("name")).startswith(RULE_NAME_PREFIX) for rule in existing):
        return report  # gpuguard's rules are there: the replicated Jobs have theirs too
    # Replicated Jobs whose added rules sit at the same indexes share one JobSet rule.
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for view in views:
        item = view.site.item if view.site is not None else None
        name = text((item or {}).get("name"))
        if not name or not is_gang(view, policy):
            continue
        added = job_failure_rules(view, policy, gang=True)
        report.changes += [f"{view.label}: {change}" for change in added.report.changes]
        report.notices += [f"{view.label}: {notice}" for notice in added.report.notices]
        if added.restart or added.fail:
            groups.setdefault((tuple(added.restart), tuple(added.fail)), []).append(name)
    new: list[JSON] = []
    for number, ((restart, fail), targets) in enumerate(groups.items(), start=1):
        suffix = "" if number == 1 else str(number)
        for name, action, indexes in (
            (RESTART_RULE, "RestartJobSetAndIgnoreMaxRestarts", restart),
            (FAIL_RULE, "FailJobSet", fail),
        ):
            if indexes:
                new.append(
                    {
                        "name": name + suffix,
                        "action": action,
                        "onJobFailureReasons": [JOB_FAILED_BY_POLICY],
                        "onJobFailureMessagePatterns": _failure_patterns(list(indexes)),
                        "targetReplicatedJobs": targets,
                    }
                )
        caught_by = _earlier_catch_all(existing, targets)
        if caught_by is not None:
            report.notices.append(
                f"failurePolicy rule {caught_by} comes first and matches device failures of "
                f"{', '.join(targets)}: gpuguard's restart rule after it never applies"
            )
    if new:
        spec["failurePolicy"] = {**(failure_policy or {}), "rules": [*existing, *new]}
        report.changes.append(
            f"add failurePolicy rule(s) {', '.join(r['name'] for r in new)}: a device failure or a "
            "disruption restarts the JobSet without spending maxRestarts"
        )
    return report


def lws_restart_policy(views: list[Workload], _policy: Policy, _facts: ClusterFacts) -> Report:
    report = Report()
    spec = as_dict(views[0].obj.get("spec"))
    template = as_dict((spec or {}).get("leaderWorkerTemplate"))
    if template is None:
        return report
    current = template.get("restartPolicy")
    if current is None:
        template["restartPolicy"] = LWS_GROUP_RESTART
        report.changes.append(f"set restartPolicy {LWS_GROUP_RESTART}: a failed pod restarts its whole group")
    elif current in LWS_POD_RESTART:
        report.notices.append(
            f"restartPolicy {current}: a pod that loses its device is replaced alone while the rest of "
            f"its group waits on it; {LWS_GROUP_RESTART} restarts the group"
        )
    return report


def gang_failure_handling(views: list[Workload], policy: Policy, facts: ClusterFacts) -> Report:
    gang = views[0].workload_kind.gang
    if gang == "jobset":
        return jobset_failure_policy(views, policy, facts)
    if gang == "group":
        return lws_restart_policy(views, policy, facts)
    return Report()


GROUP_MUTATORS: dict[RuleId, GroupMutator] = {"podFailurePolicy": gang_failure_handling}

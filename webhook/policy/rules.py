"""The seven rules. Mutators edit a workload in place and say what they changed; validators return denials.

Each mutator is idempotent: run on its own output it changes nothing. The API server re-runs every
in-tree plugin after the mutating webhooks and may call us again after any mutation
(`reinvocationPolicy: IfNeeded`), so a rule must recognise its own work (and the defaults the API
server adds) as done.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from webhook.policy import hostpaths, images, nodeaffinity
from webhook.policy.accelerators import is_accelerator_node
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import (
    SYSTEM_PRIORITY_PREFIX,
    DriverCompatibility,
    PodFailurePolicyRule,
    Policy,
    RuleId,
    TrustedDeviceSoftware,
)
from webhook.policy.workload import (
    JSON,
    SYSTEM_CRITICAL_PRIORITY,
    Workload,
    accelerator_containers,
    accelerator_requests,
    as_dict,
    dicts,
    text,
)

READINESS_TAINT_KEYS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
MAX_POD_FAILURE_POLICY_RULES = 20  # batch validation: maxPodFailurePolicyRules
DEFAULT_GRACE_PERIOD_SECONDS = 30  # what the API server defaults a missing value to


@dataclass
class Report:
    """What a rule did (or, outside enforce mode, would do), and notices the user should read anyway."""

    changes: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


Mutator = Callable[[Workload, Policy, ClusterFacts], Report]
# A validator also gets the object before an UPDATE (None on CREATE): it decides what an update introduces.
Validator = Callable[[Workload, "Workload | None", Policy, ClusterFacts], Report]


# --- rule 1: readiness-flake tolerations ----------------------------------------------------------------


def _tolerates_readiness_taint(toleration: JSON, key: str) -> bool:
    """v1 Toleration.ToleratesTaint for the NoExecute taint `key` (whose value is empty)."""
    if toleration.get("effect") not in (None, "", "NoExecute"):
        return False
    if toleration.get("key") not in (None, "", key):
        return False
    operator = toleration.get("operator") or "Equal"
    return operator == "Exists" or (operator == "Equal" and not toleration.get("value"))


def readiness_tolerations(workload: Workload, policy: Policy, _: ClusterFacts) -> Report:
    rule = policy.rules.readinessTolerations
    seconds = rule.batchSeconds if workload.is_batch else rule.servingSeconds
    report = Report()
    tolerations = workload.pod_spec.get("tolerations")
    missing = tolerations is None  # absent, or `tolerations:` left empty in YAML
    if missing:
        tolerations = []
    elif not isinstance(tolerations, list):
        return report
    for key in READINESS_TAINT_KEYS:
        # The taint manager honours the first toleration that matches, so appending after the defaulted
        # 300 s entry would do nothing: that entry's seconds are replaced in place instead.
        first = next((t for t in dicts(tolerations) if _tolerates_readiness_taint(t, key)), None)
        if first is None:
            tolerations.append(
                {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
            )
            report.changes.append(f"add {key.rsplit('/', 1)[1]} toleration for {seconds}s")
        elif (
            first.get("key") == key
            and first.get("tolerationSeconds") == rule.apiServerDefaultSeconds
            and seconds != rule.apiServerDefaultSeconds
        ):
            first["tolerationSeconds"] = seconds
            report.changes.append(f"raise {key.rsplit('/', 1)[1]} tolerationSeconds to {seconds}")
    if report.changes and missing:
        workload.pod_spec["tolerations"] = tolerations
    return report


# --- rule 2: device-failure podFailurePolicy -------------------------------------------------------------


def _covered_exit_codes(rules: list[JSON]) -> set[int]:
    """Codes an earlier `In` rule for all containers already catches: a later rule for them never fires."""
    covered: set[int] = set()
    for rule in rules:
        on_exit = as_dict(rule.get("onExitCodes"))
        if on_exit and on_exit.get("operator") == "In" and not on_exit.get("containerName"):
            values = on_exit.get("values")
            if isinstance(values, list):
                covered.update(v for v in values if isinstance(v, int))
    return covered


def _has_disruption_rule(rules: list[JSON]) -> bool:
    return any(
        pattern.get("type") == "DisruptionTarget"
        for rule in rules
        for pattern in dicts(rule.get("onPodConditions"))
    )


GANG_ANNOTATION = "gpuguard.io/gang"


def _integer(value: object, default: int) -> int | None:
    if value is None:
        return default
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def jobset_pods(obj: JSON) -> int:
    """How many pods a JobSet runs at once: replicas times parallelism, over its replicated Jobs."""
    total = 0
    for replicated in dicts((as_dict(obj.get("spec")) or {}).get("replicatedJobs")):
        job_spec = as_dict((as_dict(replicated.get("template")) or {}).get("spec")) or {}
        replicas = _integer(replicated.get("replicas"), 1) or 0
        total += replicas * (_integer(job_spec.get("parallelism"), 1) or 0)
    return total


def is_gang(workload: Workload, policy: Policy) -> bool:
    """Whether the pods of this Job only work together, so that one's device failure must fail the Job."""
    job = workload.job_spec
    if job is None:
        return False
    job_template_metadata = workload.site.job_template_metadata if workload.site is not None else None
    for metadata in (job_template_metadata, workload.metadata):
        stated = text((as_dict((metadata or {}).get("annotations")) or {}).get(GANG_ANNOTATION))
        if stated in ("true", "false"):
            return stated == "true"
    choice = policy.rules.podFailurePolicy.gang
    if workload.workload_kind.gang == "jobset":
        return choice.jobSets == "always" or (choice.jobSets == "auto" and jobset_pods(workload.obj) > 1)
    parallelism = _integer(job.get("parallelism"), 1)
    if job.get("completionMode") != "Indexed" or parallelism is None or parallelism <= 1:
        return False
    if choice.indexedJobs == "auto":
        return _integer(job.get("completions"), parallelism) == parallelism
    return choice.indexedJobs == "always"


@dataclass
class JobRules:
    """What `job_failure_rules` did, and the indexes of the rules it added by what they mean: a Job
    failed by a rule in `restart` failed for a device or a disruption, one in `fail` for good."""

    report: Report = field(default_factory=Report)
    restart: list[int] = field(default_factory=list)
    fail: list[int] = field(default_factory=list)


def _restarts_never(workload: Workload, rule: PodFailurePolicyRule, report: Report) -> bool:
    """Whether the Job's pods restart Never, as a podFailurePolicy requires, once gpuguard set it where
    it may (reported in `report`)."""
    restart_policy = workload.pod_spec.get("restartPolicy")
    if restart_policy is None and workload.workload_kind.gang == "jobset":
        # JobSet's own webhook would default it to OnFailure, which allows no podFailurePolicy; the
        # user chose nothing, and Never only makes each container restart a new pod.
        workload.pod_spec["restartPolicy"] = "Never"
        report.changes.append(
            "set restartPolicy Never (JobSet defaults OnFailure, which allows no podFailurePolicy)"
        )
    elif restart_policy == "OnFailure":
        if rule.onFailureJobs == "skip":
            report.notices.append(
                "podFailurePolicy skipped: it needs restartPolicy Never, this Job has OnFailure"
            )
            return False
        workload.pod_spec["restartPolicy"] = "Never"
        report.changes.append("convert restartPolicy OnFailure to Never")
    elif restart_policy != "Never":
        return False  # invalid for a Job: the API server's own validation answers that
    return True


def job_failure_rules(workload: Workload, policy: Policy, *, gang: bool) -> JobRules:
    """Adds the device-failure rules to the Job's podFailurePolicy after the user's own.

    A gang's Job fails at once (FailJob) on a disruption or a device exit code, so its group restarts
    together instead of hanging on the one pod a replacement would start alone.
    """
    rule = policy.rules.podFailurePolicy
    done = JobRules()
    report = done.report
    job = workload.job_spec
    if job is None or not _restarts_never(workload, rule, report):
        return done

    existing_policy = job.get("podFailurePolicy")
    if existing_policy is not None and not isinstance(existing_policy, dict):
        return done
    existing: Any = (existing_policy or {}).get("rules") or []
    if not isinstance(existing, list):
        return done
    existing_rules = list(dicts(existing))

    wanted: list[tuple[JSON, bool]] = []  # each rule, and whether it means "restart the gang"
    if rule.ignoreDisruptions and not _has_disruption_rule(existing_rules):
        wanted.append(
            (
                {
                    "action": "FailJob" if gang else "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                True,
            )
        )
    covered = _covered_exit_codes(existing_rules)
    device_action = "FailJob" if gang else rule.deviceFailureAction
    if device_action == "FailIndex" and job.get("backoffLimitPerIndex") is None:
        device_action = "Count"  # FailIndex is only valid with backoffLimitPerIndex
    for codes, action, restarts in (
        (rule.deviceFailureExitCodes, device_action, True),
        (rule.nonRetriableExitCodes, "FailJob", False),
    ):
        values = [code for code in codes if code not in covered]
        if values:
            wanted.append(({"action": action, "onExitCodes": {"operator": "In", "values": values}}, restarts))

    room = MAX_POD_FAILURE_POLICY_RULES - len(existing)
    if len(wanted) > room:
        report.notices.append(
            f"podFailurePolicy has {len(existing)} rules: {len(wanted) - max(room, 0)} device rules left out"
            f" (limit {MAX_POD_FAILURE_POLICY_RULES})"
        )
        wanted = wanted[: max(room, 0)]
    if not wanted:
        return done
    # The user's rules stay first: rules are evaluated in order and theirs were written on purpose.
    job["podFailurePolicy"] = {**(existing_policy or {}), "rules": [*existing, *(r for r, _ in wanted)]}
    # The API server defaulted podReplacementPolicy to TerminatingOrFailed when there was no
    # podFailurePolicy; with one, only Failed is valid, and re-defaulting keeps a value already set.
    job["podReplacementPolicy"] = "Failed"
    for index, (added, restarts) in enumerate(wanted, start=len(existing)):
        if added["action"] == "FailJob":
            (done.restart if restarts else done.fail).append(index)
    what = (
        "FailJob rule(s) for disruptions and device exit codes (a gang)"
        if gang
        else "podFailurePolicy rule(s) for disruptions and device exit codes"
    )
    report.changes.append(f"add {len(wanted)} {what}")
    return done


def pod_failure_policy(workload: Workload, policy: Policy, _: ClusterFacts) -> Report:
    if workload.job_spec is None:
        return Report()
    gang = is_gang(workload, policy)
    if gang and workload.workload_kind.gang == "jobset":
        return Report()  # the JobSet's replicated Jobs and its failurePolicy change together (gangs.py)
    return job_failure_rules(workload, policy, gang=gang).report


# --- rule 3: graceful termination ---------------------------------------------------------------------


def graceful_termination(workload: Workload, policy: Policy, facts: ClusterFacts) -> Report:
    rule = policy.rules.gracefulTermination
    report = Report()
    pre_stop: JSON = (
        {"sleep": {"seconds": rule.preStop.seconds}}
        if rule.preStop.action == "sleep"
        else {"exec": {"command": list(rule.preStop.command)}}
    )
    for container in accelerator_containers(workload, policy.accelerators, facts):
        lifecycle = container.get("lifecycle")
        if lifecycle is None:
            container["lifecycle"] = {"preStop": pre_stop}
        elif isinstance(lifecycle, dict) and "preStop" not in lifecycle:
            lifecycle["preStop"] = pre_stop
        else:
            continue
        report.changes.append(f"add preStop {rule.preStop.action} to container {container.get('name', '?')}")

    current = workload.pod_spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_SECONDS)
    wanted = rule.grace_period_seconds
    if isinstance(current, int) and not isinstance(current, bool) and current < wanted:
        workload.pod_spec["terminationGracePeriodSeconds"] = wanted
        report.changes.append(f"raise terminationGracePeriodSeconds {current} to {wanted}")
    return report


# --- rule 4: priority ----------------------------------------------------------------------------------


def priority(workload: Workload, policy: Policy, facts: ClusterFacts) -> Report:
    class_name = policy.rules.priority.className
    report = Report()
    spec = workload.pod_spec
    current = workload.priority_class_name()
    # The Priority plugin writes the globalDefault class into every pod without one, before webhooks
    # run: on a pod, that name says nothing about what the user chose.
    if current and not (workload.is_pod and current == facts.global_default_class()):
        return report
    known = facts.priority_classes
    if known is not None and class_name not in known:
        report.notices.append(f"priority class {class_name} does not exist in the cluster: not set")
        return report
    spec["priorityClassName"] = class_name
    info = known.get(class_name) if known is not None else None
    if workload.is_pod and info is not None:
        # The Priority plugin runs again after our patch and rejects a pod whose priority disagrees
        # with its class, so the integer and the preemption policy travel with the name.
        spec["priority"] = info.value
        if info.preemption_policy:
            spec["preemptionPolicy"] = info.preemption_policy
        else:
            spec.pop("preemptionPolicy", None)
    else:
        # Templates never get a priority from the plugin; bare pods without a cluster lookup lose the
        # stale values so that the re-run Priority plugin computes them from the new class.
        spec.pop("priority", None)
        spec.pop("preemptionPolicy", None)
    report.changes.append(f"set priorityClassName {class_name}")
    return report


# --- rule 5: driver compatibility ---------------------------------------------------------------------

_DRIVER_MAJOR = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class DriverRequirement:
    minimum: int | None  # the highest minimum driver major version stated; None: nothing stated
    source: str = ""  # what stated it, for messages
    problem: str | None = None  # an annotation that states nothing usable


def driver_requirement(workload: Workload, rule: DriverCompatibility) -> DriverRequirement:
    """The minimum driver major version the workload needs: its annotation, and the policy's image map."""
    stated: list[tuple[int, str]] = []
    problem = None
    value = workload.annotation(rule.annotation)
    if value is not None:
        if _DRIVER_MAJOR.fullmatch(value.strip()) and int(value) > 0:
            stated.append((int(value), f"annotation {rule.annotation}"))
        else:
            problem = f"annotation {rule.annotation}: {value!r} is not a driver major version (a whole number such as 550)"
    for container in workload.containers() if rule.images else ():
        ref = images.parse(container.get("image"))
        if ref is None:
            continue
        for requirement in rule.images:
            if fnmatchcase(str(ref), requirement.image):
                stated.append((requirement.minDriverMajor, f"image {container.get('image')}"))
    if not stated:
        return DriverRequirement(None, problem=problem)
    minimum, source = max(stated, key=lambda item: item[0])
    return DriverRequirement(minimum, source, problem)


def _is_multi_node(workload: Workload, rule: DriverCompatibility) -> bool:
    job = workload.job_spec
    if job is None:
        return False
    parallelism = job.get("parallelism", 1)
    completion_mode = job.get("completionMode", "NonIndexed")
    return (
        isinstance(parallelism, int)
        and parallelism >= rule.multiNode.minParallelism
        and completion_mode in rule.multiNode.completionModes
    )


def driver_rule_applies(workload: Workload, rule: DriverCompatibility) -> bool:
    """Whether driverCompatibility has anything to decide on the workload: a driver version it states
    (or misstates), or a multi-node Job that must run on one driver version."""
    requirement = driver_requirement(workload, rule)
    if requirement.minimum is not None or requirement.problem is not None:
        return True
    return rule.multiNode.sameDriverVersion and _is_multi_node(workload, rule)


def driver_compatibility(workload: Workload, policy: Policy, _: ClusterFacts) -> Report:
    rule = policy.rules.driverCompatibility
    report = Report()
    requirement = driver_requirement(workload, rule)
    key = rule.nodeLabels.driverMajor
    if requirement.minimum is not None and nodeaffinity.require_minimum(
        workload.pod_spec, key, requirement.minimum
    ):
        report.changes.append(f"require node label {key} >= {requirement.minimum} ({requirement.source})")
    version = rule.nodeLabels.driverVersion
    if (
        rule.multiNode.sameDriverVersion
        and _is_multi_node(workload, rule)
        and nodeaffinity.require_same_label_across_job(workload.pod_spec, version)
    ):
        report.changes.append(f"require one {version} across the Job's pods")
    return report


MUTATORS: dict[RuleId, Mutator] = {
    "readinessTolerations": readiness_tolerations,
    "podFailurePolicy": pod_failure_policy,
    "gracefulTermination": graceful_termination,
    "priority": priority,
    "driverCompatibility": driver_compatibility,
}


def driver_compatibility_check(
    workload: Workload, previous: Workload | None, policy: Policy, facts: ClusterFacts
) -> Report:
    """Denials for a workload whose stored node selection does not keep it off older drivers."""
    report = Report()
    if workload.is_daemonset or (workload.is_pod and (previous is not None or _exempt_pod(workload))):
        return report  # a pod's affinity cannot change after creation; DaemonSets run on every node
    rule = policy.rules.driverCompatibility
    requirement = driver_requirement(workload, rule)
    if requirement.minimum is None and requirement.problem is None:
        return report  # most workloads state nothing: the cheap answer first
    if not accelerator_requests(workload, policy.accelerators, facts):
        return report
    if previous is not None and _violates_driver_check(previous, rule):
        return report  # an existing workload must stay manageable: deny only what the update introduces
    if requirement.problem:
        report.changes.append(requirement.problem)
    minimum = requirement.minimum
    if minimum is None:
        return report
    key = rule.nodeLabels.driverMajor
    spec = workload.pod_spec
    excluded = nodeaffinity.excluding_reason(spec, key, minimum)
    if excluded is not None:
        report.changes.append(
            f"needs {key} >= {minimum} ({requirement.source}), but {excluded} rules out every such node"
        )
    elif not nodeaffinity.guarantees_minimum(spec, key, minimum):
        report.changes.append(
            f"needs {key} >= {minimum} ({requirement.source}), but its node selection admits older drivers"
        )
    if facts.nodes is not None and not any(
        nodeaffinity.selects(spec, name, node.labels)
        and (nodeaffinity.integer(node.labels.get(key)) or 0) >= minimum
        for name, node in facts.nodes.items()
    ):
        report.notices.append(
            f"no node has {key} >= {minimum} and fits this workload: its pods would stay Pending"
        )
    return report


def _violates_driver_check(workload: Workload, rule: DriverCompatibility) -> bool:
    requirement = driver_requirement(workload, rule)
    if requirement.problem:
        return True
    key = rule.nodeLabels.driverMajor
    return requirement.minimum is not None and not nodeaffinity.guarantees_minimum(
        workload.pod_spec, key, requirement.minimum
    )


def _exempt_pod(workload: Workload) -> bool:
    """DaemonSet pods are placed per node by design; mirror pods are the kubelet's static pods."""
    return workload.controller_kind() == "DaemonSet" or workload.is_mirror_pod()


# --- rule 6: accelerator-node guard (validating) ---------------------------------------------------------


def accelerator_node_reasons(workload: Workload, policy: Policy, facts: ClusterFacts) -> list[str]:
    """Why the workload is bound for accelerator nodes; empty if it is not."""
    accelerators = policy.accelerators
    reasons = [f"requests {name}" for name in accelerator_requests(workload, accelerators, facts)]
    node = facts.nodes.get(str(workload.pod_spec.get("nodeName"))) if facts.nodes is not None else None
    if node is not None and is_accelerator_node(accelerators, labels=node.labels, resources=node.resources):
        reasons.append(f"nodeName {workload.pod_spec['nodeName']}")
    labels = set(accelerators.nodeLabels)
    selector = as_dict(workload.pod_spec.get("nodeSelector")) or {}
    reasons += [f"nodeSelector {key}" for key in selector if key in labels]
    affinity = as_dict(workload.pod_spec.get("affinity")) or {}
    node_affinity = as_dict(affinity.get("nodeAffinity")) or {}
    required = as_dict(node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")) or {}
    for term in dicts(required.get("nodeSelectorTerms")):
        for expression in dicts(term.get("matchExpressions")):
            if text(expression.get("key")) in labels and expression.get("operator") in (
                "In",
                "Exists",
                "Gt",
                "Lt",
            ):
                reasons.append(f"node affinity {expression['key']}")
    taints = set(accelerators.taintKeys)
    reasons += [
        f"tolerates {t['key']}"
        for t in dicts(workload.pod_spec.get("tolerations"))
        if text(t.get("key")) in taints
    ]
    return list(dict.fromkeys(reasons))


@dataclass(frozen=True)
class ResolvedPriority:
    value: int | None  # None: the class is unknown, nothing can be decided
    source: str


def resolve_priority(workload: Workload, policy: Policy, facts: ClusterFacts) -> ResolvedPriority:
    class_name = workload.priority_class_name()
    source = f"class {class_name}" if class_name else "no class"
    resolved = workload.pod_spec.get("priority")
    # On pods the Priority plugin has already resolved the integer: it is the truth.
    if workload.is_pod and isinstance(resolved, int) and not isinstance(resolved, bool):
        return ResolvedPriority(resolved, source)
    if not class_name:
        return ResolvedPriority(0, source)
    if facts.priority_classes is not None and class_name in facts.priority_classes:
        return ResolvedPriority(facts.priority_classes[class_name].value, source)
    return ResolvedPriority(policy.priority_value(class_name), source)


def accelerator_node_guard(
    workload: Workload, previous: Workload | None, policy: Policy, facts: ClusterFacts
) -> Report:
    """A denial (in `changes`) for a low-priority workload bound for accelerator nodes."""
    report = Report()
    if workload.is_daemonset or (workload.is_pod and (previous is not None or _exempt_pod(workload))):
        return report  # a pod's priority cannot change after creation
    if previous is not None and accelerator_node_guard(previous, None, policy, facts).changes:
        return report  # an existing workload must stay manageable: deny only what the update introduces
    if workload.priority_class_name().startswith(SYSTEM_PRIORITY_PREFIX):
        return report
    reasons = accelerator_node_reasons(workload, policy, facts)
    if not reasons:
        return report
    threshold = policy.rules.acceleratorNodeGuard.minPriority
    resolved = resolve_priority(workload, policy, facts)
    if resolved.value is None:
        report.notices.append(
            f"acceleratorNodeGuard cannot check {resolved.source}: add it to the policy's priorityClasses"
        )
        return report
    if resolved.value >= threshold or resolved.value >= SYSTEM_CRITICAL_PRIORITY:
        return report
    # The most useful words first: kubectl already names the object, and warnings get cut at 120 chars.
    # Suggest the policy's class only where it would help: it exists (when the cluster is known) and
    # its value clears the threshold.
    suggestion = policy.rules.priority.className
    known = facts.priority_classes
    if known is None:
        suggested_value = policy.priority_value(suggestion)
    else:
        suggested_value = known[suggestion].value if suggestion in known else None
    fix = (
        f"set priorityClassName {suggestion} (or a class >= {threshold})"
        if (suggested_value or 0) >= threshold
        else f"set a priorityClassName with value >= {threshold}"
    )
    report.changes.append(
        f"priority {resolved.value} ({resolved.source}) < {threshold} on accelerator nodes: {fix}; "
        f"bound for them by {', '.join(reasons[:3])}"
    )
    return report


# --- rule 7: trusted device software (validating) -------------------------------------------------------


@dataclass(frozen=True)
class DeviceMount:
    host_path: str  # normalised, subPath included
    pattern: str  # the policy's hostPaths entry it reaches


def device_mount(container: JSON, volumes: dict[str, str], rule: TrustedDeviceSoftware) -> DeviceMount | None:
    """The first of the container's hostPath mounts that makes it device software."""
    for mount in dicts(container.get("volumeMounts")):
        host_path = volumes.get(text(mount.get("name")))
        if host_path is None:
            continue
        # subPathExpr is only known on the node: the whole hostPath is what the container may get.
        parts = hostpaths.components(hostpaths.joined(host_path, text(mount.get("subPath"))))
        if parts is None:
            continue  # a relative hostPath: the API server refuses the pod itself
        for pattern, pattern_parts in rule.host_path_patterns:
            if hostpaths.reaches(parts, pattern_parts):
                return DeviceMount(hostpaths.render(parts), pattern)
    return None


def _host_path_volumes(workload: Workload) -> dict[str, str]:
    return {
        text(volume.get("name")): text((as_dict(volume.get("hostPath")) or {}).get("path"))
        for volume in dicts(workload.pod_spec.get("volumes"))
        if as_dict(volume.get("hostPath")) is not None
    }


def _checked_containers(workload: Workload, previous: Workload | None) -> Iterator[tuple[str, JSON]]:
    # A controller's pods come from its template, which was checked when it was created or changed; at
    # the pod's creation only what no template holds is left: ephemeral containers (none yet, in fact).
    # On a pod UPDATE everything counts, since a container image of a pod can be changed in place.
    from_template = workload.is_pod and workload.controller_kind() is not None and previous is None
    if not from_template:
        yield from (("container", c) for c in dicts(workload.pod_spec.get("containers")))
        yield from (("init container", c) for c in dicts(workload.pod_spec.get("initContainers")))
    yield from (("ephemeral container", c) for c in workload.ephemeral_containers())


def device_software(
    workload: Workload, rule: TrustedDeviceSoftware, *, previous: Workload | None = None
) -> Iterator[tuple[str, JSON, DeviceMount]]:
    """(role, container, the mount that makes it device software) for each checked container."""
    volumes = _host_path_volumes(workload)
    if not volumes or workload.is_mirror_pod():
        return  # no hostPath, no device software; a mirror pod runs whatever the API server says
    for role, container in _checked_containers(workload, previous):
        mount = device_mount(container, volumes, rule)
        if mount is not None:
            yield role, container, mount


def untrusted_device_software(
    workload: Workload, previous: Workload | None, rule: TrustedDeviceSoftware
) -> list[str]:
    found = []
    for role, container, mount in device_software(workload, rule, previous=previous):
        image = container.get("image")
        ref = images.parse(image)
        if ref is None:
            problem = "is not an image reference"
        elif not any(images.trusted_by(ref, prefix) for prefix in rule.trustedImages):
            problem = "is not from a trusted source"
        elif rule.requireDigest and not ref.pinned:
            problem = "is not pinned by digest (requireDigest)"
        else:
            continue
        matching = "" if mount.pattern == mount.host_path else f" (matches {mount.pattern})"
        found.append(
            f"{role} {container.get('name', '?')}: image {image} {problem}, and it mounts hostPath "
            f"{mount.host_path}{matching}, which makes it device software; trusted images: "
            f"{', '.join(rule.trustedImages) or '(none)'}"
        )
    return found


def trusted_device_software(
    workload: Workload, previous: Workload | None, policy: Policy, _: ClusterFacts
) -> Report:
    """Denials for device software whose image the policy does not trust."""
    rule = policy.rules.trustedDeviceSoftware
    found = untrusted_device_software(workload, previous, rule)
    if previous is not None and found:
        # What the object already ran before this update is not the update's doing: an existing
        # install can still be scaled, labelled or have its other containers changed.
        before = set(untrusted_device_software(previous, previous, rule))
        found = [message for message in found if message not in before]
    return Report(changes=found)


VALIDATORS: dict[RuleId, Validator] = {
    "acceleratorNodeGuard": accelerator_node_guard,
    "trustedDeviceSoftware": trusted_device_software,
    "driverCompatibility": driver_compatibility_check,
}

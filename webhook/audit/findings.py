"""The audit's pure core: objects already in the cluster in, findings out.

Each workload goes through `engine.mutate` and then `engine.validate` on the mutated copy, with the live
policy and cluster facts, exactly as the API server sends it through the two webhooks at creation; only
the decisions are kept, nothing is written. A rule's mode keeps its meaning: `off` is a skip, every other
mode reports what the rule finds (enforce would apply or refuse it, warn and audit would say so).

Objects arrive owners first (`KIND_ORDER`): an object whose controller was seen is folded into that
owner's finding (pods into their ReplicaSet into their Deployment, Jobs into their CronJob), so each
workload is reported once, through the object a user edits. Running pods are also checked where they
are: a low-priority pod on an accelerator node is a finding of its own, folded or not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from webhook.policy import accelerators, engine, rules
from webhook.policy.facts import ClusterFacts
from webhook.policy.model import MUTATING_RULES, RULE_IDS, Mode, Policy, RuleId
from webhook.policy.workload import JSON, Workload, as_dict, dicts, locate, locate_all, text

# change: a rule would edit the object; deny: the guard would refuse it; warn: a notice only.
Verdict = Literal["change", "deny", "warn", "pass", "skip"]
VERDICTS: tuple[Verdict, ...] = ("deny", "change", "warn", "pass", "skip")  # most serious first
GUARD: RuleId = "acceleratorNodeGuard"
# Owners before what they own: a folded object must find its owner already seen.
KIND_ORDER: tuple[tuple[str, str], ...] = (
    ("batch", "CronJob"),
    ("apps", "Deployment"),
    ("apps", "StatefulSet"),
    ("apps", "DaemonSet"),
    ("batch", "Job"),
    ("apps", "ReplicaSet"),
    ("", "Pod"),
)
# Taint effects that keep a pod without a matching toleration off a node (PreferNoSchedule only asks).
KEEPING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_VERDICT_OF_OUTCOME: dict[engine.Outcome, Verdict] = {
    "applied": "change",
    "would-apply": "change",
    "denied": "deny",
    "would-deny": "deny",
    "notice": "warn",
}


@dataclass(frozen=True, order=True)
class Subject:
    """The object a finding is about, as an ObjectReference names it."""

    namespace: str  # "" for cluster-scoped objects
    kind: str
    name: str
    api_version: str
    uid: str = ""


@dataclass(frozen=True)
class RuleResult:
    rule: RuleId
    verdict: Verdict
    mode: Mode
    messages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    subject: Subject
    results: tuple[RuleResult, ...]
    pods: int = 0  # running pods folded into this workload

    def worst(self) -> Verdict:
        return min((r.verdict for r in self.results), key=VERDICTS.index, default="skip")

    def result(self, rule: RuleId) -> RuleResult | None:
        return next((r for r in self.results if r.rule == rule), None)


@dataclass(frozen=True)
class Audit:
    findings: tuple[Finding, ...]  # sorted by subject
    policy_hash: str
    scanned: Mapping[str, int] = field(default_factory=dict)  # objects read, by kind
    nodes_checked: bool = False

    def count(self, verdict: Verdict) -> int:
        """Findings whose worst result is `verdict`."""
        return sum(1 for f in self.findings if f.worst() == verdict)

    def only(self, selected: Iterable[RuleId]) -> Audit:
        """The same audit with only the results of `selected` rules (findings left empty dropped)."""
        wanted = set(selected)
        kept = []
        for finding in self.findings:
            results = tuple(r for r in finding.results if r.rule in wanted)
            if results:
                kept.append(Finding(finding.subject, results, finding.pods))
        return Audit(tuple(kept), self.policy_hash, self.scanned, self.nodes_checked)


def subject_of(obj: JSON) -> Subject:
    metadata = as_dict(obj.get("metadata")) or {}
    return Subject(
        namespace=text(metadata.get("namespace")),
        kind=text(obj.get("kind")),
        name=text(metadata.get("name")),
        api_version=text(obj.get("apiVersion")),
        uid=text(metadata.get("uid")),
    )


def _verdict(decisions: Iterable[engine.Decision]) -> Verdict:
    return min((_VERDICT_OF_OUTCOME[d.outcome] for d in decisions), key=VERDICTS.index, default="pass")


def _skip_reason(
    rule: RuleId, views: list[Workload], policy: Policy, mutated: engine.Result, guarded: bool
) -> str | None:
    """Why a rule that decided nothing does not apply to the workload; None when it simply passed."""
    if rule in MUTATING_RULES and mutated.skipped is not None:
        return mutated.skipped
    if rule == "podFailurePolicy" and all(
        view.job_spec is None and view.workload_kind.gang != "group" for view in views
    ):
        return "Jobs, CronJobs, JobSets and LeaderWorkerSets only"
    if rule == GUARD and not guarded:
        return "not bound for accelerator nodes"
    if rule == "driverCompatibility":
        if views[0].is_daemonset:
            return "DaemonSets run on every node"
        if not any(rules.driver_rule_applies(view, policy.rules.driverCompatibility) for view in views):
            return "states no driver version it needs"
    if rule == "trustedDeviceSoftware" and not any(
        any(rules.device_software(view, policy.rules.trustedDeviceSoftware)) for view in views
    ):
        return "mounts no device software's host paths"
    return None


def evaluate(obj: JSON, policy: Policy, facts: ClusterFacts) -> Finding | None:
    """One object's finding, or None when no rule has anything to say about it (a CPU workload bound
    for no accelerator node, a DaemonSet running no untrusted device software, an exempt pod)."""
    views = locate_all(obj, daemonsets=True, kinds=policy.workload_kinds)
    if not views:
        return None
    namespace = views[0].namespace
    mutated = engine.mutate(obj, policy, namespace=namespace, facts=facts)
    # The validating webhook sees the object after every mutating webhook: validate the mutated copy.
    validated = engine.validate(mutated.obj, policy, namespace=namespace, facts=facts)
    guarded = not views[0].is_daemonset and any(
        rules.accelerator_node_reasons(view, policy, facts) for view in views
    )
    if mutated.skipped is not None and not guarded and not validated.decisions:
        return None
    labels = facts.labels_of(namespace)
    decisions = (*mutated.decisions, *validated.decisions)
    results: list[RuleResult] = []
    for rule in RULE_IDS:
        mode = policy.mode_for(rule, namespace, labels)
        mine = [d for d in decisions if d.rule == rule]
        reason = _skip_reason(rule, views, policy, mutated, guarded)
        if mode == "off":
            results.append(RuleResult(rule, "skip", mode, (f"off in namespace {namespace}",)))
        elif not mine and reason is not None:
            results.append(RuleResult(rule, "skip", mode, (reason,)))
        else:
            results.append(RuleResult(rule, _verdict(mine), mode, tuple(d.message for d in mine)))
    return Finding(subject_of(obj), tuple(results))


def running_on_accelerator_node(pod: JSON, policy: Policy, facts: ClusterFacts) -> RuleResult | None:
    """The guard's verdict on a pod as it runs (its priority cannot change), when it runs on an
    accelerator node and the guard refuses it there; None otherwise."""
    workload = locate(pod)
    if workload is None or not workload.is_pod or facts.nodes is None:
        return None
    node_name = text(workload.pod_spec.get("nodeName"))
    node = facts.nodes.get(node_name)
    if node is None or not accelerators.is_accelerator_node(
        policy.accelerators, labels=node.labels, resources=node.resources
    ):
        return None
    validated = engine.validate(pod, policy, namespace=workload.namespace, facts=facts)
    denials = [d for d in validated.decisions if d.rule == GUARD and _VERDICT_OF_OUTCOME[d.outcome] == "deny"]
    if not denials:
        return None
    messages = tuple(f"running on accelerator node {node_name}: {d.message}" for d in denials)
    return RuleResult(GUARD, "deny", denials[0].mode, messages)


def node_findings(policy: Policy, facts: ClusterFacts) -> list[Finding]:
    """Accelerator nodes, each with whether a taint keeps pods that ask for no accelerator off it: the
    guard only sees pods bound for accelerator nodes, the scheduler puts unbound ones anywhere."""
    mode = policy.mode_for(GUARD, None)
    if facts.nodes is None or mode == "off":
        return []
    taint_keys = set(policy.accelerators.taintKeys)
    findings = []
    for name, node in facts.nodes.items():
        if not accelerators.is_accelerator_node(
            policy.accelerators, labels=node.labels, resources=node.resources
        ):
            continue
        keeping = [t for t in node.taints if t.key in taint_keys and t.effect in KEEPING_EFFECTS]
        if keeping:
            result = RuleResult(GUARD, "pass", mode, (f"tainted {keeping[0].key}:{keeping[0].effect}",))
        else:
            example = policy.accelerators.taintKeys[0] if policy.accelerators.taintKeys else "nvidia.com/gpu"
            message = (
                "accelerator node without a NoSchedule or NoExecute taint from accelerators.taintKeys: "
                "pods that ask for no accelerator can be scheduled here; "
                f"kubectl taint nodes {name} {example}=present:NoSchedule"
            )
            result = RuleResult(GUARD, "warn", mode, (message,))
        findings.append(Finding(Subject("", "Node", str(name), "v1"), (result,)))
    return findings


def _controller_uid(obj: JSON) -> str | None:
    metadata = as_dict(obj.get("metadata")) or {}
    for ref in dicts(metadata.get("ownerReferences")):
        if ref.get("controller") is True and isinstance(ref.get("uid"), str):
            return str(ref["uid"])
    return None


def _with(finding: Finding, replacement: RuleResult) -> Finding:
    """The finding with `replacement` as its result for that rule."""
    results = tuple(r for r in finding.results if r.rule != replacement.rule)
    return Finding(finding.subject, (*results, replacement), finding.pods)


class Auditor:
    """Takes objects one at a time, owners first (`KIND_ORDER`), keeping findings and no objects."""

    def __init__(self, policy: Policy, facts: ClusterFacts) -> None:
        self.policy = policy
        self.facts = facts
        self.scanned: Counter[str] = Counter()
        self._findings: dict[str, Finding] = {}  # by the subject's uid (or its name when it has none)
        self._reported_as: dict[str, str] = {}  # owner uid -> the uid of the object it is reported through
        self._pods: Counter[str] = Counter()

    def add(self, obj: JSON) -> None:
        subject = subject_of(obj)
        self.scanned[subject.kind] += 1
        key = subject.uid or f"{subject.namespace}/{subject.kind}/{subject.name}"
        owner = _controller_uid(obj)
        top = self._reported_as.get(owner) if owner is not None else None
        is_pod = subject.kind == "Pod"
        if not is_pod:  # pods own nothing: a cluster's worth of them is not remembered
            self._reported_as[key] = top or key
        if top is None:
            finding = evaluate(obj, self.policy, self.facts)
            if finding is not None:
                self._findings[key] = finding
        elif is_pod:
            self._pods[top] += 1
        running = running_on_accelerator_node(obj, self.policy, self.facts) if is_pod else None
        if running is not None:
            # The pod as it runs is judged without the mutations it would get at creation, so its denial
            # says all the creation-time one says, and more: it replaces that one.
            self._findings[key] = _with(self._findings.get(key) or Finding(subject, ()), running)

    def result(self, *, check_nodes: bool) -> Audit:
        findings = [
            Finding(f.subject, f.results, self._pods.get(key, 0)) for key, f in self._findings.items()
        ]
        if check_nodes:
            findings += node_findings(self.policy, self.facts)
        findings.sort(key=lambda f: f.subject)
        return Audit(tuple(findings), self.policy.hash, dict(self.scanned), check_nodes)


def audit(objects: Iterable[JSON], policy: Policy, facts: ClusterFacts, *, check_nodes: bool = True) -> Audit:
    """The audit of `objects` (owners first, as `KIND_ORDER` lists them)."""
    auditor = Auditor(policy, facts)
    for obj in objects:
        auditor.add(obj)
    return auditor.result(check_nodes=check_nodes)

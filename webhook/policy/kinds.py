"""The workload kinds gpuguard handles, in one registry: where each keeps its pod templates, and which
are gangs (their members fail and restart together).

A kind is one entry; the mutator, the validator, the audit, the offline CLI and the webhook
configurations all read this table. An operator adds a custom kind through the policy's
`workloadKinds`, with template paths written as `spec.groups[].template` (`[]`: every item of a list,
`*`: every value of a mapping).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

JSON = dict[str, Any]
Path = tuple[str, ...]
EACH_ITEM = "[]"
EACH_VALUE = "*"

# How a kind's members fail together:
#   none: each pod stands alone (a replacement pod is the right answer).
#   jobset: each replicated Job is a gang whose failure the JobSet's failurePolicy turns into a restart.
#   group: the kind's own controller restarts its groups (LeaderWorkerSet's restartPolicy).
#   replicas: the kind's own operator runs the group (Kubeflow, Ray, Volcano): templates only.
GangKind = Literal["none", "jobset", "group", "replicas"]


@dataclass(frozen=True)
class WorkloadKind:
    group: str
    versions: tuple[str, ...]
    kind: str
    resource: str  # the plural the webhook configurations and the audit's lists name
    # Paths to PodTemplateSpecs (metadata and spec), and to JobSpecs, whose pod template is `template`.
    pod_templates: tuple[Path, ...] = ()
    job_specs: tuple[Path, ...] = ()
    batch: bool = False  # runs to completion; serving work is restarted forever
    gang: GangKind = "none"
    # Built into Kubernetes: the admission path decodes only the fields the rules read
    # (webhook.admission.review.RULE_FIELDS) and mutate copies only what they write.
    core: bool = False

    @property
    def api_group(self) -> str:
        return f"{self.group}/" if self.group else ""

    @property
    def is_pod(self) -> bool:
        return (self.group, self.kind) == ("", "Pod")

    @property
    def single_template(self) -> bool:
        """One pod template at a fixed place: its decisions need not say which template they are about."""
        paths = (*self.pod_templates, *self.job_specs)
        return len(paths) <= 1 and not any(step in (EACH_ITEM, EACH_VALUE) for path in paths for step in path)


def parse_path(text: str) -> Path:
    """`spec.groups[].template` -> ("spec", "groups", "[]", "template"); `*` stays a step of its own."""
    steps: list[str] = []
    for part in text.split("."):
        each = part.endswith(EACH_ITEM)
        name = part[: -len(EACH_ITEM)] if each else part
        if not name or (not all(c.isalnum() or c in "-_" for c in name) and name != EACH_VALUE):
            raise ValueError(f"path {text!r}: {part!r} is not a field name, `name[]` or `*`")
        steps.append(name)
        if each:
            steps.append(EACH_ITEM)
    if steps[0] == EACH_VALUE:
        raise ValueError(f"path {text!r} cannot start with `*`")
    return tuple(steps)


_TEMPLATE = ("template",)
BUILTIN_KINDS: tuple[WorkloadKind, ...] = (
    WorkloadKind("", ("v1",), "Pod", "pods", core=True),
    WorkloadKind("batch", ("v1",), "Job", "jobs", job_specs=(("spec",),), batch=True, core=True),
    WorkloadKind(
        "batch",
        ("v1",),
        "CronJob",
        "cronjobs",
        job_specs=(("spec", "jobTemplate", "spec"),),
        batch=True,
        core=True,
    ),
    WorkloadKind(
        "apps", ("v1",), "Deployment", "deployments", pod_templates=(("spec", "template"),), core=True
    ),
    WorkloadKind(
        "apps", ("v1",), "StatefulSet", "statefulsets", pod_templates=(("spec", "template"),), core=True
    ),
    WorkloadKind(
        "apps", ("v1",), "ReplicaSet", "replicasets", pod_templates=(("spec", "template"),), core=True
    ),
    WorkloadKind(
        "jobset.x-k8s.io",
        ("v1alpha2",),
        "JobSet",
        "jobsets",
        job_specs=(("spec", "replicatedJobs", EACH_ITEM, "template", "spec"),),
        batch=True,
        gang="jobset",
    ),
    WorkloadKind(
        "leaderworkerset.x-k8s.io",
        ("v1",),
        "LeaderWorkerSet",
        "leaderworkersets",
        pod_templates=(
            ("spec", "leaderWorkerTemplate", "leaderTemplate"),
            ("spec", "leaderWorkerTemplate", "workerTemplate"),
        ),
        gang="group",
    ),
    WorkloadKind(
        "kubeflow.org",
        ("v1",),
        "PyTorchJob",
        "pytorchjobs",
        pod_templates=(("spec", "pytorchReplicaSpecs", EACH_VALUE, *_TEMPLATE),),
        batch=True,
        gang="replicas",
    ),
    WorkloadKind(
        "kubeflow.org",
        ("v1", "v2beta1"),
        "MPIJob",
        "mpijobs",
        pod_templates=(("spec", "mpiReplicaSpecs", EACH_VALUE, *_TEMPLATE),),
        batch=True,
        gang="replicas",
    ),
    WorkloadKind(
        "kubeflow.org",
        ("v1",),
        "TFJob",
        "tfjobs",
        pod_templates=(("spec", "tfReplicaSpecs", EACH_VALUE, *_TEMPLATE),),
        batch=True,
        gang="replicas",
    ),
    WorkloadKind(
        "ray.io",
        ("v1",),
        "RayCluster",
        "rayclusters",
        pod_templates=(
            ("spec", "headGroupSpec", *_TEMPLATE),
            ("spec", "workerGroupSpecs", EACH_ITEM, *_TEMPLATE),
        ),
        gang="replicas",
    ),
    WorkloadKind(
        "ray.io",
        ("v1",),
        "RayJob",
        "rayjobs",
        pod_templates=(
            ("spec", "rayClusterSpec", "headGroupSpec", *_TEMPLATE),
            ("spec", "rayClusterSpec", "workerGroupSpecs", EACH_ITEM, *_TEMPLATE),
            ("spec", "submitterPodTemplate"),
        ),
        batch=True,
        gang="replicas",
    ),
    WorkloadKind(
        "batch.volcano.sh",
        ("v1alpha1",),
        "Job",
        "jobs",
        pod_templates=(("spec", "tasks", EACH_ITEM, *_TEMPLATE),),
        batch=True,
        gang="replicas",
    ),
)
# DaemonSets are how device software ships; only trustedDeviceSoftware looks at them.
DAEMONSET = WorkloadKind(
    "apps", ("v1",), "DaemonSet", "daemonsets", pod_templates=(("spec", "template"),), core=True
)


class Registry:
    """The kinds by (group, kind): the built-in ones and a policy's custom ones."""

    def __init__(self, kinds: tuple[WorkloadKind, ...]) -> None:
        self.kinds = kinds
        self._by_key: Mapping[tuple[str, str], WorkloadKind] = {(k.group, k.kind): k for k in kinds}

    def get(self, group: str, kind: str, *, daemonsets: bool = False) -> WorkloadKind | None:
        found = self._by_key.get((group, kind))
        if found is None and daemonsets and (group, kind) == (DAEMONSET.group, DAEMONSET.kind):
            return DAEMONSET
        return found

    def owns_templates_of(self, owner_kind: str | None) -> bool:
        """Whether objects controlled by `owner_kind` (a JobSet's Jobs, a LeaderWorkerSet's StatefulSets)
        were made from templates of a kind gpuguard already mutated."""
        return owner_kind is not None and any(k.kind == owner_kind and not k.core for k in self.kinds)


BUILTIN = Registry(BUILTIN_KINDS)


@dataclass(frozen=True)
class Site:
    """One pod template inside an object."""

    label: str  # which template, for messages ("replicatedJobs[workers]"); "" for single-template kinds
    template: JSON  # the PodTemplateSpec: metadata and spec
    pod_spec: JSON
    job_spec: JSON | None = None
    job_template_metadata: JSON | None = None  # a JobSet's replicated Job template's metadata
    item: JSON | None = None  # the list item holding the template (a replicatedJob: its name, replicas)


def _expand(
    node: Any, path: Path, taken: tuple[str, ...], item: JSON | None
) -> Iterator[tuple[Any, tuple[str, ...], JSON | None]]:
    if not path:
        yield node, taken, item
        return
    step, rest = path[0], path[1:]
    if step == EACH_ITEM:
        if isinstance(node, list):
            for index, value in enumerate(node):
                if isinstance(value, dict):
                    name = value.get("name") or value.get("groupName")  # Ray's worker groups
                    label = f"[{name}]" if isinstance(name, str) and name else f"[{index}]"
                    yield from _expand(value, rest, (*taken[:-1], taken[-1] + label), value)
        return
    if not isinstance(node, dict):
        return
    if step == EACH_VALUE:
        for key, value in node.items():
            yield from _expand(value, rest, (*taken, str(key)), item)
        return
    if step in node:
        yield from _expand(node[step], rest, (*taken, step), item)


def _label(taken: tuple[str, ...]) -> str:
    return ".".join(step for step in taken if step not in ("spec", "template"))


def sites(obj: JSON, kind: WorkloadKind) -> Iterator[Site]:
    """Every pod template of `obj` that is well-formed enough to read (a dict with a dict spec)."""
    single = kind.single_template
    for path in kind.job_specs:
        for job_spec, taken, item in _expand(obj, path, (), None):
            template = job_spec.get("template") if isinstance(job_spec, dict) else None
            pod_spec = template.get("spec") if isinstance(template, dict) else None
            if isinstance(pod_spec, dict):
                assert isinstance(template, dict) and isinstance(job_spec, dict)
                job_template = item.get("template") if item is not None else None
                metadata = job_template.get("metadata") if isinstance(job_template, dict) else None
                yield Site(
                    "" if single else _label(taken),
                    template,
                    pod_spec,
                    job_spec,
                    metadata if isinstance(metadata, dict) else None,
                    item,
                )
    for path in kind.pod_templates:
        for template, taken, item in _expand(obj, path, (), None):
            pod_spec = template.get("spec") if isinstance(template, dict) else None
            if isinstance(pod_spec, dict):
                assert isinstance(template, dict)
                yield Site("" if single else _label(taken), template, pod_spec, item=item)

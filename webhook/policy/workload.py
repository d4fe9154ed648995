"""Where the pod spec lives in each supported kind, and what makes a workload an accelerator workload.

Everything here reads plain dicts as the API server sends them (defaulted, possibly with fields we have
never heard of) and never assumes a field has the right type: a manifest is data from a user.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from webhook.policy.accelerators import claim_counts
from webhook.policy.facts import NO_FACTS, ClusterFacts
from webhook.policy.kinds import BUILTIN, DAEMONSET, Registry, Site, WorkloadKind, sites
from webhook.policy.model import Accelerators

JSON = dict[str, Any]

MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
SYSTEM_CRITICAL_PRIORITY = 2_000_000_000


def as_dict(value: object) -> JSON | None:
    return value if isinstance(value, dict) else None


def text(value: object) -> str:
    """A string field's value, or "" when it is missing or not a string."""
    return value if isinstance(value, str) else ""


def dicts(value: object) -> Iterator[JSON]:
    """The dict items of a list, skipping anything malformed."""
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                yield item


@dataclass(frozen=True)
class Workload:
    """A view into one pod template of an object (a pod: the pod itself): `obj` and the dicts inside it
    that rules read and edit in place."""

    group: str
    kind: str
    obj: JSON
    pod_spec: JSON
    job_spec: JSON | None
    namespace: str | None
    workload_kind: WorkloadKind
    site: Site | None = None  # None for a pod

    @property
    def label(self) -> str:
        """Which of the object's templates this is, for messages; "" when the kind has one."""
        return self.site.label if self.site is not None else ""

    @property
    def is_pod(self) -> bool:
        return self.kind == "Pod" and self.group == ""

    @property
    def is_template(self) -> bool:
        return not self.is_pod

    @property
    def is_daemonset(self) -> bool:
        return self.workload_kind is DAEMONSET

    @property
    def is_batch(self) -> bool:
        """Batch work runs to completion; serving work is restarted forever."""
        if self.is_pod:
            return bool(self.pod_spec.get("restartPolicy", "Always") != "Always")
        return self.workload_kind.batch

    @property
    def metadata(self) -> JSON:
        return as_dict(self.obj.get("metadata")) or {}

    @property
    def display_name(self) -> str:
        meta = self.metadata
        name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName") else "")
        return f"{self.kind} {name!s}".strip()

    def containers(self, *, init: bool = True) -> Iterator[JSON]:
        yield from dicts(self.pod_spec.get("containers"))
        if init:
            yield from dicts(self.pod_spec.get("initContainers"))

    def ephemeral_containers(self) -> Iterator[JSON]:
        """`kubectl debug` containers: only pods have them, added through pods/ephemeralcontainers."""
        yield from dicts(self.pod_spec.get("ephemeralContainers"))

    def annotation(self, key: str) -> str | None:
        """The annotation on the pod template (what the pods carry), else on the object itself."""
        for metadata in (self.template_metadata, self.metadata):
            value = (as_dict(metadata.get("annotations")) or {}).get(key)
            if isinstance(value, str):
                return value
        return None

    @property
    def template_metadata(self) -> JSON:
        """The pod template's metadata; a pod's own metadata for a pod."""
        if self.site is None:
            return self.metadata
        return as_dict(self.site.template.get("metadata")) or {}

    def controller_kind(self) -> str | None:
        for ref in dicts(self.metadata.get("ownerReferences")):
            if ref.get("controller") is True:
                kind = ref.get("kind")
                return kind if isinstance(kind, str) else None
        return None

    def is_mirror_pod(self) -> bool:
        annotations = as_dict(self.metadata.get("annotations")) or {}
        return self.is_pod and MIRROR_POD_ANNOTATION in annotations

    def priority_class_name(self) -> str:
        name = self.pod_spec.get("priorityClassName")
        return name if isinstance(name, str) else ""


def split_api_version(api_version: object) -> str:
    """The API group of an apiVersion string: "apps/v1" -> "apps", "v1" -> ""."""
    if not isinstance(api_version, str) or "/" not in api_version:
        return ""
    return api_version.split("/", 1)[0]


def locate_all(
    obj: JSON,
    *,
    group: str | None = None,
    kind: str | None = None,
    namespace: str | None = None,
    daemonsets: bool = False,
    kinds: Registry = BUILTIN,
) -> list[Workload]:
    """A view of each pod template of `obj`; empty for kinds gpuguard does not handle (DaemonSets unless
    asked) and for objects without a readable template.

    `namespace` is the request's: objects created by controllers often carry none in their metadata.
    """
    kind = kind if kind is not None else obj.get("kind")
    group = group if group is not None else split_api_version(obj.get("apiVersion"))
    if not isinstance(kind, str):
        return []
    workload_kind = kinds.get(group, kind, daemonsets=daemonsets)
    if workload_kind is None:
        return []
    if namespace is None:
        metadata = as_dict(obj.get("metadata")) or {}
        namespace = metadata.get("namespace") if isinstance(metadata.get("namespace"), str) else None
    if workload_kind.is_pod:
        spec = as_dict(obj.get("spec"))
        return [] if spec is None else [Workload(group, kind, obj, spec, None, namespace, workload_kind)]
    return [
        Workload(group, kind, obj, site.pod_spec, site.job_spec, namespace, workload_kind, site)
        for site in sites(obj, workload_kind)
    ]


def locate(
    obj: JSON,
    *,
    group: str | None = None,
    kind: str | None = None,
    namespace: str | None = None,
    daemonsets: bool = False,
    kinds: Registry = BUILTIN,
) -> Workload | None:
    """The view of a pod or of a single-template object (its first template for the others)."""
    views = locate_all(obj, group=group, kind=kind, namespace=namespace, daemonsets=daemonsets, kinds=kinds)
    return views[0] if views else None


def accelerator_resources(container: JSON, accelerators: Accelerators) -> list[str]:
    """The accelerator extended resources a container asks for, by name."""
    # Asked several times per container and request: no helper calls.
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return []
    verdicts = accelerators.resource_verdicts
    found: dict[str, None] = {}
    for section in ("limits", "requests"):
        names = resources.get(section)
        if isinstance(names, dict):
            for name in names:
                if isinstance(name, str) and verdicts[name]:
                    found[name] = None
    return list(found)


def _claim_counts(
    claim: JSON, namespace: str | None, accelerators: Accelerators, facts: ClusterFacts
) -> bool:
    """Whether a pod's claim counts (`claim_counts`), from the device classes it asks for when known."""
    for field, known in (
        ("resourceClaimName", facts.claims),
        ("resourceClaimTemplateName", facts.claim_templates),
    ):
        name = claim.get(field)
        if isinstance(name, str) and known is not None and (namespace or "", name) in known:
            return claim_counts(accelerators, known[(namespace or "", name)])
    return claim_counts(accelerators, None)


def accelerator_claims(
    workload: Workload, accelerators: Accelerators, facts: ClusterFacts = NO_FACTS
) -> list[str]:
    """Names of the pod's DRA resource claims that count as accelerators."""
    if not accelerators.resourceClaims:
        return []
    return [
        str(claim.get("name", ""))
        for claim in dicts(workload.pod_spec.get("resourceClaims"))
        if _claim_counts(claim, workload.namespace, accelerators, facts)
    ]


def _uses_accelerators(container: JSON, accelerators: Accelerators, claims: list[str]) -> bool:
    if accelerator_resources(container, accelerators):
        return True
    resources = as_dict(container.get("resources")) or {}
    return any(claim.get("name") in claims for claim in dicts(resources.get("claims")))


def accelerator_requests(
    workload: Workload, accelerators: Accelerators, facts: ClusterFacts = NO_FACTS
) -> list[str]:
    """What makes the workload an accelerator workload (resource names, DRA claims); empty if nothing."""
    found: dict[str, None] = {}
    for container in workload.containers():
        found.update(dict.fromkeys(accelerator_resources(container, accelerators)))
    found.update(
        dict.fromkeys(f"DRA claim {name}" for name in accelerator_claims(workload, accelerators, facts))
    )
    return list(found)


def is_sidecar(container: JSON) -> bool:
    return container.get("restartPolicy") == "Always"


def accelerator_containers(
    workload: Workload, accelerators: Accelerators, facts: ClusterFacts = NO_FACTS
) -> Iterator[JSON]:
    """Regular and sidecar containers that use accelerators; plain init containers never qualify."""
    claims = accelerator_claims(workload, accelerators, facts)
    for container in dicts(workload.pod_spec.get("containers")):
        if _uses_accelerators(container, accelerators, claims):
            yield container
    for container in dicts(workload.pod_spec.get("initContainers")):
        if is_sidecar(container) and _uses_accelerators(container, accelerators, claims):
            yield container

"""The cluster facts admission reads (PriorityClasses, namespace labels, nodes, DRA claims): one
informer per resource, each converter keeping only the fields a rule reads, published as one
`ClusterFacts` snapshot that requests read without locking.

Nodes are most of a large cluster's objects and most of each object is what no rule reads (images,
conditions, dozens of labels), so the node converter keeps what makes a node an accelerator node under
the current policy (the policy's node labels it carries, the accelerator resources in its capacity),
which is also what a message needs to say why, and the driver labels the metrics read; every label
only while the driver check, which matches workloads' node selections against them, can run. Nodes
alike share one value. When a new policy changes what is read, the nodes are listed again with a
converter for it (`FactInformers`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from webhook.kube.client import ApiClient, ResourceListWatch, collection, metadata_of
from webhook.kube.informer import Converter, Informer
from webhook.policy.facts import ClusterFacts, NodeInfo, PriorityClassInfo, node_info
from webhook.policy.model import Accelerators, DriverNodeLabels, Policy, RuleId

# Distinct node values kept for sharing; far more than a fleet has (most are one of a handful), the
# bound only matters if a policy names a label whose value is unique per node.
MAX_SHARED_NODE_VALUES = 4096


def priority_class(raw: dict[str, Any]) -> tuple[Hashable, PriorityClassInfo] | None:
    name = metadata_of(raw).get("name")
    value = raw.get("value")
    if not isinstance(name, str) or not isinstance(value, int):
        return None
    preemption = raw.get("preemptionPolicy")
    return name, PriorityClassInfo(
        value=value,
        preemption_policy=preemption if isinstance(preemption, str) else None,
        global_default=raw.get("globalDefault") is True,
    )


def namespace_labels(raw: dict[str, Any]) -> tuple[Hashable, dict[str, str]] | None:
    metadata = metadata_of(raw)
    name = metadata.get("name")
    labels = metadata.get("labels")
    return (name, dict(labels) if isinstance(labels, dict) else {}) if isinstance(name, str) else None


def node(raw: dict[str, Any]) -> tuple[Hashable, NodeInfo] | None:
    """A node as a file shows it (`gpuguard review` inputs): every label and capacity resource."""
    return node_info(raw)


def list_nodes(api: ApiClient) -> dict[str, NodeInfo]:
    """Every Node, listed page by page (`gpuguard nodes drivers` against a cluster)."""
    nodes = ResourceListWatch(collection(api, "/api/v1/nodes"))
    found: dict[str, NodeInfo] = {}
    token: str | None = None
    while True:
        page = nodes.list_page(token)
        found.update(item for raw in page.items if (item := node_info(raw)) is not None)
        token = page.continue_token
        if token is None:
            return found


@dataclasses.dataclass(frozen=True)
class NodeReads:
    """What of a node the rules and the metrics read under one policy; a new policy that changes it
    means converting the nodes again."""

    accelerators: Accelerators
    driver_labels: DriverNodeLabels
    # The driver check matches each workload's own node selection against every node's labels: any
    # label a workload may name. Kept whole only when the rule can run somewhere.
    every_label: bool

    @classmethod
    def of(cls, policy: Policy) -> NodeReads:
        driver: RuleId = "driverCompatibility"
        everywhere = policy.rule(driver).mode or policy.mode
        modes = {everywhere} | {
            override.rules.get(driver) or override.mode or everywhere for override in policy.namespaces
        }
        can_check = policy.enabled and modes != {"off"}
        return cls(policy.accelerators, policy.rules.driverCompatibility.nodeLabels, can_check)


def node_converter(reads: NodeReads) -> Converter[NodeInfo]:
    """A node reduced to what `reads` names: the node labels the policy names (every label when the
    driver check can run) and the accelerator resources of its capacity. Equal values are one shared
    object, and label keys and values are interned: a fleet repeats them from node to node."""
    driver = reads.driver_labels
    label_keys = (
        *reads.accelerators.nodeLabels,
        driver.driverMajor,
        driver.driverVersion,
        driver.cudaVersion,
        driver.product,
        *driver.pools,
    )
    accelerators = reads.accelerators
    shared: dict[tuple[tuple[tuple[str, str], ...], tuple[str, ...]], NodeInfo] = {}
    intern = sys.intern

    def convert(raw: dict[str, Any]) -> tuple[Hashable, NodeInfo] | None:
        metadata = metadata_of(raw)
        name = metadata.get("name")
        if not isinstance(name, str):
            return None
        labels = metadata.get("labels")
        kept: dict[str, str] = {}
        if isinstance(labels, dict):
            keys = labels if reads.every_label else (key for key in label_keys if key in labels)
            for key in keys:
                value = labels[key]
                kept[intern(key)] = intern(value) if isinstance(value, str) else value
        status = raw.get("status")
        capacity = status.get("capacity") if isinstance(status, dict) else None
        resources = (
            tuple(sorted(r for r in capacity if accelerators.is_accelerator_resource(r)))
            if isinstance(capacity, dict)
            else ()
        )
        key = (tuple(kept.items()), resources)
        value = shared.get(key)
        if value is None:
            if len(shared) >= MAX_SHARED_NODE_VALUES:
                shared.clear()
            value = shared[key] = NodeInfo(kept, resources)
        return name, value

    return convert


def _device_classes(claim_spec: object) -> tuple[str, ...]:
    """Device classes a claim spec asks for: `exactly` or any of `firstAvailable` (resource.k8s.io/v1)."""
    devices = claim_spec.get("devices") if isinstance(claim_spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    found: dict[str, None] = {}
    for request in requests if isinstance(requests, list) else []:
        if not isinstance(request, dict):
            continue
        exactly = request.get("exactly")
        candidates = [exactly] if isinstance(exactly, dict) else request.get("firstAvailable") or []
        for candidate in candidates:
            name = candidate.get("deviceClassName") if isinstance(candidate, dict) else None
            if isinstance(name, str):
                found[name] = None
    return tuple(found)


def resource_claim(raw: dict[str, Any]) -> tuple[Hashable, tuple[str, ...]] | None:
    metadata = metadata_of(raw)
    key = (metadata.get("namespace", ""), metadata.get("name", ""))
    return key, _device_classes(raw.get("spec"))


def resource_claim_template(raw: dict[str, Any]) -> tuple[Hashable, tuple[str, ...]] | None:
    metadata = metadata_of(raw)
    key = (metadata.get("namespace", ""), metadata.get("name", ""))
    spec = raw.get("spec")
    return key, _device_classes(spec.get("spec") if isinstance(spec, dict) else None)


class FactsPublisher:
    """Folds each informer's snapshot into one `ClusterFacts`, replaced whole under a lock so that
    informers publishing at once never lose each other's field."""

    def __init__(self, get: Callable[[], ClusterFacts], put: Callable[[ClusterFacts], None]) -> None:
        self._get = get
        self._put = put
        self._lock = threading.Lock()

    def publisher(self, field: str) -> Callable[[Mapping[Hashable, Any] | None], None]:
        def publish(snapshot: Mapping[Hashable, Any] | None) -> None:
            with self._lock:
                current = self._get()
                unavailable = {*current.unavailable} - {field}
                if snapshot is None:
                    unavailable.add(field)
                changes: dict[str, Any] = {field: snapshot, "unavailable": tuple(sorted(unavailable))}
                self._put(dataclasses.replace(current, **changes))

        return publish


class FactInformers:
    """The informers behind `ClusterFacts`, one per lookup, and the node converter's policy."""

    def __init__(self, api: ApiClient, facts: FactsPublisher, stop: threading.Event, policy: Policy) -> None:
        self.node_reads = NodeReads.of(policy)
        specs: list[tuple[str, str, Converter[Any]]] = [
            ("priority_classes", "/apis/scheduling.k8s.io/v1/priorityclasses", priority_class),
            ("namespace_labels", "/api/v1/namespaces", namespace_labels),
            ("nodes", "/api/v1/nodes", node_converter(self.node_reads)),
            ("claims", "/apis/resource.k8s.io/v1/resourceclaims", resource_claim),
            ("claim_templates", "/apis/resource.k8s.io/v1/resourceclaimtemplates", resource_claim_template),
        ]
        self.informers: list[Informer[Any]] = []
        for name, path, convert in specs:
            informer: Informer[Any] = Informer(
                name, ResourceListWatch(collection(api, path)), convert, stop=stop
            )
            informer.on_snapshot(facts.publisher(name))
            self.informers.append(informer)
        self.nodes: Informer[NodeInfo] = self.informers[2]

    def policy_loaded(self, policy: Policy) -> None:
        """Lists the nodes again when the new policy changes what is read of a node (what makes an
        accelerator node, the driver labels, whether the driver check runs); until that list is read,
        admission judges nodes by what the previous policy kept."""
        reads = NodeReads.of(policy)
        if reads == self.node_reads:
            return
        self.node_reads = reads
        self.nodes.reconvert(node_converter(reads))

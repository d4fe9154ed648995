"""What the cluster knows and an object does not: PriorityClasses, namespace labels, nodes, DRA claims.

The shell keeps these up to date from watches; the engine only reads them. Every field is None when
unknown (offline CLI, or the API unreachable): rules then decide from the policy alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ClaimKey = tuple[str, str]  # (namespace, name)
# The ClusterFacts fields filled from the cluster, by name (the names `unavailable` lists).
LOOKUPS = ("priority_classes", "namespace_labels", "nodes", "claims", "claim_templates")


@dataclass(frozen=True)
class PriorityClassInfo:
    value: int
    preemption_policy: str | None = None
    global_default: bool = False


@dataclass(frozen=True)
class NodeInfo:
    labels: Mapping[str, str]
    resources: tuple[str, ...] = ()  # resource names in the node's capacity


def node_info(raw: object) -> tuple[str, NodeInfo] | None:
    """A Node object (as the API serves it) as its name and NodeInfo; None when it has no name."""
    metadata = raw.get("metadata") if isinstance(raw, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not isinstance(raw, dict) or not isinstance(metadata, dict):
        return None
    labels = metadata.get("labels")
    status = raw.get("status")
    capacity = status.get("capacity") if isinstance(status, dict) else None
    resources = tuple(sorted(capacity)) if isinstance(capacity, dict) else ()
    return name, NodeInfo(dict(labels) if isinstance(labels, dict) else {}, resources)


def nodes_of(documents: Iterable[Any]) -> dict[str, NodeInfo]:
    """The Nodes among manifests: single objects and Lists (`kubectl get nodes -o yaml|json`)."""
    nodes: dict[str, NodeInfo] = {}
    for doc in documents:
        items = doc.get("items") if isinstance(doc, dict) else None
        for item in items if isinstance(items, list) else [doc]:
            if isinstance(item, dict) and item.get("kind", "Node") == "Node" and (found := node_info(item)):
                nodes[found[0]] = found[1]
    return nodes


@dataclass(frozen=True)
class ClusterFacts:
    priority_classes: Mapping[str, PriorityClassInfo] | None = None
    namespace_labels: Mapping[str, Mapping[str, str]] | None = None
    nodes: Mapping[str, NodeInfo] | None = None
    # Device class names each ResourceClaim / ResourceClaimTemplate asks for.
    claims: Mapping[ClaimKey, tuple[str, ...]] | None = None
    claim_templates: Mapping[ClaimKey, tuple[str, ...]] | None = None
    # Lookups that are configured but not available right now; users are told decisions fell back.
    unavailable: tuple[str, ...] = ()

    def labels_of(self, namespace: str | None) -> Mapping[str, str] | None:
        if self.namespace_labels is None or namespace is None:
            return None
        return self.namespace_labels.get(namespace, {})

    def global_default_class(self) -> str | None:
        if self.priority_classes is None:
            return None
        return next((name for name, info in self.priority_classes.items() if info.global_default), None)


NO_FACTS = ClusterFacts()

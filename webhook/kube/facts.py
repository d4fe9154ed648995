"""The cluster facts admission reads (PriorityClasses, namespace labels, nodes, DRA claims): one
informer per resource, each converter keeping only the fields a rule reads, published as one
`ClusterFacts` snapshot that requests read without locking."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from kubernetes import client

from webhook.kube.client import ResourceListWatch, metadata_of
from webhook.kube.informer import Converter, Informer
from webhook.policy.facts import ClusterFacts, NodeInfo, PriorityClassInfo, node_info


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
    return node_info(raw)


def list_nodes(api: client.ApiClient) -> dict[str, NodeInfo]:
    """Every Node, listed page by page (`gpuguard nodes drivers` against a cluster)."""
    nodes = ResourceListWatch(client.CoreV1Api(api).list_node)
    found: dict[str, NodeInfo] = {}
    token: str | None = None
    while True:
        page = nodes.list_page(token)
        found.update(item for raw in page.items if (item := node_info(raw)) is not None)
        token = page.continue_token
        if token is None:
            return found


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


def fact_informers(
    api: client.ApiClient, facts: FactsPublisher, stop: threading.Event
) -> list[Informer[Any]]:
    core = client.CoreV1Api(api)
    scheduling = client.SchedulingV1Api(api)
    resource = client.ResourceV1Api(api)
    specs: list[tuple[str, Callable[..., Any], Converter[Any]]] = [
        ("priority_classes", scheduling.list_priority_class, priority_class),
        ("namespace_labels", core.list_namespace, namespace_labels),
        ("nodes", core.list_node, node),
        ("claims", resource.list_resource_claim_for_all_namespaces, resource_claim),
        (
            "claim_templates",
            resource.list_resource_claim_template_for_all_namespaces,
            resource_claim_template,
        ),
    ]
    informers: list[Informer[Any]] = []
    for name, call, convert in specs:
        informer: Informer[Any] = Informer(name, ResourceListWatch(call), convert, stop=stop)
        informer.on_snapshot(facts.publisher(name))
        informers.append(informer)
    return informers

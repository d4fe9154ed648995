"""Cluster access with the official `kubernetes` client: the caches behind ClusterFacts and the policy
ConfigMap, each kept by a list-then-watch thread (a small reflector, as client-go's informers do).

Nothing here runs on the admission path: requests read the last published snapshot. A watch that ends
is resumed; every `resync_seconds` the whole list is read again; when the API cannot be reached, the
snapshot is withdrawn (None) so that rules fall back to the policy alone and say so.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import orjson
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from webhook.facts import ClusterFacts, NodeInfo, PriorityClassInfo

Converter = Callable[[dict[str, Any]], tuple[Hashable, Any] | None]
RESYNC_SECONDS = 300
MAX_BACKOFF_SECONDS = 30.0

log = logging.getLogger("gpuguard.cluster")


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials inside a pod, else the kubeconfig (explicit, $KUBECONFIG or ~/.kube/config)."""
    configuration = client.Configuration()
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


def _metadata(raw: dict[str, Any]) -> dict[str, Any]:
    metadata = raw.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


class Reflector:
    """Mirrors one kind of object into a dict `{key: value}` and hands each new snapshot to `publish`.

    `publish(None)` means "unknown": the list could not be read. A resource the API server does not
    serve (404) is left unknown without complaint: a cluster without DRA simply has no claims.
    """

    def __init__(
        self,
        name: str,
        list_call: Callable[..., Any],
        convert: Converter,
        publish: Callable[[Mapping[Hashable, Any] | None], None],
        *,
        stop: threading.Event,
        resync_seconds: int = RESYNC_SECONDS,
        **list_args: Any,
    ) -> None:
        self.name = name
        self.list_call = list_call
        self.list_args = list_args
        self.convert = convert
        self.publish = publish
        self.stop = stop
        self.resync_seconds = resync_seconds
        self.items: dict[Hashable, Any] = {}
        self.served = True
        self.thread = threading.Thread(target=self._run, name=f"reflector-{name}", daemon=True)

    def relist(self) -> str:
        """Reads the whole list, publishes it, and returns the resourceVersion to watch from."""
        response = self.list_call(**self.list_args, _preload_content=False, _request_timeout=10)
        data = orjson.loads(response.data)
        items: dict[Hashable, Any] = {}
        for raw in data.get("items") or []:
            converted = self.convert(raw)
            if converted is not None:
                items[converted[0]] = converted[1]
        self.items = items
        self.publish(dict(items))
        return str(_metadata(data).get("resourceVersion", ""))

    def sync(self) -> bool:
        """The first list, before serving; False (and unknown facts) when the API cannot answer."""
        try:
            self.resource_version: str | None = self.relist()
            return True
        except ApiException as exc:
            self._failed(exc)
        except Exception as exc:
            self._failed(exc)
        self.resource_version = None
        return False

    def start(self) -> None:
        self.thread.start()

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, ApiException) and exc.status == 404:
            if self.served:
                log.info("%s are not served by this API server; lookups disabled", self.name)
            self.served = False
            self.publish(None)
            return
        log.warning("%s lookup failed: %s", self.name, exc)
        self.publish(None)

    def _apply(self, event: dict[str, Any]) -> bool:
        """Applies one watch event; False when the watch must restart from a fresh list."""
        raw: dict[str, Any] = event["object"] if isinstance(event.get("object"), dict) else {}
        kind = event.get("type")
        if kind == "ERROR":  # typically 410 Gone: our resourceVersion is too old
            log.info("%s watch ended: %s", self.name, raw.get("message", raw))
            self.resource_version = None
            return False
        self.resource_version = str(_metadata(raw).get("resourceVersion") or self.resource_version)
        converted = None if kind == "BOOKMARK" else self.convert(raw)
        if converted is None:
            return True
        key, value = converted
        if kind == "DELETED":
            if self.items.pop(key, None) is None:
                return True
        elif self.items.get(key) == value:
            return True  # status-only churn (node heartbeats) changes nothing a rule reads
        else:
            self.items[key] = value
        self.publish(dict(self.items))
        return True

    def _run(self) -> None:
        backoff = 1.0
        while not self.stop.is_set() and self.served:
            try:
                if self.resource_version is None:
                    self.resource_version = self.relist()
                response = self.list_call(
                    **self.list_args,
                    watch=True,
                    allow_watch_bookmarks=True,
                    resource_version=self.resource_version,
                    timeout_seconds=self.resync_seconds,
                    _preload_content=False,
                    _request_timeout=self.resync_seconds + 10,
                )
                try:
                    for line in iter_resp_lines(response):
                        if self.stop.is_set():
                            return
                        if not self._apply(orjson.loads(line)):
                            break
                finally:
                    response.release_conn()
                # The watch ran its resync period, or the server ended it: start again from a full list.
                self.resource_version = None
                backoff = 1.0
            except Exception as exc:
                self.resource_version = None
                self._failed(exc)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)


# --- converters: the raw objects' fields the rules read -------------------------------------------------


def priority_class(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    name = _metadata(raw).get("name")
    value = raw.get("value")
    if not isinstance(name, str) or not isinstance(value, int):
        return None
    preemption = raw.get("preemptionPolicy")
    return name, PriorityClassInfo(
        value=value,
        preemption_policy=preemption if isinstance(preemption, str) else None,
        global_default=raw.get("globalDefault") is True,
    )


def namespace_labels(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    metadata = _metadata(raw)
    name = metadata.get("name")
    labels = metadata.get("labels")
    return (name, dict(labels) if isinstance(labels, dict) else {}) if isinstance(name, str) else None


def node(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    metadata = _metadata(raw)
    name = metadata.get("name")
    if not isinstance(name, str):
        return None
    labels = metadata.get("labels")
    status = raw.get("status")
    capacity = status.get("capacity") if isinstance(status, dict) else None
    resources = tuple(sorted(capacity)) if isinstance(capacity, dict) else ()
    return name, NodeInfo(dict(labels) if isinstance(labels, dict) else {}, resources)


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


def resource_claim(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    metadata = _metadata(raw)
    key = (metadata.get("namespace", ""), metadata.get("name", ""))
    return key, _device_classes(raw.get("spec"))


def resource_claim_template(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    metadata = _metadata(raw)
    key = (metadata.get("namespace", ""), metadata.get("name", ""))
    spec = raw.get("spec")
    return key, _device_classes(spec.get("spec") if isinstance(spec, dict) else None)


class Facts:
    """Publishes ClusterFacts snapshots into `target` (a settable attribute holder) from many threads."""

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


def fact_reflectors(api: client.ApiClient, facts: Facts, stop: threading.Event) -> list[Reflector]:
    core = client.CoreV1Api(api)
    scheduling = client.SchedulingV1Api(api)
    resource = client.ResourceV1Api(api)
    specs: list[tuple[str, Callable[..., Any], Converter]] = [
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
    return [Reflector(name, call, convert, facts.publisher(name), stop=stop) for name, call, convert in specs]


class PolicyConfigMap:
    """Watches one ConfigMap key and reports the text (None when the ConfigMap or key is gone)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        *,
        key: str,
        offer: Callable[[str | None], object],
        stop: threading.Event,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.key = key
        self.offer = offer
        self.uid = ""
        self._last: str | bool | None = False  # False: nothing seen yet
        self.reflector = Reflector(
            "policy ConfigMap",
            self.core.list_namespaced_config_map,
            self._convert,
            self._publish,
            stop=stop,
            namespace=namespace,
            field_selector=f"metadata.name={name}",
        )

    def _convert(self, raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
        self.uid = str(_metadata(raw).get("uid", self.uid))
        data = raw.get("data")
        text = data.get(self.key) if isinstance(data, dict) else None
        return self.name, text if isinstance(text, str) else None

    def _publish(self, snapshot: Mapping[Hashable, Any] | None) -> None:
        if snapshot is None:
            return  # the API is unreachable: keep the active policy, the reflector says why
        text = snapshot.get(self.name)
        if text != self._last:
            self._last = text
            self.offer(text)

    def event(self, reason: str, message: str, *, warning: bool) -> None:
        """Records a Kubernetes Event on the ConfigMap, so `kubectl describe configmap` shows it."""
        now = datetime.datetime.now(datetime.UTC)
        host = socket.gethostname()
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}.", namespace=self.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="ConfigMap", namespace=self.namespace, name=self.name, uid=self.uid
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=client.V1EventSource(component="gpuguard", host=host),
            reporting_component="gpuguard",
            reporting_instance=host,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self.core.create_namespaced_event(self.namespace, body)
        except Exception as exc:
            log.warning(
                "could not record event %s on ConfigMap %s/%s: %s", reason, self.namespace, self.name, exc
            )

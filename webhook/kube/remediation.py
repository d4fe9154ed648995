"""The API calls the controllers and the node agent make: patches of a Node or a Pod's status at a known
resourceVersion, evictions, and the ConfigMap that keeps the circuit breaker's state. Raw JSON in and
out.

Every write goes through a `Fence`, checked just before the request is sent: the controllers give
theirs the leader elector's `write_window`, so a replica that has not renewed its Lease within the
renew deadline sends nothing (NotLeaderError, which drops the reconcile), and what it sends gives up
before a standby may take over. Checked here, once, rather than in each controller, no write is
missed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube.client import REQUEST_TIMEOUT_SECONDS, ResourceListWatch, collection, raw_json
from webhook.kube.controller import TerminalError
from webhook.policy import nativesync
from webhook.policy.health import fences

FIELD_MANAGER = "gpuguard"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# DRA's API group at the version 1.37 serves ResourceSlices, ResourceClaims and DeviceTaintRules at.
RESOURCE_API = "resource.k8s.io/v1"


class ConflictError(Exception):
    """The object changed since it was read (409): read it again and decide again."""


class NotFoundError(Exception):
    """The object is gone (404)."""


class NotLeaderError(TerminalError):
    """This replica may no longer know it holds the Lease: the write was not sent, the reconcile drops."""


# How many seconds a write may take from now; 0 or less when it must not be sent at all.
WriteWindow = Callable[[], float]


class Fence:
    def __init__(self, window: WriteWindow) -> None:
        self.window = window

    def timeout(self) -> float:
        """The request timeout for a write about to go (raises NotLeaderError when it must not)."""
        left = self.window()
        if left <= 0:
            raise NotLeaderError("the Lease was not renewed within the renew deadline: not writing")
        return min(left, REQUEST_TIMEOUT_SECONDS)


# For writers that need no Lease: the node agent (one per node) and the CLI.
UNFENCED = Fence(lambda: REQUEST_TIMEOUT_SECONDS)


def _translated(exc: ApiException) -> Exception:
    if exc.status == 409:
        return ConflictError(str(exc.reason))
    if exc.status == 404:
        return NotFoundError(str(exc.reason))
    return exc


class _Writer:
    def __init__(self, api: client.ApiClient, fence: Fence = UNFENCED) -> None:
        self.core = client.CoreV1Api(api)
        self.fence = fence

    def _call(self, call: Any, name: str, patch: dict[str, Any], content_type: str) -> dict[str, Any]:
        try:
            response = call(
                name,
                patch,
                field_manager=FIELD_MANAGER,
                _content_type=content_type,
                _preload_content=False,
                _request_timeout=self.fence.timeout(),
            )
        except ApiException as exc:
            raise _translated(exc) from exc
        result: dict[str, Any] = raw_json(response)
        return result


class NodeWriter(_Writer):
    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the Node (metadata and spec); the patch carries the resourceVersion."""
        return self._call(self.core.patch_node, name, patch, MERGE_PATCH)

    def patch_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of the Node's status: conditions merge by type, so others' stay."""
        return self._call(self.core.patch_node_status, name, patch, STRATEGIC_MERGE_PATCH)


class PodStatusWriter(_Writer):
    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of the Pod's status: conditions merge by type, so the kubelet's stay."""

        def call(pod: str, body: dict[str, Any], **options: Any) -> Any:
            return self.core.patch_namespaced_pod_status(pod, namespace, body, **options)

        return self._call(call, name, patch, STRATEGIC_MERGE_PATCH)


EvictionResult = Literal["evicted", "blocked", "gone"]


@dataclass(frozen=True)
class EvictionOutcome:
    result: EvictionResult
    message: str = ""


class Evictor(_Writer):
    """The Eviction API: the API server checks PodDisruptionBudgets and adds DisruptionTarget."""

    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            # Only this pod: a StatefulSet's replacement of the same name is never evicted by mistake.
            "deleteOptions": {"preconditions": {"uid": uid}} if uid else {},
        }
        try:
            self.core.create_namespaced_pod_eviction(
                name,
                namespace,
                client.V1Eviction.model_validate(body),
                _preload_content=False,
                _request_timeout=self.fence.timeout(),
            )
        except ApiException as exc:
            if exc.status == 429:
                return EvictionOutcome("blocked", _status_message(exc))
            if exc.status in (404, 409):
                # 409: the uid precondition failed, the pod of that name is another one now.
                return EvictionOutcome("gone", _status_message(exc))
            raise
        return EvictionOutcome("evicted")


class DeviceTaintRuleWriter:
    """gpuguard's DeviceTaintRules: created, their effect patched at the resourceVersion read, deleted
    with that version as a precondition (a rule changed meanwhile is decided on again)."""

    PATH = f"/apis/{RESOURCE_API}/devicetaintrules"

    def __init__(self, api: client.ApiClient, fence: Fence = UNFENCED) -> None:
        self.api = api
        self.fence = fence

    def create(self, body: dict[str, Any]) -> None:
        self._send("POST", self.PATH, body, "application/json")

    def patch_effect(self, name: str, resource_version: str, effect: str) -> None:
        patch = {"metadata": {"resourceVersion": resource_version}, "spec": {"taint": {"effect": effect}}}
        self._send("PATCH", f"{self.PATH}/{name}", patch, MERGE_PATCH)

    def delete(self, name: str, resource_version: str) -> None:
        options = {"preconditions": {"resourceVersion": resource_version}}
        self._send("DELETE", f"{self.PATH}/{name}", options, "application/json")

    def _send(self, method: str, path: str, body: dict[str, Any], content_type: str) -> None:
        _send(self.api, self.fence, method, path, body, content_type)


class InvalidObjectError(TerminalError):
    """The API server refused the object as invalid (422): sending it again cannot help."""


class NativePolicyWriter:
    """gpuguard's own admission policies and bindings (webhook.policy.nativesync): created, replaced
    whole at the resourceVersion read, deleted with that version as a precondition."""

    GROUP = "/apis/admissionregistration.k8s.io/v1"

    def __init__(self, api: client.ApiClient, fence: Fence = UNFENCED) -> None:
        self.api = api
        self.fence = fence

    def create(self, resource: str, body: dict[str, Any]) -> None:
        self._send("POST", f"{self.GROUP}/{resource}", body)

    def replace(self, resource: str, name: str, body: dict[str, Any]) -> None:
        """`body` carries the resourceVersion read: ConflictError when the object changed since."""
        self._send("PUT", f"{self.GROUP}/{resource}/{name}", body)

    def delete(self, resource: str, name: str, resource_version: str) -> None:
        options = {"preconditions": {"resourceVersion": resource_version}}
        self._send("DELETE", f"{self.GROUP}/{resource}/{name}", options)

    def _send(self, method: str, path: str, body: dict[str, Any]) -> None:
        try:
            _send(self.api, self.fence, method, path, body, "application/json")
        except ApiException as exc:
            if exc.status == 422:
                raise InvalidObjectError(_status_message(exc)) from exc
            raise


_CONFIGURATION_RESOURCES = {
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
}


class WebhookConfigurationWriter:
    """gpuguard's own Mutating- and ValidatingWebhookConfiguration `name`: read, and JSON-patched with a
    test of the resourceVersion read (webhook.policy.nativenarrow.condition_patch)."""

    def __init__(self, api: client.ApiClient, name: str, fence: Fence = UNFENCED) -> None:
        self.api = api
        self.name = name
        self.fence = fence

    def _path(self, kind: str) -> str:
        return f"{NativePolicyWriter.GROUP}/{_CONFIGURATION_RESOURCES[kind]}/{self.name}"

    def read(self, kind: str) -> dict[str, Any] | None:
        request = self.api.param_serialize(
            "GET",
            self._path(kind),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        data = response.read()
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=data, data=None)
        found: dict[str, Any] = orjson.loads(data)
        return found

    def patch(self, kind: str, operations: list[dict[str, Any]]) -> None:
        """`operations` start with a test of the resourceVersion read: ConflictError when it changed since,
        InvalidObjectError when the API server refuses the patched configuration."""
        try:
            _send(self.api, self.fence, "PATCH", self._path(kind), operations, "application/json-patch+json")
        except ApiException as exc:
            if exc.status != 422:
                raise
            # A failed test and an invalid result both answer 422: the version read tells them apart.
            current = self.read(kind)
            if current is None or current["metadata"]["resourceVersion"] != operations[0]["value"]:
                raise ConflictError(f"{kind} {self.name} changed since it was read") from exc
            raise InvalidObjectError(_status_message(exc)) from exc


class NamespaceOwner:
    """The ownerReference to the controllers' Namespace, read once (a Namespace's uid never changes)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self._reference: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any]:
        if self._reference is None:
            response = self.core.read_namespace(
                self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            uid = str(raw_json(response)["metadata"]["uid"])
            self._reference = nativesync.namespace_owner(self.namespace, uid)
        return self._reference


def _send(api: client.ApiClient, fence: Fence, method: str, path: str, body: Any, content_type: str) -> None:
    """A raw write through the fence; ConflictError, NotFoundError or the ApiException on failure."""
    query = [("fieldManager", FIELD_MANAGER)] if method != "DELETE" else []
    request = api.param_serialize(
        method,
        path,
        query_params=query,
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*request, _request_timeout=fence.timeout())
    data = response.read()
    if not 200 <= response.status <= 299:
        raise _translated(ApiException.from_response(http_resp=response, body=data, data=None))


def _status_message(exc: ApiException) -> str:
    """The Status message the API server sent (for a 429: which budget, how many pods it needs)."""
    try:
        status = orjson.loads(exc.body or b"{}")
    except orjson.JSONDecodeError:
        return str(exc.reason)
    return str(status.get("message") or exc.reason) if isinstance(status, dict) else str(exc.reason)


@dataclass(frozen=True)
class StoredState:
    data: dict[str, str]
    resource_version: str | None


class ConfigMapStore:
    """One ConfigMap: read, and written whole at the version read (the circuit breaker's state)."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, fence: Fence = UNFENCED) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.fence = fence

    def read(self) -> StoredState:
        try:
            response = self.core.read_namespaced_config_map(
                self.name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                return StoredState({}, None)
            raise
        raw = raw_json(response)
        return StoredState(dict(raw.get("data") or {}), str(raw["metadata"]["resourceVersion"]))

    def write(self, data: dict[str, str], read: StoredState) -> None:
        """Creates or replaces the ConfigMap; ConflictError when it changed since `read`."""
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": {"app.kubernetes.io/name": "gpuguard-controllers"},
        }
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
        options: dict[str, Any] = {
            "field_manager": FIELD_MANAGER,
            "_preload_content": False,
            "_request_timeout": self.fence.timeout(),
        }
        try:
            if read.resource_version is None:
                self.core.create_namespaced_config_map(
                    self.namespace, client.V1ConfigMap.model_validate(body), **options
                )
            else:
                metadata["resourceVersion"] = read.resource_version
                self.core.replace_namespaced_config_map(
                    self.name, self.namespace, client.V1ConfigMap.model_validate(body), **options
                )
        except ApiException as exc:
            raise _translated(exc) from exc


# --- what the controllers' informers list and watch -----------------------------------------------------


def nodes(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(client.CoreV1Api(api).list_node)


def pods(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(client.CoreV1Api(api).list_pod_for_all_namespaces)


def pods_on_node(api: client.ApiClient, node: str) -> ResourceListWatch:
    """The pods bound to one node (the node agent's view: the kubelet's own field selector)."""
    return ResourceListWatch(
        client.CoreV1Api(api).list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}"
    )


def resource_slices(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(collection(api, f"/apis/{RESOURCE_API}/resourceslices"))


def slices_on_node(api: client.ApiClient, node: str) -> ResourceListWatch:
    """The ResourceSlices of one node's devices (the node agent's view; the API server selects
    ResourceSlices by spec.nodeName, as the kubelet's own list does)."""
    return ResourceListWatch(
        collection(api, f"/apis/{RESOURCE_API}/resourceslices"), field_selector=f"spec.nodeName={node}"
    )


def resource_claims(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(collection(api, f"/apis/{RESOURCE_API}/resourceclaims"))


def own_device_taint_rules(api: client.ApiClient) -> ResourceListWatch:
    """gpuguard's DeviceTaintRules only (by label): it never reads, so never touches, anyone else's."""
    return ResourceListWatch(
        collection(api, DeviceTaintRuleWriter.PATH),
        label_selector=f"{fences.MANAGED_BY_LABEL}={fences.MANAGED_BY}",
    )


def own_native_policies(api: client.ApiClient, resource: str) -> ResourceListWatch:
    """gpuguard's own objects of one admission policy resource (by its owner label): RBAC cannot limit
    the controllers to them, so they list only these and never read, so never touch, anyone else's."""
    return ResourceListWatch(
        collection(api, f"{NativePolicyWriter.GROUP}/{resource}"),
        label_selector=f"{nativesync.OWNER_LABEL}={nativesync.OWNER}",
    )


def webhook_configuration(api: client.ApiClient, kind: str, name: str) -> ResourceListWatch:
    """gpuguard's own webhook configuration of `kind`, by field selector (RBAC limits the controllers to
    its name)."""
    return ResourceListWatch(
        collection(api, f"{NativePolicyWriter.GROUP}/{_CONFIGURATION_RESOURCES[kind]}"),
        field_selector=f"metadata.name={name}",
    )


def disruption_budgets(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(client.PolicyV1Api(api).list_pod_disruption_budget_for_all_namespaces)


def namespaces(api: client.ApiClient) -> ResourceListWatch:
    return ResourceListWatch(client.CoreV1Api(api).list_namespace)


def config_map(api: client.ApiClient, namespace: str, name: str) -> ResourceListWatch:
    """One ConfigMap, by field selector (what RBAC limited to one resourceName allows)."""
    return ResourceListWatch(
        client.CoreV1Api(api).list_namespaced_config_map,
        namespace=namespace,
        field_selector=f"metadata.name={name}",
    )

"""The API side of gpuguard's certificates: the Secret that holds them and the caBundle of both webhook
configurations. Plain bytes in and out; what the bytes mean is `webhook.certs`' business."""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube.client import REQUEST_TIMEOUT_SECONDS, ResourceListWatch, raw_json

FIELD_MANAGER = "gpuguard"
CONFIGURATION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")

log = logging.getLogger("gpuguard.certificates")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class StoredSecret:
    """The Secret as read: `data` None when it is absent (`resource_version` None) or not decodable."""

    data: dict[str, bytes] | None
    resource_version: str | None
    problem: str | None = None
    # Kept on update: the type is immutable, and labels or annotations others added are theirs.
    secret_type: str = "kubernetes.io/tls"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


class SecretStore:
    """Reads and writes the Secret; a write loses (returns False) when the Secret changed since `read`."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name

    def list_watch(self) -> ResourceListWatch:
        return ResourceListWatch(
            self.core.list_namespaced_secret,
            namespace=self.namespace,
            field_selector=f"metadata.name={self.name}",
        )

    def read(self) -> StoredSecret:
        try:
            response = self.core.read_namespaced_secret(
                self.name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                return StoredSecret(None, None)
            raise
        raw = raw_json(response)
        metadata = raw["metadata"]
        common: dict[str, Any] = {
            "resource_version": str(metadata["resourceVersion"]),
            "secret_type": raw.get("type") or "Opaque",
            "labels": metadata.get("labels") or {},
            "annotations": metadata.get("annotations") or {},
        }
        try:
            data = {key: base64.b64decode(value) for key, value in (raw.get("data") or {}).items()}
        except ValueError as exc:
            return StoredSecret(None, problem=str(exc), **common)
        return StoredSecret(data, **common)

    def write(self, data: Mapping[str, bytes], annotations: Mapping[str, str], read: StoredSecret) -> bool:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            # kubernetes.io/tls (new Secrets): tools recognise it; ca.crt and ca.key ride along as extra keys.
            "type": read.secret_type,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {
                    **read.labels,
                    "app.kubernetes.io/name": "gpuguard",
                    "app.kubernetes.io/managed-by": "gpuguard",
                },
                "annotations": {**read.annotations, **annotations},
            },
            "data": {key: _b64(value) for key, value in data.items()},
        }
        try:
            if read.resource_version is None:
                self.core.create_namespaced_secret(
                    self.namespace,
                    client.V1Secret.model_validate(body),
                    field_manager=FIELD_MANAGER,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
            else:
                body["metadata"]["resourceVersion"] = read.resource_version
                self.core.replace_namespaced_secret(
                    self.name,
                    self.namespace,
                    client.V1Secret.model_validate(body),
                    field_manager=FIELD_MANAGER,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
        except ApiException as exc:
            # 409: another replica created or changed it first. 404: it was deleted since our read.
            if exc.status in (404, 409):
                return False
            raise
        return True


class WebhookConfigurations:
    """The caBundle of every webhook in the Mutating- and ValidatingWebhookConfiguration `name`."""

    def __init__(self, api: client.ApiClient, name: str) -> None:
        registration = client.AdmissionregistrationV1Api(api)
        self.name = name
        self.calls = {
            "MutatingWebhookConfiguration": (
                registration.read_mutating_webhook_configuration,
                registration.patch_mutating_webhook_configuration,
            ),
            "ValidatingWebhookConfiguration": (
                registration.read_validating_webhook_configuration,
                registration.patch_validating_webhook_configuration,
            ),
        }
        self._missing: set[str] = set()

    def sync(self, bundle: bytes) -> bool:
        """Patches every caBundle that differs from `bundle`. True when all of them already carried it
        (the API servers may still be catching up with a patch made now)."""
        encoded = _b64(bundle)
        in_place = True
        for kind in CONFIGURATION_KINDS:
            read, patch = self.calls[kind]
            try:
                response = read(self.name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                if kind not in self._missing:
                    log.warning("%s %s does not exist: gpuguard is not called through it", kind, self.name)
                    self._missing.add(kind)
                continue
            self._missing.discard(kind)
            operations = ca_bundle_patch(raw_json(response), encoded)
            if operations:
                in_place = False
                # JSON Patch with a test of each webhook's name: a list reordered since the read fails
                # the patch (and the next pass retries) instead of writing into the wrong webhook.
                patch(
                    self.name,
                    operations,
                    field_manager=FIELD_MANAGER,
                    _content_type="application/json-patch+json",
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
                log.info("caBundle of %s %s updated", kind, self.name)
        return in_place


def ca_bundle_patch(configuration: Mapping[str, Any], encoded: str) -> list[dict[str, Any]]:
    operations: list[dict[str, Any]] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        if (webhook.get("clientConfig") or {}).get("caBundle") == encoded:
            continue
        operations += [
            {"op": "test", "path": f"/webhooks/{index}/name", "value": webhook["name"]},
            {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded},
        ]
    return operations

"""Certificates in the cluster: one CA and serving certificate shared by every replica through a Secret,
trusted through the caBundle of both webhook configurations, rotated before expiry, and served without a
restart.

The Secret is the only shared state. Every replica runs the same loop: read the Secret, serve its
certificate, keep both caBundles equal to its CA bundle, and take the next step `tls.plan` names. A step
is a write with optimistic concurrency (create-if-absent, or update at the resourceVersion read): when
replicas race, one write lands and the others re-read and adopt it, so they never hold different CAs.

Error channels: API errors are logged and retried with backoff while the replica keeps serving what it
has; /readyz says whether the served certificate came from the Secret and is valid. The caBundle is only
ever patched, never created: a deleted webhook configuration (the emergency disable) stays deleted.
"""

from __future__ import annotations

import base64
import datetime
import logging
import ssl
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import orjson
from cryptography import x509
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook import certfiles, cluster, tls

log = logging.getLogger("gpuguard.certificates")

# Drift (an edited caBundle, a missed watch event) is repaired within this, as are time-based steps.
RECONCILE_SECONDS = 60.0
MAX_BACKOFF_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 10
PHASE_ANNOTATION = "gpuguard.io/certificate-phase"
EXPIRY_ANNOTATION = "gpuguard.io/certificate-not-after"
FIELD_MANAGER = "gpuguard"
CONFIGURATION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


@dataclass(frozen=True)
class Settings:
    namespace: str
    secret: str
    # The serving certificate's names; the first is its common name.
    names: tuple[str, ...]
    # The Mutating- and ValidatingWebhookConfiguration of this name get the caBundle; None: neither.
    webhook_config: str | None
    # Where the serving files are written (an emptyDir in a pod: the root filesystem is read-only).
    cert_dir: Path
    schedule: tls.Schedule = field(default_factory=tls.Schedule)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _json(response: object) -> Any:
    """The body of a call made with `_preload_content=False`: raw JSON, whatever the client's annotation
    says. Read raw so that nothing the client's models do not know (a newer server's fields) is lost."""
    return orjson.loads(cast(Any, response).data)


@dataclass(frozen=True)
class Stored:
    """The Secret as read: `material` None when it is absent (`resource_version` None) or unusable."""

    material: tls.Material | None
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

    def read(self) -> Stored:
        try:
            response = self.core.read_namespaced_secret(
                self.name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status == 404:
                return Stored(None, None)
            raise
        raw = _json(response)
        metadata = raw["metadata"]
        found = Stored(
            None,
            str(metadata["resourceVersion"]),
            secret_type=raw.get("type") or "Opaque",
            labels=metadata.get("labels") or {},
            annotations=metadata.get("annotations") or {},
        )
        try:
            data = {key: base64.b64decode(value) for key, value in (raw.get("data") or {}).items()}
            return replace(found, material=tls.Material.from_secret_data(data))
        except (ValueError, tls.InvalidMaterialError) as exc:
            return replace(found, problem=str(exc))

    def write(self, material: tls.Material, read: Stored) -> bool:
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
                # For people: `kubectl get secret -o yaml` shows where a rotation stands.
                "annotations": {
                    **read.annotations,
                    PHASE_ANNOTATION: material.phase,
                    EXPIRY_ANNOTATION: material.leaf.not_valid_after_utc.isoformat(),
                },
            },
            "data": {key: _b64(value) for key, value in material.secret_data().items()},
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
            operations = _ca_bundle_patch(_json(response), encoded)
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


def _ca_bundle_patch(configuration: Mapping[str, Any], encoded: str) -> list[dict[str, Any]]:
    operations: list[dict[str, Any]] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        if (webhook.get("clientConfig") or {}).get("caBundle") == encoded:
            continue
        operations += [
            {"op": "test", "path": f"/webhooks/{index}/name", "value": webhook["name"]},
            {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded},
        ]
    return operations


class ServingCertificate:
    """What the TLS listener presents, switchable while it runs.

    uvicorn's SSLContext is made once, before the listener opens. Its SNI callback, called by OpenSSL
    for every handshake whether or not the client sent a server name, moves the connection to the
    context of the current certificate. Each certificate gets a new context, fully loaded before it is
    published by one reference assignment: a handshake sees the old or the new one, never half of
    either, and established connections (requests in flight) keep the certificate they started with.
    The switched-to context only supplies the certificate and key; protocol settings stay uvicorn's.
    """

    def __init__(self, cert_dir: Path) -> None:
        self.cert_dir = cert_dir
        self._context: ssl.SSLContext | None = None
        self._leaf: x509.Certificate | None = None

    def placeholder(self, names: tuple[str, ...]) -> certfiles.ServingFiles:
        """A throwaway self-issued certificate for the listener to start with: /healthz answers while
        the real one is fetched, and /readyz says not ready until then."""
        ca = tls.new_ca("gpuguard-placeholder")
        return tls.write_serving_files(self.cert_dir, ca.cert_pem, tls.issue(ca, names[0], sans=names))

    def attach(self, context: ssl.SSLContext) -> None:
        context.sni_callback = self._select

    def _select(self, connection: ssl.SSLObject | ssl.SSLSocket, _: str | None, __: ssl.SSLContext) -> None:
        current = self._context
        if current is not None:
            connection.context = current

    def use(self, material: tls.Material) -> bool:
        """Serves `material`'s certificate from the next handshake on; False when it already is."""
        if self._leaf == material.leaf:
            return False
        files = tls.write_serving_files(self.cert_dir, material.ca_bundle, material.serving)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(files.cert, files.key)
        self._context, self._leaf = context, material.leaf
        return True

    def valid(self) -> bool:
        """A certificate from the Secret is served and within its validity (what /readyz requires)."""
        leaf = self._leaf
        return leaf is not None and tls.is_current(leaf, _now())


class CertificateManager:
    """One replica's side of the lifecycle: `prepare` before the listener opens, `attach` its context,
    then `start` the loop (a thread) that bootstraps, serves, reconciles and rotates."""

    def __init__(self, api: client.ApiClient, settings: Settings, *, stop: threading.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.store = SecretStore(api, settings.namespace, settings.secret)
        self.configurations = (
            WebhookConfigurations(api, settings.webhook_config) if settings.webhook_config else None
        )
        self.serving = ServingCertificate(settings.cert_dir)
        # Wakes the loop: set on every Secret event, so a change made by another replica (or by
        # `gpuguard certs rotate`) is served within moments rather than at the next reconcile.
        self._wake = threading.Event()
        self._watch = cluster.Reflector(
            "TLS Secret",
            self.store.core.list_namespaced_secret,
            _resource_version,
            lambda _: self._wake.set(),
            stop=stop,
            namespace=settings.namespace,
            field_selector=f"metadata.name={settings.secret}",
        )
        # When this replica first saw the webhook configurations carry a bundle: the earliest moment
        # the API servers could have it, hence a safe start for the wait before serving a new CA.
        self._bundle_trusted: tuple[bytes, datetime.datetime] | None = None
        self.thread = threading.Thread(target=self._run, name="certificates", daemon=True)

    def prepare(self) -> certfiles.ServingFiles:
        return self.serving.placeholder(self.settings.names)

    def start(self) -> None:
        self._watch.sync()
        self._watch.start()
        self.thread.start()

    def _run(self) -> None:
        backoff = 1.0
        while not self.stop.is_set():
            self._wake.clear()
            try:
                wait = max((self.step(_now()) - _now()).total_seconds(), 0.0)
                backoff = 1.0
            except Exception as exc:  # the API may be away for a while; keep serving what we have
                log.warning("certificate reconcile failed: %s", exc)
                wait, backoff = backoff, min(backoff * 2, MAX_BACKOFF_SECONDS)
            if wait > 0:
                self._wake.wait(min(wait, RECONCILE_SECONDS))

    def step(self, now: datetime.datetime) -> datetime.datetime:
        """One pass: read, serve, reconcile, maybe advance. Returns when the next pass is due."""
        settings = self.settings
        stored = self.store.read()
        if stored.problem is not None:
            log.warning(
                "Secret %s/%s is unusable (%s): replacing it",
                settings.namespace,
                settings.secret,
                stored.problem,
            )
        material = stored.material
        if material is not None:
            if self.serving.use(material):
                log.info(
                    "serving certificate %x (valid until %s, phase %s)",
                    material.leaf.serial_number,
                    material.leaf.not_valid_after_utc.isoformat(),
                    material.phase,
                )
            self._reconcile_bundle(material.ca_bundle, now)
        plan = tls.plan(material, now=now, names=settings.names, schedule=settings.schedule)
        if plan.action is None:
            return plan.due
        if plan.action == "serve-new-ca":
            # Only once the API servers have trusted the new CA for a full delay, as far as this
            # replica can tell: a caBundle patched late postpones the switch instead of breaking calls.
            trusted = self._bundle_trusted
            ready_at = trusted[1] + settings.schedule.rotation_delay if trusted else now
            if trusted is None or now < ready_at:
                return max(ready_at, now + datetime.timedelta(seconds=1))
        updated = tls.advance(
            material, plan.action, names=settings.names, schedule=settings.schedule, now=now
        )
        if self.store.write(updated, stored):
            log.info("certificates: %s (%s)", plan.action, plan.reason)
        # Ours or a competitor's: read it back and serve what landed.
        return now

    def _reconcile_bundle(self, bundle: bytes, now: datetime.datetime) -> None:
        in_place = self.configurations.sync(bundle) if self.configurations is not None else True
        # A bundle new to this replica, or one that had to be patched (again), counts from now: the
        # API servers have had it for no longer than that.
        if not in_place or self._bundle_trusted is None or self._bundle_trusted[0] != bundle:
            self._bundle_trusted = (bundle, now)


def _resource_version(raw: dict[str, Any]) -> tuple[Hashable, Any] | None:
    metadata = raw.get("metadata") or {}
    return metadata.get("name"), metadata.get("resourceVersion")


def begin_rotation(
    api: client.ApiClient, *, namespace: str, name: str, schedule: tls.Schedule
) -> tls.Material:
    """Step 1 of a rotation, now (`gpuguard certs rotate`): the running replicas carry out the rest.
    Raises tls.InvalidMaterialError when there is nothing to rotate or a rotation is under way, and
    RuntimeError when the Secret changed while we wrote (run it again)."""
    store = SecretStore(api, namespace, name)
    stored = store.read()
    if stored.material is None:
        raise tls.InvalidMaterialError(
            f"Secret {namespace}/{name}: {stored.problem or 'not found'}; gpuguard creates it on start"
        )
    rotated = tls.begin_rotation(stored.material, schedule=schedule, now=_now())
    if not store.write(rotated, stored):
        raise RuntimeError(f"Secret {namespace}/{name} changed while rotating; run the command again")
    return rotated

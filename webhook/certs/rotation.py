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

import datetime
import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from webhook.certs import tls
from webhook.certs.files import ServingFiles
from webhook.certs.serving import ServingCertificate
from webhook.kube.certificates import SecretStore, StoredSecret, WebhookConfigurations
from webhook.kube.informer import Informer

log = logging.getLogger("gpuguard.certificates")

RECONCILE_SECONDS = 60.0
MAX_BACKOFF_SECONDS = 30.0
PHASE_ANNOTATION = "gpuguard.io/certificate-phase"
EXPIRY_ANNOTATION = "gpuguard.io/certificate-not-after"


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


@dataclass(frozen=True)
class Stored:
    """The Secret's certificates as read: `material` None when absent or unusable (`problem` says why)."""

    material: tls.Material | None
    problem: str | None
    secret: StoredSecret


def read_certificates(store: SecretStore) -> Stored:
    secret = store.read()
    if secret.data is None:
        return Stored(None, secret.problem, secret)
    try:
        return Stored(tls.Material.from_secret_data(secret.data), None, secret)
    except (ValueError, tls.InvalidMaterialError) as exc:
        return Stored(None, str(exc), secret)


def write_certificates(store: SecretStore, material: tls.Material, read: Stored) -> bool:
    # For people: `kubectl get secret -o yaml` shows where a rotation stands.
    annotations = {
        PHASE_ANNOTATION: material.phase,
        EXPIRY_ANNOTATION: material.leaf.not_valid_after_utc.isoformat(),
    }
    return store.write(material.secret_data(), annotations, read.secret)


class CertificateManager:
    """One replica's side of the lifecycle: `prepare` before the listener opens, `attach` its context,
    then `start` the loop (a thread) that bootstraps, serves, reconciles and rotates."""

    def __init__(
        self,
        settings: Settings,
        store: SecretStore,
        configurations: WebhookConfigurations | None,
        *,
        stop: threading.Event,
    ) -> None:
        self.settings = settings
        self.stop = stop
        self.store = store
        self.configurations = configurations
        self.serving = ServingCertificate(settings.cert_dir)
        # Wakes the loop: set on every Secret event, so a change made by another replica (or by
        # `gpuguard certs rotate`) is served within moments rather than at the next reconcile.
        self._wake = threading.Event()
        self._watch: Informer[Any] = Informer(
            "TLS Secret", self.store.list_watch(), _resource_version, stop=stop
        )
        self._watch.on_change(lambda _: self._wake.set())
        # When this replica first saw the webhook configurations carry a bundle: the earliest moment
        # the API servers could have it, hence a safe start for the wait before serving a new CA.
        self._bundle_trusted: tuple[bytes, datetime.datetime] | None = None
        self.thread = threading.Thread(target=self._run, name="certificates", daemon=True)

    def prepare(self) -> ServingFiles:
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
        stored = read_certificates(self.store)
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
        if write_certificates(self.store, updated, stored):
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


def begin_rotation(store: SecretStore, *, schedule: tls.Schedule) -> tls.Material:
    """Step 1 of a rotation, now (`gpuguard certs rotate`): the running replicas carry out the rest.
    Raises tls.InvalidMaterialError when there is nothing to rotate or a rotation is under way, and
    RuntimeError when the Secret changed while we wrote (run it again)."""
    namespace, name = store.namespace, store.name
    stored = read_certificates(store)
    if stored.material is None:
        raise tls.InvalidMaterialError(
            f"Secret {namespace}/{name}: {stored.problem or 'not found'}; gpuguard creates it on start"
        )
    rotated = tls.begin_rotation(stored.material, schedule=schedule, now=_now())
    if not write_certificates(store, rotated, stored):
        raise RuntimeError(f"Secret {namespace}/{name} changed while rotating; run the command again")
    return rotated

"""Certificates in the cluster (certs/rotation.py): what a replica's pass does with the Secret and the
caBundles, and `gpuguard certs rotate`'s first step.

tls.plan's schedule has its own tests (test_tls.py); these drive `CertificateManager.step` at chosen
times against the in-process API server (apiserver.py) through the real client: the first replica
creates the Secret and every replica serves what landed, the caBundles follow the Secret, a new CA is
served only after the API servers have trusted it, as far as this replica saw, for a full delay, and an
unusable Secret is replaced. The loop's thread is not started: each pass is called.
"""

from __future__ import annotations

import base64
import datetime
import threading
from pathlib import Path

import pytest

from tests.harness.apiserver import FakeApiServer
from webhook.certs import tls
from webhook.certs.rotation import (
    EXPIRY_ANNOTATION,
    PHASE_ANNOTATION,
    CertificateManager,
    Settings,
    begin_rotation,
    read_certificates,
)
from webhook.kube.certificates import SecretStore, WebhookConfigurations

NAMESPACE, NAME = "gpuguard", "gpuguard-tls"
SECRET = f"/api/v1/namespaces/{NAMESPACE}/secrets/{NAME}"
REGISTRATION = "/apis/admissionregistration.k8s.io/v1"
MUTATING = f"{REGISTRATION}/mutatingwebhookconfigurations/gpuguard"
VALIDATING = f"{REGISTRATION}/validatingwebhookconfigurations/gpuguard"
NAMES = ("gpuguard.gpuguard.svc", "gpuguard.gpuguard.svc.cluster.local")
DELAY = datetime.timedelta(minutes=10)
SCHEDULE = tls.Schedule(rotation_delay=DELAY)


@pytest.fixture
def server() -> FakeApiServer:
    server = FakeApiServer()
    for path, kind in (
        (MUTATING, "MutatingWebhookConfiguration"),
        (VALIDATING, "ValidatingWebhookConfiguration"),
    ):
        webhooks = [
            {"name": "pods.gpuguard.io", "clientConfig": {}},
            {"name": "jobs.gpuguard.io", "clientConfig": {}},
        ]
        server.put(path, {"kind": kind, "metadata": {"name": "gpuguard"}, "webhooks": webhooks})
    return server


def replica(server: FakeApiServer, cert_dir: Path, stop: threading.Event) -> CertificateManager:
    api = server.api_client()
    settings = Settings(NAMESPACE, NAME, NAMES, "gpuguard", cert_dir, SCHEDULE)
    return CertificateManager(
        settings, SecretStore(api, NAMESPACE, NAME), WebhookConfigurations(api, "gpuguard"), stop=stop
    )


def settled(
    server: FakeApiServer, cert_dir: Path, stop: threading.Event, now: datetime.datetime
) -> CertificateManager:
    """A replica that created the Secret, then served it and made its CA trusted."""
    manager = replica(server, cert_dir, stop)
    manager.step(now)
    manager.step(now)
    return manager


def stored(server: FakeApiServer) -> tls.Material:
    material = read_certificates(SecretStore(server.api_client(), NAMESPACE, NAME)).material
    assert material is not None
    return material


def served(cert_dir: Path) -> bytes:
    return (cert_dir / "tls.crt").read_bytes()


def ca_bundles(server: FakeApiServer) -> set[bytes]:
    return {
        base64.b64decode(webhook["clientConfig"]["caBundle"])
        for path in (MUTATING, VALIDATING)
        for webhook in server.objects[path]["webhooks"]
    }


def writes(server: FakeApiServer) -> int:
    return len(server.sent("POST")) + len(server.sent("PUT"))


def test_the_first_pass_creates_the_secret_and_the_next_serves_it_and_makes_its_ca_trusted(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    manager = replica(server, tmp_path, stop)
    now = datetime.datetime.now(datetime.UTC)
    assert manager.step(now) == now  # written: read it back at once
    material = stored(server)
    annotations = server.objects[SECRET]["metadata"]["annotations"]
    assert annotations[PHASE_ANNOTATION] == "steady"
    assert annotations[EXPIRY_ANNOTATION] == material.leaf.not_valid_after_utc.isoformat()
    assert tls.covers(material.leaf, NAMES)
    assert not manager.serving.valid()  # the Secret's certificate is not served until read back

    due = manager.step(now)
    assert manager.serving.valid() and served(tmp_path) == material.cert
    assert ca_bundles(server) == {material.ca_bundle}
    assert due == SCHEDULE.renew_at(material.leaf)  # nothing to do until the leaf is due
    assert writes(server) == 1


def test_another_replica_serves_the_same_certificate_and_writes_nothing(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    settled(server, tmp_path / "a", stop, now)
    patches = len(server.sent("PATCH"))
    second = replica(server, tmp_path / "b", stop)
    second.step(now)
    assert served(tmp_path / "b") == served(tmp_path / "a")
    assert writes(server) == 1 and len(server.sent("PATCH")) == patches


def test_a_new_ca_is_served_only_once_this_replica_saw_it_trusted_for_a_full_delay(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    settled(server, tmp_path / "a", stop, now)
    old_cert = stored(server).cert
    begin_rotation(SecretStore(server.api_client(), NAMESPACE, NAME), schedule=SCHEDULE)
    rotating = stored(server)
    assert rotating.phase == "trusting-new-ca" and ca_bundles(server) != {rotating.ca_bundle}

    # The schedule says serve the new CA from here on; a replica that first sees the bundle now must
    # still give the API servers a full delay from its own first sight.
    late = tls.issued_at(rotating.newest_ca) + DELAY
    newcomer = replica(server, tmp_path / "b", stop)
    assert newcomer.step(late) == late + DELAY
    assert ca_bundles(server) == {rotating.ca_bundle}
    assert stored(server).cert == old_cert and served(tmp_path / "b") == old_cert

    assert newcomer.step(late + DELAY) == late + DELAY  # renewed from the new CA: read it back
    renewed = stored(server)
    assert renewed.phase == "serving-new-ca" and tls.signed_by(renewed.leaf, renewed.newest_ca)
    newcomer.step(late + DELAY)
    assert served(tmp_path / "b") == renewed.cert


def test_a_bundle_patched_again_restarts_the_wait(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    manager = settled(server, tmp_path, stop, now)
    begin_rotation(SecretStore(server.api_client(), NAMESPACE, NAME), schedule=SCHEDULE)
    rotating = stored(server)
    manager.step(now)  # patches the new bundle in: trusted from now
    due = tls.issued_at(rotating.newest_ca) + DELAY
    # Someone put the old bundle back meanwhile: the API servers may not trust the new CA yet.
    for path in (MUTATING, VALIDATING):
        for webhook in server.objects[path]["webhooks"]:
            webhook["clientConfig"]["caBundle"] = base64.b64encode(b"old").decode()
    later = max(due, now + DELAY) + datetime.timedelta(seconds=1)
    assert manager.step(later) == later + DELAY
    assert stored(server).cert == rotating.cert  # not renewed yet


def test_an_unusable_secret_is_replaced_keeping_what_others_put_on_it(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    server.put(
        SECRET,
        {
            "metadata": {"name": NAME, "labels": {"team": "infra"}},
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": base64.b64encode(b"junk").decode()},
        },
    )
    manager = replica(server, tmp_path, stop)
    manager.step(datetime.datetime.now(datetime.UTC))
    assert stored(server).phase == "steady"
    assert server.objects[SECRET]["metadata"]["labels"]["team"] == "infra"
    assert server.sent("PUT") and not server.sent("POST")


def test_rotate_refuses_without_a_secret_and_names_it(server: FakeApiServer) -> None:
    with pytest.raises(tls.InvalidMaterialError, match=f"Secret {NAMESPACE}/{NAME}: not found; "):
        begin_rotation(SecretStore(server.api_client(), NAMESPACE, NAME), schedule=SCHEDULE)


def test_rotate_refuses_a_second_rotation(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    replica(server, tmp_path, stop).step(now)
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    begin_rotation(store, schedule=SCHEDULE)
    with pytest.raises(tls.InvalidMaterialError, match="already in progress"):
        begin_rotation(store, schedule=SCHEDULE)


def test_rotate_that_loses_a_race_says_to_run_it_again(
    server: FakeApiServer, tmp_path: Path, stop: threading.Event
) -> None:
    replica(server, tmp_path, stop).step(datetime.datetime.now(datetime.UTC))
    before = stored(server)
    server.refuse(SECRET, 409, method="PUT")
    with pytest.raises(RuntimeError, match="changed while rotating; run the command again"):
        begin_rotation(SecretStore(server.api_client(), NAMESPACE, NAME), schedule=SCHEDULE)
    assert stored(server) == before

"""The API side of gpuguard's certificates (kube/certificates.py): the Secret read as bytes (or as why it
cannot be), written create-if-absent or at the version read, losing quietly to another replica's write,
and keeping what others put on it; every caBundle of both webhook configurations patched to the bundle,
with each webhook's name tested, and a configuration that is gone left gone.

Requests go through the real client to the in-process API server (apiserver.py).
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.harness.apiserver import FakeApiServer
from webhook.kube.certificates import SecretStore, StoredSecret, WebhookConfigurations, ca_bundle_patch

NAMESPACE, NAME = "gpuguard", "gpuguard-tls"
SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
SECRET = f"{SECRETS}/{NAME}"
REGISTRATION = "/apis/admissionregistration.k8s.io/v1"
MUTATING = f"{REGISTRATION}/mutatingwebhookconfigurations/gpuguard"
VALIDATING = f"{REGISTRATION}/validatingwebhookconfigurations/gpuguard"
BUNDLE = b"-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
ENCODED = base64.b64encode(BUNDLE).decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def secret(data: dict[str, str] | None, **metadata: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": NAME, **metadata}}
    if data is not None:
        obj["data"] = data
    return obj


def configuration(kind: str, *bundles: str | None) -> dict[str, Any]:
    webhooks = [
        {"name": f"hook-{index}.gpuguard.io", "clientConfig": {} if bundle is None else {"caBundle": bundle}}
        for index, bundle in enumerate(bundles)
    ]
    return {"kind": kind, "metadata": {"name": "gpuguard"}, "webhooks": webhooks}


def bundles(server: FakeApiServer, path: str) -> list[str | None]:
    return [webhook["clientConfig"].get("caBundle") for webhook in server.objects[path]["webhooks"]]


# --- the Secret -------------------------------------------------------------------------------------


def test_an_absent_secret_reads_as_no_data_and_no_version() -> None:
    assert SecretStore(FakeApiServer().api_client(), NAMESPACE, NAME).read() == StoredSecret(None, None)


def test_a_secret_reads_as_bytes_with_what_others_put_on_it() -> None:
    server = FakeApiServer()
    server.put(SECRET, secret({"tls.crt": b64(b"cert")}, labels={"team": "infra"}, annotations={"a": "b"}))
    read = SecretStore(server.api_client(), NAMESPACE, NAME).read()
    assert read.data == {"tls.crt": b"cert"}
    assert read.resource_version == server.objects[SECRET]["metadata"]["resourceVersion"]
    assert (read.secret_type, read.labels, read.annotations) == ("Opaque", {"team": "infra"}, {"a": "b"})


def test_a_secret_that_does_not_decode_says_why_and_keeps_its_version() -> None:
    server = FakeApiServer()
    server.put(SECRET, secret({"tls.crt": "not base64!"}))
    read = SecretStore(server.api_client(), NAMESPACE, NAME).read()
    assert read.data is None and read.problem and read.resource_version is not None


def test_a_refused_read_is_raised() -> None:
    server = FakeApiServer()
    server.refuse(SECRET, 403)
    with pytest.raises(ApiException):
        SecretStore(server.api_client(), NAMESPACE, NAME).read()


def test_a_secret_absent_when_read_is_created_as_a_tls_secret_gpuguard_manages() -> None:
    server = FakeApiServer()
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    assert store.write({"tls.crt": b"cert"}, {"gpuguard.io/certificate-phase": "steady"}, store.read())
    (create,) = server.sent("POST")
    assert create.path == SECRETS
    stored = server.objects[SECRET]
    assert stored["type"] == "kubernetes.io/tls"
    assert stored["data"] == {"tls.crt": b64(b"cert")}
    assert stored["metadata"]["labels"] == {
        "app.kubernetes.io/name": "gpuguard",
        "app.kubernetes.io/managed-by": "gpuguard",
    }
    assert stored["metadata"]["annotations"] == {"gpuguard.io/certificate-phase": "steady"}
    assert create.query["fieldManager"] == "gpuguard"


def test_an_update_is_made_at_the_version_read_and_keeps_type_labels_and_annotations() -> None:
    server = FakeApiServer()
    server.put(
        SECRET,
        secret({"tls.crt": b64(b"old")}, labels={"team": "infra"}, annotations={"note": "theirs"})
        | {"type": "Opaque"},
    )
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    read = store.read()
    assert store.write({"tls.crt": b"new"}, {"gpuguard.io/certificate-phase": "steady"}, read)
    (replace,) = server.sent("PUT")
    assert replace.body["metadata"]["resourceVersion"] == read.resource_version
    stored = server.objects[SECRET]
    assert stored["type"] == "Opaque"  # immutable: a write of another type would be refused
    assert stored["metadata"]["labels"]["team"] == "infra"
    assert stored["metadata"]["annotations"] == {"note": "theirs", "gpuguard.io/certificate-phase": "steady"}


def test_a_write_after_another_replicas_loses_and_leaves_theirs() -> None:
    server = FakeApiServer()
    server.put(SECRET, secret({"tls.crt": b64(b"first")}))
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    read = store.read()
    server.put(SECRET, secret({"tls.crt": b64(b"theirs")}))  # another replica, since our read
    assert not store.write({"tls.crt": b"ours"}, {}, read)
    assert server.objects[SECRET]["data"] == {"tls.crt": b64(b"theirs")}


def test_a_create_after_another_replicas_loses() -> None:
    server = FakeApiServer()
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    read = store.read()
    server.put(SECRET, secret({"tls.crt": b64(b"theirs")}))
    assert not store.write({"tls.crt": b"ours"}, {}, read)
    assert server.objects[SECRET]["data"] == {"tls.crt": b64(b"theirs")}


def test_an_update_of_a_secret_deleted_since_the_read_loses() -> None:
    server = FakeApiServer()
    server.put(SECRET, secret({"tls.crt": b64(b"first")}))
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    read = store.read()
    del server.objects[SECRET]
    assert not store.write({"tls.crt": b"ours"}, {}, read)


def test_any_other_refused_write_is_raised() -> None:
    server = FakeApiServer()
    server.refuse(SECRETS, 403, method="POST")
    store = SecretStore(server.api_client(), NAMESPACE, NAME)
    with pytest.raises(ApiException):
        store.write({"tls.crt": b"cert"}, {}, store.read())


# --- the caBundles ----------------------------------------------------------------------------------


def test_every_webhook_of_both_configurations_gets_the_bundle_and_only_then_is_in_place() -> None:
    server = FakeApiServer()
    server.put(MUTATING, configuration("MutatingWebhookConfiguration", None, "b2xk"))
    server.put(VALIDATING, configuration("ValidatingWebhookConfiguration", ENCODED, None))
    configurations = WebhookConfigurations(server.api_client(), "gpuguard")
    assert not configurations.sync(BUNDLE)
    assert bundles(server, MUTATING) == [ENCODED, ENCODED]
    assert bundles(server, VALIDATING) == [ENCODED, ENCODED]
    patches = server.sent("PATCH")
    assert {request.query["fieldManager"] for request in patches} == {"gpuguard"}
    assert configurations.sync(BUNDLE)
    assert len(server.sent("PATCH")) == 2  # nothing more to patch


def test_each_bundle_is_added_under_a_test_of_its_webhooks_name() -> None:
    # A list reordered since the read then fails the patch (the next pass retries) instead of giving
    # the bundle to another webhook; a webhook already carrying it is left out.
    webhooks = configuration("MutatingWebhookConfiguration", ENCODED, None)
    assert ca_bundle_patch(webhooks, ENCODED) == [
        {"op": "test", "path": "/webhooks/1/name", "value": "hook-1.gpuguard.io"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": ENCODED},
    ]


def test_a_deleted_configuration_stays_deleted() -> None:
    # Deleting the webhook configurations is how an operator turns gpuguard off in an emergency.
    server = FakeApiServer()
    server.put(VALIDATING, configuration("ValidatingWebhookConfiguration", None))
    configurations = WebhookConfigurations(server.api_client(), "gpuguard")
    configurations.sync(BUNDLE)
    assert MUTATING not in server.objects
    assert not server.sent("POST") and not server.sent("PUT")
    assert bundles(server, VALIDATING) == [ENCODED]


def test_a_configuration_that_cannot_be_read_is_raised_for_the_loop_to_retry() -> None:
    server = FakeApiServer()
    server.put(MUTATING, configuration("MutatingWebhookConfiguration", None))
    server.refuse(MUTATING, 500, method="GET")
    with pytest.raises(ApiException):
        WebhookConfigurations(server.api_client(), "gpuguard").sync(BUNDLE)
    assert bundles(server, MUTATING) == [None]

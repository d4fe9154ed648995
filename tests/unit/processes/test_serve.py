"""The composition root of `gpuguard serve` (processes/serve.py): what `build` wires before the listener
opens, against the in-process API server (apiserver.py) through the real client.

No cluster access unless asked for; the policy ConfigMap read before anything is served, so the first
request meets the ConfigMap's policy, and what the store decides said as Events on the ConfigMap; a
policy class the cluster lacks said once the classes are known; each worker its own certificate folder.
The listener itself is not started here (tests/integration and tests/e2e serve).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.harness.apiserver import FakeApiServer, Request
from webhook.certs.rotation import Settings
from webhook.kube import client as kube_client
from webhook.policy.model import CONFIGMAP_KEY, default_policy, parse_policy
from webhook.processes import serve

NAMESPACE, NAME = "gpuguard", "gpuguard-policy"
CONFIGMAP = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{NAME}"
EVENTS = f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


@pytest.fixture
def server(apiserver: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    """The API server every client `build` makes talks to."""
    monkeypatch.setattr(kube_client, "api_client", lambda kubeconfig=None: apiserver.api_client())
    return apiserver


def options(tmp_path: Path, **changes: Any) -> serve.Options:
    return serve.Options("127.0.0.1", 0, tmp_path / "tls.crt", tmp_path / "tls.key", **changes)


def with_configmap(server: FakeApiServer, text: str) -> None:
    server.put(
        CONFIGMAP,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": NAME, "uid": "cm-1"},
            "data": {CONFIGMAP_KEY: text},
        },
    )


def event(server: FakeApiServer, reason: str) -> dict[str, Any]:
    def has_reason(request: Request) -> bool:
        return bool(request.body["reason"] == reason)

    body: dict[str, Any] = server.wait_for("POST", EVENTS, where=has_reason).body
    return body


def test_without_cluster_options_no_client_is_made_and_the_policy_file_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: threading.Event
) -> None:
    def no_cluster(kubeconfig: str | None = None) -> Any:
        raise AssertionError("a Kubernetes client was made without cluster access asked for")

    monkeypatch.setattr(kube_client, "api_client", no_cluster)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("mode: warn\n")
    _, state = serve.build(options(tmp_path, policy_file=policy_file), stop)
    assert state.policy.mode == "warn"
    assert state.store.source == f"file {policy_file}"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("mode: audit\n", id="another-policy"),
        # The defaults spelled out: the policy in force does not change, its source does, and says so.
        pytest.param("mode: enforce\n", id="the-embedded-policy"),
    ],
)
def test_the_configmaps_policy_is_in_force_before_serving_and_said_active_on_it(
    tmp_path: Path, server: FakeApiServer, stop: threading.Event, text: str
) -> None:
    with_configmap(server, text)
    _, state = serve.build(options(tmp_path, policy_configmap=f"{NAMESPACE}/{NAME}"), stop)
    assert state.policy.hash == parse_policy(text).hash
    assert state.store.source == f"ConfigMap {NAMESPACE}/{NAME}"
    loaded = event(server, "PolicyLoaded")
    assert loaded["note"] == f"policy {state.policy.hash} is active"
    assert loaded["regarding"]["kind"] == "ConfigMap" and loaded["regarding"]["uid"] == "cm-1"


def test_a_refused_configmap_policy_is_said_on_it_and_the_embedded_one_stays(
    tmp_path: Path, server: FakeApiServer, stop: threading.Event
) -> None:
    with_configmap(server, "mode: bogus\n")
    _, state = serve.build(options(tmp_path, policy_configmap=f"{NAMESPACE}/{NAME}"), stop)
    assert state.policy.hash == default_policy().hash
    refused = event(server, "InvalidPolicy")
    assert refused["type"] == "Warning" and "mode: unknown value 'bogus'" in refused["note"]


def test_a_policy_class_the_cluster_lacks_is_said_once_the_classes_are_known(
    tmp_path: Path, server: FakeApiServer, stop: threading.Event
) -> None:
    with_configmap(server, "mode: warn\n")
    _, state = serve.build(options(tmp_path, policy_configmap=f"{NAMESPACE}/{NAME}", cluster=True), stop)
    class_name = state.policy.rules.priority.className
    assert state.facts.priority_classes == {}
    missing = event(server, "PriorityClassMissing")
    assert missing["note"] == (
        f"PriorityClass {class_name} (rules.priority.className) does not exist: it is not injected"
    )
    assert missing["type"] == "Warning"


def test_a_policy_class_the_cluster_has_is_not_said_missing(
    tmp_path: Path, server: FakeApiServer, stop: threading.Event
) -> None:
    class_name = default_policy().rules.priority.className
    server.put(f"{PRIORITY_CLASSES}/{class_name}", {"metadata": {"name": class_name}, "value": 1000})
    _, state = serve.build(options(tmp_path, cluster=True), stop)
    assert state.facts.priority_classes is not None and class_name in state.facts.priority_classes
    assert serve._missing_priority_class(state) is None
    assert not server.sent("POST")  # no ConfigMap to tell, no Event


def test_each_worker_writes_the_secrets_certificate_in_a_folder_of_its_own(tmp_path: Path) -> None:
    settings = Settings(NAMESPACE, "gpuguard-tls", ("gpuguard.gpuguard.svc",), "gpuguard", tmp_path)
    shared = options(tmp_path, certificates=settings, workers=2)
    per_worker = [serve._worker_options(shared, slot).certificates for slot in (0, 1)]
    assert [certificates.cert_dir for certificates in per_worker if certificates] == [
        tmp_path / "worker-0",
        tmp_path / "worker-1",
    ]
    alone = options(tmp_path)
    assert serve._worker_options(alone, 1) == alone
    assert dataclasses.replace(serve._worker_options(shared, 1), certificates=settings) == shared

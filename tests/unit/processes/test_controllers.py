"""The composition root of `gpuguard controllers` (processes/controllers.py), against the in-process API
server (apiserver.py) through the real client.

Ready once every cache listed, a resource the cluster does not serve (DRA) excepted and named; the
policy ConfigMap's policy loaded and said active on it; a replica stands for election only once its
caches synced, and a leader that stops cleanly gives the Lease up while one that lost it does not.
What the controllers decide is theirs to test (test_nodehealth.py, test_podhealth.py, ...).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.harness.apiserver import FakeApiServer, Request
from webhook.policy.model import CONFIGMAP_KEY, parse_policy
from webhook.processes import controllers

NAMESPACE = "gpuguard"
POLICY_CONFIGMAP = f"/api/v1/namespaces/{NAMESPACE}/configmaps/gpuguard-policy"
EVENTS = f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{controllers.LEASE_NAME}"
DRA = {
    "resourceslices": "/apis/resource.k8s.io/v1/resourceslices",
    "resourceclaims": "/apis/resource.k8s.io/v1/resourceclaims",
    "devicetaintrules": "/apis/resource.k8s.io/v1/devicetaintrules",
}
WAIT = 10.0


@pytest.fixture
def server(apiserver: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    """The API server every client the manager makes talks to."""
    monkeypatch.setattr(controllers, "api_client", lambda kubeconfig=None: apiserver.api_client())
    return apiserver


def manager(stop: threading.Event, **options: Any) -> controllers.ControllerManager:
    return controllers.ControllerManager(
        controllers.Options(NAMESPACE, identity="replica-a", retry_seconds=0.1, **options), stop
    )


def test_ready_once_every_cache_listed_but_a_resource_the_cluster_does_not_serve(
    server: FakeApiServer, stop: threading.Event
) -> None:
    for path in DRA.values():
        server.refuse(path, 404)  # a cluster without DRA
    built = manager(stop)
    assert not built.synced()
    for informer in built.informers:
        informer.sync()
    assert built.synced()
    status = built._status()
    assert status["unavailableLookups"] == list(DRA)  # in the order the informers are made
    assert status["role"] == "standby" and status["identity"] == "replica-a"


def test_the_configmaps_policy_is_loaded_and_said_active_in_the_controllers(
    server: FakeApiServer, stop: threading.Event
) -> None:
    text = "health:\n  paused: true\n"
    server.put(
        POLICY_CONFIGMAP,
        {"metadata": {"name": "gpuguard-policy", "uid": "cm-1"}, "data": {CONFIGMAP_KEY: text}},
    )
    built = manager(stop, policy_configmap=f"{NAMESPACE}/gpuguard-policy")
    built.events.start()
    built.informers[-1].sync()  # the ConfigMap's, listed with the others
    assert built.store.policy.hash == parse_policy(text).hash and built.store.policy.health.paused

    def loaded(request: Request) -> bool:
        return bool(request.body["reason"] == "PolicyLoaded")

    note = server.wait_for("POST", EVENTS, where=loaded).body["note"]
    assert note == f"policy {built.store.policy.hash} is active in the controllers"


def leading(built: controllers.ControllerManager) -> threading.Event:
    """Set once the replica has started leading (its leader's work started)."""
    led = threading.Event()
    lead = built.elector.on_started

    def started() -> None:
        lead()
        led.set()

    built.elector.on_started = started
    return led


def test_a_leader_that_stops_cleanly_gives_the_lease_up(server: FakeApiServer, stop: threading.Event) -> None:
    built = manager(stop)
    led = leading(built)
    built.start()
    assert led.wait(WAIT)
    assert server.objects[LEASE]["spec"]["holderIdentity"] == "replica-a"
    assert built._status()["role"] == "leader"
    built.shutdown()
    assert not server.objects[LEASE]["spec"].get("holderIdentity")  # the standby takes over at once
    assert not built.lost_lease


def test_a_leader_that_lost_the_lease_stops_and_leaves_it_to_the_other_replica(
    server: FakeApiServer, stop: threading.Event
) -> None:
    built = manager(stop)
    led = leading(built)
    built.start()
    assert led.wait(WAIT)
    writes = len([r for r in server.requests if r.path == LEASE and r.method == "PUT"])
    built.elector.on_stopped()  # what the elector calls on a renewal it could not make in time
    assert stop.is_set() and built.lost_lease
    built.shutdown()
    assert len([r for r in server.requests if r.path == LEASE and r.method == "PUT"]) == writes
    assert server.objects[LEASE]["spec"]["holderIdentity"] == "replica-a"


def test_a_replica_stands_for_election_only_once_its_caches_listed(
    server: FakeApiServer, stop: threading.Event
) -> None:
    server.refuse("/api/v1/nodes", 500)  # the nodes cannot be listed at first
    built = manager(stop)
    led = leading(built)
    built.start()
    assert led.wait(WAIT)
    first_lease_request = next(i for i, r in enumerate(server.requests) if r.path == LEASE)
    node_lists = [i for i, r in enumerate(server.requests) if r.path == "/api/v1/nodes"]
    assert len(node_lists) >= 2  # refused, then listed
    assert node_lists[1] < first_lease_request

"""The informer against the real API server: its first list is streamed from the watch cache (the
WatchList protocol) and it watches on from the stream's end, and a list call that cannot stream is
listed by pages instead. The scripted cases (410s, dropped watches, servers that refuse the stream)
are in tests/unit/kube/test_informer.py."""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.harness.controlplane import ControlPlane
from webhook.kube.client import ResourceListWatch, api_client, collection, metadata_of
from webhook.kube.informer import Change, Informer

WAIT = 30.0


def named(raw: dict[str, Any]) -> tuple[Hashable, str]:
    metadata = metadata_of(raw)
    return str(metadata.get("name")), str(metadata.get("resourceVersion"))


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    stop = threading.Event()
    yield stop
    stop.set()


def test_the_first_list_is_streamed_and_the_watch_goes_on_from_its_end(
    control_plane: ControlPlane, namespace: str, stop: threading.Event
) -> None:
    for name in ("a", "b", "c"):
        control_plane.kubectl("-n", namespace, "create", "configmap", name, f"--from-literal=key={name}")
    api = api_client(str(control_plane.kubeconfig))
    source = ResourceListWatch(collection(api, f"/api/v1/namespaces/{namespace}/configmaps"))
    informer = Informer("configmaps", source, named, stop=stop)
    changes: queue.Queue[Change[str]] = queue.Queue()
    informer.on_change(changes.put)

    assert informer.sync()
    assert informer.streams_lists
    assert {"a", "b", "c"} <= set(informer.current())
    listed = {changes.get(timeout=WAIT).key for _ in informer.current()}
    assert listed == set(informer.current())

    informer.start()
    control_plane.kubectl("-n", namespace, "create", "configmap", "d", "--from-literal=key=d")
    assert changes.get(timeout=WAIT).key == "d"  # and nothing listed before it came again


def test_a_list_call_that_cannot_stream_is_listed_by_pages(
    control_plane: ControlPlane, stop: threading.Event
) -> None:
    api = api_client(str(control_plane.kubeconfig))
    # The generated custom-object calls know no sendInitialEvents: they refuse it before any request.
    custom = client.CustomObjectsApi(api).list_cluster_custom_object
    source = ResourceListWatch(custom, group="apiregistration.k8s.io", version="v1", plural="apiservices")
    informer = Informer("apiservices", source, named, stop=stop)

    assert informer.sync()
    assert not informer.streams_lists
    assert "v1." in informer.current()  # the core API's APIService, always registered

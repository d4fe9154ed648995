"""The policy as one key of one ConfigMap (kube/policy_source.py): each change of its text offered to the
policy store once, its absence offered as None, an unreachable API server offering nothing (the active
policy stays), Events recorded on the ConfigMap itself; and the one-shot read of `gpuguard audit`.

The ConfigMap lives in an in-process API server (apiserver.py) behind the real client; each list is
taken on the test's thread with the informer's `sync`, so no watch thread runs.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from tests.harness.apiserver import FakeApiServer
from webhook.kube.client import AccessError
from webhook.kube.events import EventRecorder
from webhook.kube.policy_source import PolicyConfigMap, read_policy_text

NAMESPACE, NAME, KEY = "gpuguard", "gpuguard-policy", "policy.yaml"
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
PATH = f"{CONFIGMAPS}/{NAME}"
WAIT = 10.0


def configmap(data: dict[str, Any] | None, *, name: str = NAME, uid: str = "uid-1") -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "uid": uid}}
    if data is not None:
        obj["data"] = data
    return obj


class Watched:
    """A PolicyConfigMap over `server`, with what it offered and the Events it sent."""

    def __init__(self, server: FakeApiServer, stop: threading.Event) -> None:
        self.offered: list[str | None] = []
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        recorder = EventRecorder(lambda namespace, body: self.events.put((namespace, body)), stop=stop)
        recorder.start()
        self.source = PolicyConfigMap(
            server.api_client(),
            NAMESPACE,
            NAME,
            key=KEY,
            offer=self.offered.append,
            events=recorder,
            stop=stop,
        )

    def sync(self) -> bool:
        return self.source.informer.sync()


def test_the_text_is_offered_once_for_each_change(stop: threading.Event) -> None:
    server = FakeApiServer()
    server.put(PATH, configmap({KEY: "mode: warn\n"}))
    server.put(f"{CONFIGMAPS}/other", configmap({KEY: "mode: off\n"}, name="other"))
    watched = Watched(server, stop)
    assert watched.sync()
    assert watched.offered == ["mode: warn\n"]  # the other ConfigMap is not even listed
    assert server.requests[0].query["fieldSelector"] == f"metadata.name={NAME}"
    watched.sync()
    assert watched.offered == ["mode: warn\n"]  # listed again, unchanged: nothing new to load
    server.put(PATH, configmap({KEY: "mode: audit\n", "notes": "x"}))
    watched.sync()
    assert watched.offered == ["mode: warn\n", "mode: audit\n"]


@pytest.mark.parametrize(
    "stored",
    [None, configmap({"other.yaml": "mode: warn\n"}), configmap(None)],
    ids=["no-configmap", "no-key", "no-data"],
)
def test_a_missing_configmap_or_key_is_offered_as_none(stop: threading.Event, stored: Any) -> None:
    server = FakeApiServer()
    if stored is not None:
        server.put(PATH, stored)
    watched = Watched(server, stop)
    watched.sync()
    assert watched.offered == [None]


def test_a_configmap_deleted_later_is_offered_as_none(stop: threading.Event) -> None:
    server = FakeApiServer()
    server.put(PATH, configmap({KEY: "mode: warn\n"}))
    watched = Watched(server, stop)
    watched.sync()
    del server.objects[PATH]
    watched.sync()
    assert watched.offered == ["mode: warn\n", None]


def test_an_unreachable_api_server_offers_nothing_and_the_active_policy_stays(stop: threading.Event) -> None:
    server = FakeApiServer()
    server.put(PATH, configmap({KEY: "mode: warn\n"}))
    watched = Watched(server, stop)
    watched.sync()
    server.unreachable = True
    assert not watched.sync()
    assert watched.offered == ["mode: warn\n"]
    # Back with the same text: it is still the one in force, nothing to load again.
    server.unreachable = False
    watched.sync()
    assert watched.offered == ["mode: warn\n"]


def test_an_event_is_recorded_on_the_configmap_as_last_seen(stop: threading.Event) -> None:
    server = FakeApiServer()
    server.put(PATH, configmap({KEY: "mode: [\n"}, uid="uid-7"))
    watched = Watched(server, stop)
    watched.sync()
    watched.source.event("InvalidPolicy", "policy is not valid YAML", warning=True)
    namespace, body = watched.events.get(timeout=WAIT)
    assert namespace == NAMESPACE
    assert body["regarding"] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "namespace": NAMESPACE,
        "name": NAME,
        "uid": "uid-7",
    }
    assert (body["reason"], body["action"], body["type"]) == ("InvalidPolicy", "LoadPolicy", "Warning")


# --- read once --------------------------------------------------------------------------------------


def test_a_one_shot_read_answers_the_keys_text() -> None:
    server = FakeApiServer()
    server.put(PATH, configmap({KEY: "mode: audit\n"}))
    assert read_policy_text(server.api_client(), NAMESPACE, NAME, key=KEY) == "mode: audit\n"


@pytest.mark.parametrize(
    "stored",
    [None, configmap({"other.yaml": "x"}), configmap(None)],
    ids=["no-configmap", "no-key", "no-data"],
)
def test_a_one_shot_read_of_nothing_is_none(stored: Any) -> None:
    server = FakeApiServer()
    if stored is not None:
        server.put(PATH, stored)
    assert read_policy_text(server.api_client(), NAMESPACE, NAME, key=KEY) is None


def test_a_one_shot_read_refused_says_what_was_refused() -> None:
    server = FakeApiServer()
    server.refuse(PATH, 403)
    with pytest.raises(AccessError, match=f"^cannot read ConfigMap {NAMESPACE}/{NAME}: 403 "):
        read_policy_text(server.api_client(), NAMESPACE, NAME, key=KEY)

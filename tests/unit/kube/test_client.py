"""The Kubernetes client as gpuguard uses it (kube/client.py): credentials found or refused in words a
user can act on, raw list calls with the generated calls' arguments, and a resource's list and watch
with the API server's answers turned into what the informer acts on (not served, expired, unreachable,
no streamed lists).

The requests go through the real client to an in-process API server (apiserver.py); that the real one
answers the same is tests/e2e's business.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.harness.apiserver import INITIAL_EVENTS_END, FakeApiServer
from webhook.kube.client import (
    AccessError,
    ConfigError,
    ResourceListWatch,
    UnreachableError,
    api_client,
    collection,
)
from webhook.kube.informer import ExpiredError, NotServedError, StreamingNotSupportedError

CONFIGMAPS = "/api/v1/namespaces/gpuguard/configmaps"

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster: {server: "https://10.0.0.1:6443", insecure-skip-tls-verify: true}
users:
- name: admin
  user: {token: secret-token}
contexts:
- name: lab
  context: {cluster: lab, user: admin}
current-context: lab
"""


@pytest.fixture
def server() -> FakeApiServer:
    server = FakeApiServer()
    for name in ("a", "b", "c"):
        server.put(f"{CONFIGMAPS}/{name}", {"metadata": {"name": name}, "data": {"k": name}})
    return server


def configmaps(server: FakeApiServer, **list_args: str) -> ResourceListWatch:
    return ResourceListWatch(collection(server.api_client(), CONFIGMAPS), page_size=2, **list_args)


# --- credentials ------------------------------------------------------------------------------------


def test_a_kubeconfig_gives_a_client_of_its_current_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(KUBECONFIG)
    configuration = api_client(str(kubeconfig)).configuration
    assert configuration.host == "https://10.0.0.1:6443"
    assert configuration.api_key == {"BearerToken": "Bearer secret-token"}


@pytest.mark.parametrize(
    "text",
    ["just a string\n", "- a\n- list\n", "apiVersion: v1\nkind: Config\ncurrent-context: nowhere\n"],
    ids=["string", "list", "no-such-context"],
)
def test_a_file_that_is_not_a_usable_kubeconfig_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(text)
    with pytest.raises(ConfigError, match=f"^no usable cluster credentials in {kubeconfig}: "):
        api_client(str(kubeconfig))


def test_without_a_kubeconfig_the_error_names_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=f"in {tmp_path / 'absent'}: "):
        api_client()


def test_a_refused_read_says_what_and_why_and_a_403_names_the_permissions() -> None:
    forbidden = AccessError("list nodes", ApiException(status=403, reason="Forbidden"))
    assert str(forbidden) == "cannot list nodes: 403 Forbidden (the credentials lack this permission)"
    assert forbidden.status == 403
    assert str(AccessError("list nodes", ApiException(status=500, reason="Internal"))) == (
        "cannot list nodes: 500 Internal"
    )


# --- raw list calls ---------------------------------------------------------------------------------


def test_a_raw_list_call_sends_the_generated_calls_arguments_in_the_apis_words(server: FakeApiServer) -> None:
    call = collection(server.api_client(), CONFIGMAPS)
    call(limit=2, _continue="2", field_selector="metadata.name=a", resource_version=None)
    (request,) = server.requests
    assert (request.method, request.path) == ("GET", CONFIGMAPS)
    # None is left out, as the generated calls leave it out.
    assert request.query == {"limit": "2", "continue": "2", "fieldSelector": "metadata.name=a"}


def test_a_raw_list_call_that_the_server_refuses_raises_its_status(server: FakeApiServer) -> None:
    server.refuse(CONFIGMAPS, 403)
    with pytest.raises(ApiException) as raised:
        collection(server.api_client(), CONFIGMAPS)()
    assert raised.value.status == 403


# --- lists ------------------------------------------------------------------------------------------


def test_a_list_is_read_in_pages_each_continuing_the_last(server: FakeApiServer) -> None:
    source = configmaps(server)
    first = source.list_page(None)
    assert [item["metadata"]["name"] for item in first.items] == ["a", "b"]
    assert first.continue_token == "2"
    last = source.list_page(first.continue_token)
    assert [item["metadata"]["name"] for item in last.items] == ["c"]
    assert last.continue_token is None and last.resource_version
    assert [request.query.get("continue") for request in server.requests] == [None, "2"]
    assert {request.query["limit"] for request in server.requests} == {"2"}


def test_the_fixed_arguments_go_with_every_page(server: FakeApiServer) -> None:
    page = configmaps(server, field_selector="metadata.name=b").list_page(None)
    assert [item["metadata"]["name"] for item in page.items] == ["b"]
    assert server.requests[0].query["fieldSelector"] == "metadata.name=b"


def test_what_is_not_an_object_in_a_list_is_left_out() -> None:
    def answer(**_: object) -> object:
        return type("Response", (), {"data": b'{"metadata": {}, "items": [{"metadata": {}}, "x", 3]}'})()

    page = ResourceListWatch(answer).list_page(None)
    assert page.items == [{"metadata": {}}]
    assert (page.resource_version, page.continue_token) == ("", None)


@pytest.mark.parametrize(
    ("status", "raised"),
    [(404, NotServedError), (410, ExpiredError)],
    ids=["not-served", "expired"],
)
def test_the_answers_the_informer_acts_on_are_translated(
    server: FakeApiServer, status: int, raised: type[Exception]
) -> None:
    server.refuse(CONFIGMAPS, status, status)
    with pytest.raises(raised):
        configmaps(server).list_page(None)
    with pytest.raises(raised), configmaps(server).watch("100", 5):
        pass


def test_another_refusal_is_the_clients_own_error(server: FakeApiServer) -> None:
    server.refuse(CONFIGMAPS, 403)
    with pytest.raises(ApiException) as raised:
        configmaps(server).list_page(None)
    assert raised.value.status == 403


def test_a_server_that_does_not_answer_is_unreachable(server: FakeApiServer) -> None:
    server.unreachable = True
    with pytest.raises(UnreachableError):
        configmaps(server).list_page(None)


# --- watches ----------------------------------------------------------------------------------------


def test_a_streamed_list_asks_for_the_initial_events_and_yields_them_to_the_end_bookmark(
    server: FakeApiServer,
) -> None:
    with configmaps(server).watch_list(30) as events:
        received = list(events)
    assert [event["type"] for event in received] == ["ADDED", "ADDED", "ADDED", "BOOKMARK"]
    assert received[-1]["object"]["metadata"]["annotations"] == {INITIAL_EVENTS_END: "true"}
    query = server.requests[0].query
    assert query["sendInitialEvents"] == "true" and query["resourceVersionMatch"] == "NotOlderThan"
    assert query["watch"] == "true" and query["allowWatchBookmarks"] == "true"
    assert query["timeoutSeconds"] == "30"


def test_a_watch_resumes_from_the_version_it_is_given(server: FakeApiServer) -> None:
    server.close()  # nothing happens on the watch until the server ends it
    with configmaps(server).watch("123", 30) as events:
        assert list(events) == []
    query = server.requests[0].query
    assert query["resourceVersion"] == "123" and "sendInitialEvents" not in query


@pytest.mark.parametrize("status", [400, 422])
def test_a_server_refusing_streamed_lists_makes_the_informer_list_by_pages(
    server: FakeApiServer, status: int
) -> None:
    server.refuse(CONFIGMAPS, status)
    with pytest.raises(StreamingNotSupportedError), configmaps(server).watch_list(30):
        pass


def test_a_plain_watch_refused_as_invalid_is_not_taken_for_a_missing_feature(server: FakeApiServer) -> None:
    server.refuse(CONFIGMAPS, 422)
    with pytest.raises(ApiException), configmaps(server).watch("1", 30):
        pass


def test_a_generated_call_without_the_streaming_arguments_lists_by_pages(server: FakeApiServer) -> None:
    custom = client.CustomObjectsApi(server.api_client()).list_cluster_custom_object
    source = ResourceListWatch(functools.partial(custom, "jobset.x-k8s.io", "v1alpha2", "jobsets"))
    with pytest.raises(StreamingNotSupportedError), source.watch_list(30):
        pass
    assert server.requests == []  # refused by the client itself

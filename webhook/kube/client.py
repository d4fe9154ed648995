"""The Kubernetes API client, and list/watch access to one resource as raw JSON.

Everything is read with `_preload_content=False` and parsed with orjson: nothing a newer server sends
that the client's models do not know is lost, and no model objects are built for objects nobody reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import orjson
import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

from webhook.kube.informer import ExpiredError, ListPage, NotServedError, StreamingNotSupportedError

# What a failed API call raises, for callers that say what failed without importing the client.
ApiError = ApiException
REQUEST_TIMEOUT_SECONDS = 10
# Pages of a list. A page is decoded whole, and the memory its objects took stays with the process
# (freed, but rarely returned to the system): with 11 KB nodes, pages of 500 left a replica 47 MB
# larger after the first list, pages of 100 12 MB, for 40 more requests per 5,000 nodes (about 0.2 s).
PAGE_SIZE = 100


__all__ = [
    "NETWORK_ERRORS",
    "AccessError",
    "ApiClient",
    "ApiError",
    "ConfigError",
    "ResourceListWatch",
    "UnreachableError",
    "api_client",
    "collection",
    "metadata_of",
    "raw_json",
]


class ConfigError(ValueError):
    """No usable credentials: the kubeconfig is missing or is not a kubeconfig, or the in-cluster files are."""


class UnreachableError(Exception):
    """The API server did not answer (connection refused, TLS failure, timeout)."""


# What a call raises when the API server cannot be reached: the client's calls let urllib3's errors
# through, ResourceListWatch turns them into UnreachableError.
NETWORK_ERRORS: tuple[type[Exception], ...] = (UnreachableError, urllib3.exceptions.HTTPError)


class AccessError(Exception):
    """The API server refused a read gpuguard needs; the message names what, where, and why."""

    def __init__(self, what: str, exc: ApiException) -> None:
        hint = " (the credentials lack this permission)" if exc.status == 403 else ""
        super().__init__(f"cannot {what}: {exc.status} {exc.reason}{hint}")
        self.status = exc.status


def api_client(kubeconfig: str | None = None) -> ApiClient:
    """In-cluster credentials inside a pod, else the kubeconfig (explicit, $KUBECONFIG or ~/.kube/config)."""
    configuration = client.Configuration()
    try:
        if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    # The client's loader meets a file that is not a kubeconfig with whatever the first bad field
    # raises (a TypeError for a plain string, an AttributeError for a list): all of them mean this.
    except (ConfigException, yaml.YAMLError, TypeError, AttributeError, KeyError, ValueError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ConfigError(f"no usable cluster credentials in {where}: {exc}") from exc
    return ApiClient(configuration)


def raw_json(response: object) -> Any:
    """The body of a call made with `_preload_content=False`, whatever the client's annotation says."""
    return orjson.loads(cast(Any, response).data)


def _camel(name: str) -> str:
    head, *rest = name.lstrip("_").split("_")
    return head + "".join(word.capitalize() for word in rest)


def collection(api: ApiClient, path: str) -> Callable[..., Any]:
    """A list call for the collection at `path` ("/api/v1/nodes"), taking the arguments of the generated
    ones (`limit`, `_continue`, `watch`, `field_selector`, ...) and answering the raw response.

    The generated API classes cost memory for what a raw read never uses: the first use of
    `CoreV1Api` imports some 250 pydantic models (about 21 MB of a replica's resident memory).
    """

    def call(*, _preload_content: bool = False, _request_timeout: Any = None, **params: Any) -> Any:
        assert not _preload_content, "raw collection calls answer the undecoded response"
        query = [(_camel(name), value) for name, value in params.items() if value is not None]
        request = api.param_serialize(
            "GET",
            path,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        return response.response

    return call


def metadata_of(raw: object) -> dict[str, Any]:
    metadata = raw.get("metadata") if isinstance(raw, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _translated(exc: ApiException) -> Exception:
    if exc.status == 404:
        return NotServedError(str(exc.reason))
    if exc.status == 410:
        return ExpiredError(str(exc.reason))
    return exc


class ResourceListWatch:
    """One resource's list and watch through a generated client call (`CoreV1Api.list_node` and the
    like), with fixed arguments such as a namespace or a field selector."""

    def __init__(
        self, list_call: Callable[..., Any], *, page_size: int = PAGE_SIZE, **list_args: Any
    ) -> None:
        self.list_call = list_call
        self.page_size = page_size
        self.list_args = list_args

    def list_page(self, continue_token: str | None) -> ListPage:
        paging: dict[str, Any] = {"limit": self.page_size}
        if continue_token:
            paging["_continue"] = continue_token
        try:
            response = self.list_call(
                **self.list_args, **paging, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            raise _translated(exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise UnreachableError(str(exc)) from exc
        data = raw_json(response)
        metadata = metadata_of(data)
        items = data.get("items")
        return ListPage(
            items=[item for item in items if isinstance(item, dict)] if isinstance(items, list) else [],
            resource_version=str(metadata.get("resourceVersion") or ""),
            continue_token=str(metadata.get("continue") or "") or None,
        )

    def watch_list(self, timeout_seconds: int) -> contextlib.AbstractContextManager[Iterator[dict[str, Any]]]:
        return self._events(timeout_seconds, send_initial_events=True, resource_version_match="NotOlderThan")

    def watch(
        self, resource_version: str, timeout_seconds: int
    ) -> contextlib.AbstractContextManager[Iterator[dict[str, Any]]]:
        return self._events(timeout_seconds, resource_version=resource_version)

    @contextlib.contextmanager
    def _events(self, timeout_seconds: int, **params: Any) -> Iterator[Iterator[dict[str, Any]]]:
        streamed_list = bool(params.get("send_initial_events"))
        try:
            response = self.list_call(
                **self.list_args,
                **params,
                watch=True,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                _preload_content=False,
                _request_timeout=timeout_seconds + REQUEST_TIMEOUT_SECONDS,
            )
        except ApiException as exc:
            # A server without WatchList refuses the parameters as invalid.
            if streamed_list and exc.status in (400, 422):
                raise StreamingNotSupportedError(str(exc.reason)) from exc
            raise _translated(exc) from exc
        except (TypeError, ValueError) as exc:
            # A generated call without the parameters (the custom objects' ones) refuses them itself.
            if streamed_list:
                raise StreamingNotSupportedError(str(exc).splitlines()[0]) from exc
            raise
        try:
            yield (orjson.loads(line) for line in iter_resp_lines(response))
        finally:
            # Closed, not only released: a stream left before its end (a streamed list read up to
            # its end bookmark, a watch retired by a newer list) still has chunks on the wire, which
            # the pooled connection's next request would read as its answer.
            response.close()
            response.release_conn()

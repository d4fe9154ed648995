"""The policy as one key of one ConfigMap, watched: every change of its text is offered to the policy
store, and what the store decides is told back as Events on the ConfigMap. Or read once, for a
one-shot command (`gpuguard audit`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from webhook.kube.client import (
    REQUEST_TIMEOUT_SECONDS,
    AccessError,
    ApiClient,
    ResourceListWatch,
    collection,
    metadata_of,
    raw_json,
)
from webhook.kube.events import EventRecorder, ObjectRef, Reason
from webhook.kube.informer import Informer


class PolicyConfigMap:
    """Watches one ConfigMap key and offers its text (None when the ConfigMap or the key is gone)."""

    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        name: str,
        *,
        key: str,
        offer: Callable[[str | None], object],
        events: EventRecorder,
        stop: threading.Event,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.key = key
        self.offer = offer
        self.events = events
        self.uid = ""
        self._last: str | bool | None = False  # False: nothing seen yet
        source = ResourceListWatch(
            collection(api, f"/api/v1/namespaces/{namespace}/configmaps"),
            field_selector=f"metadata.name={name}",
        )
        self.informer: Informer[str | None] = Informer("policy ConfigMap", source, self._convert, stop=stop)
        self.informer.on_snapshot(self._publish)

    def _convert(self, raw: dict[str, Any]) -> tuple[Hashable, str | None] | None:
        self.uid = str(metadata_of(raw).get("uid", self.uid))
        data = raw.get("data")
        text = data.get(self.key) if isinstance(data, dict) else None
        return self.name, text if isinstance(text, str) else None

    def _publish(self, snapshot: Mapping[Hashable, str | None] | None) -> None:
        if snapshot is None:
            return  # the API is unreachable: keep the active policy, the informer says why
        text = snapshot.get(self.name)
        if text != self._last:
            self._last = text
            self.offer(text)

    def event(self, reason: Reason, note: str, *, warning: bool) -> None:
        """Records an Event on the ConfigMap, so `kubectl describe configmap` shows it."""
        regarding = ObjectRef("v1", "ConfigMap", self.namespace, self.name, self.uid)
        self.events.record(regarding, reason, note, action="LoadPolicy", warning=warning)


def read_policy_text(api: client.ApiClient, namespace: str, name: str, *, key: str) -> str | None:
    """The policy text in one ConfigMap key, read once; None when the ConfigMap or the key is absent."""
    try:
        response = client.CoreV1Api(api).read_namespaced_config_map(
            name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise AccessError(f"read ConfigMap {namespace}/{name}", exc) from exc
    data = raw_json(response).get("data")
    text = data.get(key) if isinstance(data, dict) else None
    return text if isinstance(text, str) else None

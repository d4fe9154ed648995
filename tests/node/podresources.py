"""A client of the kubelet's PodResources API (v1) on its unix socket: which pod holds which device
(`List`), and which devices the node can still hand out (`GetAllocatableResources`). A device held
by a pod but no longer allocatable is a failed device under a running workload: the signal
`gpuguard node-agent` is to report for kubelets and device plugins that do not write
`allocatedResourcesStatus`. Answers come back as plain data."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from .kubelet_api import POD_RESOURCES_SERVICE, KubeletApis


@dataclass(frozen=True)
class HeldDevices:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: frozenset[str]


class PodResourcesClient:
    def __init__(self, apis: KubeletApis, socket: Path, timeout: float = 10.0) -> None:
        self.api = apis.podresources
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{socket}")

    def _call(self, method: str, request: Any, response_type: Any) -> Any:
        call = self._channel.unary_unary(
            f"/{POD_RESOURCES_SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return call(request, timeout=self.timeout)

    def held_devices(self) -> list[HeldDevices]:
        """`List`: every device each container of each pod on the node holds (one entry per
        container and resource; the kubelet splits a container's devices by topology)."""
        response = self._call("List", self.api.ListPodResourcesRequest(), self.api.ListPodResourcesResponse)
        found: defaultdict[tuple[str, str, str, str], set[str]] = defaultdict(set)
        for pod in response.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    found[pod.namespace, pod.name, container.name, devices.resource_name].update(
                        devices.device_ids
                    )
        return [HeldDevices(*key, device_ids=frozenset(ids)) for key, ids in found.items()]

    def allocatable_devices(self) -> dict[str, frozenset[str]]:
        """`GetAllocatableResources`: resource name -> the IDs of the devices that are still healthy."""
        response = self._call(
            "GetAllocatableResources",
            self.api.AllocatableResourcesRequest(),
            self.api.AllocatableResourcesResponse,
        )
        found: defaultdict[str, set[str]] = defaultdict(set)
        for devices in response.devices:
            found[devices.resource_name].update(devices.device_ids)
        return {resource: frozenset(ids) for resource, ids in found.items()}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def held_but_not_allocatable(
    held: list[HeldDevices], allocatable: dict[str, frozenset[str]]
) -> list[HeldDevices]:
    """The holdings that include a device the node no longer offers (pure: plain data in and out)."""
    return [
        HeldDevices(h.namespace, h.pod, h.container, h.resource, lost)
        for h in held
        if (lost := h.device_ids - allocatable.get(h.resource, frozenset()))
    ]

"""A client of the kubelet's PodResources API (v1) on its unix socket.

The two calls the agent needs take empty requests and answer with a few nested messages, so their
protobuf encoding is read here directly (fields by number, as in the kubelet's `api.proto`; everything
else skipped, as protobuf readers do): no generated code, no protobuf runtime.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc

from webhook.policy.health.holdings import ClaimHolding, Holding

SERVICE = "v1.PodResourcesLister"
# The kubelet's socket, under the directory the DaemonSet mounts read-only.
DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# Bounds the kubelet's own server sets on a message; a larger one is refused, not read.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of a message: bytes for length-delimited fields, ints otherwise."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, at = _varint(data, at)
            yield number, value
        elif wire_type == _LENGTH:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise WireError(f"field {number} runs past the message")
            yield number, data[at : at + size]
            at += size
        elif wire_type in (_FIXED64, _FIXED32):
            width = 8 if wire_type == _FIXED64 else 4
            if at + width > len(data):
                raise WireError(f"field {number} runs past the message")
            yield number, int.from_bytes(data[at : at + width], "little")
            at += width
        else:
            raise WireError(f"field {number} has wire type {wire_type}, which v1 never uses")


def _text(value: bytes | int) -> str:
    if isinstance(value, int):
        raise WireError("a string field holds a number")
    return value.decode("utf-8")


def _message(value: bytes | int) -> bytes:
    if isinstance(value, int):
        raise WireError("a message field holds a number")
    return value


def _devices(data: bytes) -> tuple[str, list[str]]:
    """ContainerDevices: resource_name = 1, device_ids = 2 (topology = 3 skipped)."""
    resource, ids = "", []
    for number, value in fields(data):
        if number == 1:
            resource = _text(value)
        elif number == 2:
            ids.append(_text(value))
    return resource, ids


def _containers(data: bytes) -> Iterator[tuple[str, str, bytes]]:
    """(namespace, pod, ContainerResources) of a ListPodResourcesResponse: pod_resources = 1 { name = 1,
    namespace = 2, containers = 3 }."""
    for number, pod_value in fields(data):
        if number != 1:
            continue
        pod = namespace = ""
        containers: list[bytes] = []
        for pod_field, value in fields(_message(pod_value)):
            if pod_field == 1:
                pod = _text(value)
            elif pod_field == 2:
                namespace = _text(value)
            elif pod_field == 3:
                containers.append(_message(value))
        for container_data in containers:
            yield namespace, pod, container_data


def decode_list(data: bytes) -> list[Holding]:
    """The device plugins' devices in a ListPodResourcesResponse: containers { name = 1, devices = 2 }.
    One Holding per container and resource (the kubelet may split a container's devices of one
    resource by topology: they are joined)."""
    found: defaultdict[tuple[str, str, str, str], set[str]] = defaultdict(set)
    for namespace, pod, container_data in _containers(data):
        container, held = "", []
        for container_field, value in fields(container_data):
            if container_field == 1:
                container = _text(value)
            elif container_field == 2:
                held.append(_devices(_message(value)))
        for resource, ids in held:
            found[namespace, pod, container, resource].update(ids)
    return [Holding(*key, device_ids=frozenset(ids)) for key, ids in found.items()]


def _claim_resource(data: bytes) -> tuple[str, str, str]:
    """ClaimResource: driver_name = 2, pool_name = 3, device_name = 4 (cdi_devices = 1 and share_id = 5
    skipped)."""
    named = {2: "", 3: "", 4: ""}
    for number, value in fields(data):
        if number in named:
            named[number] = _text(value)
    return named[2], named[3], named[4]


def _dynamic_resource(data: bytes) -> tuple[str, str, list[tuple[str, str, str]]]:
    """DynamicResource: claim_name = 2, claim_namespace = 3, claim_resources = 4 (1 is reserved)."""
    claim = namespace = ""
    devices = []
    for number, value in fields(data):
        if number == 2:
            claim = _text(value)
        elif number == 3:
            namespace = _text(value)
        elif number == 4:
            devices.append(_claim_resource(_message(value)))
    return claim, namespace, devices


def decode_claims(data: bytes) -> list[ClaimHolding]:
    """The DRA devices in a ListPodResourcesResponse: containers { name = 1, dynamic_resources = 5 }.
    One ClaimHolding per container, claim and device; a device without a driver, pool or name is
    none (nothing could fence it)."""
    found: dict[ClaimHolding, None] = {}
    for namespace, pod, container_data in _containers(data):
        container, dynamic = "", []
        for container_field, value in fields(container_data):
            if container_field == 1:
                container = _text(value)
            elif container_field == 5:
                dynamic.append(_dynamic_resource(_message(value)))
        for claim, claim_namespace, devices in dynamic:
            for driver, pool, device in devices:
                if driver and pool and device:
                    holding = ClaimHolding(
                        namespace, pod, container, claim_namespace, claim, driver, pool, device
                    )
                    found[holding] = None
    return list(found)


def decode_allocatable(data: bytes) -> dict[str, frozenset[str]]:
    """AllocatableResourcesResponse: devices = 1 (cpu_ids = 2, memory = 3 skipped)."""
    found: defaultdict[str, set[str]] = defaultdict(set)
    for number, value in fields(data):
        if number == 1:
            resource, ids = _devices(_message(value))
            found[resource].update(ids)
    return {resource: frozenset(ids) for resource, ids in found.items()}


def _raw(data: bytes) -> bytes:
    return data


class PodResourcesClient:
    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout: float = 10.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            f"unix://{socket}", options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        )

    def _call(self, method: str) -> bytes:
        call = self._channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_raw, response_deserializer=_raw
        )
        answer: bytes = call(b"", timeout=self.timeout)  # both requests are empty messages
        return answer

    def held(self) -> list[Holding]:
        """`List`: the devices each container of each pod on the node holds."""
        return decode_list(self._call("List"))

    def listed(self) -> tuple[list[Holding], list[ClaimHolding]]:
        """`List`, asked once: the device plugins' devices each container of each pod on the node holds
        (as `held`), and the DRA devices it holds through its claims."""
        answer = self._call("List")
        return decode_list(answer), decode_claims(answer)

    def allocatable(self) -> dict[str, frozenset[str]]:
        """`GetAllocatableResources`: resource name -> the IDs of the devices the node still offers."""
        return decode_allocatable(self._call("GetAllocatableResources"))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

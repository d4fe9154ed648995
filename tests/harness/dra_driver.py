"""A fake DRA driver on the kubelet's real gRPC APIs, for one node: what NVIDIA's GPU DRA driver
does there, without GPUs.

- Registration: a socket in the kubelet's `plugins_registry` folder serving
  `pluginregistration.Registration` (`GetInfo` names the driver, its endpoint and the services it
  speaks; the kubelet's plugin watcher finds the socket, asks, and says `NotifyRegistrationStatus`).
- Its endpoint, in the kubelet's `plugins/<driver>` folder, serves the DRA v1 service
  (`NodePrepareResources` / `NodeUnprepareResources`) and the device health stream
  (`dra-health/v1alpha1` `NodeWatchResources`).
- Prepare reads the claim's allocation from the API server, as a real driver does, and hands the
  kubelet its devices without CDI ids: the nodes' containerd runs with CDI off, and without one
  the kubelet names a device `<driver>/<pool>/<device>` in the pod's `allocatedResourcesStatus`.
- Publishing: the kubelet wipes a node's ResourceSlices when it starts and when a driver goes away,
  so the driver publishes its slice (one pool named after the node, N devices) once registered, as
  the admin rather than the node (a real driver's publisher runs as its own ServiceAccount); every
  publication moves the pool's generation on, as the kubeletplugin helper's publisher does.

The test flips a device's taints (`publish`) and its health (`set_health`); a device whose health
was never set is not streamed at all, so the kubelet reports it `Unknown`.

The driver runs outside the node's mount namespace: it reaches the kubelet's folders through the
node's work directory, and names its endpoint by the path the kubelet sees."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from tests.harness.controlplane import ControlPlane, KubectlError
from tests.harness.kubelet_api import (
    DRA_HEALTH_SERVICE,
    DRA_SERVICE,
    PLUGIN_REGISTRATION_SERVICE,
    KubeletApis,
)

DRA_PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
# How registration names the DRA service (dra/v1 types.go), not its gRPC name (DRA_SERVICE).
DRA_SERVICE_VERSION = "v1.DRAPlugin"
KUBELET_DIR_IN_NODE = Path("/var/lib/kubelet")  # what the kubelet's mount namespace binds the folder to
HEALTHY = "HEALTHY"
UNHEALTHY = "UNHEALTHY"
# How long the kubelet may trust a health report: longer than any test, so that a device stays as
# last reported instead of going Unknown for want of a repeat.
HEALTH_TIMEOUT_SECONDS = 3600
STREAM_WAKE_SECONDS = 1.0  # how often an idle health stream looks whether the kubelet hung up


def device_class(driver: str) -> dict[str, Any]:
    """The DeviceClass a cluster administrator installs with the driver: every device of it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


class FakeDraDriver:
    def __init__(
        self,
        apis: KubeletApis,
        plane: ControlPlane,
        kubelet_dir: Path,
        driver: str,
        node: str,
        devices: Sequence[str],
    ) -> None:
        self.apis = apis
        self.plane = plane
        self.driver = driver
        self.node = node
        self.devices = tuple(devices)
        self.kubelet_dir = kubelet_dir  # as this process sees it: KUBELET_DIR_IN_NODE in the node
        self.registration_socket = kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"
        self.endpoint = kubelet_dir / "plugins" / driver / "dra.sock"
        self.slice_name = f"{node}-{driver}"
        self.registered = threading.Event()
        self._prepared: dict[str, tuple[str, ...]] = {}  # claim UID -> its devices, while prepared
        self._claims = threading.Lock()  # prepare and unprepare come on the server's threads
        self._generation = 0  # the pool's, moved on by every publication
        self._health: dict[str, str] = {}  # only the devices whose health the driver reports
        self._changed = threading.Condition()
        self._version = 0  # bumped on every health change and on stop: wakes the streams
        self._stopping = False
        self._servers: list[grpc.Server] = []

    # --- the test's side ---------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Serves its endpoint, then puts up its registration socket and waits until the kubelet says
        it is registered."""
        self.endpoint.parent.mkdir(parents=True, exist_ok=True)
        self.registration_socket.parent.mkdir(parents=True, exist_ok=True)
        self._serve(self.endpoint, self._dra_handlers())
        # Last: the kubelet's plugin watcher acts on the socket's creation.
        self._serve(self.registration_socket, self._registration_handlers())
        if not self.registered.wait(timeout):
            raise TimeoutError(f"{self.node}: the kubelet did not register DRA driver {self.driver}")

    def publish(self, taints: Mapping[str, list[dict[str, str]]] | None = None) -> None:
        """The node's ResourceSlice: every device, with `taints` by device name."""
        self._generation += 1
        piece = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": self.slice_name},
            "spec": {
                "driver": self.driver,
                "nodeName": self.node,
                "pool": {"name": self.node, "generation": self._generation, "resourceSliceCount": 1},
                "devices": [
                    {"name": name, **({"taints": taints[name]} if taints and name in taints else {})}
                    for name in self.devices
                ],
            },
        }
        self.plane.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(piece))

    def prepared(self) -> dict[str, tuple[str, ...]]:
        """The claims the kubelet has prepared and not unprepared: claim UID -> device names."""
        with self._claims:
            return dict(self._prepared)

    def set_health(self, device: str, health: str) -> None:
        """From now on the health stream reports `device` as `health` (HEALTHY, UNHEALTHY)."""
        with self._changed:
            self._health[device] = health
            self._version += 1
            self._changed.notify_all()

    def stop(self) -> None:
        """Registration socket first (the kubelet deregisters the driver), then the endpoint; the
        ResourceSlice goes with the driver."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for server in reversed(self._servers):
            server.stop(grace=None)
        self._servers.clear()
        for socket in (self.registration_socket, self.endpoint):
            with contextlib.suppress(FileNotFoundError):  # removed already
                socket.unlink()
        self.plane.kubectl("delete", "resourceslice", self.slice_name, "--ignore-not-found", check=False)

    # --- gRPC plumbing -------------------------------------------------------------------------------

    def _serve(self, socket: Path, handlers: list[grpc.GenericRpcHandler]) -> None:
        with contextlib.suppress(FileNotFoundError):  # left by a driver that was killed
            socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-dra"))
        server.add_generic_rpc_handlers(handlers)
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        self._servers.append(server)

    def _registration_handlers(self) -> list[grpc.GenericRpcHandler]:
        api = self.apis.pluginregistration
        return [
            grpc.method_handlers_generic_handler(
                PLUGIN_REGISTRATION_SERVICE,
                {
                    "GetInfo": grpc.unary_unary_rpc_method_handler(
                        self._get_info,
                        request_deserializer=api.InfoRequest.FromString,
                        response_serializer=api.PluginInfo.SerializeToString,
                    ),
                    "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                        self._notify_registration_status,
                        request_deserializer=api.RegistrationStatus.FromString,
                        response_serializer=api.RegistrationStatusResponse.SerializeToString,
                    ),
                },
            )
        ]

    def _dra_handlers(self) -> list[grpc.GenericRpcHandler]:
        dra, health = self.apis.dra, self.apis.dra_health
        return [
            grpc.method_handlers_generic_handler(
                DRA_SERVICE,
                {
                    "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                        self._prepare,
                        request_deserializer=dra.NodePrepareResourcesRequest.FromString,
                        response_serializer=dra.NodePrepareResourcesResponse.SerializeToString,
                    ),
                    "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                        self._unprepare,
                        request_deserializer=dra.NodeUnprepareResourcesRequest.FromString,
                        response_serializer=dra.NodeUnprepareResourcesResponse.SerializeToString,
                    ),
                },
            ),
            grpc.method_handlers_generic_handler(
                DRA_HEALTH_SERVICE,
                {
                    "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                        self._watch_resources,
                        request_deserializer=health.NodeWatchResourcesRequest.FromString,
                        response_serializer=health.NodeWatchResourcesResponse.SerializeToString,
                    )
                },
            ),
        ]

    # --- the kubelet's side ------------------------------------------------------------------------

    def _get_info(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.apis.pluginregistration.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(KUBELET_DIR_IN_NODE / self.endpoint.relative_to(self.kubelet_dir)),
            # The kubelet picks the newest DRA service and health service both sides speak.
            supported_versions=[DRA_SERVICE_VERSION, DRA_HEALTH_SERVICE],
        )

    def _notify_registration_status(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.plugin_registered:
            self.registered.set()
        else:
            self.registered.clear()
        return self.apis.pluginregistration.RegistrationStatusResponse()

    def _allocated(self, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        """This driver's devices in the claim's allocation (the API server's word)."""
        claim = self.plane.kubectl_json("get", "resourceclaim", name, "-n", namespace)
        if claim["metadata"]["uid"] != uid:
            raise LookupError(f"claim {namespace}/{name} is {claim['metadata']['uid']}, not {uid}")
        results = (claim.get("status", {}).get("allocation") or {}).get("devices", {}).get("results") or []
        return [r for r in results if r["driver"] == self.driver and r["pool"] == self.node]

    def _prepare(self, request: Any, context: grpc.ServicerContext) -> Any:
        dra = self.apis.dra
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                results = self._allocated(claim.namespace, claim.name, claim.uid)
            except (LookupError, KubectlError) as error:
                response.claims[claim.uid].CopyFrom(dra.NodePrepareResourceResponse(error=str(error)))
                continue
            devices = [
                dra.Device(request_names=[r["request"]], pool_name=r["pool"], device_name=r["device"])
                for r in results
            ]
            with self._claims:
                self._prepared[claim.uid] = tuple(r["device"] for r in results)
            response.claims[claim.uid].CopyFrom(dra.NodePrepareResourceResponse(devices=devices))
        return response

    def _unprepare(self, request: Any, context: grpc.ServicerContext) -> Any:
        dra = self.apis.dra
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            with self._claims:
                self._prepared.pop(claim.uid, None)
            response.claims[claim.uid].CopyFrom(dra.NodeUnprepareResourceResponse())
        return response

    def _health_report(self) -> Any:
        health = self.apis.dra_health
        with self._changed:
            reported = sorted(self._health.items())
        now = int(time.time())
        return health.NodeWatchResourcesResponse(
            devices=[
                health.DeviceHealth(
                    device=health.DeviceIdentifier(pool_name=self.node, device_name=device),
                    health=health.HealthStatus.Value(status),
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                )
                for device, status in reported
            ]
        )

    def _watch_resources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The health of the devices it reports, now (when there are any) and after every change,
        until the kubelet hangs up; a driver whose devices' health was never set streams nothing."""
        while True:
            with self._changed:
                seen, reporting = self._version, bool(self._health)
            if reporting:
                yield self._health_report()
            with self._changed:
                while self._version == seen and context.is_active() and not self._stopping:
                    self._changed.wait(timeout=STREAM_WAKE_SECONDS)
                if not context.is_active() or self._stopping:
                    return

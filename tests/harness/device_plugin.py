"""A fake accelerator device plugin on the kubelet's real device plugin API (v1beta1): it serves
`DevicePlugin` on a unix socket in the kubelet's device-plugin folder, registers with the kubelet
(`Registration.Register`), streams its devices with their health (`ListAndWatch`) and answers
`Allocate` (and `GetDevicePluginOptions`, which the kubelet asks on connecting). The test flips a device's health; the kubelet then lowers allocatable and reports the
device's health on the pods holding it (`allocatedResourcesStatus`), as with a real GPU.

Like a real plugin it registers again whenever the kubelet restarts: a starting kubelet empties
the folder (the plugin's socket with it) and creates a new `kubelet.sock`. The test can restart it
as a configuration change or a crash does (`restart`: the same devices, renamed ones, fewer), and
hold it back from registering (`registration_held`: a plugin slow to come back)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tests.harness.kubelet_api import (
    DEVICE_PLUGIN_SERVICE,
    DEVICE_PLUGIN_VERSION,
    REGISTRATION_SERVICE,
    KubeletApis,
)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEVICES_ENV = "GPUGUARD_FAKE_DEVICES"  # what Allocate hands the container: the device IDs it got
WATCH_INTERVAL = 0.2  # how often the plugin looks for a new kubelet.sock (a kubelet restart)


@dataclass(frozen=True)
class Allocation:
    device_ids: tuple[str, ...]


class FakeDevicePlugin:
    def __init__(
        self,
        apis: KubeletApis,
        plugin_dir: Path,
        resource: str,
        device_ids: Sequence[str],
    ) -> None:
        self.api = apis.deviceplugin
        self.plugin_dir = plugin_dir
        self.resource = resource
        # The devices it enumerates when it starts: what `restart()` without devices comes back with.
        self.device_ids = tuple(device_ids)
        self._health = dict.fromkeys(device_ids, HEALTHY)
        self._changed = threading.Condition()
        self._generation = 0  # bumped on every health change and on stop: wakes the streams
        self._stopping = threading.Event()
        # Serving and registering, by the watcher (a new kubelet) or by a restart: one at a time.
        self._lifecycle = threading.Lock()
        self._server: grpc.Server | None = None
        self._socket: Path | None = None
        self._registered_with: tuple[int, int] | None = None  # the kubelet.sock registered with
        self._held = threading.Event()
        self._watcher: threading.Thread | None = None
        self.allocations: list[Allocation] = []
        self.registrations = 0

    # --- the test's side ---------------------------------------------------------------------------

    def start(self) -> None:
        """Serves and registers once the kubelet's socket is there, then keeps registered."""
        self._watcher = threading.Thread(
            target=self._keep_registered, name=f"plugin {self.resource}", daemon=True
        )
        self._watcher.start()

    def set_health(self, device_id: str, health: str) -> None:
        with self._changed:
            if device_id not in self._health:
                raise KeyError(device_id)
            self._health[device_id] = health
            self._generation += 1
            self._changed.notify_all()

    def health(self) -> dict[str, str]:
        with self._changed:
            return dict(self._health)

    def restart(self, device_ids: Sequence[str] | None = None) -> None:
        """The plugin restarts, as after a crash or a change of its configuration: its server goes (the
        kubelet's stream ends, and the kubelet marks every device unhealthy), and it comes back at once
        enumerating `device_ids` (its first devices when None), all healthy, and registers again
        (unless held). The GPU operator's time-slicing config comes back with every ID renamed
        (`GPU-<uuid>::<n>`); a plugin restarted after a GPU fell off the bus, with one device fewer."""
        with self._lifecycle:
            self._stop_server()
            with self._changed:
                self._health = dict.fromkeys(self.device_ids if device_ids is None else device_ids, HEALTHY)
                self._generation += 1
                self._changed.notify_all()
            self._registered_with = None
            self._register_if_due()

    @contextlib.contextmanager
    def registration_held(self) -> Iterator[None]:
        """Inside, the plugin does not register with a kubelet it is not registered with (a restarted
        one): a plugin slow to come back, so that what the kubelet reports without it can be seen. It
        registers on its next look once released."""
        self._held.set()
        try:
            yield
        finally:
            self._held.clear()

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        with self._lifecycle:
            self._stop_server()

    # --- registration --------------------------------------------------------------------------------

    def _kubelet_socket(self) -> tuple[int, int] | None:
        try:
            info = (self.plugin_dir / "kubelet.sock").stat()
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_ctime_ns

    def _keep_registered(self) -> None:
        while not self._stopping.is_set():
            with self._lifecycle:
                self._register_if_due()
            self._stopping.wait(WATCH_INTERVAL)

    def _register_if_due(self) -> None:
        """Serves and registers with a kubelet it is not registered with: at the start, after the
        kubelet restarted (a new kubelet.sock), after a restart of the plugin."""
        current = self._kubelet_socket()
        if current is None or current == self._registered_with or self._held.is_set():
            return
        try:
            self._serve_and_register()
        except grpc.RpcError:
            return  # a kubelet still starting: try again on the next look
        self._registered_with = current

    def _serve_and_register(self) -> None:
        self._stop_server()
        # A socket of its own for each registration, as a new plugin process may name it: the kubelet
        # then never mistakes the new registration for the connection it is still winding up (same
        # path: "device plugin already connected").
        socket = (
            self.plugin_dir / f"gpuguard-fake-{self.resource.replace('/', '-')}-{self.registrations}.sock"
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-plugin"))
        api = self.api
        handlers = {
            # The kubelet asks for the options again when it connects, whatever Register said.
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda request, context: api.DevicePluginOptions(),
                request_deserializer=api.Empty.FromString,
                response_serializer=api.DevicePluginOptions.SerializeToString,
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch,
                request_deserializer=api.Empty.FromString,
                response_serializer=api.ListAndWatchResponse.SerializeToString,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self._allocate,
                request_deserializer=api.AllocateRequest.FromString,
                response_serializer=api.AllocateResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(DEVICE_PLUGIN_SERVICE, handlers),)
        )
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        self._server, self._socket = server, socket
        with grpc.insecure_channel(f"unix://{self.plugin_dir / 'kubelet.sock'}") as channel:
            register = channel.unary_unary(
                f"/{REGISTRATION_SERVICE}/Register",
                request_serializer=api.RegisterRequest.SerializeToString,
                response_deserializer=api.Empty.FromString,
            )
            request = api.RegisterRequest(
                version=DEVICE_PLUGIN_VERSION,
                endpoint=socket.name,  # relative to the kubelet's device-plugin folder
                resource_name=self.resource,
                options=api.DevicePluginOptions(),
            )
            register(request, timeout=10)
        self.registrations += 1

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self._socket is not None:
            with contextlib.suppress(FileNotFoundError):  # a starting kubelet empties the folder
                self._socket.unlink()
            self._socket = None

    # --- the kubelet's side ------------------------------------------------------------------------

    def _devices(self) -> Any:
        with self._changed:
            devices = [self.api.Device(ID=i, health=h) for i, h in sorted(self._health.items())]
        return self.api.ListAndWatchResponse(devices=devices)

    def _list_and_watch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        """The device list now and after every health change, until the kubelet hangs up."""
        while True:
            with self._changed:
                seen = self._generation
            yield self._devices()
            with self._changed:
                while self._generation == seen and context.is_active() and not self._stopping.is_set():
                    self._changed.wait(timeout=1.0)  # wake now and then to notice a closed stream
            if not context.is_active() or self._stopping.is_set():
                return

    def _allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        responses = []
        for container in request.container_requests:
            ids = tuple(container.devices_ids)
            self.allocations.append(Allocation(ids))
            responses.append(self.api.ContainerAllocateResponse(envs={DEVICES_ENV: ",".join(ids)}))
        return self.api.AllocateResponse(container_responses=responses)

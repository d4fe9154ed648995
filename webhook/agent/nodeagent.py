"""The poll loop of `gpuguard node-agent`: one replica per node (a DaemonSet); its composition root is
webhook.processes.node_agent.

Every `interval` seconds it asks the kubelet's PodResources API which devices the node's pods hold
and which the node still allocates, and keeps each pod's `GPUGuardDevicesAllocatable` condition true
to that (webhook.policy.health.holdings decides what to write). The pod device-health watcher of
`gpuguard controllers` reads the condition as it reads `allocatedResourcesStatus`, and decides under
the policy whether to evict. The agent itself only reports: it never evicts, taints or deletes. What
it remembers in memory (each resource's allocatable set on the last poll, the devices that left it,
when it first saw a loss) only decides and delays a first report; a report already made is read back
from the pod, so a restarted agent neither forgets nor repeats one.

DRA devices are not in the allocatable sets: the agent reads which pod holds which of them (driver,
pool, device, and the claim) as the kubelet sees it, and its own node's ResourceSlices say which have
failed (webhook.policy.health.claimloss decides): a pod holding one gets the same condition, naming
the device and why, under the same guards. It reports the holders in its `/policy` status
(`draDevices`) and a gauge.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from webhook.agent.podresources import DEFAULT_SOCKET
from webhook.kube.events import EventRecorder, ObjectRef
from webhook.kube.remediation import ConflictError, NotFoundError
from webhook.policy.health import claimloss, holdings
from webhook.policy.health.holdings import (
    ClaimHolding,
    DeviceHolders,
    DeviceKey,
    Holding,
    PodView,
    Registration,
)
from webhook.policy.health.observed import SliceFacts
from webhook.policy.model_health import DeviceTaintSignal
from webhook.runtime.metrics import Registry

log = logging.getLogger("gpuguard.node-agent")

# The taints that fail a DRA device here: the agent reads no policy, so any driver taint of effect
# NoSchedule or NoExecute (the default policy's `deviceTaints.keys: []`); the controllers' policy
# decides what is done about the condition.
ANY_DEVICE_TAINT = DeviceTaintSignal(keys=[], forSeconds=0)


@dataclass(frozen=True)
class Options:
    node: str
    socket: Path = DEFAULT_SOCKET
    interval: float = 10.0
    # How long a device must stay held-but-not-allocatable before it is reported.
    confirm_seconds: float = 30.0
    host: str = "0.0.0.0"
    port: int = 8082
    kubeconfig: str | None = None


class PodResources(Protocol):
    def listed(self) -> tuple[list[Holding], list[ClaimHolding]]: ...

    def allocatable(self) -> dict[str, frozenset[str]]: ...


class PodCache(Protocol):
    def snapshot(self) -> dict[Hashable, PodView]: ...

    def has_synced(self) -> bool: ...


class SliceCache(Protocol):
    def snapshot(self) -> dict[Hashable, SliceFacts]: ...

    def has_synced(self) -> bool: ...


class StatusWriter(Protocol):
    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...


@dataclass
class Observation:
    """What the last poll saw, for the metrics and /readyz."""

    ok: bool = False
    lost: dict[str, int] = field(default_factory=dict)
    unregistered: tuple[str, ...] = ()
    # DRA device id -> the pods holding it on this node, and their claims.
    dra: dict[str, DeviceHolders] = field(default_factory=dict)
    # DRA device id -> why it failed, of those held here.
    dra_failed: Mapping[str, str] = field(default_factory=dict)

    def dra_devices_by_driver(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for holders in self.dra.values():
            counts[holders.driver] = counts.get(holders.driver, 0) + 1
        return counts


class NodeAgent:
    def __init__(
        self,
        options: Options,
        *,
        resources: PodResources,
        pods: PodCache,
        slices: SliceCache,
        writer: StatusWriter,
        events: EventRecorder,
        registry: Registry,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.resources = resources
        self.pods = pods
        self.slices = slices
        self.writer = writer
        self.events = events
        self.registry = registry
        self.stop = stop
        self.clock = clock
        self.first_seen: dict[DeviceKey, float] = {}
        self.registrations: Mapping[str, Registration] = {}
        self.observation = Observation()
        registry.counter("gpuguard_node_agent_polls_total", "PodResources polls by outcome", ("outcome",))
        registry.counter(
            "gpuguard_node_agent_condition_writes_total",
            "pod condition writes by condition status and outcome",
            ("status", "outcome"),
        )
        registry.counter(
            "gpuguard_node_agent_reregistrations_total",
            "allocatable device sets replaced wholesale (a plugin registered again under other IDs: no loss)",
            ("resource",),
        )
        registry.gauge(
            "gpuguard_node_agent_lost_devices",
            "devices held by pods but no longer allocatable, by resource (last poll)",
            ("resource",),
            lambda: [((resource,), float(n)) for resource, n in self.observation.lost.items()],
        )
        registry.gauge(
            "gpuguard_node_agent_unregistered_resources",
            "resources held by pods whose device plugin offers no device at all (last poll)",
            ("resource",),
            lambda: [((resource,), 1.0) for resource in self.observation.unregistered],
        )
        registry.gauge(
            "gpuguard_node_agent_dra_devices",
            "DRA devices pods hold through their resource claims, by driver (last poll)",
            ("driver",),
            lambda: [((driver,), float(n)) for driver, n in self.observation.dra_devices_by_driver().items()],
        )

    def poll(self) -> None:
        """One pass: read the kubelet, decide, write the differences. A failed read changes nothing."""
        try:
            (held, claims), allocatable = self.resources.listed(), self.resources.allocatable()
        except Exception as exc:  # grpc errors and unreadable answers alike: report, keep what is written
            log.warning(
                "PodResources API unreadable: %s", exc, extra={"fields": {"socket": str(self.options.socket)}}
            )
            self.registry.inc("gpuguard_node_agent_polls_total", "error")
            self.observation = Observation()
            return
        self.registry.inc("gpuguard_node_agent_polls_total", "ok")
        now = self.clock()
        pods = {str(key): pod for key, pod in self.pods.snapshot().items()}
        reported = holdings.reported_devices(pods.values())
        loss = holdings.loss(held, allocatable, self.registrations, reported)
        self.registrations = loss.registrations
        dra = self._claim_loss(claims, pods)
        seen = holdings.device_keys(loss.lost) | holdings.device_keys(dra.lost)
        self.first_seen = {key: self.first_seen.get(key, now) for key in seen}
        lost = holdings.confirmed(
            [*loss.lost, *dra.lost], self.first_seen, reported, now, self.options.confirm_seconds
        )
        unsure_resources = {*loss.unregistered, *loss.reregistered}
        unsure = {h.pod_key for h in held if h.resource in unsure_resources} | dra.unsure
        counts: dict[str, int] = {}
        for holding in loss.lost:
            counts[holding.resource] = counts.get(holding.resource, 0) + len(holding.device_ids)
        self.observation = Observation(True, counts, loss.unregistered, holdings.dra_holders(claims), dra.why)
        if loss.unregistered:
            log.warning(
                "no device of %s is allocatable: its plugin is not registered; pods holding it keep their condition",
                ", ".join(loss.unregistered),
            )
        for resource in loss.reregistered:
            self.registry.inc("gpuguard_node_agent_reregistrations_total", resource)
        if loss.reregistered:
            log.warning(
                "the allocatable devices of %s were replaced wholesale: their plugin registered again under"
                " other IDs, which is no device failure; pods holding them keep their condition",
                ", ".join(loss.reregistered),
            )
        for write in holdings.writes(pods, lost, unsure=unsure, why=dra.why):
            self._write(write)

    def _claim_loss(self, claims: list[ClaimHolding], pods: Mapping[str, PodView]) -> claimloss.ClaimLoss:
        """The failed DRA devices held here; until the node's ResourceSlices are cached, none, and
        every pod holding one keeps what its condition says."""
        if not self.slices.has_synced():
            return claimloss.ClaimLoss(unsure=frozenset(h.pod_key for h in claims))
        return claimloss.claim_loss(claims, self.slices.snapshot().values(), pods, ANY_DEVICE_TAINT)

    def _write(self, write: holdings.Write) -> None:
        pod, condition = write.pod, write.condition
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        written = {
            "type": holdings.CONDITION_TYPE,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastProbeTime": now,
        }
        if pod.condition is None or pod.condition.status != condition.status:
            # Moves only with the status, as the kubelet's and the node controller's do; a strategic
            # merge keeps the one the pod carries when the patch leaves it out.
            written["lastTransitionTime"] = now
        patch = {
            "metadata": {"resourceVersion": pod.resource_version},
            "status": {"conditions": [written]},
        }
        try:
            self.writer.patch_status(pod.namespace, pod.name, patch)
        except ConflictError:
            # The pod changed since it was cached: the next poll decides on the newer version.
            self.registry.inc("gpuguard_node_agent_condition_writes_total", condition.status, "conflict")
            return
        except NotFoundError:
            self.registry.inc("gpuguard_node_agent_condition_writes_total", condition.status, "gone")
            return
        self.registry.inc("gpuguard_node_agent_condition_writes_total", condition.status, "written")
        lost = condition.status == "False"
        log.warning(
            "pod holds a device its node no longer allocates"
            if lost
            else "pod's devices are allocatable again",
            extra={"fields": {"pod": pod.key, "node": self.options.node, "devices": condition.message}},
        )
        self.events.record(
            ObjectRef("v1", "Pod", pod.namespace, pod.name, pod.uid),
            "DeviceNotAllocatable" if lost else "DevicesAllocatable",
            f"on node {self.options.node}: {condition.message}" if lost else condition.message,
            action="ReportDeviceHealth",
            warning=lost,
        )

    def run(self) -> None:
        while not self.stop.is_set():
            if self.pods.has_synced():
                self.poll()
            self.stop.wait(self.options.interval)

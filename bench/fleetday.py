"""A fleet day, simulated: gpuguard's real controllers replayed over a scripted day of a GPU fleet.

    python -m bench.fleetday [--nodes 1000] [--seed 26] [--examples 1] [--only ordinary|failures|wave]

The node health controller, the pod device-health watcher and the node agent run as they do in
`gpuguard controllers` and `gpuguard node-agent` (the same classes, the same pure core, real informers
and work queues), against an API that exists only in memory: scripted Nodes and Pods change as a fleet's
do, and every write gpuguard sends (condition, taint, cordon, record annotation, eviction, the breaker's
ConfigMap, the agent's pod condition) is recorded and applied back to the objects, whose watch events
then reach the informers as they would. Time is a fake clock advanced a second at a time, skipping the
seconds when nothing is due: a quiet day takes seconds of CPU (one that acts, as many as its reconciles
cost), and the same seed gives the same day.

Three runs, each from a fleet of `--nodes` GPU nodes (8 GPUs each, a device plugin pod and four GPU pods
per node) in 10 pools over 3 zones, with the policy's defaults in enforce mode:

- the ordinary day: a 30% scale-up with 8-minute driver installs, a reboot wave, a 15-minute zone
  partition, a device-plugin config rollout that renames every device, a DRA driver upgrade, kubelet
  restarts, a MIG reconfiguration of one pool, the scale-down. Floor: no write at all.
- the same day with 19 real device failures per 1,000 nodes. Floors: each failed node tainted (the pod
  holding a device reported Unhealthy evicted) within its signal's `forSeconds` plus one resync
  (`RESYNC_SECONDS`), no write on a node that did not fail, never more nodes tainted in a pool than
  its budget.
- a rolling bad-driver wave: nodes fail one after another, some replaced by new nodes meanwhile. Floor:
  the breaker opens when the number of nodes that became due passes `circuitBreaker.maxNodes`.

and the memory the ledger and the breaker hold, hour by hour: flat across the day's churn is a floor.
Exits 3 (bench.FLOOR_MISSED) when a floor is missed; the writes each run made are listed under the
table, by the event that last touched their node, with the reasons gpuguard gave.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import heapq
import itertools
import logging
import math
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from bench import FLOOR_MISSED
from webhook.agent.nodeagent import NodeAgent
from webhook.agent.nodeagent import Options as AgentOptions
from webhook.controllers import series
from webhook.controllers.breaker import Breaker
from webhook.controllers.wiring import HealthControllers
from webhook.kube.events import EventRecorder, ObjectRef, Reason
from webhook.kube.informer import Informer, ListPage, listed_events
from webhook.kube.queue import WorkQueue
from webhook.kube.remediation import ConflictError, EvictionOutcome, NotFoundError, StoredState
from webhook.policy.health import holdings, ladder, observed, records
from webhook.policy.model import Policy, parse_policy
from webhook.policy.model_health import scaled_count
from webhook.runtime.metrics import Registry

JSON = dict[str, Any]

DAY_SECONDS = 24 * 3600
TICK_SECONDS = 1
# How late after its signal's forSeconds a failure may be acted on: the longest a controller waits
# before it looks at a node again without any object changing (a held node's recheck).
RESYNC_SECONDS = ladder.HELD_RECHECK_SECONDS
START = datetime.datetime(2026, 3, 2, tzinfo=datetime.UTC)

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"
MIG_SLICES = 7
GPUS = 8
WORKERS = 4  # GPU pods per node, two GPUs each
POOLS = 10
ZONES = 3
DRA_POOL = "pool-9"  # GPUs through the DRA driver: no nvidia.com/gpu, pods hold resource claims
MIG_POOL = "pool-3"
PARTITIONED_ZONE = "zone-1"
FAILURES_PER_1000 = 19
PLUGIN_NAMESPACE = "gpu-operator"
PLUGIN_LABELS = {"app": "nvidia-device-plugin-daemonset"}
DRA_PLUGIN_LABELS = {"app": "nvidia-dra-driver-gpu-kubelet-plugin"}
WORK_NAMESPACE = "ml"
UNREACHABLE_TAINTS = (
    {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
)
AGENT_INTERVAL_SECONDS = 10
# How long after its node's last scripted change a node agent keeps polling: past its confirmation
# (30 s), so that it sees every transition a change brings.
AGENT_WATCH_SECONDS = 300
# The floor on memory across the day: what the ledger and breaker hold at the end of the ordinary
# day (the fleet back to its size at the start) against the start.
MEMORY_GROWTH = 1.25
MEMORY_SLACK_BYTES = 32 * 1024

say: Callable[[str], None] = lambda text: print(f"bench: {text}", file=sys.stderr, flush=True)  # noqa: E731


def enforcing() -> Policy:
    """The defaults, every action enforced: what a platform team turns on."""
    return parse_policy(yaml.safe_dump({"health": {"mode": "enforce"}}))


# --- the scripted API objects --------------------------------------------------------------------------


@dataclass
class SimPod:
    namespace: str
    name: str
    uid: str
    node: str
    daemon: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = True
    pending: bool = False  # waiting in init containers: not started
    started_at: datetime.datetime | None = None
    crash_looping: bool = False
    # What a worker holds: the resource and the device IDs the kubelet allocated to it.
    resource: str = ""
    device_ids: tuple[str, ...] = ()
    claim: bool = False
    # Conditions written through the API (the node agent's), by type.
    written: dict[str, JSON] = field(default_factory=dict)
    version: int = 0

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def raw(self, node: SimNode) -> JSON:
        conditions: list[JSON] = [{"type": "Ready", "status": "True" if self.ready else "False"}]
        conditions += self.written.values()
        container: JSON = {"name": "main", "ready": self.ready, "restartCount": 0}
        if self.crash_looping:
            container["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
        elif self.started_at is not None and not self.pending:
            container["state"] = {"running": {"startedAt": records.format_time(self.started_at)}}
        else:
            container["state"] = {"waiting": {"reason": "PodInitializing"}}
        spec: JSON = {"nodeName": self.node, "containers": [{"name": "main"}]}
        if self.resource:
            container["allocatedResourcesStatus"] = [
                {
                    "name": f"claim:gpu/{self.resource}" if self.claim else self.resource,
                    "resources": [
                        {"resourceID": d, "health": node.device_health(d)} for d in self.device_ids
                    ],
                }
            ]
            if self.claim:
                spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": f"{self.name}-gpu"}]
            else:
                count = str(len(self.device_ids))
                spec["containers"][0]["resources"] = {"limits": {self.resource: count}}
        owner = {"kind": "DaemonSet" if self.daemon else "Job", "name": "owner", "controller": True}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "resourceVersion": str(self.version),
                "labels": dict(self.labels),
                "ownerReferences": [owner],
            },
            "spec": spec,
            "status": {
                "phase": "Pending" if self.pending else "Running",
                "conditions": conditions,
                "containerStatuses": [container],
            },
        }


@dataclass
class SimNode:
    name: str
    uid: str
    pool: str
    zone: str
    dra: bool = False
    # The hardware and the software on it, from which capacity, allocatable and device health follow.
    gpus: int = GPUS
    gone: int = 0  # GPUs fallen off the bus and no longer enumerated (the first ones)
    broken: int = 0  # GPUs the plugin reports unhealthy (the first ones it enumerates)
    registered: bool = True  # the device plugin (or DRA driver) is registered with the kubelet
    known: bool = True  # the kubelet has had the resource since the node joined (0 when unregistered)
    renamed: bool = False  # the plugin's ID strategy changed: every device has a new ID
    mig: bool = False
    dra_streaming: bool = True  # the DRA driver streams device health
    unhealthy_claims: set[str] = field(default_factory=set)
    ready: str = "True"
    conditions: dict[str, str] = field(default_factory=dict)
    taints: list[JSON] = field(default_factory=list)
    unschedulable: bool = False
    annotations: dict[str, str] = field(default_factory=dict)
    own_condition: JSON | None = None
    plugin: SimPod | None = None
    workers: dict[str, SimPod] = field(default_factory=dict)
    version: int = 0

    @property
    def resource(self) -> str:
        return MIG if self.mig else GPU

    def device_ids(self) -> list[str]:
        """Every device the plugin enumerates, in order (the broken ones first); a GPU keeps its ID
        when another falls off the bus."""
        if self.dra:
            return [f"gpu.nvidia.com/{self.name}/gpu-{i}" for i in range(self.gone, self.gpus)]
        if self.mig:
            return [f"MIG-{self.uid}-{g}-{s}" for g in range(self.gone, self.gpus) for s in range(MIG_SLICES)]
        return [str(i) if self.renamed else f"GPU-{self.uid}-{i}" for i in range(self.gone, self.gpus)]

    def allocatable_ids(self) -> frozenset[str]:
        if not self.registered or self.dra:
            return frozenset()
        per_gpu = MIG_SLICES if self.mig else 1
        return frozenset(self.device_ids()[self.broken * per_gpu :])

    def device_health(self, device: str) -> str:
        if self.dra:
            if not self.dra_streaming:
                return "Unknown"
            return "Unhealthy" if device in self.unhealthy_claims else "Healthy"
        # The kubelet reads a device it has no word on (its plugin not registered, or an ID the plugin no
        # longer lists) as Healthy.
        known = self.registered and device in self.device_ids()
        return "Unhealthy" if known and device not in self.allocatable_ids() else "Healthy"

    def extended(self) -> tuple[dict[str, str], dict[str, str]]:
        if self.dra or not self.known:
            return {}, {}
        per_gpu = MIG_SLICES if self.mig else 1
        capacity = {self.resource: (self.gpus - self.gone) * per_gpu if self.registered else 0}
        allocatable = {self.resource: len(self.allocatable_ids())}
        if self.mig:
            # The kubelet keeps a resource it once had at 0.
            capacity[GPU], allocatable[GPU] = 0, 0
        return {k: str(v) for k, v in capacity.items()}, {k: str(v) for k, v in allocatable.items()}

    def raw(self) -> JSON:
        capacity, allocatable = self.extended()
        conditions: list[JSON] = [{"type": "Ready", "status": self.ready}]
        conditions += [{"type": t, "status": s} for t, s in self.conditions.items()]
        if self.own_condition is not None:
            conditions.append(self.own_condition)
        labels = {
            "karpenter.sh/nodepool": self.pool,
            "topology.kubernetes.io/zone": self.zone,
            "nvidia.com/gpu.present": "true",
            "feature.node.kubernetes.io/pci-10de.present": "true",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
        }
        if self.mig:
            labels["nvidia.com/mig.config"] = "all-1g.10gb"
        spec: JSON = {"taints": [dict(t) for t in self.taints]}
        if self.unschedulable:
            spec["unschedulable"] = True
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "uid": self.uid,
                "resourceVersion": str(self.version),
                "labels": labels,
                "annotations": dict(self.annotations),
            },
            "spec": spec,
            "status": {
                "capacity": {"cpu": "192", "pods": "110", **capacity},
                "allocatable": {"cpu": "190", "pods": "110", **allocatable},
                "conditions": conditions,
            },
        }


@dataclass
class Write:
    """One write gpuguard sent, as the API would have applied it."""

    at: int  # seconds into the day
    kind: str  # condition, taint, untaint, cordon, uncordon, record, evict, pod condition, breaker
    node: str
    target: str
    why: str
    cause: str  # the scripted event that last touched the node
    false: bool  # the node had not failed


class Cluster:
    """The API objects of the day, the fake clock, and what the informers are yet to be told."""

    def __init__(self) -> None:
        self.seconds = 0
        self.nodes: dict[str, SimNode] = {}
        self.pods: dict[str, tuple[SimPod, str]] = {}  # pod key -> (pod, node name)
        self.versions = itertools.count(1)
        self.uids = itertools.count(1)
        self.pending: list[tuple[str, JSON]] = []  # (informer, watch event) not yet delivered
        self.cause: dict[str, str] = {}
        self.failed: dict[str, int] = {}  # node -> when it failed
        self.writes: list[Write] = []
        self.events = 0
        self.breaker_data: dict[str, str] = {}
        self.breaker_version = 0
        self.on_taint: list[Callable[[SimNode], None]] = []

    @property
    def now(self) -> datetime.datetime:
        return START + datetime.timedelta(seconds=self.seconds)

    def monotonic(self) -> float:
        return float(self.seconds)

    def uid(self) -> str:
        return f"{next(self.uids):08x}"

    # --- the scripted side ---------------------------------------------------------------------------

    def node_changed(self, node: SimNode, *, scripted: bool = True) -> None:
        node.version = next(self.versions)
        self.pending.append(("nodes", {"type": "MODIFIED", "object": node.raw()}))
        self.events += scripted
        if not scripted:
            return  # gpuguard's marks: nothing the kubelet reports on the pods changes
        # The kubelet rewrites its pods' device health as the plugin's word on the devices changes.
        for pod in [node.plugin, *node.workers.values()]:
            if pod is not None:
                self.pod_changed(pod, scripted=False)

    def pod_changed(self, pod: SimPod, *, scripted: bool = True) -> None:
        node = self.nodes[pod.node]
        pod.version = next(self.versions)
        self.pending.append(("pods", {"type": "MODIFIED", "object": pod.raw(node)}))
        self.events += scripted

    def add_node(self, node: SimNode) -> None:
        self.nodes[node.name] = node
        self.node_changed(node)

    def add_pod(self, node: SimNode, pod: SimPod) -> None:
        if pod.daemon:
            node.plugin = pod
        else:
            node.workers[pod.key] = pod
        self.pods[pod.key] = (pod, node.name)
        self.pod_changed(pod)

    def delete_pod(self, key: str, *, scripted: bool = True) -> None:
        pod, node_name = self.pods.pop(key)
        node = self.nodes[node_name]
        node.workers.pop(key, None)
        if node.plugin is pod:
            node.plugin = None
        self.pending.append(("pods", {"type": "DELETED", "object": pod.raw(node)}))
        self.events += scripted

    def delete_node(self, node: SimNode) -> None:
        for key in [*node.workers, *([node.plugin.key] if node.plugin else [])]:
            self.delete_pod(key, scripted=False)
        del self.nodes[node.name]
        self.failed.pop(node.name, None)
        self.pending.append(("nodes", {"type": "DELETED", "object": node.raw()}))
        self.events += 1

    # --- what gpuguard wrote -------------------------------------------------------------------------

    def wrote(self, kind: str, node: str, target: str, why: str) -> None:
        """Records a write; it is false when its node (for the breaker: any node) had not failed."""
        failed = self.failed.values() if not node else [self.failed[node]] if node in self.failed else []
        false = not any(at <= self.seconds for at in failed)
        cause = self.cause.get(node, "no event (steady state)")
        self.writes.append(Write(self.seconds, kind, node, target, why, cause, false))


def new_node(cluster: Cluster, index: int, *, pool: str | None = None, started: bool = True) -> SimNode:
    """A node of the fleet with its device plugin (or DRA driver) pod; workers are scheduled apart."""
    pool = pool or f"pool-{index % POOLS}"
    node = SimNode(
        name=f"gpu-{index:05d}",
        uid=cluster.uid(),
        pool=pool,
        zone=f"zone-{index % ZONES}",
        dra=pool == DRA_POOL,
    )
    plugin = SimPod(
        PLUGIN_NAMESPACE,
        f"{'dra-plugin' if node.dra else 'device-plugin'}-{node.name}",
        cluster.uid(),
        node.name,
        daemon=True,
        labels=dict(DRA_PLUGIN_LABELS if node.dra else PLUGIN_LABELS),
        started_at=cluster.now - datetime.timedelta(hours=1) if started else None,
        ready=started,
        pending=not started,
    )
    if not started:
        node.registered = node.known = False
    cluster.add_node(node)
    cluster.add_pod(node, plugin)
    return node


def schedule_workers(cluster: Cluster, node: SimNode) -> None:
    """Four GPU pods take every device the node offers, in order."""
    ids = node.device_ids()
    per_pod = max(len(ids) // WORKERS, 1)
    for index in range(WORKERS):
        pod = SimPod(
            WORK_NAMESPACE,
            f"train-{node.name}-{cluster.uid()}",
            cluster.uid(),
            node.name,
            started_at=cluster.now,
            resource="req" if node.dra else node.resource,
            device_ids=tuple(ids[index * per_pod : (index + 1) * per_pod]),
            claim=node.dra,
        )
        cluster.add_pod(node, pod)


# --- the fake API boundary: gpuguard's writes, recorded and applied ------------------------------------


class NodeApi:
    """`NodeWrites`: merge patches of the node and strategic merge patches of its status."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _node(self, name: str, patch: JSON) -> SimNode:
        node = self.cluster.nodes.get(name)
        if node is None:
            raise NotFoundError(name)
        if patch.get("metadata", {}).get("resourceVersion") != str(node.version):
            raise ConflictError(name)
        return node

    def patch_status(self, name: str, patch: JSON) -> JSON:
        node = self._node(name, patch)
        for condition in patch["status"]["conditions"]:
            if condition.get("$patch") == "delete":
                node.own_condition = None
                self.cluster.wrote("condition", name, name, "removed")
            else:
                merged = {**(node.own_condition or {}), **condition}
                node.own_condition = merged
                self.cluster.wrote(
                    "condition", name, name, f"{merged['status']} {merged['reason']}: {merged['message']}"
                )
        return self._changed(node)

    def patch(self, name: str, patch: JSON) -> JSON:
        node = self._node(name, patch)
        spec = patch.get("spec", {})
        why = node.own_condition["message"] if node.own_condition else ""
        if "taints" in spec:
            was = any(t["key"] == observed.TAINT_KEY for t in node.taints)
            node.taints = [dict(t) for t in spec["taints"]]
            now = any(t["key"] == observed.TAINT_KEY for t in node.taints)
            if was != now:
                self.cluster.wrote("taint" if now else "untaint", name, name, why)
        if "unschedulable" in spec:
            node.unschedulable = spec["unschedulable"] is True
            self.cluster.wrote("cordon" if node.unschedulable else "uncordon", name, name, why)
        annotations = patch["metadata"].get("annotations", {})
        for key, value in annotations.items():
            if value is None:
                node.annotations.pop(key, None)
            else:
                node.annotations[key] = value
            if key == records.RECORD_ANNOTATION:
                self.cluster.wrote("record", name, name, value or "removed")
        result = self._changed(node)
        if any(t["key"] == observed.TAINT_KEY for t in node.taints):
            for react in self.cluster.on_taint:
                react(node)
        return result

    def _changed(self, node: SimNode) -> JSON:
        self.cluster.node_changed(node, scripted=False)
        return {"metadata": {"resourceVersion": str(node.version)}}


class EvictionApi:
    """`Evictions`: no PodDisruptionBudget refuses here; the pod terminates at once."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def evict(self, namespace: str, name: str, uid: str) -> EvictionOutcome:
        key = f"{namespace}/{name}"
        found = self.cluster.pods.get(key)
        if found is None or found[0].uid != uid:
            return EvictionOutcome("gone")
        self.cluster.wrote("evict", found[1], key, "")
        self.cluster.delete_pod(key, scripted=False)
        return EvictionOutcome("evicted")


class PodStatusApi:
    """The node agent's `StatusWriter`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def patch_status(self, namespace: str, name: str, patch: JSON) -> JSON:
        key = f"{namespace}/{name}"
        found = self.cluster.pods.get(key)
        if found is None:
            raise NotFoundError(key)
        pod, node = found
        if patch["metadata"]["resourceVersion"] != str(pod.version):
            raise ConflictError(key)
        for condition in patch["status"]["conditions"]:
            pod.written[condition["type"]] = condition
            self.cluster.wrote(
                "pod condition",
                node,
                key,
                f"{condition['status']} {condition['reason']}: {condition['message']}",
            )
        self.cluster.pod_changed(pod, scripted=False)
        return {"metadata": {"resourceVersion": str(pod.version)}}


class BreakerConfigMap:
    """`StateStore`: the breaker's ConfigMap, written at the version read."""

    def __init__(self, cluster: Cluster, breaker: Callable[[], Breaker]) -> None:
        self.cluster = cluster
        self.breaker = breaker

    def read(self) -> StoredState:
        return StoredState(dict(self.cluster.breaker_data), str(self.cluster.breaker_version))

    def write(self, data: dict[str, str], read: StoredState) -> None:
        if read.resource_version != str(self.cluster.breaker_version):
            raise ConflictError("breaker")
        self.cluster.breaker_data = dict(data)
        self.cluster.breaker_version += 1
        self.cluster.wrote("breaker", "", "ConfigMap gpuguard-remediation", data.get("reason", ""))
        # What the state informer hands the breaker once the write is watched.
        self.breaker().observe(dict(data))


class WitnessedEvents(EventRecorder):
    """The Events gpuguard records, kept as the reason of the write they explain (none is sent)."""

    def __init__(self, cluster: Cluster, stop: threading.Event) -> None:
        super().__init__(lambda namespace, body: None, stop=stop, clock=cluster.monotonic)
        self.cluster = cluster

    def record(self, regarding: ObjectRef, reason: Reason, note: str, *, action: str, warning: bool) -> None:
        target = regarding.name if regarding.kind == "Node" else f"{regarding.namespace}/{regarding.name}"
        for write in reversed(self.cluster.writes[-8:]):
            if write.target == target and write.at == self.cluster.seconds:
                write.why = f"{reason}: {note}" if not write.why else write.why
                break


class Listing:
    """The list the informers start from; their watch events are handed to them by the replay."""

    def __init__(self, items: Callable[[], list[JSON]]) -> None:
        self.items = items

    def list_page(self, continue_token: str | None) -> ListPage:
        return ListPage(self.items(), "1", None)

    @contextlib.contextmanager
    def watch_list(self, timeout_seconds: int) -> Iterator[Iterator[JSON]]:
        yield listed_events(self.items(), "1")

    @contextlib.contextmanager
    def watch(self, resource_version: str, timeout_seconds: int) -> Iterator[Iterator[JSON]]:
        yield iter(())


class NodeResources:
    """The kubelet's PodResources API on one node: what its pods hold, what it can hand out."""

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def listed(self) -> tuple[list[holdings.Holding], list[holdings.ClaimHolding]]:
        """What the device plugin's pods hold, and the DRA devices (ids `<driver>/<pool>/<device>`)
        the claim pods hold."""
        workers = self.node.workers.values()
        held = [
            holdings.Holding(pod.namespace, pod.name, "main", pod.resource, frozenset(pod.device_ids))
            for pod in workers
            if not pod.claim
        ]
        claims = [
            holdings.ClaimHolding(
                pod.namespace, pod.name, "main", pod.namespace, f"{pod.name}-gpu", *device.split("/")
            )
            for pod in workers
            if pod.claim
            for device in pod.device_ids
        ]
        return held, claims

    def allocatable(self) -> dict[str, frozenset[str]]:
        ids = self.node.allocatable_ids()
        return {self.node.resource: ids} if ids else {}


class NodeSlices:
    """The agent's cache of its node's ResourceSlices: the simulated cluster publishes none, so the
    agent finds no DRA device's pool and leaves the conditions of the pods holding one alone."""

    def snapshot(self) -> dict[Hashable, observed.SliceFacts]:
        return {}

    def has_synced(self) -> bool:
        return True


class NodePods:
    """The agent's cache of the pods on its node."""

    def __init__(self, cluster: Cluster, node: SimNode) -> None:
        self.cluster = cluster
        self.node = node

    def snapshot(self) -> dict[Hashable, holdings.PodView]:
        views = (holdings.pod_view(pod.raw(self.node)) for pod in self.node.workers.values())
        return {view.key: view for view in views if view is not None}

    def has_synced(self) -> bool:
        return True


# --- the replay --------------------------------------------------------------------------------------


class ClockedQueue(WorkQueue[str]):
    """The controllers' work queue on the fake clock, telling the replay when its next delayed key is
    due, so that the seconds when nothing happens are skipped."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock=clock)
        self._dues: list[float] = []

    def add_after(self, key: str, delay: float) -> None:
        super().add_after(key, delay)
        if delay > 0:
            heapq.heappush(self._dues, self.clock() + delay)

    def next_due(self) -> float | None:
        while self._dues and self._dues[0] <= self.clock():
            heapq.heappop(self._dues)
        return self._dues[0] if self._dues else None


def _node_item(raw: JSON) -> tuple[Hashable, observed.NodeFacts] | None:
    node = observed.node_facts(raw)
    return (node.name, node) if node is not None else None


def _pod_item(raw: JSON) -> tuple[Hashable, observed.PodFacts] | None:
    pod = observed.pod_facts(raw)
    return (pod.key, pod) if pod is not None else None


class NoDeviceRules:
    """`DeviceTaintRules` of a fleet without DRA devices: nothing is ever fenced, so nothing is sent."""

    def create(self, body: JSON) -> None:
        raise AssertionError(f"the fleet day has no DRA device to fence: {body['metadata']['name']}")

    def patch_effect(self, name: str, resource_version: str, effect: str) -> None:
        raise AssertionError(f"the fleet day has no DeviceTaintRule {name}")

    def delete(self, name: str, resource_version: str) -> None:
        raise AssertionError(f"the fleet day has no DeviceTaintRule {name}")


class Replay:
    """gpuguard's controllers and node agents wired as `gpuguard controllers` wires them, on this thread."""

    def __init__(self, cluster: Cluster, policy: Policy) -> None:
        self.cluster = cluster
        self.policy = policy
        stop = threading.Event()
        self.events = WitnessedEvents(cluster, stop)
        self.registry = Registry()
        self.nodes: Informer[observed.NodeFacts] = Informer(
            "nodes", Listing(lambda: [n.raw() for n in cluster.nodes.values()]), _node_item, stop=stop
        )
        self.pods: Informer[observed.PodFacts] = Informer(
            "pods",
            Listing(lambda: [p.raw(cluster.nodes[n]) for p, n in cluster.pods.values()]),
            _pod_item,
            stop=stop,
        )
        self.controllers = HealthControllers(
            nodes=self.nodes,
            pods=self.pods,
            namespace_labels=lambda namespace: {},
            policy=lambda: policy,
            writes=NodeApi(cluster),
            rules=NoDeviceRules(),
            evictions=EvictionApi(cluster),
            breaker_store=BreakerConfigMap(cluster, lambda: self.controllers.breaker),
            events=self.events,
            registry=self.registry,
            clock=lambda: cluster.now,
            stop=stop,
        )
        self.queues = [ClockedQueue(cluster.monotonic), ClockedQueue(cluster.monotonic)]
        for controller, queue in zip(
            (self.controllers.node_health.controller, self.controllers.pod_health.controller),
            self.queues,
            strict=True,
        ):
            # The same queue, on the fake clock: requeue_after and backoff come due as the day advances.
            controller.queue = queue
        series.register(
            self.registry,
            node_health=list,
            breaker_open=lambda: self.controllers.breaker.state.open,
            held_nodes=lambda: len(self.controllers.ledger.held()),
            queue_depths=list,
            leader=lambda: True,
        )
        self.agents: dict[str, NodeAgent] = {}
        self.agent_watch: dict[str, int] = {}  # node -> until when its agent polls

    def start(self) -> None:
        """Caches synced, then leadership: the ledger seeded, every node and pod looked at once."""
        self.cluster.pending.clear()
        assert self.nodes.sync() and self.pods.sync()
        self.controllers.seed(self.nodes.snapshot().values(), self.policy, self.cluster.now)
        self.controllers.enqueue_all()
        for node in self.cluster.nodes.values():
            self.watch_devices(node)  # every agent's first poll: what its node offers before the day
        self.poll_agents()
        self.settle()

    def deliver(self) -> bool:
        """The watch events of the writes and changes so far, through each informer's own event path."""
        pending, self.cluster.pending = self.cluster.pending, []
        for informer, event in pending:
            (self.nodes if informer == "nodes" else self.pods)._apply(event)
        return bool(pending)

    def settle(self) -> None:
        """Works both queues and delivers what their writes changed, until neither has a key due now."""
        while True:
            worked = self.deliver()
            for controller in (
                self.controllers.node_health.controller,
                self.controllers.pod_health.controller,
            ):
                while controller.process_next(0):
                    worked = True
                    self.deliver()
            if not worked:
                return

    def watch_devices(self, node: SimNode) -> None:
        """The node's devices or pods changed: its agent polls every interval for a while."""
        self.agent_watch[node.name] = self.cluster.seconds + AGENT_WATCH_SECONDS

    def poll_agents(self) -> None:
        """The node agents of the nodes whose devices or pods changed lately poll; the others would find
        what they found before, since only a scripted change moves what the kubelet answers (they are
        not run, to keep a day in seconds). Each agent lives as long as its node, from its first poll."""
        for name, until in sorted(self.agent_watch.items()):
            node = self.cluster.nodes.get(name)
            if node is None:
                del self.agent_watch[name]
                self.agents.pop(name, None)
                continue
            agent = self.agents.get(name)
            if agent is None:
                agent = NodeAgent(
                    AgentOptions(node=name),
                    resources=NodeResources(node),
                    pods=NodePods(self.cluster, node),
                    slices=NodeSlices(),
                    writer=PodStatusApi(self.cluster),
                    events=self.events,
                    registry=Registry(),
                    stop=threading.Event(),
                    clock=self.cluster.monotonic,
                )
                self.agents[name] = agent
            agent.poll()
            if until < self.cluster.seconds:
                del self.agent_watch[name]

    def acted(self) -> dict[str, tuple[int, float]]:
        """What the time-to-act histogram on the controllers' /metrics says: step -> (count, mean)."""
        text = self.registry.render()
        counts = re.findall(rf'^{series.TIME_TO_ACT}_count{{step="(\w+)"}} (\S+)$', text, re.M)
        sums = dict(re.findall(rf'^{series.TIME_TO_ACT}_sum{{step="(\w+)"}} (\S+)$', text, re.M))
        return {step: (int(n), float(sums[step]) / max(int(n), 1)) for step, n in counts}

    def reconciles(self) -> int:
        """Reconciles both controllers ran, whatever their result: what the day cost them."""
        return sum(
            int(self.registry.value(series.RECONCILES, controller, result))
            for controller in ("node-health", "pod-health")
            for result in ("success", "requeue_after", "error", "terminal")
        )

    def memory(self) -> dict[str, int]:
        """Bytes held by the ledger, the breaker, and whatever else the controllers keep (the pod
        index, the rate limits, the maps either controller holds itself), the caches not counted."""
        controllers = self.controllers
        shared = (controllers.ledger, controllers.breaker, self.nodes, self.pods, self.events)
        own = (
            controllers.index,
            controllers.limits,
            vars(controllers.pod_health),
            vars(controllers.node_health),
        )
        return {
            "ledger": deep_size(controllers.ledger),
            "breaker": deep_size(controllers.breaker),
            "per-object maps": deep_size(own, exclude=shared),
        }


def deep_size(root: object, exclude: Iterable[object] = ()) -> int:
    """Bytes held by the data reachable from `root` but not through `exclude`: containers and
    dataclasses, not code, locks, threads, clocks or this bench's fakes."""
    seen = {id(obj) for obj in exclude}
    total = 0
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or callable(obj) or type(obj).__module__ in ("threading", "_thread", __name__):
            continue
        if type(obj).__module__ == "webhook.kube.controller" or isinstance(obj, WorkQueue | Registry):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        slots: Iterable[str] = getattr(type(obj), "__slots__", ())
        stack.extend(getattr(obj, slot) for slot in slots if hasattr(obj, slot))
    return total


# --- the day's script ----------------------------------------------------------------------------------

Action = Callable[[Cluster, SimNode], None]


def hours(value: float) -> int:
    return int(value * 3600)


def fresh_start(cluster: Cluster, node: SimNode) -> None:
    """The plugin pod's container starts again (a new startedAt)."""
    assert node.plugin is not None
    node.plugin.started_at, node.plugin.pending = cluster.now, False
    node.plugin.ready = not node.plugin.crash_looping


def join_without_driver(cluster: Cluster, node: SimNode) -> None:
    """A new node: the driver container compiles for 8 minutes, the plugin waits in its init containers."""


def driver_installed(cluster: Cluster, node: SimNode) -> None:
    node.registered = node.known = True
    fresh_start(cluster, node)
    cluster.node_changed(node)


def workers_scheduled(cluster: Cluster, node: SimNode) -> None:
    schedule_workers(cluster, node)


def kured_drains(cluster: Cluster, node: SimNode) -> None:
    node.unschedulable = True
    cluster.node_changed(node)
    for key in list(node.workers):
        cluster.delete_pod(key)


def unreachable(cluster: Cluster, node: SimNode) -> None:
    """The kubelet stops posting: the node lifecycle controller sets Ready Unknown, taints the node and
    marks its pods NotReady."""
    node.ready = "Unknown"
    node.taints += [dict(t) for t in UNREACHABLE_TAINTS]
    cluster.node_changed(node)
    for pod in [node.plugin, *node.workers.values()]:
        if pod is not None:
            pod.ready = False
            cluster.pod_changed(pod)


def reachable(cluster: Cluster, node: SimNode) -> None:
    node.ready = "True"
    node.taints = [t for t in node.taints if t not in UNREACHABLE_TAINTS]
    cluster.node_changed(node)
    for pod in [node.plugin, *node.workers.values()]:
        if pod is not None:
            pod.ready = not pod.crash_looping
            cluster.pod_changed(pod)


def rebooted(cluster: Cluster, node: SimNode) -> None:
    """Back up: the kubelet reports the resource at 0 until the driver container has loaded the driver
    again and the plugin registers."""
    node.ready = "True"
    node.taints = [t for t in node.taints if t not in UNREACHABLE_TAINTS]
    node.registered = False
    assert node.plugin is not None
    node.plugin.pending, node.plugin.ready, node.plugin.started_at = True, False, None
    cluster.node_changed(node)


def kured_uncordons(cluster: Cluster, node: SimNode) -> None:
    node.unschedulable = False
    cluster.node_changed(node)
    schedule_workers(cluster, node)


def plugin_restarting(cluster: Cluster, node: SimNode) -> None:
    """The plugin restarts with its new config: not Ready; the kubelet keeps its devices meanwhile."""
    assert node.plugin is not None
    node.plugin.ready = False
    node.plugin.started_at = cluster.now
    cluster.pod_changed(node.plugin)


def plugin_renamed_devices(cluster: Cluster, node: SimNode) -> None:
    """Registered again under a new ID strategy: every device has a new ID; running pods keep theirs."""
    node.renamed = True
    node.registered = True
    fresh_start(cluster, node)
    cluster.node_changed(node)


def dra_driver_restarting(cluster: Cluster, node: SimNode) -> None:
    """The kubelet clears a driver whose health stream ended: every claim's device reads Unknown."""
    node.dra_streaming = False
    assert node.plugin is not None
    node.plugin.ready = False
    node.plugin.started_at = cluster.now
    cluster.node_changed(node)


def dra_driver_streaming(cluster: Cluster, node: SimNode) -> None:
    node.dra_streaming = True
    fresh_start(cluster, node)
    cluster.node_changed(node)


def kubelet_restarted(cluster: Cluster, node: SimNode) -> None:
    """Capacity 0 until the plugin registers with the new kubelet; the plugin's container runs on."""
    node.registered = False
    cluster.node_changed(node)


def plugin_registered(cluster: Cluster, node: SimNode) -> None:
    node.registered = True
    cluster.node_changed(node)


def mig_manager_stops_clients(cluster: Cluster, node: SimNode) -> None:
    """The MIG manager evicts the GPU's clients and stops the plugin before it repartitions."""
    for key in list(node.workers):
        cluster.delete_pod(key)
    plugin_restarting(cluster, node)


def mig_layout_applied(cluster: Cluster, node: SimNode) -> None:
    """New resource names: nvidia.com/mig-1g.10gb, seven per GPU; nvidia.com/gpu stays at 0."""
    node.mig = True
    node.registered = True
    fresh_start(cluster, node)
    cluster.node_changed(node)
    schedule_workers(cluster, node)


def removed(cluster: Cluster, node: SimNode) -> None:
    cluster.delete_node(node)


# The failures: what a failing GPU or its software stack shows.


def device_fell_off_the_bus(cluster: Cluster, node: SimNode) -> None:
    """XID 79: the plugin's health check marks the GPU unhealthy (8/8 -> 7/8)."""
    node.broken += 1
    cluster.node_changed(node)


def plugin_reenumerates(cluster: Cluster, node: SimNode) -> None:
    """The plugin restarts and enumerates the GPUs still on the bus: 7/7, no gap left."""
    node.gone += node.broken
    node.broken = 0
    fresh_start(cluster, node)
    cluster.node_changed(node)


def two_devices_unhealthy(cluster: Cluster, node: SimNode) -> None:
    node.broken += 2
    cluster.node_changed(node)


def plugin_crash_loops(cluster: Cluster, node: SimNode) -> None:
    """The plugin dies and crash-loops; the kubelet marks the devices of a plugin gone unhealthy."""
    assert node.plugin is not None
    node.plugin.crash_looping, node.plugin.ready = True, False
    node.broken = node.gpus - node.gone
    cluster.node_changed(node)


def hardware_not_ready(cluster: Cluster, node: SimNode) -> None:
    node.conditions["AcceleratedHardwareReady"] = "False"
    cluster.node_changed(node)


def claim_device_unhealthy(cluster: Cluster, node: SimNode) -> None:
    """The DRA driver streams Unhealthy for one device a pod's claim holds."""
    node.unhealthy_claims.add(node.device_ids()[0])
    cluster.node_changed(node)


@dataclass(frozen=True)
class Episode:
    """A scripted event: from `at`, each selected node in turn (`stagger` apart) goes through `steps`
    (offsets from its own start)."""

    name: str
    at: int
    select: Callable[[Cluster, random.Random], list[SimNode]]
    steps: tuple[tuple[int, Action], ...]
    stagger: float = 0.0


@dataclass(frozen=True)
class Failure:
    """A real failure, the signal's wait it must be acted on within (read from the policy) and the act
    that remediates it: the node's taint, or for a device one pod reports the eviction of that pod."""

    name: str
    steps: tuple[tuple[int, Action], ...]
    wait: Callable[[Policy], float]
    dra: bool = False
    remedy: str = "taint"


def original(cluster: Cluster, *, dra: bool = False) -> list[SimNode]:
    """The nodes the day started with (not a MIG pool's), healthy and with or without DRA."""
    return [
        n
        for n in cluster.nodes.values()
        if n.dra == dra and n.pool != MIG_POOL and n.name not in cluster.failed and n.name < "gpu-9"
    ]


def share(fraction: float) -> Callable[[Cluster, random.Random], list[SimNode]]:
    def select(cluster: Cluster, rng: random.Random) -> list[SimNode]:
        nodes = original(cluster)
        return sorted(rng.sample(nodes, round(len(nodes) * fraction)), key=lambda n: n.name)

    return select


def scale_up(fraction: float) -> Callable[[Cluster, random.Random], list[SimNode]]:
    """New nodes (named gpu-9xxxx) across the device-plugin pools, their driver not installed yet."""

    def select(cluster: Cluster, rng: random.Random) -> list[SimNode]:
        count = round(sum(1 for n in cluster.nodes.values() if not n.dra) * fraction)
        pools = [f"pool-{p}" for p in range(POOLS) if f"pool-{p}" not in (DRA_POOL, MIG_POOL)]
        return [new_node(cluster, 90000 + i, pool=pools[i % len(pools)], started=False) for i in range(count)]

    return select


def scaled_up(cluster: Cluster, rng: random.Random) -> list[SimNode]:
    return [n for n in cluster.nodes.values() if n.name >= "gpu-9"]


def zone(name: str) -> Callable[[Cluster, random.Random], list[SimNode]]:
    return lambda cluster, rng: [n for n in cluster.nodes.values() if n.zone == name]


def pool(name: str) -> Callable[[Cluster, random.Random], list[SimNode]]:
    return lambda cluster, rng: [n for n in cluster.nodes.values() if n.pool == name]


def device_plugin_nodes(cluster: Cluster, rng: random.Random) -> list[SimNode]:
    return [n for n in cluster.nodes.values() if not n.dra]


ORDINARY_DAY: tuple[Episode, ...] = (
    Episode(
        "scale-up of 30%, 8-minute driver installs",
        at=hours(1),
        select=scale_up(0.30),
        stagger=1,
        steps=((0, join_without_driver), (480, driver_installed), (540, workers_scheduled)),
    ),
    Episode(
        "reboot wave of 10% (kured)",
        at=hours(3),
        select=share(0.10),
        stagger=30,
        steps=(
            (0, kured_drains),
            (60, unreachable),
            (180, rebooted),
            (660, driver_installed),
            (690, kured_uncordons),
        ),
    ),
    Episode(
        f"zone partition of {PARTITIONED_ZONE}, 15 minutes",
        at=hours(6),
        select=zone(PARTITIONED_ZONE),
        steps=((0, unreachable), (900, reachable)),
    ),
    Episode(
        "device-plugin config rollout renaming every device",
        at=hours(9),
        select=device_plugin_nodes,
        stagger=2,
        steps=((0, plugin_restarting), (20, plugin_renamed_devices)),
    ),
    Episode(
        "DRA driver upgrade (claims Unknown for 10 minutes)",
        at=hours(12),
        select=pool(DRA_POOL),
        stagger=3,
        steps=((0, dra_driver_restarting), (600, dra_driver_streaming)),
    ),
    Episode(
        "kubelet restarts on 10% (capacity 0 until the plugin registers)",
        at=hours(15),
        select=share(0.10),
        stagger=10,
        steps=((0, kubelet_restarted), (30, plugin_registered)),
    ),
    Episode(
        f"MIG reconfiguration of {MIG_POOL}",
        at=hours(18),
        select=pool(MIG_POOL),
        stagger=20,
        steps=((0, mig_manager_stops_clients), (120, mig_layout_applied)),
    ),
    Episode(
        "scale-down of the scale-up's nodes", at=hours(21), select=scaled_up, stagger=1, steps=((0, removed),)
    ),
)

FAILURES: tuple[Failure, ...] = (
    Failure(
        "XID 79 with re-enumeration (8/8, 7/8, then 7/7)",
        steps=((0, device_fell_off_the_bus), (120, plugin_reenumerates)),
        wait=lambda policy: policy.health.signals.deviceGap.forSeconds,
    ),
    Failure(
        "device gap (2 of 8 unhealthy)",
        steps=((0, two_devices_unhealthy),),
        wait=lambda policy: policy.health.signals.deviceGap.forSeconds,
    ),
    Failure(
        "device plugin dead (crash loop)",
        steps=((0, plugin_crash_loops),),
        wait=lambda policy: policy.health.signals.devicePlugin.notReadyForSeconds,
    ),
    Failure(
        "node condition AcceleratedHardwareReady=False",
        steps=((0, hardware_not_ready),),
        wait=lambda policy: max(c.forSeconds for c in policy.health.signals.nodeConditions),
    ),
    Failure(
        "pod-reported Unhealthy device (DRA)",
        steps=((0, claim_device_unhealthy),),
        wait=lambda policy: policy.health.signals.deviceGap.forSeconds,
        dra=True,
        remedy="evict",
    ),
)
# Hours of the ordinary day when no scripted event runs: the failures start then.
QUIET_HOURS = (0.25, 0.5, 2.0, 2.5, 4.5, 5.0, 5.5, 7.0, 7.5, 8.0, 10.5, 11.0, 13.0, 13.5, 14.0, 16.0, 17.0, 19.5,
               22.0, 22.5, 23.0)  # fmt: skip


# --- running a scenario ----------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    events: int
    writes: list[Write]
    missed: list[str]
    times_to_act: list[float]
    evictions: int
    breaker: str
    over_budget: int
    memory: list[dict[str, int]]
    floors: list[tuple[str, bool]]
    expects_failures: bool = False
    reconciles: int = 0
    # The controllers' own time-to-act histogram: step -> (count, mean seconds).
    acted: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def false_writes(self) -> list[Write]:
        return [w for w in self.writes if w.false]


class Day:
    """One scripted day against one fleet, replayed second by second."""

    def __init__(self, nodes: int, seed: int, policy: Policy) -> None:
        self.rng = random.Random(seed)
        self.policy = policy
        self.cluster = Cluster()
        for index in range(nodes):
            node = new_node(self.cluster, index)
            schedule_workers(self.cluster, node)
        self.replay = Replay(self.cluster, policy)
        self.agenda: list[tuple[int, int, str, Action, SimNode | None, Callable[[], None] | None]] = []
        self.order = itertools.count()
        self.failures: dict[str, tuple[Failure, int]] = {}
        self.over_budget = 0
        self.cluster.on_taint.append(self._check_budget)

    def plan(self, episode: Episode) -> None:
        """Selects the episode's nodes when it starts (a scale-up creates them then)."""

        def begin() -> None:
            for index, node in enumerate(episode.select(self.cluster, self.rng)):
                start = self.cluster.seconds + round(index * episode.stagger)
                for offset, action in episode.steps:
                    self.at(start + offset, episode.name, action, node)

        self.later(episode.at, begin)

    def fail(self, failure: Failure, node: SimNode, at: int) -> None:
        self.failures[node.name] = (failure, at)
        self.cluster.failed[node.name] = at
        for offset, action in failure.steps:
            self.at(at + offset, f"failure: {failure.name}", action, node)

    def at(self, when: int, cause: str, action: Action, node: SimNode) -> None:
        heapq.heappush(self.agenda, (when, next(self.order), cause, action, node, None))

    def later(self, when: int, call: Callable[[], None]) -> None:
        heapq.heappush(self.agenda, (when, next(self.order), "", lambda c, n: None, None, call))

    def _check_budget(self, node: SimNode) -> None:
        pool_nodes = [n for n in self.cluster.nodes.values() if n.pool == node.pool]
        tainted = sum(1 for n in pool_nodes if any(t["key"] == observed.TAINT_KEY for t in n.taints))
        if tainted > ladder.budget(self.policy, len(pool_nodes)):
            self.over_budget += 1

    def run(self, seconds: int = DAY_SECONDS) -> list[dict[str, int]]:
        """The day, second by second; the ledger's and breaker's memory at every hour."""
        self.replay.start()
        self.cluster.events = 0  # the fleet as it was at the start is no event
        memory = [self.replay.memory()]
        cluster = self.cluster
        second = 0
        while second <= seconds:
            cluster.seconds = second
            while self.agenda and self.agenda[0][0] <= second:
                _, _, cause, action, node, call = heapq.heappop(self.agenda)
                if call is not None:
                    call()
                elif node is not None and node.name in cluster.nodes:
                    cluster.cause[node.name] = cause
                    action(cluster, node)
                    self.replay.watch_devices(node)
            if second % AGENT_INTERVAL_SECONDS == 0:
                self.replay.poll_agents()
            self.replay.settle()
            if second % 3600 == 0 and second:
                memory.append(self.replay.memory())
            second = self._next_second(second)
        return memory

    def _next_second(self, second: int) -> int:
        """The next second when anything can happen: a scripted step, an agent's poll, a key due, the
        hourly memory sample."""
        moments = [(second // 3600 + 1) * 3600]
        if self.agenda:
            moments.append(self.agenda[0][0])
        if self.replay.agent_watch:
            moments.append((second // AGENT_INTERVAL_SECONDS + 1) * AGENT_INTERVAL_SECONDS)
        for queue in self.replay.queues:
            due = queue.next_due()
            if due is not None:
                moments.append(math.ceil(due))
        return max(second + TICK_SECONDS, min(moments))

    def times_to_act(self) -> tuple[list[float], list[str]]:
        """Seconds from each failure to its remedy, and the failures remedied late or never."""
        times, missed = [], []
        for name, (failure, at) in sorted(self.failures.items()):
            allowed = failure.wait(self.policy) + RESYNC_SECONDS
            taken = next(
                (
                    w.at
                    for w in self.cluster.writes
                    if w.kind == failure.remedy and w.node == name and w.at >= at
                ),
                None,
            )
            if taken is not None:
                times.append(float(taken - at))
            if taken is None or taken - at > allowed:
                late = "never" if taken is None else f"after {taken - at} s"
                missed.append(f"{name} ({failure.name}): {failure.remedy} {late}, allowed {allowed:g} s")
        return times, missed


def breaker_state(breaker: Breaker) -> str:
    state = breaker.state
    if not state.open:
        return "closed"
    return f"open at {state.opened_at:%H:%M:%S}" if state.opened_at else "open"


def ordinary_day(nodes: int, seed: int, *, failures: bool) -> Outcome:
    policy = enforcing()
    day = Day(nodes, seed, policy)
    for episode in ORDINARY_DAY:
        day.plan(episode)
    if failures:
        count = max(round(nodes * FAILURES_PER_1000 / 1000), 1)
        chosen: set[str] = set()
        for index in range(count):
            failure = FAILURES[index % len(FAILURES)]
            candidates = [n for n in original(day.cluster, dra=failure.dra) if n.name not in chosen]
            node = day.rng.choice(candidates)
            chosen.add(node.name)
            at = hours(QUIET_HOURS[index % len(QUIET_HOURS)]) + 97 * (index // len(QUIET_HOURS))
            day.fail(failure, node, at)
    memory = day.run()
    times, missed = day.times_to_act()
    writes = day.cluster.writes
    name = "ordinary day" + (f" + {len(day.failures)} device failures" if failures else "")
    outcome = Outcome(
        name,
        day.cluster.events,
        writes,
        missed,
        times,
        sum(1 for w in writes if w.kind == "evict"),
        breaker_state(day.replay.controllers.breaker),
        day.over_budget,
        memory,
        [],
        expects_failures=failures,
        reconciles=day.replay.reconciles(),
        acted=day.replay.acted(),
    )
    outcome.floors.append(("no write on a node that did not fail", not outcome.false_writes))
    if failures:
        outcome.floors.append(("every failure acted on within forSeconds + one resync", not missed))
        outcome.floors.append(("never more nodes tainted in a pool than its budget", not day.over_budget))
    else:
        start, end = (sum(m[k] for k in ("ledger", "breaker")) for m in (memory[0], memory[-1]))
        outcome.floors.append(
            (
                "ledger and breaker memory flat across the day",
                end <= start * MEMORY_GROWTH + MEMORY_SLACK_BYTES,
            )
        )
    return outcome


def bad_driver_wave(nodes: int, seed: int) -> Outcome:
    """A driver that breaks every GPU rolls out node after node, faster than the breaker's window
    allows; every other node gpuguard taints is replaced by a new one two minutes later."""
    policy = enforcing()
    day = Day(nodes, seed, policy)
    breaker = policy.health.circuitBreaker
    victims = original(day.cluster)
    rng = day.rng
    rng.shuffle(victims)
    threshold = scaled_count(breaker.maxNodes, nodes)
    # Fast enough that 1.3 times the threshold become due within one window.
    stagger = breaker.windowSeconds / (threshold * 1.3)
    wave = victims[: min(len(victims), round(threshold * 1.6))]
    for index, node in enumerate(wave):
        at = 60 + round(index * stagger)
        day.fail(Failure("bad driver", ((0, plugin_crash_loops),), lambda p: 0), node, at)
    replaced: set[str] = set()
    replacements = itertools.count(80000)

    def replace_every_other(node: SimNode) -> None:
        if node.name in replaced or node.name not in day.failures:
            return
        replaced.add(node.name)
        if len(replaced) % 2:

            def swap() -> None:
                if node.name in day.cluster.nodes:
                    day.cluster.delete_node(node)
                    fresh = new_node(day.cluster, next(replacements), pool=node.pool)
                    schedule_workers(day.cluster, fresh)

            day.later(day.cluster.seconds + 120, swap)

    day.cluster.on_taint.append(replace_every_other)
    duration = 60 + round(len(wave) * stagger) + policy.health.signals.devicePlugin.notReadyForSeconds + 600
    memory = day.run(duration)
    # What became due, as the breaker's own log has it (a node by name and uid, replaced ones included).
    due_at = sorted(day.replay.controllers.breaker.logged().values())
    state = day.replay.controllers.breaker.state
    if state.open and state.opened_at is not None:
        window = datetime.timedelta(seconds=breaker.windowSeconds)
        due = sum(1 for moment in due_at if state.opened_at - window <= moment <= state.opened_at)
        verdict = f"open with {due} due in {breaker.windowSeconds} s (threshold {threshold})"
        met = due == threshold + 1
    else:
        verdict = f"closed ({len(due_at)} became due, threshold {threshold} in {breaker.windowSeconds} s)"
        met = False
    writes = day.cluster.writes
    times, _ = day.times_to_act()
    outcome = Outcome(
        f"rolling bad-driver wave ({len(wave)} nodes, every other replaced)",
        day.cluster.events,
        writes,
        [],
        times,
        sum(1 for w in writes if w.kind == "evict"),
        verdict,
        day.over_budget,
        memory,
        [],
        reconciles=day.replay.reconciles(),
        acted=day.replay.acted(),
    )
    outcome.floors.append(("no write on a node that did not fail", not outcome.false_writes))
    outcome.floors.append(("the breaker opens at its threshold", met))
    return outcome


# --- the report ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], share_: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * share_), len(ordered) - 1)]


def kib(value: int) -> str:
    return f"{value / 1024:.0f}"


# The kinds of write, the actions first: how the examples under the table are ordered.
KINDS = ("taint", "cordon", "evict", "condition", "pod condition", "breaker", "untaint", "uncordon", "record")


def report(outcomes: Sequence[Outcome], nodes: int, examples: int) -> bool:
    print(f"A fleet day simulated: {nodes} GPU nodes in {POOLS} pools, gpuguard's defaults in enforce mode\n")
    print(
        "| scenario | events | false actions (all writes) | missed failures | time to act p50 / p99"
        " | evictions | breaker | floors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        taint = (
            f"{statistics.median(o.times_to_act):.0f} / {percentile(o.times_to_act, 0.99):.0f} s"
            if o.times_to_act
            else "-"
        )
        false = o.false_writes
        actions = sum(1 for w in false if w.kind != "record")
        missed = str(len(o.missed)) if o.expects_failures else "-"
        floors = ", ".join(f"{name}: {'met' if met else '**missed**'}" for name, met in o.floors)
        print(
            f"| {o.name} | {o.events} | {actions} ({len(false)}) | {missed} | {taint} | {o.evictions}"
            f" | {o.breaker} | {floors} |"
        )
    print(
        "\nTime to act as the controllers' /metrics report it (`gpuguard_remediation_time_to_act_seconds`),"
    )
    print("from first sight of a node's signals: count, mean\n")
    print("| scenario | condition | taint | evicted | drained |")
    print("|---|---|---|---|---|")
    for o in outcomes:
        cells = [
            f"{o.acted[step][0]}, {o.acted[step][1]:.0f} s" if step in o.acted else "-"
            for step in ("condition", "taint", "evicted", "drained")
        ]
        print(f"| {o.name} | {' | '.join(cells)} |")
    print("\nMemory the controllers hold, KiB (at the start / peak / end of the run, sampled hourly):\n")
    print(
        "| scenario | ledger | breaker | per-object maps (pod index, rate limits, the controllers' own maps) |"
    )
    print("|---|---|---|---|")
    for o in outcomes:
        cells = [
            " / ".join(kib(v) for v in (o.memory[0][k], max(m[k] for m in o.memory), o.memory[-1][k]))
            for k in ("ledger", "breaker", "per-object maps")
        ]
        print(f"| {o.name} | {' | '.join(cells)} |")
    for o in outcomes:
        if o.false_writes:
            print(f"\n{o.name}: writes on nodes that had not failed, by the event that last touched the node")
        by_cause: dict[str, list[Write]] = collections.defaultdict(list)
        for write in o.false_writes:
            by_cause[write.cause].append(write)
        for cause, writes in sorted(by_cause.items()):
            kinds = collections.Counter(w.kind for w in writes)
            counts = ", ".join(f"{kinds[kind]} {kind}" for kind in KINDS if kind in kinds)
            print(f"- {cause}: {counts} on {len({w.node for w in writes})} nodes; the first:")
            for kind in (k for k in KINDS if k in kinds):
                for write in [w for w in writes if w.kind == kind][:examples]:
                    at = START + datetime.timedelta(seconds=write.at)
                    print(f"    {at:%H:%M:%S} {write.kind} {write.target}: {write.why[:300]}")
        if o.missed:
            print(f"\n{o.name}: failures not acted on in time")
        for line in o.missed:
            print(f"- {line}")
    return all(met for o in outcomes for _, met in o.floors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.fleetday", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--examples", type=int, default=1, help="writes listed per cause and kind")
    parser.add_argument(
        "--only",
        choices=("ordinary", "failures", "wave"),
        action="append",
        help="run only this replay (repeatable): the ordinary day, the day with failures, the wave",
    )
    args = parser.parse_args(argv)
    # What the controllers log as they act is what the table lists; their errors still show.
    logging.getLogger("gpuguard").setLevel(logging.ERROR)
    runs: list[tuple[str, Callable[[], Outcome]]] = [
        ("ordinary", lambda: ordinary_day(args.nodes, args.seed, failures=False)),
        ("failures", lambda: ordinary_day(args.nodes, args.seed, failures=True)),
        ("wave", lambda: bad_driver_wave(args.nodes, args.seed)),
    ]
    outcomes = []
    for name, run in runs:
        if args.only and name not in args.only:
            continue
        started = time.process_time()
        outcome = run()
        outcomes.append(outcome)
        say(f"{name}: {time.process_time() - started:.1f} s of CPU, {outcome.reconciles} reconciles")
    return 0 if report(outcomes, args.nodes, args.examples) else FLOOR_MISSED


if __name__ == "__main__":
    sys.exit(main())

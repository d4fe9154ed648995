"""What the controllers observe of nodes, pods and DRA devices: the fields the verdicts read, converted
from the API objects (`node_facts`, `pod_facts`, `slice_facts`, `claim_facts`, `budget_facts`).

The converters take API dicts as served and never fail on one: a field of the wrong type reads as
absent. A Node's own fields say nothing of its DRA devices; the controllers join those in from the
node's ResourceSlices and the claims holding them (`node_devices`, `with_devices`).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from webhook.policy.health import holdings
from webhook.policy.health.holdings import device_id
from webhook.policy.health.records import (
    ACK_ANNOTATION,
    RECORD_ANNOTATION,
    NodeRecord,
    as_mapping,
    parse_time,
)
from webhook.policy.quantity import whole_count

TAINT_KEY = "gpuguard.io/device-unhealthy"
CONDITION_TYPE = "GPUGuardDeviceHealthy"
DISRUPTION_TARGET = "DisruptionTarget"
CLAIM_PREFIX = "claim:"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str
    # Kept so that a rewritten taint list leaves others' NoExecute taints exactly as they were.
    time_added: str = ""

    def to_raw(self) -> dict[str, str]:
        raw = {"key": self.key, "effect": self.effect}
        if self.value:
            raw["value"] = self.value
        if self.time_added:
            raw["timeAdded"] = self.time_added
        return raw


@dataclass(frozen=True, slots=True)
class OwnCondition:
    """gpuguard's node condition: status False while devices failed."""

    status: str
    reason: str
    message: str


# --- DRA: the devices a node's ResourceSlices publish, and the conditions of the claims holding them --


@dataclass(frozen=True, slots=True)
class DeviceCondition:
    """A condition a driver wrote on an allocated device (ResourceClaim status.devices[].conditions)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class DraDevice:
    driver: str
    pool: str
    name: str
    # The ResourceSlice that publishes it (what `gpuguard nodes explain` names).
    slice: str = ""
    taints: tuple[Taint, ...] = ()
    # Conditions of the claims it is allocated to.
    conditions: tuple[DeviceCondition, ...] = ()

    @property
    def id(self) -> str:
        return device_id(self.driver, self.pool, self.name)


@dataclass(frozen=True, slots=True)
class SliceFacts:
    name: str
    driver: str
    pool: str
    generation: int
    # How many slices the pool's generation is published in (pool.resourceSliceCount).
    slice_count: int
    node: str
    devices: tuple[DraDevice, ...] = ()


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    request: str
    driver: str
    pool: str
    device: str

    @property
    def id(self) -> str:
        return device_id(self.driver, self.pool, self.device)


@dataclass(frozen=True, slots=True)
class ClaimFacts:
    namespace: str
    name: str
    uid: str = ""
    devices: tuple[AllocatedDevice, ...] = ()
    # device id -> the conditions its driver wrote for this claim.
    conditions: Mapping[str, tuple[DeviceCondition, ...]] = field(default_factory=dict)
    # The pods the claim is reserved for (status.reservedFor), by name.
    pods: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class DeviceUser:
    """A pod a DRA device's claims are reserved for, as the choice of who evicts it reads it."""

    namespace: str
    # A PodDisruptionBudget selects the pod; said too of a pod not seen yet (the safe side: the
    # Eviction API consults its budget, the device-taint-eviction controller would not).
    budgeted: bool
    namespace_labels: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class NodeDevices:
    """The DRA devices a node publishes now: those of the newest generation of each of its pools."""

    devices: tuple[DraDevice, ...] = ()
    # Drivers with a pool whose newest generation is not all published yet: their count is unknown.
    updating: frozenset[str] = frozenset()
    # device id -> the effect of gpuguard's DeviceTaintRule on it (joined in from the rules' cache).
    fenced: Mapping[str, str] = field(default_factory=dict)
    # The API server serves DeviceTaintRules (resource.k8s.io/v1 from 1.37): without them a failed
    # device cannot be fenced alone, and its node is tainted instead.
    fencing: bool = True
    # device id -> the pods using it (joined in from the claims, the pods and their budgets).
    users: Mapping[str, tuple[DeviceUser, ...]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for device in self.devices:
            counts[device.driver] = counts.get(device.driver, 0) + 1
        return counts


NO_DRA_DEVICES = NodeDevices()


def slice_facts(raw: Mapping[str, Any]) -> SliceFacts | None:
    """The fields of a ResourceSlice the verdicts read; None for a slice of no single node (devices
    reachable from many nodes, network-attached: not one node's to fail)."""
    metadata, spec = as_mapping(raw.get("metadata")), as_mapping(raw.get("spec"))
    name, node, driver = metadata.get("name"), spec.get("nodeName"), spec.get("driver")
    pool = as_mapping(spec.get("pool"))
    if not all(isinstance(value, str) and value for value in (name, node, driver)):
        return None
    generation, count = pool.get("generation"), pool.get("resourceSliceCount")
    devices = []
    for device in spec.get("devices") or []:
        device_name = as_mapping(device).get("name")
        if not isinstance(device_name, str):
            continue
        taints = tuple(
            Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
            for t in map(as_mapping, as_mapping(device).get("taints") or [])
        )
        devices.append(DraDevice(str(driver), str(pool.get("name", "")), device_name, str(name), taints))
    return SliceFacts(
        name=str(name),
        driver=str(driver),
        pool=str(pool.get("name", "")),
        generation=generation if type(generation) is int else 0,
        slice_count=count if type(count) is int and count > 0 else 1,
        node=str(node),
        devices=tuple(devices),
    )


def claim_facts(raw: Mapping[str, Any]) -> ClaimFacts | None:
    """The fields of a ResourceClaim the verdicts read; None for a claim not allocated (it holds no
    device yet): most claims of a cluster waiting to be scheduled are never kept."""
    metadata, status = as_mapping(raw.get("metadata")), as_mapping(raw.get("status"))
    name, namespace = metadata.get("name"), metadata.get("namespace")
    results = as_mapping(as_mapping(status.get("allocation")).get("devices")).get("results") or []
    if not isinstance(name, str) or not isinstance(namespace, str) or not results:
        return None
    devices = tuple(
        AllocatedDevice(
            str(result.get("request", "")),
            str(result.get("driver", "")),
            str(result.get("pool", "")),
            str(result.get("device", "")),
        )
        for result in map(as_mapping, results)
    )
    conditions: dict[str, tuple[DeviceCondition, ...]] = {}
    for device in map(as_mapping, status.get("devices") or []):
        found = tuple(
            DeviceCondition(
                str(c.get("type", "")),
                str(c.get("status", "")),
                str(c.get("reason") or ""),
                str(c.get("message") or ""),
            )
            for c in map(as_mapping, device.get("conditions") or [])
        )
        if found:
            held = device_id(*(str(device.get(part, "")) for part in ("driver", "pool", "device")))
            conditions[held] = conditions.get(held, ()) + found
    pods = tuple(
        str(user.get("name"))
        for user in map(as_mapping, status.get("reservedFor") or [])
        if user.get("resource") == "pods" and isinstance(user.get("name"), str)
    )
    return ClaimFacts(namespace, name, str(metadata.get("uid", "")), devices, conditions, pods)


def node_devices(slices: Iterable[SliceFacts], claims: Iterable[ClaimFacts] = ()) -> NodeDevices:
    """The devices a node's ResourceSlices publish: of each pool, the newest generation only (a device
    the driver no longer publishes has left the pool, however many older slices still list it), and
    only once that generation is published in full (until then the driver's count is unknown). Each
    device carries the conditions its claims' drivers wrote for it."""
    pools: dict[tuple[str, str], list[SliceFacts]] = {}
    for piece in slices:
        pools.setdefault((piece.driver, piece.pool), []).append(piece)
    conditions: dict[str, tuple[DeviceCondition, ...]] = {}
    for claim in claims:
        for key, found in claim.conditions.items():
            conditions[key] = conditions.get(key, ()) + found
    devices: list[DraDevice] = []
    updating: set[str] = set()
    for (driver, _), pieces in sorted(pools.items()):
        newest = max(piece.generation for piece in pieces)
        current = sorted((piece for piece in pieces if piece.generation == newest), key=lambda p: p.name)
        if len(current) < max(piece.slice_count for piece in current):
            updating.add(driver)
            continue
        for piece in current:
            devices.extend(
                replace(device, conditions=conditions[device.id]) if device.id in conditions else device
                for device in piece.devices
            )
    return NodeDevices(tuple(devices), frozenset(updating))


# --- nodes and pods ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BudgetFacts:
    """A PodDisruptionBudget (policy/v1): which pods of its namespace its selector picks."""

    namespace: str
    name: str
    match_labels: Mapping[str, str] = field(default_factory=dict)
    # (key, operator, values) of matchExpressions: In, NotIn, Exists, DoesNotExist.
    expressions: tuple[tuple[str, str, frozenset[str]], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.match_labels.items()) and all(
            _requirement_holds(labels, key, operator, values) for key, operator, values in self.expressions
        )


def _requirement_holds(labels: Mapping[str, str], key: str, operator: str, values: frozenset[str]) -> bool:
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    return False  # an operator the API server would not have accepted


def budget_facts(raw: Mapping[str, Any]) -> BudgetFacts | None:
    """A PodDisruptionBudget's selector; None for one that selects nothing (a null selector). In
    policy/v1 an empty selector selects every pod of the namespace."""
    metadata, spec = as_mapping(raw.get("metadata")), as_mapping(raw.get("spec"))
    namespace, name, selector = metadata.get("namespace"), metadata.get("name"), spec.get("selector")
    if not isinstance(namespace, str) or not isinstance(name, str) or not isinstance(selector, Mapping):
        return None
    expressions = tuple(
        (
            str(requirement.get("key", "")),
            str(requirement.get("operator", "")),
            frozenset(str(value) for value in requirement.get("values") or ()),
        )
        for requirement in map(as_mapping, selector.get("matchExpressions") or ())
    )
    match_labels = {str(k): str(v) for k, v in as_mapping(selector.get("matchLabels")).items()}
    return BudgetFacts(namespace, name, match_labels, expressions)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    name: str
    uid: str = ""
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    # Extended resources only (names with a "/"): what a device plugin reports, in whole devices. A
    # quantity that does not parse is left out: unknown, never read as 0.
    capacity: Mapping[str, int] = field(default_factory=dict)
    allocatable: Mapping[str, int] = field(default_factory=dict)
    # type -> status of every condition but gpuguard's own.
    conditions: Mapping[str, str] = field(default_factory=dict)
    condition: OwnCondition | None = None
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()
    record: NodeRecord | None = None
    # The annotation is there but unreadable (edited by hand): treated as no record, and reported.
    record_error: str = ""
    # The operator's acknowledgement (ACK_ANNOTATION), None when there is none.
    acknowledged_at: datetime.datetime | None = None
    # The node's DRA devices, from its ResourceSlices (`node_devices`): the Node object says nothing
    # of them, the controllers join them in (`with_devices`).
    dra: NodeDevices = NO_DRA_DEVICES

    @property
    def tainted(self) -> bool:
        return any(taint.key == TAINT_KEY for taint in self.taints)


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    container: str
    # The allocatedResourcesStatus name: a requested resource, or claim:<claim>[/<request>].
    resource: str
    device: str
    health: Literal["Unhealthy", "Unknown"]


@dataclass(frozen=True, slots=True)
class Termination:
    container: str
    exit_code: int
    finished_at: datetime.datetime | None


@dataclass(frozen=True, slots=True)
class PodFacts:
    namespace: str
    name: str
    uid: str = ""
    node: str = ""
    phase: str = "Pending"
    deleting: bool = False
    owner_kind: str = ""
    mirror: bool = False
    # Extended resources the containers ask for, and claim:<name> for each resource claim they use.
    requests: tuple[str, ...] = ()
    # Kept for DaemonSet pods (to find the device plugin) and pods using resource claims (to find the
    # PodDisruptionBudgets selecting them): other pods need no labels here.
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = False
    # The latest container start: a restarted device plugin registers its devices again.
    started_at: datetime.datetime | None = None
    devices: tuple[DeviceHealth, ...] = ()
    # (resource, device) of the DRA devices the kubelet reported Healthy or Unhealthy for this pod: in
    # this status, and in earlier ones when the controllers remembered them (`with_reported`). The
    # kubelet starts every DRA device at Unknown and keeps it there while its driver streams no health,
    # so Unknown means something only for a device whose driver has been heard about it.
    reported: frozenset[tuple[str, str]] = frozenset()
    terminations: tuple[Termination, ...] = ()
    crash_looping: bool = False
    disruption_target: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def holds(self, resource: str) -> bool:
        """Whether an allocatedResourcesStatus name refers to something this pod asked for."""
        if resource.startswith(CLAIM_PREFIX):
            claim = resource.removeprefix(CLAIM_PREFIX).split("/", 1)[0]
            return f"{CLAIM_PREFIX}{claim}" in self.requests
        return resource in self.requests


def node_facts(raw: Mapping[str, Any]) -> NodeFacts | None:
    """The fields of a Node the verdicts read; None for an object without a name."""
    metadata = as_mapping(raw.get("metadata"))
    name = metadata.get("name")
    if not isinstance(name, str):
        return None
    spec, status = as_mapping(raw.get("spec")), as_mapping(raw.get("status"))
    conditions: dict[str, str] = {}
    own: OwnCondition | None = None
    for condition in status.get("conditions") or []:
        if not isinstance(condition, dict) or not isinstance(condition.get("type"), str):
            continue
        if condition["type"] == CONDITION_TYPE:
            own = OwnCondition(
                str(condition.get("status", "")),
                str(condition.get("reason", "")),
                str(condition.get("message", "")),
            )
        else:
            conditions[condition["type"]] = str(condition.get("status", ""))
    taints = tuple(
        Taint(
            str(taint.get("key", "")),
            str(taint.get("value", "")),
            str(taint.get("effect", "")),
            str(taint.get("timeAdded") or ""),
        )
        for taint in spec.get("taints") or []
        if isinstance(taint, dict)
    )
    annotations = as_mapping(metadata.get("annotations"))
    record, record_error = None, ""
    text = annotations.get(RECORD_ANNOTATION)
    if isinstance(text, str):
        try:
            record = NodeRecord.from_json(text)
        except ValueError as exc:
            record_error = f"annotation {RECORD_ANNOTATION} is unreadable: {exc}"
    labels = as_mapping(metadata.get("labels"))
    return NodeFacts(
        name=name,
        uid=str(metadata.get("uid", "")),
        resource_version=str(metadata.get("resourceVersion", "")),
        labels={str(k): str(v) for k, v in labels.items()},
        capacity=_extended(status.get("capacity")),
        allocatable=_extended(status.get("allocatable")),
        conditions=conditions,
        condition=own,
        unschedulable=spec.get("unschedulable") is True,
        taints=taints,
        record=record,
        record_error=record_error,
        acknowledged_at=parse_time(annotations.get(ACK_ANNOTATION)),
    )


def _extended(resources: object) -> dict[str, int]:
    found: dict[str, int] = {}
    for name, value in as_mapping(resources).items():
        count = whole_count(value)
        if "/" in name and count is not None:
            found[name] = count
    return found


def pod_facts(raw: Mapping[str, Any]) -> PodFacts | None:
    """The fields of a Pod the verdicts read; None for a pod that matters to no verdict (no extended
    resource, no claim, not a DaemonSet's): most pods of a cluster are never kept."""
    metadata, spec, status = (as_mapping(raw.get(key)) for key in ("metadata", "spec", "status"))
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str):
        return None
    requests = _requests(spec)
    owners = [as_mapping(owner) for owner in metadata.get("ownerReferences") or []]
    owner_kind = next((str(o.get("kind", "")) for o in owners if o.get("controller") is True), "")
    if not requests and owner_kind != "DaemonSet":
        return None
    statuses = [as_mapping(s) for s in status.get("containerStatuses") or []]
    devices: list[DeviceHealth] = []
    reported: set[tuple[str, str]] = set()
    terminations: list[Termination] = []
    started: list[datetime.datetime] = []
    crash_looping = False
    for container_status in statuses:
        container = str(container_status.get("name", ""))
        _allocated_health(container, container_status, devices, reported)
        for key in ("state", "lastState"):
            terminated = as_mapping(as_mapping(container_status.get(key)).get("terminated"))
            exit_code = terminated.get("exitCode")
            if isinstance(exit_code, int) and exit_code != 0:
                terminations.append(
                    Termination(container, exit_code, parse_time(terminated.get("finishedAt")))
                )
        state = as_mapping(container_status.get("state"))
        running_since = parse_time(as_mapping(state.get("running")).get("startedAt"))
        if running_since is not None:
            started.append(running_since)
        crash_looping = crash_looping or as_mapping(state.get("waiting")).get("reason") == "CrashLoopBackOff"
    conditions = [as_mapping(c) for c in status.get("conditions") or []]
    for condition in conditions:
        # The node agent's report, from the PodResources API: a device held but no longer allocatable.
        # Its DRA entries (claim: resources) are left out: the agent fails a DRA device on any driver's
        # taint or on leaving its pool, read from the node's ResourceSlices without the policy, and the
        # controllers read those slices themselves, with the policy's drivers, taint keys and forSeconds.
        if condition.get("type") == holdings.CONDITION_TYPE and condition.get("status") == "False":
            lost = holdings.lost_devices(str(condition.get("message", "")))
            devices.extend(
                DeviceHealth(d.container, d.resource, d.device, "Unhealthy")
                for d in lost
                if not d.resource.startswith(CLAIM_PREFIX)
            )
    claims = any(request.startswith(CLAIM_PREFIX) for request in requests)
    labels = as_mapping(metadata.get("labels")) if owner_kind == "DaemonSet" or claims else {}
    # The texts pods share (namespace, node, phase, owner kind, resource names, label keys and values)
    # are interned: each decoded pod brings its own copies, and the leader keeps every accelerator pod.
    intern = sys.intern
    return PodFacts(
        namespace=intern(namespace),
        name=name,
        uid=str(metadata.get("uid", "")),
        node=intern(str(spec.get("nodeName") or "")),
        phase=intern(str(status.get("phase") or "Pending")),
        deleting=metadata.get("deletionTimestamp") is not None,
        owner_kind=intern(owner_kind),
        mirror="kubernetes.io/config.mirror" in as_mapping(metadata.get("annotations")),
        requests=tuple(intern(request) for request in requests),
        labels={intern(str(k)): intern(str(v)) for k, v in labels.items()},
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        started_at=max(started, default=None),
        devices=tuple(dict.fromkeys(devices)),
        reported=frozenset(reported),
        terminations=tuple(terminations),
        crash_looping=crash_looping,
        disruption_target=any(
            c.get("type") == DISRUPTION_TARGET and c.get("status") == "True" for c in conditions
        ),
    )


def _requests(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The extended resources (names with a "/") the pod's containers ask for, init containers first,
    and claim:<name> for each resource claim it uses."""
    requests: dict[str, None] = {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = as_mapping(as_mapping(container).get("resources"))
        for kind in ("limits", "requests"):
            requests.update(
                (resource, None) for resource in as_mapping(resources.get(kind)) if "/" in resource
            )
    for claim in spec.get("resourceClaims") or []:
        claim_name = as_mapping(claim).get("name")
        if isinstance(claim_name, str):
            requests[f"{CLAIM_PREFIX}{claim_name}"] = None
    return tuple(requests)


def _allocated_health(
    container: str,
    container_status: Mapping[str, Any],
    devices: list[DeviceHealth],
    reported: set[tuple[str, str]],
) -> None:
    """Adds a container's allocatedResourcesStatus to the pod's: its devices reported Unhealthy or
    Unknown to `devices`, its DRA devices reported Healthy or Unhealthy to `reported`."""
    for resource_status in container_status.get("allocatedResourcesStatus") or []:
        resource = str(as_mapping(resource_status).get("name", ""))
        for health in as_mapping(resource_status).get("resources") or []:
            state = as_mapping(health).get("health")
            device = str(as_mapping(health).get("resourceID", ""))
            if state in ("Unhealthy", "Unknown"):
                devices.append(DeviceHealth(container, resource, device, state))
            # Only DRA devices are ever Unknown (device plugins report Healthy or Unhealthy), so
            # only they need remembering: kept small, as every pod's facts are in memory.
            if state in ("Healthy", "Unhealthy") and resource.startswith(CLAIM_PREFIX):
                reported.add((resource, device))


def with_devices(node: NodeFacts, devices: NodeDevices) -> NodeFacts:
    """The node with the DRA devices its ResourceSlices publish."""
    return node if devices == node.dra else replace(node, dra=devices)


def with_reported(pod: PodFacts, earlier: frozenset[tuple[str, str]]) -> PodFacts:
    """The pod with the devices its earlier statuses reported Healthy or Unhealthy (kept by the
    controllers across status updates) added to what this status reports."""
    if earlier <= pod.reported:
        return pod
    return replace(pod, reported=pod.reported | earlier)

"""Which pods hold devices their node no longer offers, from the kubelet's PodResources API (pure).

The kubelet's PodResources API answers two questions: which devices each container of each pod holds
(`List`) and which devices the node can still hand out (`GetAllocatableResources`: the healthy ones,
held or not). A device held but no longer allocatable has failed under a running workload. The node
agent reports it as a pod condition; the pod device-health watcher reads that condition like the
kubelet's own `allocatedResourcesStatus`, so device plugins and kubelets that do not write the latter
are covered too. The condition's message is written and read here, in one place.

A device is lost only through a transition the agent saw: it was allocatable on an earlier poll and
left while the rest of its resource's set stayed. A set replaced wholesale is the device plugin
registering again under other IDs (a time-slicing or MPS config turns `GPU-<uuid>` into
`GPU-<uuid>::<n>`, a new ID strategy renames every device): the pods keep the devices the kubelet
allocated them and nothing failed, so that is no loss, as the kubelet itself defaults a device it no
longer knows to healthy.

DRA devices never show in `GetAllocatableResources`; `List` names them by driver, pool and device
(`ClaimHolding`), and `dra_holders` maps each to the pods holding it on the node.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

# A pod condition (custom types are allowed there, as readiness gates use them). Status False: the pod
# holds a device its node no longer allocates; True once it holds none (written only to undo a False).
CONDITION_TYPE = "GPUGuardDevicesAllocatable"
LOST_REASON = "DeviceNotAllocatable"
RESTORED_REASON = "DevicesAllocatable"
# The message earlier agents wrote (`<resource> <id>[,<id>] (container <name>)`, `; ` between them):
# still read, so their reports survive an upgrade; it could not carry IDs that are empty or contain
# those separators, which the JSON list written now does.
_HOLDING = re.compile(r"^(?P<resource>\S+) (?P<devices>\S+) \(container (?P<container>[^)]*)\)$")


@dataclass(frozen=True, slots=True)
class Holding:
    """The devices of one resource one container of a pod holds (or, from `lost`, has lost)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: frozenset[str]

    @property
    def pod_key(self) -> str:
        return f"{self.namespace}/{self.pod}"


DeviceKey = tuple[str, str, str, str]  # pod key, container, resource, device


def device_id(driver: str, pool: str, device: str) -> str:
    """<driver>/<pool>/<device>: how allocation results, DeviceTaintRules and the kubelet name a device."""
    return f"{driver}/{pool}/{device}"


def device_driver(name: str) -> str | None:
    """The driver a device's name says: the kubelet names a claim's device by its first CDI device ID
    (`vendor/class=name`, which does not name the driver) or, without one, `<driver>/<pool>/<device>`
    (pkg/kubelet/cm/dra/manager.go); None for any name but the latter."""
    if "=" in name or name.count("/") < 2:
        return None
    return name.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class ClaimHolding:
    """A DRA device one container of a pod holds through a resource claim (`List`'s
    `dynamic_resources`): the kubelet's own view, which needs no ResourceClaim from the API server."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim: str
    driver: str
    pool: str
    device: str

    @property
    def pod_key(self) -> str:
        return f"{self.namespace}/{self.pod}"

    @property
    def claim_key(self) -> str:
        return f"{self.claim_namespace}/{self.claim}"

    @property
    def device_id(self) -> str:
        return device_id(self.driver, self.pool, self.device)


@dataclass(frozen=True, slots=True)
class DeviceHolders:
    """The pods on the node holding one DRA device, and the claims they hold it through."""

    driver: str
    pods: tuple[str, ...]
    claims: tuple[str, ...]


def dra_holders(claims: Iterable[ClaimHolding]) -> dict[str, DeviceHolders]:
    """Device id -> who holds it: what a failed DRA device (a driver taint, a DeviceTaintRule, an
    Unhealthy report) takes down on this node. A claim shared by several containers, or pods, counts
    its device once."""
    drivers: dict[str, str] = {}
    pods: defaultdict[str, set[str]] = defaultdict(set)
    keys: defaultdict[str, set[str]] = defaultdict(set)
    for holding in claims:
        drivers[holding.device_id] = holding.driver
        pods[holding.device_id].add(holding.pod_key)
        keys[holding.device_id].add(holding.claim_key)
    return {
        device: DeviceHolders(drivers[device], tuple(sorted(pods[device])), tuple(sorted(keys[device])))
        for device in sorted(drivers)
    }


@dataclass(frozen=True, slots=True)
class Registration:
    """What the agent remembers of one resource between polls."""

    # The last non-empty allocatable set seen (an empty one says nothing about any device).
    offered: frozenset[str]
    # IDs that left `offered` while the rest of the set stayed, and have not come back.
    departed: frozenset[str] = frozenset()


def registration(previous: Registration | None, offered: frozenset[str]) -> tuple[Registration, bool]:
    """The resource's registration after a poll that found `offered` allocatable, and whether the set
    was replaced wholesale (fewer than half of the earlier IDs stayed): a re-registration under new IDs,
    which forgets what had departed, since those IDs name nothing any more."""
    if previous is None:
        return Registration(offered), False
    stayed = previous.offered & offered
    if 2 * len(stayed) < len(previous.offered):
        return Registration(offered), True
    return Registration(offered, (previous.departed | previous.offered) - offered), False


@dataclass(frozen=True, slots=True)
class Loss:
    # Holdings that include a device the node no longer allocates, only those devices kept.
    lost: tuple[Holding, ...]
    # Resources held by pods but absent from the allocatable set altogether: their device plugin is
    # not registered (restarting, or gone). That says nothing about any one device, so no pod is named.
    unregistered: tuple[str, ...]
    # Resources whose allocatable set was replaced wholesale on this poll: a re-registration under new
    # IDs, not a failure; pods holding them keep what they say, as for an unregistered one.
    reregistered: tuple[str, ...]
    # What to remember for the next poll, per resource.
    registrations: Mapping[str, Registration]


def loss(
    held: Iterable[Holding],
    allocatable: Mapping[str, frozenset[str]],
    known: Mapping[str, Registration],
    reported: Collection[DeviceKey] = (),
) -> Loss:
    """Which held devices are lost, given what the previous polls saw (`known`, the `registrations` of
    the last `Loss`; empty on the first poll, which loses nothing) and what the pods' conditions already
    report: a report stands while its device is still not allocatable (it survives an agent restart and
    a re-registration, which forget the transition itself)."""
    registrations = dict(known)
    reregistered: list[str] = []
    for resource, ids in allocatable.items():
        if ids:
            registrations[resource], replaced = registration(known.get(resource), ids)
            if replaced:
                reregistered.append(resource)
    lost: list[Holding] = []
    unregistered: dict[str, None] = {}
    for holding in held:
        offered = allocatable.get(holding.resource)
        if not offered:
            unregistered[holding.resource] = None
            continue
        departed = registrations[holding.resource].departed
        missing = frozenset(
            device
            for device in holding.device_ids - offered
            if device in departed
            or (holding.pod_key, holding.container, holding.resource, device) in reported
        )
        if missing:
            lost.append(Holding(holding.namespace, holding.pod, holding.container, holding.resource, missing))
    return Loss(tuple(lost), tuple(sorted(unregistered)), tuple(sorted(reregistered)), registrations)


@dataclass(frozen=True, slots=True)
class Condition:
    status: str
    reason: str
    message: str


def by_pod(holdings: Iterable[Holding]) -> dict[str, list[Holding]]:
    found: defaultdict[str, list[Holding]] = defaultdict(list)
    for holding in holdings:
        found[holding.pod_key].append(holding)
    return dict(found)


def lost_condition(holdings: Iterable[Holding], why: Mapping[str, str] | None = None) -> Condition:
    """The condition for a pod holding lost devices. Its message is a JSON list, one
    `{"resource", "container", "devices"}` per holding, sorted, so the same loss always reads the same
    and any device ID reads back as it was written. A holding of devices `why` explains (DRA devices:
    a driver's taint, or gone from their pool) carries that too, as `"why"`."""
    why = why or {}
    parts: list[tuple[str, str, list[str], dict[str, object]]] = []
    for h in holdings:
        devices = sorted(h.device_ids)
        part: dict[str, object] = {"resource": h.resource, "container": h.container, "devices": devices}
        reasons = [why[device] for device in devices if device in why]
        if reasons:
            part["why"] = "; ".join(reasons)
        parts.append((h.resource, h.container, devices, part))
    parts.sort(key=lambda sorted_by: sorted_by[:3])
    return Condition("False", LOST_REASON, json.dumps([part for *_, part in parts]))


RESTORED = Condition("True", RESTORED_REASON, "every device the pod holds is allocatable again")


@dataclass(frozen=True, slots=True)
class LostDevice:
    container: str
    resource: str
    device: str


def lost_devices(message: str) -> tuple[LostDevice, ...]:
    """The devices named by a `lost_condition` message, or by an earlier agent's (unreadable parts are
    skipped: anyone allowed to write pod status can write anything there)."""
    try:
        parts = json.loads(message)
    except (ValueError, RecursionError):
        return _legacy_lost_devices(message)
    found: list[LostDevice] = []
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        container, resource, devices = part.get("container"), part.get("resource"), part.get("devices")
        if isinstance(container, str) and isinstance(resource, str) and isinstance(devices, list):
            found.extend(LostDevice(container, resource, d) for d in devices if isinstance(d, str))
    return tuple(found)


def _legacy_lost_devices(message: str) -> tuple[LostDevice, ...]:
    found: list[LostDevice] = []
    for part in message.split("; "):
        match = _HOLDING.match(part)
        if match is None:
            continue
        found.extend(
            LostDevice(match["container"], match["resource"], device)
            for device in match["devices"].split(",")
            if device
        )
    return tuple(found)


# --- what the agent writes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodView:
    """What the agent reads of a pod on its node: enough to write its condition at a known version."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    # The agent's condition as the pod carries it now (None: never written).
    condition: Condition | None = None
    # (ResourceClaim name, the pod's name for it in spec.resourceClaims): the kubelet's PodResources
    # names the claim object, the pod's `claim:<name>` resources (allocatedResourcesStatus) its own.
    claims: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def claim_name(self, claim: str) -> str:
        """The pod's name for the ResourceClaim `claim`, or the claim's own when the pod does not say
        (yet) which of its claims it is."""
        return next((entry for object_name, entry in self.claims if object_name == claim), claim)


def pod_view(raw: Mapping[str, object]) -> PodView | None:
    metadata, status = raw.get("metadata"), raw.get("status")
    if not isinstance(metadata, Mapping):
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str):
        return None
    condition = None
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    for item in conditions if isinstance(conditions, list) else []:
        if isinstance(item, Mapping) and item.get("type") == CONDITION_TYPE:
            condition = Condition(
                str(item.get("status", "")), str(item.get("reason", "")), str(item.get("message", ""))
            )
    return PodView(
        namespace,
        name,
        str(metadata.get("uid", "")),
        str(metadata.get("resourceVersion", "")),
        condition,
        _claim_names(raw.get("spec"), status),
    )


def _claim_names(spec: object, status: object) -> tuple[tuple[str, str], ...]:
    """(ResourceClaim name, the pod's name for it): a claim the pod references by name says so in its
    spec, one made from a template in status.resourceClaimStatuses."""
    found: dict[str, str] = {}
    for source in (
        spec.get("resourceClaims") if isinstance(spec, Mapping) else None,
        status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None,
    ):
        for item in source if isinstance(source, list) else []:
            if isinstance(item, Mapping):
                entry, object_name = item.get("name"), item.get("resourceClaimName")
                if isinstance(entry, str) and isinstance(object_name, str):
                    found[object_name] = entry
    return tuple(sorted(found.items()))


@dataclass(frozen=True, slots=True)
class Write:
    pod: PodView
    condition: Condition


def device_keys(holdings: Iterable[Holding]) -> set[DeviceKey]:
    return {(h.pod_key, h.container, h.resource, d) for h in holdings for d in h.device_ids}


def confirmed(
    lost: Iterable[Holding],
    first_seen: Mapping[DeviceKey, float],
    reported: Iterable[DeviceKey],
    now: float,
    confirm_seconds: float,
) -> list[Holding]:
    """The losses seen for at least `confirm_seconds` (a device plugin that re-registers, or a List
    answered mid-change, is not a failure), or already reported on the pod (the report survives an
    agent restart: it lives in the cluster). Only the confirmed devices are kept."""
    reported = set(reported)
    kept: list[Holding] = []
    for holding in lost:
        devices = frozenset(
            device
            for device in holding.device_ids
            if (key := (holding.pod_key, holding.container, holding.resource, device)) in reported
            or now - first_seen.get(key, now) >= confirm_seconds
        )
        if devices:
            kept.append(Holding(holding.namespace, holding.pod, holding.container, holding.resource, devices))
    return kept


def reported_devices(pods: Iterable[PodView]) -> set[DeviceKey]:
    """The devices the pods' conditions already name as lost."""
    found: set[DeviceKey] = set()
    for pod in pods:
        if pod.condition is not None and pod.condition.status == "False":
            found.update(
                (pod.key, d.container, d.resource, d.device) for d in lost_devices(pod.condition.message)
            )
    return found


def writes(
    pods: Mapping[str, PodView],
    lost: Iterable[Holding],
    *,
    unsure: Iterable[str] = (),
    why: Mapping[str, str] | None = None,
) -> list[Write]:
    """The condition writes that make every pod on the node say what it holds: False naming its lost
    devices (and `why`, where it explains them), True again for a pod whose False no longer holds.
    Pods in `unsure` (holding a resource whose plugin is not registered, a DRA device whose pool is
    not known in full) keep what they say. Nothing is written that is already there."""
    wanted = {key: lost_condition(held, why) for key, held in by_pod(lost).items()}
    unsure = set(unsure)
    planned: list[Write] = []
    for key, pod in sorted(pods.items()):
        condition = wanted.get(key)
        if condition is None:
            stale = pod.condition is not None and pod.condition.status == "False"
            if not stale or key in unsure:
                continue
            condition = RESTORED
        if pod.condition != condition:
            planned.append(Write(pod, condition))
    return planned

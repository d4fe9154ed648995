"""Device health verdicts: plain node and pod facts in, what gpuguard should do about them out.

Nothing here reads a clock, a cache or the cluster: the controllers hand in the facts (converted from
the API objects by `node_facts` and `pod_facts`), gpuguard's own record of the node, the fleet figures
the budget needs and `now`, and get back a plan. The plan names the node state it wants (condition,
taint, cordon, record) with every step's effect already decided by its mode, so the caller only writes
the difference and records the steps.

Signals are timed from when gpuguard first saw them (kept in the record, on the node), never from a
`lastTransitionTime`, which agents reset (karpenter#2833) or backdate.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from webhook.policy.health.observed import (
    CLAIM_PREFIX,
    TAINT_KEY,
    DeviceHealth,
    DraDevice,
    NodeFacts,
    OwnCondition,
    PodFacts,
    Taint,
    device_id,
)
from webhook.policy.health.record import (
    ACK_ANNOTATION,
    RECORD_ANNOTATION,
    NodeRecord,
    as_mapping,
    clamped,
)
from webhook.policy.model import HealthSignals, Mode, Policy, scaled_count

EXCLUDE_LABEL = "gpuguard.io/exclude-from-remediation"
# A node held back (budget, breaker, someone else's cordon) is looked at again this often, since what
# holds it changes on other nodes.
HELD_RECHECK_SECONDS = 30.0

HealthState = Literal["healthy", "suspect", "unhealthy", "recovering"]
SignalKind = Literal[
    "deviceGap",
    "deviceMissing",
    "podDevice",
    "podDeviceUnknown",
    "devicePlugin",
    "capacityVanished",
    "nodeCondition",
    "deviceTaint",
    "deviceCondition",
]
Effect = Literal["do", "would", "hold"]
# The steps of the ladder as they appear in Events, metrics and `gpuguard nodes`.
StepAction = Literal["condition", "taint", "drain", "recover", "cancel"]
EvictReason = Literal["DeviceUnhealthy", "DeviceUnknown", "NodeDrain"]


# --- assessment: which signals a node shows ----------------------------------------------------------


@dataclass(frozen=True)
class Signal:
    key: str
    kind: SignalKind
    message: str
    for_seconds: float
    since: datetime.datetime
    resource: str = ""
    # Devices known to have failed (0 when the signal cannot count them).
    devices: int = 0
    whole_node: bool = False
    # Why the signal is due before it persisted for `for_seconds` (correlated container failures).
    confirmed_by: str = ""
    # The DRA devices (<driver>/<pool>/<device>) it fails, each of which gpuguard may fence alone.
    device_ids: tuple[str, ...] = ()

    @property
    def due_at(self) -> datetime.datetime:
        wait = 0.0 if self.confirmed_by else self.for_seconds
        return self.since + datetime.timedelta(seconds=wait)

    def due(self, now: datetime.datetime) -> bool:
        return now >= self.due_at


@dataclass(frozen=True)
class Suppressed:
    """A pattern that looks like failed devices and is not: reported, never acted on."""

    kind: SignalKind
    message: str


@dataclass(frozen=True)
class Assessment:
    node: str
    pool: str
    # An accelerator node selected by the policy; the rest are never acted on.
    accelerator: bool
    signals: tuple[Signal, ...]
    suppressed: tuple[Suppressed, ...]
    # resource -> (allocatable, capacity), accelerator resources only; for a DRA driver, (devices not
    # failed by a taint, devices published).
    devices: Mapping[str, tuple[int, int]]
    correlated_failures: int
    state: HealthState
    # Share (0-1) of the node's devices failed, by the due signals.
    failed_share: float
    # The node has no accelerator pods left (what a drain waits for).
    drained: bool

    def due(self, now: datetime.datetime) -> tuple[Signal, ...]:
        return tuple(signal for signal in self.signals if signal.due(now))


def is_accelerator_node(node: NodeFacts, policy: Policy) -> bool:
    """Selected by health.nodeSelector, and carrying an accelerator resource (at any count, 0 included:
    the kubelet writes 0 for a resource whose plugin went away) or an accelerator node label."""
    if not policy.health.nodeSelector.matches(node.labels):
        return False
    accelerators = policy.accelerators
    if any(accelerators.is_accelerator_resource(name) for name in node.capacity):
        return True
    drivers = {device.driver for device in node.dra.devices} | node.dra.updating
    if any(accelerators.is_accelerator_driver(driver) for driver in drivers):
        return True
    return any(label in node.labels for label in accelerators.nodeLabels)


def left_alone(node: NodeFacts, policy: Policy) -> str:
    """Why gpuguard writes nothing to this node and evicts none of its pods (excluded, paused, someone
    else's: the node lifecycle controller's or another remediator's); "" when it may act. The node
    controller and the pod watcher both ask this. Events may still say why."""
    health = policy.health
    if node.labels.get(EXCLUDE_LABEL) == "true":
        return f"the node is labelled {EXCLUDE_LABEL}=true"
    if health.paused:
        return "remediation is paused (health.paused)"
    lifecycle = _not_ready(node)
    if lifecycle:
        return f"the node lifecycle controller handles the node: {lifecycle}"
    other = next((t.key for t in node.taints if t.key in health.othersRemediatingTaints), None)
    if other is not None:
        return f"taint {other} shows someone else remediates the node"
    return ""


def _is_accelerator_request(name: str, policy: Policy) -> bool:
    """An accelerator resource, or a resource claim (`claim:` names) when the policy counts claims."""
    accelerators = policy.accelerators
    return accelerators.is_accelerator_resource(name) or (
        accelerators.resourceClaims and name.startswith(CLAIM_PREFIX)
    )


def is_accelerator_pod(pod: PodFacts, policy: Policy) -> bool:
    return any(_is_accelerator_request(name, policy) for name in pod.requests)


def _reported_devices(
    pod: PodFacts, policy: Policy, state: Literal["Unhealthy", "Unknown"], *, driver_settled: bool
) -> list[DeviceHealth]:
    """The pod's accelerator devices reported in `state`. Other devices it holds (an RDMA or SR-IOV NIC,
    an FPGA) are not gpuguard's to act on unless the policy names them. Unknown counts only when the
    policy gives it a wait, the device was reported Healthy or Unhealthy before (the kubelet says
    Unknown for every DRA device whose driver streams no health) and the driver is not restarting (a
    driver whose health stream ends leaves all its devices Unknown until the new one streams)."""
    if state == "Unknown" and (
        policy.health.signals.podDeviceHealth.unknownForSeconds is None or not driver_settled
    ):
        return []
    return [
        device
        for device in pod.devices
        if device.health == state
        and pod.holds(device.resource)
        and _is_accelerator_request(device.resource, policy)
        and (state == "Unhealthy" or (device.resource, device.device) in pod.reported)
    ]


def _plugin_pods(pods: Iterable[PodFacts], policy: Policy) -> list[PodFacts]:
    plugin = policy.health.signals.devicePlugin
    return [
        pod
        for pod in pods
        if pod.owner_kind == "DaemonSet" and not pod.terminal and plugin.matches(pod.namespace, pod.labels)
    ]


def plugins_settled(pods: Iterable[PodFacts], policy: Policy, now: datetime.datetime) -> bool:
    """The device plugins or DRA drivers among a node's pods (`health.signals.devicePlugin`) run
    settled: what they say about devices counts."""
    return _settled(_plugin_pods(pods, policy), policy, now)


def _settled(plugins: Sequence[PodFacts], policy: Policy, now: datetime.datetime) -> bool:
    """A device plugin that is Ready and has run past the restart grace: its word on devices counts."""
    grace = datetime.timedelta(seconds=policy.health.signals.devicePlugin.restartGraceSeconds)
    return bool(plugins) and all(
        pod.ready and not pod.deleting and pod.started_at is not None and now - pod.started_at >= grace
        for pod in plugins
    )


def _correlated_failures(pods: Iterable[PodFacts], policy: Policy, now: datetime.datetime) -> int:
    codes = set(policy.rules.podFailurePolicy.deviceFailureExitCodes)
    window = datetime.timedelta(seconds=policy.health.signals.correlation.windowSeconds)
    failures = 0
    for pod in pods:
        if not is_accelerator_pod(pod, policy):
            continue
        failures += pod.crash_looping
        failures += sum(
            1
            for t in pod.terminations
            if t.exit_code in codes and (t.finished_at is None or now - t.finished_at <= window)
        )
    return failures


def assess(
    node: NodeFacts,
    pods: Iterable[PodFacts],
    policy: Policy,
    now: datetime.datetime,
    record: NodeRecord | None = None,
) -> Assessment:
    """The node's signals and state. `pods` are the pods bound to the node (the informer keeps only the
    ones a verdict reads); `record` is gpuguard's record (the node's annotation when None)."""
    record = record if record is not None else node.record or NodeRecord()
    pods = list(pods)
    health = policy.health
    signals_policy = health.signals
    accelerators = policy.accelerators
    accelerator = is_accelerator_node(node, policy)
    capacities = {
        name: capacity
        for name, capacity in sorted(node.capacity.items())
        if accelerators.is_accelerator_resource(name)
    }
    # Allocatable missing or unreadable beside a capacity: unknown, so no gap can be told.
    devices = {
        name: (node.allocatable[name], capacity)
        for name, capacity in capacities.items()
        if name in node.allocatable
    }
    found: list[Signal] = []
    suppressed: list[Suppressed] = []

    def signal(
        key: str, kind: SignalKind, message: str, for_seconds: float, *, continues: str = "", **extra: Any
    ) -> None:
        """A signal timed from its first sighting, or from that of the signal it `continues` (the same
        failure seen another way), whichever came first."""
        since = min(record.signals.get(key, now), record.signals.get(continues, now))
        found.append(Signal(key, kind, message, for_seconds, since, **extra))

    plugins = _plugin_pods(pods, policy)
    settled = _settled(plugins, policy, now)
    # Bring-up: no accelerator capacity registered yet and the plugin has not started (a new node whose
    # driver installs, its plugin Pending in init containers). Nothing there has failed yet.
    registered = any(capacity > 0 for capacity in capacities.values())
    starting = [] if registered else [pod for pod in plugins if pod.phase == "Pending"]
    correlated = _correlated_failures(pods, policy, now) if accelerator else 0
    live_pods = [pod for pod in pods if not pod.terminal and is_accelerator_pod(pod, policy)]
    dra = _dra_devices(node, policy)
    published = {device.id for devices in dra.values() for device in devices}

    if accelerator:
        gap_seconds = signals_policy.deviceGap.forSeconds
        for resource, (allocatable, capacity) in devices.items():
            if capacity <= 0 or allocatable >= capacity:
                continue
            missing = capacity - allocatable
            message = f"{resource}: {missing} of {capacity} devices unhealthy (allocatable {allocatable})"
            if allocatable > 0 or settled:
                confirm = ""
                if correlated >= signals_policy.correlation.minFailures:
                    confirm = f"{correlated} device-failure exits or crash loops on the node"
                signal(
                    f"deviceGap/{resource}",
                    "deviceGap",
                    message,
                    gap_seconds,
                    resource=resource,
                    devices=missing,
                    confirmed_by=confirm,
                )
            elif plugins:
                # The plugin marks every device unhealthy while it is disconnected (a restart, an upgrade).
                suppressed.append(Suppressed("deviceGap", f"{message}: the device plugin is restarting"))
            else:
                # No plugin pod to ask: a plugin this policy does not select, or one being replaced.
                wait = max(gap_seconds, signals_policy.devicePlugin.capacityVanishedForSeconds)
                signal(
                    f"deviceGap/{resource}",
                    "deviceGap",
                    f"{message}; no device plugin pod seen",
                    wait,
                    resource=resource,
                    devices=missing,
                )
        for resource, (capacity, expected) in missing_devices(node, record, policy).items():
            # A device gone from capacity does not come back by itself: only a new node, a new layout
            # or an operator's acknowledgement clears this. A failed device that a plugin restart stopped
            # enumerating (8/7 became 7/7) is the same failure: its wait goes on from the gap's sighting.
            # A DRA driver (a name without a "/") publishes its devices in ResourceSlices, and a device
            # it tainted and then stopped publishing is the same failure too.
            plugin = "/" in resource
            shown = f"capacity {capacity}" if plugin else f"{capacity} in its ResourceSlices"
            signal(
                f"deviceMissing/{resource}",
                "deviceMissing",
                f"{resource}: {expected - capacity} of {expected} expected devices missing ({shown})",
                gap_seconds,
                continues=f"deviceGap/{resource}" if plugin else f"deviceTaint/{resource}",
                resource=resource,
                devices=expected - capacity,
            )
        # Vanished needs something that was there: the kubelet writes an explicit 0 for a resource whose
        # plugin went away (or, after its own restart, until the plugin registers again). A node with an
        # accelerator label and no accelerator resource at all (DRA, passthrough, no plugin by design)
        # has no device-plugin capacity to lose.
        if capacities and not registered:
            if starting:
                suppressed.append(
                    Suppressed(
                        "capacityVanished",
                        f"no accelerator capacity registered yet: device plugin pod {starting[0].key} "
                        "has not started (bring-up)",
                    )
                )
            else:
                signal(
                    "capacityVanished",
                    "capacityVanished",
                    "no accelerator capacity reported",
                    signals_policy.devicePlugin.capacityVanishedForSeconds,
                    whole_node=True,
                )
        for pod in plugins:
            if pod in starting:
                suppressed.append(
                    Suppressed(
                        "devicePlugin",
                        f"device plugin pod {pod.key} has not started on a node that never registered "
                        "accelerator capacity (bring-up)",
                    )
                )
            elif not pod.ready:
                signal(
                    "devicePlugin",
                    "devicePlugin",
                    f"device plugin pod {pod.key} is not Ready",
                    signals_policy.devicePlugin.notReadyForSeconds,
                    whole_node=True,
                )
                break
        for wanted in signals_policy.nodeConditions:
            if node.conditions.get(wanted.type) == wanted.status:
                signal(
                    f"nodeCondition/{wanted.type}",
                    "nodeCondition",
                    f"{wanted.type}={wanted.status}",
                    wanted.forSeconds,
                    whole_node=True,
                )
        for driver, driver_devices in sorted(dra.items()):
            _dra_signals(driver, driver_devices, signals_policy, signal)
        reports: list[tuple[Literal["Unhealthy", "Unknown"], SignalKind, int]] = [
            ("Unhealthy", "podDevice", signals_policy.deviceGap.forSeconds)
        ]
        unknown_wait = signals_policy.podDeviceHealth.unknownForSeconds
        if unknown_wait is not None:
            reports.append(("Unknown", "podDeviceUnknown", unknown_wait))
        for health_state, kind, wait in reports:
            reported: dict[str, set[str]] = {}
            for pod in live_pods:
                for device in _reported_devices(pod, policy, health_state, driver_settled=settled):
                    reported.setdefault(device.resource, set()).add(device.device)
            for resource, ids in sorted(reported.items()):
                message = f"{resource}: {len(ids)} devices reported {health_state} by pods ({', '.join(sorted(ids))})"
                # A claim's devices count for their driver's share of the node (the kubelet names a
                # DRA device <driver>/<pool>/<device> when its driver gives no CDI name).
                drivers = {driver for driver in dra if any(i.startswith(f"{driver}/") for i in ids)}
                share_of = drivers.pop() if len(drivers) == 1 else resource
                # Only an Unhealthy device is fenced: the device, not the pod, is what failed.
                fenceable = tuple(sorted(ids & published)) if ids <= published and kind == "podDevice" else ()
                signal(
                    f"{kind}/{resource}",
                    kind,
                    message,
                    wait,
                    resource=share_of,
                    devices=len(ids),
                    device_ids=fenceable,
                )

    devices.update(_dra_counts(dra, signals_policy))
    due = [s for s in found if s.due(now)]
    failed_share = _failed_share(due, devices)
    holds_marks = _holds_marks(node, record)
    state: HealthState
    if due or (found and holds_marks):
        state = "unhealthy"
    elif found:
        state = "suspect"
    elif holds_marks:
        state = "recovering"
    else:
        state = "healthy"
    return Assessment(
        node=node.name,
        pool=health.pool_of(node.labels),
        accelerator=accelerator,
        signals=tuple(found),
        suppressed=tuple(suppressed),
        devices=devices,
        correlated_failures=correlated,
        state=state,
        failed_share=failed_share,
        # Terminating pods still hold their devices until the kubelet ends them.
        drained=not any(_drain_evicts(pod, policy) for pod in live_pods),
    )


def _dra_devices(node: NodeFacts, policy: Policy) -> dict[str, list[DraDevice]]:
    """The node's published devices of accelerator drivers, by driver."""
    drivers: dict[str, list[DraDevice]] = {}
    for device in node.dra.devices:
        if policy.accelerators.is_accelerator_driver(device.driver):
            drivers.setdefault(device.driver, []).append(device)
    return drivers


def failing_taints(device: DraDevice, signals: HealthSignals) -> tuple[Taint, ...]:
    """The device's taints that fail it: NoSchedule or NoExecute with a key the policy names (any
    when it names none). Effect None is informational, and gpuguard's own key is never its signal."""
    taints = signals.deviceTaints
    return tuple(t for t in device.taints if t.key != TAINT_KEY and taints.fails(t.key, t.effect))


def _dra_counts(dra: Mapping[str, Sequence[DraDevice]], signals: HealthSignals) -> dict[str, tuple[int, int]]:
    return {
        driver: (sum(1 for d in published if not failing_taints(d, signals)), len(published))
        for driver, published in sorted(dra.items())
    }


def _listed(devices: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(devices[:most])
    return shown + (f" and {len(devices) - most} more" if len(devices) > most else "")


def _dra_signals(
    driver: str, published: Sequence[DraDevice], signals: HealthSignals, signal: Callable[..., None]
) -> None:
    """A driver's tainted devices, and its devices showing a claim condition the policy names."""
    tainted = [(device, failing_taints(device, signals)) for device in published]
    tainted = [(device, taints) for device, taints in tainted if taints]
    if tainted:
        named = [
            f"{d.id} ({', '.join(f'{t.key}={t.value}:{t.effect}' if t.value else f'{t.key}:{t.effect}' for t in taints)}"
            f", ResourceSlice {d.slice})"
            for d, taints in tainted
        ]
        signal(
            f"deviceTaint/{driver}",
            "deviceTaint",
            f"{driver}: {len(tainted)} of {len(published)} devices tainted by their driver: {_listed(named)}",
            signals.deviceTaints.forSeconds,
            resource=driver,
            devices=len(tainted),
            device_ids=tuple(device.id for device, _ in tainted),
        )
    for wanted in signals.claimDeviceConditions:
        showing, ids = [], []
        for device in published:
            match = next(
                (c for c in device.conditions if c.type == wanted.type and c.status == wanted.status), None
            )
            if match is not None:
                said = f"{match.reason}: {match.message}" if match.message else match.reason or match.type
                showing.append(f"{device.id} ({said})")
                ids.append(device.id)
        if showing:
            signal(
                f"deviceCondition/{wanted.type}/{driver}",
                "deviceCondition",
                f"{driver}: {len(showing)} of {len(published)} devices with claim condition "
                f"{wanted.type}={wanted.status}: {_listed(showing)}",
                wanted.forSeconds,
                resource=driver,
                devices=len(showing),
                device_ids=tuple(ids),
            )


def _failed_devices(node: NodeFacts, due: Sequence[Signal]) -> dict[str, DeviceFence]:
    """The node's DRA devices the due signals fail (a None fence each, the effect chosen later)."""
    published = {device.id: device for device in node.dra.devices}
    return {
        key: DeviceFence(published[key].driver, published[key].pool, published[key].name, "None")
        for signal in due
        for key in signal.device_ids
        if key in published
    }


def _fence_effect(policy: Policy) -> DeviceTaintEffect:
    """NoExecute when evictions are enforced and the device-taint-eviction controller is to do them."""
    evicting = policy.health.dra.evict == "deviceTaint" and policy.health_mode("evict") == "enforce"
    return "NoExecute" if evicting else "NoSchedule"


def _drain_evicts(pod: PodFacts, policy: Policy) -> bool:
    """A drain evicts the pod (so waits for it): not a DaemonSet's or a static pod, and evictions are
    enforced in its namespace (by name; a namespace chosen by a selector is not known here)."""
    return (
        pod.owner_kind != "DaemonSet"
        and not pod.mirror
        and policy.health_mode("evict", pod.namespace) == "enforce"
    )


def _failed_share(due: Sequence[Signal], devices: Mapping[str, tuple[int, int]]) -> float:
    if any(signal.whole_node for signal in due):
        return 1.0
    share = 0.0
    for resource, (_, capacity) in devices.items():
        failed = max((s.devices for s in due if s.resource == resource), default=0)
        if capacity > 0:
            share = max(share, min(failed, capacity) / capacity)
    return share


def _holds_marks(node: NodeFacts, record: NodeRecord) -> bool:
    """gpuguard has something on this node to undo one day."""
    return (
        record.admitted_at is not None
        or record.cordoned
        or record.unhealthy_since is not None
        or node.condition is not None
        or node.tainted
    )


# --- plan: what to do about it -----------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    action: StepAction
    effect: Effect
    mode: Mode
    note: str


@dataclass(frozen=True)
class Fleet:
    """What the budget needs to know beyond the node: its pool, and who else is being acted on."""

    pool_nodes: int
    # Nodes of the pool gpuguard acts on now (admitted), this node left out.
    pool_admitted: int
    breaker_open: bool


DeviceTaintEffect = Literal["None", "NoSchedule", "NoExecute"]


@dataclass(frozen=True, slots=True)
class DeviceFence:
    """A DeviceTaintRule of gpuguard's on one DRA device: its taint is TAINT_KEY with `effect`."""

    driver: str
    pool: str
    device: str
    effect: DeviceTaintEffect

    @property
    def id(self) -> str:
        return device_id(self.driver, self.pool, self.device)

    @property
    def rule(self) -> str:
        return rule_name(self.id)


def rule_name(device: str) -> str:
    """gpuguard-<hash>: one rule per device, the same name from any replica."""
    return f"{RULE_PREFIX}{hashlib.sha256(device.encode()).hexdigest()[:16]}"


# What marks a DeviceTaintRule as gpuguard's: the controllers list only rules with this label, and a
# rule of theirs names its node and device in annotations (a node name may be longer than a label).
RULE_PREFIX = "gpuguard-"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpuguard"
RULE_NODE_ANNOTATION = "gpuguard.io/node"
RULE_DEVICE_ANNOTATION = "gpuguard.io/device"


@dataclass(frozen=True, slots=True)
class OwnRule:
    """One of gpuguard's DeviceTaintRules, as cached."""

    name: str
    node: str
    device: str
    effect: str
    resource_version: str


def own_rule(raw: Mapping[str, Any]) -> OwnRule | None:
    """A DeviceTaintRule gpuguard created (its label, its name, its annotations); None for any other."""
    metadata, spec = as_mapping(raw.get("metadata")), as_mapping(raw.get("spec"))
    annotations = as_mapping(metadata.get("annotations"))
    name, node, device = (
        metadata.get("name"),
        annotations.get(RULE_NODE_ANNOTATION),
        annotations.get(RULE_DEVICE_ANNOTATION),
    )
    if (
        as_mapping(metadata.get("labels")).get(MANAGED_BY_LABEL) != MANAGED_BY
        or not isinstance(name, str)
        or not name.startswith(RULE_PREFIX)
        or not isinstance(node, str)
        or not isinstance(device, str)
    ):
        return None
    effect = str(as_mapping(spec.get("taint")).get("effect", ""))
    return OwnRule(name, node, device, effect, str(metadata.get("resourceVersion", "")))


def rule_object(fence: DeviceFence, node: str, node_uid: str) -> dict[str, Any]:
    """The DeviceTaintRule of a fence, owned by its Node (the garbage collector removes it with the
    Node; gpuguard removes it once the device is no longer failed)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": fence.rule,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {RULE_NODE_ANNOTATION: node, RULE_DEVICE_ANNOTATION: fence.id},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {
            "deviceSelector": {"driver": fence.driver, "pool": fence.pool, "device": fence.device},
            "taint": {"key": TAINT_KEY, "effect": fence.effect},
        },
    }


@dataclass(frozen=True)
class NodePlan:
    assessment: Assessment
    # What to keep on the node; None: nothing (the annotation goes).
    record: NodeRecord | None
    # The node as wanted after the steps that are done ("do"); "would" and "hold" change nothing.
    condition: OwnCondition | None
    tainted: bool
    unschedulable: bool
    steps: tuple[Step, ...]
    # Why gpuguard writes nothing to the node at all (excluded, paused, someone else remediates it, the
    # node lifecycle controller handles it); "" otherwise.
    hands_off: str
    # Why disruptive steps are held back (budget, breaker, someone else's cordon); "" otherwise.
    held: str
    requeue_after: float | None
    # The node became due for remediation with this plan (the record's unhealthy_since is new): what
    # the circuit breaker counts. Never for a node left alone.
    became_due: bool = False
    # gpuguard's marks are on the node without a readable record of them: the record was rebuilt from
    # the marks, and this says so (a warning to report); "" otherwise.
    record_lost: str = ""
    # The record's times that were later than now, clamped to now (to log).
    clamped: tuple[str, ...] = ()
    # Why gpuguard keeps its marks on a node whose devices are clear again (repeated failures), until
    # an operator acknowledges it; "" otherwise.
    escalated: str = ""
    # The DeviceTaintRules gpuguard wants on this node's DRA devices, by device id.
    fences: Mapping[str, DeviceFence] = field(default_factory=dict)

    def budget_slot(self) -> bool:
        """The node takes a place in its pool's budget."""
        return self.record is not None and self.record.admitted_at is not None


def budget(policy: Policy, pool_nodes: int) -> int:
    return scaled_count(policy.health.budget.maxUnhealthy, pool_nodes)


def plan_node(
    node: NodeFacts,
    pods: Iterable[PodFacts],
    policy: Policy,
    fleet: Fleet,
    now: datetime.datetime,
    record: NodeRecord | None = None,
) -> NodePlan:
    """The ladder for one node: condition, then taint, then cordon and drain, undone on recovery."""
    record, record_lost = owned_record(node, record if record is not None else node.record, now)
    record, clamped_fields = clamped(record, now)
    record = _carried(node, record)
    assessment = assess(node, pods, policy, now, record)
    fences: dict[str, DeviceFence] = {}
    health = policy.health
    modes: dict[StepAction, Mode] = {
        "condition": policy.health_mode("condition"),
        "taint": policy.health_mode("taint"),
        "drain": policy.health_mode("drain"),
    }
    keep = _Wanted(node.condition, node.tainted, node.unschedulable)
    if not assessment.accelerator and assessment.state == "healthy":
        return NodePlan(assessment, None, *keep.values(), (), "", "", None)

    hands_off = left_alone(node, policy)
    was_due = record.unhealthy_since is not None
    # A node someone else cordoned (a reboot, a maintenance) is theirs until they give it back: it
    # becomes due, for the breaker too, only once gpuguard may act on it.
    may_become_due = not hands_off and not _cordoned_by_others(node, record)
    record = _bookkeeping(record, assessment, node, policy, now, may_become_due=may_become_due)
    steps: list[Step] = []
    wanted = keep
    held = escalated = ""
    due = assessment.due(now)
    if assessment.state == "unhealthy":
        # The disruptive rungs first: the condition's reason tells how far the ladder went.
        ladder: list[Step] = []
        if record.cordoned and not node.unschedulable and not hands_off:
            # An operator uncordoned the node gpuguard drained: they take over until it recovers.
            record = replace(record, cancelled_at=now, cordoned=False, draining_since=None)
            wanted, record = _step(
                ladder,
                wanted,
                record,
                "cancel",
                modes,
                "",
                now,
                change=node.tainted,
                tainted=False,
                mode_of="taint",
                note="an operator uncordoned the node: gpuguard stops remediating it",
            )
        held = hands_off or _held(node, record, assessment, fleet, policy)
        disruptive = modes["taint"] != "off" or modes["drain"] != "off"
        # The condition is an action too: node remediators act on it, so it takes a budget place.
        acting = disruptive or modes["condition"] != "off"
        admitted = record.admitted_at is not None
        if not admitted and acting and not held and due:
            record = replace(record, admitted_at=now)
            admitted = True
        summary = _summary(assessment, due)
        devices = _failed_devices(node, due) if node.dra.fencing else {}
        # Failed DRA devices are fenced alone; the node is tainted only for what no fence covers.
        device_only = bool(devices) and all(signal.device_ids for signal in due)
        effect = _fence_effect(policy)
        if admitted and record.cancelled_at is None:
            taint: dict[str, Any] = {
                "change": not node.tainted,
                "tainted": True,
                "note": f"taint {TAINT_KEY}:NoSchedule: {summary}",
            }
            if device_only:
                ids = sorted(devices)
                taint = {
                    "change": dict(node.dra.fenced) != dict.fromkeys(ids, effect),
                    "note": f"DeviceTaintRule {TAINT_KEY}:{effect} on {_listed(ids)}: {summary}",
                }
            wanted, record = _step(ladder, wanted, record, "taint", modes, held, now, **taint)
            if (
                record.draining_since is None
                and assessment.failed_share * 100 >= health.actions.drain.threshold
            ):
                # A node the breaker finds cordoned stays so; no new drain starts while it is open.
                drain_held = held or ("circuit breaker open" if fleet.breaker_open else "")
                wanted, record = _step(
                    ladder,
                    wanted,
                    record,
                    "drain",
                    modes,
                    drain_held,
                    now,
                    change=True,
                    unschedulable=True,
                    note=f"cordon and evict accelerator pods: {_share(assessment)}",
                )
                # Only a drain done is recorded: one only said (audit) is said again, and when the
                # drain is enforced it starts with the cordon, as on any node.
                if ladder and ladder[-1].action == "drain" and ladder[-1].effect == "do":
                    record = replace(record, draining_since=now, cordoned=not node.unschedulable)
        elif held and disruptive and due:
            ladder.append(Step("taint", "hold", modes["taint"], held))
        if modes["taint"] != "off":
            # Until the taint step is done, a None rule: the API's own dry run of the device's eviction.
            enforced = admitted and not held and record.cancelled_at is None and modes["taint"] == "enforce"
            fences = {
                key: replace(device, effect=effect if enforced else "None") for key, device in devices.items()
            }
        last = record.last_action, record.last_action_at
        condition = _condition(assessment, record, summary, held)
        wanted, record = _mark(steps, wanted, record, node, condition, modes, hands_off, now)
        if any(step.effect == "do" for step in ladder):
            record = replace(record, last_action=last[0], last_action_at=last[1])
        steps.extend(ladder)
    elif assessment.state == "recovering":
        assert record.clear_since is not None
        recover_at = record.clear_since + datetime.timedelta(seconds=health.recovery.afterSeconds)
        escalated = _escalation(node, record, policy) if now >= recover_at else ""
        if escalated:
            condition = OwnCondition("False", "RepeatedFailures", escalated)
            wanted, record = _mark(steps, wanted, record, node, condition, modes, hands_off, now)
        elif now >= recover_at:
            rest = _between_episodes(record, policy, now, remediated=True)
            wanted, record = _recover(steps, node, record, rest, modes, hands_off, now)
    elif assessment.state == "healthy":
        record = _between_episodes(record, policy, now, remediated=False)

    return NodePlan(
        assessment=assessment,
        record=None if _empty(record) else record,
        condition=wanted.condition,
        tainted=wanted.tainted,
        unschedulable=wanted.unschedulable,
        steps=tuple(steps),
        hands_off=hands_off,
        held=held,
        # A node that does not answer restarts its signals' clocks: only its coming back (a change of
        # the node, which requeues it) can change the verdict.
        requeue_after=None if _not_ready(node) else _requeue_after(assessment, record, policy, now, held),
        became_due=not was_due and record.unhealthy_since is not None,
        record_lost=record_lost,
        clamped=clamped_fields,
        escalated=escalated,
        fences=fences,
    )


@dataclass(frozen=True)
class _Wanted:
    condition: OwnCondition | None
    tainted: bool
    unschedulable: bool

    def values(self) -> tuple[OwnCondition | None, bool, bool]:
        return self.condition, self.tainted, self.unschedulable


_UNSET: Any = object()


def _step(
    steps: list[Step],
    wanted: _Wanted,
    record: NodeRecord,
    action: StepAction,
    modes: Mapping[StepAction, Mode],
    held: str,
    now: datetime.datetime,
    *,
    change: bool,
    note: str,
    mode_of: StepAction | None = None,
    condition: Any = _UNSET,
    tainted: Any = _UNSET,
    unschedulable: Any = _UNSET,
) -> tuple[_Wanted, NodeRecord]:
    """One rung: nothing when it changes nothing or its mode is off; held, would, or done."""
    mode = modes[mode_of or action]
    if not change or mode == "off":
        return wanted, record
    if held:
        steps.append(Step(action, "hold", mode, held))
        return wanted, record
    if mode != "enforce":
        steps.append(Step(action, "would", mode, note))
        return wanted, record
    steps.append(Step(action, "do", mode, note))
    changes = {
        name: value
        for name, value in (("condition", condition), ("tainted", tainted), ("unschedulable", unschedulable))
        if value is not _UNSET
    }
    return replace(wanted, **changes), replace(record, last_action=action, last_action_at=now)


def _mark(
    steps: list[Step],
    wanted: _Wanted,
    record: NodeRecord,
    node: NodeFacts,
    condition: OwnCondition,
    modes: Mapping[StepAction, Mode],
    hands_off: str,
    now: datetime.datetime,
) -> tuple[_Wanted, NodeRecord]:
    """The condition rung: gpuguard's condition as it should read, a step when the node's differs."""
    return _step(
        steps,
        wanted,
        record,
        "condition",
        modes,
        hands_off,
        now,
        change=node.condition != condition,
        condition=condition,
        note=condition.message,
    )


# The condition reasons that say gpuguard drained the node, so cordoned it.
DRAIN_REASONS = frozenset({"Draining", "Drained"})
# The node lifecycle controller's taints: the node does not answer, and that controller handles it.
NODE_LIFECYCLE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def owned_record(
    node: NodeFacts, record: NodeRecord | None, now: datetime.datetime
) -> tuple[NodeRecord, str]:
    """gpuguard's record of the node, rebuilt from its marks when there is none (stripped, or
    unreadable) and the node carries gpuguard's taint or condition: what they show gpuguard did keeps
    its budget place and stays gpuguard's to undo. The second value says so ("" for a record read)."""
    if record is not None:
        return record, ""
    own = node.condition
    marks = [mark for mark, on in (("taint", node.tainted), ("condition", own is not None)) if on]
    if not marks:
        return NodeRecord(), ""
    acted = node.tainted or (own is not None and own.status == "False")
    # Only gpuguard's drain writes these reasons, and it drains only a node it cordons itself.
    drained = node.unschedulable and own is not None and own.status == "False" and own.reason in DRAIN_REASONS
    rebuilt = NodeRecord(
        unhealthy_since=now,
        admitted_at=now if acted else None,
        cordoned=drained,
        draining_since=now if drained else None,
        uid=node.uid,
    )
    missing = node.record_error or f"annotation {RECORD_ANNOTATION} is missing"
    cordon = ", its cordon included" if drained else ""
    return (
        rebuilt,
        f"gpuguard's {' and '.join(marks)} are on the node but {missing}: it keeps them as its own{cordon}",
    )


def _carried(node: NodeFacts, record: NodeRecord) -> NodeRecord:
    """What of the record still holds: the expected counts and the history belong to one Node (uid),
    and an operator's acknowledgement newer than the last one taken clears both. A drain gpuguard did
    always comes with its cordon: one recorded without (an earlier version recorded drains it only
    said) was never done."""
    if record.draining_since is not None and not record.cordoned:
        record = replace(record, draining_since=None)
    if record.uid and node.uid and record.uid != node.uid:
        record = replace(record, expected={}, remediations=())
    ack = node.acknowledged_at
    if ack is not None and (record.acknowledged_at is None or ack > record.acknowledged_at):
        kept = tuple(moment for moment in record.remediations if moment > ack)
        record = replace(record, expected={}, remediations=kept, acknowledged_at=ack)
    return record


def _not_ready(node: NodeFacts) -> str:
    """Why the node does not answer (its pods' readiness says nothing of its devices); "" when it does."""
    ready = node.conditions.get("Ready", "True")
    if ready != "True":
        return f"its Ready condition is {ready}"
    taint = next((t.key for t in node.taints if t.key in NODE_LIFECYCLE_TAINTS), None)
    return f"it carries taint {taint}" if taint is not None else ""


def _bookkeeping(
    record: NodeRecord,
    assessment: Assessment,
    node: NodeFacts,
    policy: Policy,
    now: datetime.datetime,
    *,
    may_become_due: bool,
) -> NodeRecord:
    """First-seen times of the current signals (a signal that cleared starts again when it returns;
    all start again once a node that did not answer does), when the node first became due (never
    while it is left alone), since when it has been clear, and the devices it showed."""
    signals = {signal.key: signal.since for signal in assessment.signals} if not _not_ready(node) else {}
    unhealthy_since = record.unhealthy_since
    if unhealthy_since is None and may_become_due and assessment.due(now):
        unhealthy_since = now
    clear_since = record.clear_since
    if assessment.signals:
        clear_since = None
    elif clear_since is None:
        clear_since = now
    return replace(
        record,
        signals=signals,
        unhealthy_since=unhealthy_since,
        clear_since=clear_since,
        uid=node.uid or record.uid,
        expected=_seen_devices(node, record, policy),
    )


def _registered_devices(node: NodeFacts, policy: Policy) -> dict[str, int]:
    """The accelerator resources the node reports devices of, and how many; and the devices of each
    accelerator DRA driver its ResourceSlices publish, by driver name."""
    accelerators = policy.accelerators
    registered = {
        name: count
        for name, count in node.capacity.items()
        if count > 0 and accelerators.is_accelerator_resource(name)
    }
    registered.update(
        (driver, count)
        for driver, count in node.dra.counts().items()
        if accelerators.is_accelerator_driver(driver)
    )
    return registered


def _seen_devices(node: NodeFacts, record: NodeRecord, policy: Policy) -> dict[str, int]:
    """The most devices seen per resource: what the record expects from now on. No capacity at all
    (a kubelet restart, a plugin gone, a DRA driver whose slices are gone) changes nothing; other
    resource names (a new MIG layout, a new sharing configuration) start again from what the node
    reports. A driver whose pool is being republished keeps what was expected of it."""
    reported = _registered_devices(node, policy)
    reported.update((d, record.expected[d]) for d in node.dra.updating if d in record.expected)
    if not reported:
        return dict(record.expected)
    seen = record.expected if set(record.expected) == set(reported) else {}
    return {name: max(count, seen.get(name, 0)) for name, count in reported.items()}


def missing_devices(node: NodeFacts, record: NodeRecord, policy: Policy) -> dict[str, tuple[int, int]]:
    """resource -> (capacity, expected) where the node reports fewer devices than the most gpuguard
    recorded on it (same resources) or the policy's expectedDevices for its class."""
    reported = _registered_devices(node, policy)
    updating = {d: record.expected[d] for d in node.dra.updating if d in record.expected}
    seen = record.expected if set(record.expected) == set(reported) | set(updating) else {}
    baseline = policy.health.expected_devices(node.labels)
    missing = {}
    for name, capacity in sorted(reported.items()):
        expected = max(seen.get(name, 0), baseline.get(name, 0))
        if capacity < expected:
            missing[name] = (capacity, expected)
    return missing


def _held(node: NodeFacts, record: NodeRecord, assessment: Assessment, fleet: Fleet, policy: Policy) -> str:
    """Why no new disruptive step may start on this node; "" when one may."""
    health = policy.health
    if record.cancelled_at is not None:
        return "an operator uncordoned the node during gpuguard's drain; it waits for the node to recover"
    if _cordoned_by_others(node, record):
        return "the node was cordoned by someone else"
    if record.admitted_at is not None:
        return ""
    if fleet.breaker_open:
        return "circuit breaker open"
    allowed = budget(policy, fleet.pool_nodes)
    if fleet.pool_admitted >= allowed:
        pool = f"pool {assessment.pool}" if assessment.pool else "the nodes without a pool label"
        return (
            f"budget: {fleet.pool_admitted} of {fleet.pool_nodes} accelerator nodes of {pool} are being "
            f"remediated and budget.maxUnhealthy {health.budget.maxUnhealthy} allows {allowed}"
        )
    return ""


def _cordoned_by_others(node: NodeFacts, record: NodeRecord) -> bool:
    return node.unschedulable and not record.cordoned and record.draining_since is None


def _share(assessment: Assessment) -> str:
    return f"{assessment.failed_share:.0%} of its devices failed"


def _summary(assessment: Assessment, due: Sequence[Signal]) -> str:
    message = "; ".join(signal.message for signal in due or assessment.signals)
    if assessment.correlated_failures:
        message += f"; {assessment.correlated_failures} device-failure exits or crash loops"
    return message


def _condition(assessment: Assessment, record: NodeRecord, summary: str, held: str) -> OwnCondition:
    """False, what node remediators act on, only while gpuguard itself acts on the node; until then
    (held by the budget, the breaker, someone else's cordon; not due yet) status Unknown with reason
    Held, which they leave alone: the remediator a node is handed to obeys gpuguard's brakes."""
    if record.admitted_at is None or record.cancelled_at is not None:
        return OwnCondition("Unknown", "Held", f"{summary}; held: {held or 'the signals have not persisted'}")
    reason = "DevicesUnhealthy"
    if record.draining_since is not None:
        reason = "Drained" if assessment.drained else "Draining"
    return OwnCondition("False", reason, summary)


def _escalation(node: NodeFacts, record: NodeRecord, policy: Policy) -> str:
    """Why the node keeps gpuguard's marks although its devices are clear: it was remediated
    escalation.remediations times within the window that ends with this episode, and no operator
    acknowledged it since. "" when it recovers."""
    escalation = policy.health.recovery.escalation
    episode = record.unhealthy_since
    if not escalation.remediations or record.admitted_at is None or episode is None:
        return ""
    if record.acknowledged_at is not None and record.acknowledged_at >= episode:
        return ""
    start = episode - datetime.timedelta(seconds=escalation.windowSeconds)
    count = 1 + sum(1 for moment in record.remediations if start <= moment < episode)
    if count < escalation.remediations:
        return ""
    return (
        f"remediated {count} times within {escalation.windowSeconds} s: gpuguard keeps its marks until an "
        f"operator acknowledges the node (gpuguard nodes ack {node.name}, or the annotation {ACK_ANNOTATION})"
    )


def _between_episodes(
    record: NodeRecord, policy: Policy, now: datetime.datetime, *, remediated: bool
) -> NodeRecord:
    """What the record keeps once an episode is over: the node's identity, the devices it showed, and
    the episodes gpuguard acted on (this one too when `remediated`) that may still escalate one: within
    the window, after the operator's last acknowledgement."""
    escalation = policy.health.recovery.escalation
    history = set(record.remediations)
    if remediated and record.admitted_at is not None and record.unhealthy_since is not None:
        history.add(record.unhealthy_since)
    start = now - datetime.timedelta(seconds=escalation.windowSeconds)
    if record.acknowledged_at is not None:
        start = max(start, record.acknowledged_at + datetime.timedelta.resolution)
    recent = sorted(moment for moment in history if moment >= start)
    return NodeRecord(
        uid=record.uid,
        expected=record.expected,
        remediations=tuple(recent[-escalation.remediations :]) if escalation.remediations else (),
        acknowledged_at=record.acknowledged_at,
    )


def _recover(
    steps: list[Step],
    node: NodeFacts,
    record: NodeRecord,
    rest: NodeRecord,
    modes: Mapping[StepAction, Mode],
    hands_off: str,
    now: datetime.datetime,
) -> tuple[_Wanted, NodeRecord]:
    """Undoes exactly gpuguard's marks: its condition, its taint, and the cordon only if it cordoned.
    Once they are gone the record is `rest`."""
    wanted = _Wanted(node.condition, node.tainted, node.unschedulable)
    undo: list[tuple[StepAction, dict[str, Any]]] = []
    if node.condition is not None:
        undo.append(("condition", {"condition": None}))
    if node.tainted:
        undo.append(("taint", {"tainted": False}))
    if record.cordoned and node.unschedulable:
        undo.append(("drain", {"unschedulable": False}))
    marks = ", ".join({"condition": "condition", "taint": "taint", "drain": "cordon"}[a] for a, _ in undo)
    effects = [modes[action] for action, _ in undo if modes[action] != "off"]
    if not effects:
        return wanted, rest if not undo else record
    note = f"devices healthy again: removing gpuguard's {marks}"
    if hands_off:
        steps.append(Step("recover", "hold", effects[0], hands_off))
        return wanted, record
    for action, change in undo:
        if modes[action] == "enforce":
            wanted = replace(wanted, **change)
    done = all(mode == "enforce" for mode in effects)
    effect: Effect = "do" if any(mode == "enforce" for mode in effects) else "would"
    steps.append(Step("recover", effect, "enforce" if effect == "do" else effects[0], note))
    left = wanted.condition is not None or wanted.tainted or (record.cordoned and wanted.unschedulable)
    if done and not left:
        return wanted, rest
    return wanted, replace(record, last_action="recover", last_action_at=now)


def _empty(record: NodeRecord) -> bool:
    """Nothing worth keeping on the node: what is known of the node itself (uid, devices, the last
    acknowledgement) is kept only along with an episode or a history."""
    return replace(record, uid="", expected={}, acknowledged_at=None) == NodeRecord()


def _requeue_after(
    assessment: Assessment, record: NodeRecord, policy: Policy, now: datetime.datetime, held: str
) -> float | None:
    """When the verdict can next change without any object changing: a signal coming due, recovery.

    A moment already past is no reason to look again: a recovery that is due and still here was only
    said (its mode is audit or warn) and waits for a policy change, which requeues every node anyway.
    """
    moments = [signal.due_at for signal in assessment.signals if not signal.due(now)]
    if assessment.state == "recovering" and record.clear_since is not None:
        moments.append(record.clear_since + datetime.timedelta(seconds=policy.health.recovery.afterSeconds))
    delays = [(moment - now).total_seconds() for moment in moments if moment > now]
    if held:
        delays.append(HELD_RECHECK_SECONDS)
    return min(delays, default=None)


# --- pods --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodVerdict:
    evict: bool
    reason: EvictReason | None
    message: str
    # When an Unknown device will have persisted long enough.
    requeue_after: float | None = None


NO_EVICTION = PodVerdict(False, None, "")


def pod_verdict(
    pod: PodFacts,
    policy: Policy,
    now: datetime.datetime,
    *,
    draining: bool = False,
    unknown_since: datetime.datetime | None = None,
    driver_settled: bool = False,
    fenced: Sequence[str] = (),
) -> PodVerdict:
    """Whether a pod should be evicted: it holds an accelerator device reported Unhealthy, or Unknown
    for podDeviceHealth.unknownForSeconds (since `unknown_since`; only a device reported before, while
    its node's plugins are `driver_settled`), or DRA devices gpuguard `fenced` (NoSchedule rules, whose
    pods the Eviction API evicts), or its node is being drained."""
    if pod.terminal or pod.deleting or not pod.node:
        return NO_EVICTION
    if pod.disruption_target:
        # An eviction (ours or anyone's) adds DisruptionTarget, then deletes: a pod seen in between would
        # be evicted, that is deleted, a second time. A condition left without a deletion is cleared by
        # the disruption controller after two minutes, and that change brings the pod back here.
        return PodVerdict(False, None, "already a disruption target")
    if pod.mirror or pod.owner_kind == "DaemonSet":
        return PodVerdict(False, None, "DaemonSet and static pods are never evicted: they would come back")
    if not is_accelerator_pod(pod, policy):
        return NO_EVICTION
    unhealthy = _reported_devices(pod, policy, "Unhealthy", driver_settled=driver_settled)
    if unhealthy:
        return PodVerdict(True, "DeviceUnhealthy", f"{_devices(unhealthy)} reported Unhealthy")
    if fenced:
        note = f"DRA device {', '.join(fenced)} failed, fenced by DeviceTaintRule {TAINT_KEY}:NoSchedule"
        return PodVerdict(True, "DeviceUnhealthy", note)
    unknown = _reported_devices(pod, policy, "Unknown", driver_settled=driver_settled)
    wait = policy.health.signals.podDeviceHealth.unknownForSeconds
    if unknown and wait is not None and not draining:
        since = unknown_since or now
        left = (since + datetime.timedelta(seconds=wait) - now).total_seconds()
        if left > 0:
            return PodVerdict(False, None, f"{_devices(unknown)} reported Unknown", requeue_after=left)
        return PodVerdict(True, "DeviceUnknown", f"{_devices(unknown)} reported Unknown for {wait} s")
    if draining:
        return PodVerdict(True, "NodeDrain", f"node {pod.node} is drained: its devices failed")
    return NO_EVICTION


def has_unknown_device(pod: PodFacts, policy: Policy, *, driver_settled: bool) -> bool:
    """The pod holds a device whose Unknown counts (what `pod_verdict` times from `unknown_since`)."""
    return bool(_reported_devices(pod, policy, "Unknown", driver_settled=driver_settled))


def _devices(devices: Sequence[DeviceHealth]) -> str:
    return ", ".join(f"{d.resource} {d.device} (container {d.container})" for d in devices)


def eviction_retry_seconds(policy: Policy, attempts: int) -> float:
    """Backoff after the n-th refused eviction: retrySeconds, doubling, at most maxRetrySeconds."""
    eviction = policy.health.eviction
    return float(min(eviction.retrySeconds * 2 ** max(attempts - 1, 0), eviction.maxRetrySeconds))


# --- circuit breaker ---------------------------------------------------------------------------------


def breaker_counts_from(
    policy: Policy, now: datetime.datetime, closed_at: datetime.datetime | None
) -> datetime.datetime:
    """From when a node that became due counts for the breaker: its window, cut at its last close."""
    start = now - datetime.timedelta(seconds=policy.health.circuitBreaker.windowSeconds)
    return max(start, closed_at) if closed_at is not None else start


def breaker_demand(
    became_due: Iterable[datetime.datetime],
    policy: Policy,
    now: datetime.datetime,
    closed_at: datetime.datetime | None = None,
) -> int:
    """How many of these nodes became due for remediation within circuitBreaker.windowSeconds and
    since an operator last closed the breaker."""
    start = breaker_counts_from(policy, now, closed_at)
    return sum(1 for moment in became_due if moment >= start)


def breaker_allows(policy: Policy, fleet_nodes: int) -> int:
    return scaled_count(policy.health.circuitBreaker.maxNodes, fleet_nodes)


def breaker_trips(
    became_due: Iterable[datetime.datetime],
    fleet_nodes: int,
    policy: Policy,
    now: datetime.datetime,
    closed_at: datetime.datetime | None = None,
) -> bool:
    """More than circuitBreaker.maxNodes nodes became due for remediation within its window (and since
    an operator last closed the breaker): something fleet-wide is wrong, stop and ask a human."""
    return breaker_demand(became_due, policy, now, closed_at) > breaker_allows(policy, fleet_nodes)

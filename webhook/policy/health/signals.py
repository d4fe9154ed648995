"""Which signals a node shows, and the state they put it in (`assess`).

A signal is a failure seen one way (a device gap, a device gone, a plugin not Ready, a node
condition, a DRA device taint or claim condition, devices pods report), timed from gpuguard's first
sighting of it in the node's record; the shapes that look like failed devices and are not (a plugin
restarting, a node coming up) are reported as suppressed, never acted on. Also here: which nodes the
controllers look after (`in_health_scope`: accelerator nodes, as `webhook.policy.accelerators` defines
them, that health.nodeSelector selects), which pods' requests are accelerator ones, and when gpuguard
leaves a node alone.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from webhook.policy.accelerators import claim_counts, is_accelerator_node
from webhook.policy.health.holdings import device_driver
from webhook.policy.health.observed import (
    CLAIM_PREFIX,
    TAINT_KEY,
    DeviceHealth,
    DraDevice,
    NodeFacts,
    PodFacts,
    Taint,
)
from webhook.policy.health.records import NodeRecord
from webhook.policy.model import Policy
from webhook.policy.model_health import DeviceTaintSignal, HealthSignals

EXCLUDE_LABEL = "gpuguard.io/exclude-from-remediation"

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
    # An accelerator node health.nodeSelector selects (`in_health_scope`); the rest are never acted on.
    in_scope: bool
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


def in_health_scope(node: NodeFacts, policy: Policy) -> bool:
    """An accelerator node (`is_accelerator_node`, as admission and the audit define it, with the
    drivers of the node's ResourceSlices) that health.nodeSelector selects: the nodes the controllers
    assess, count in their pools and act on."""
    if not policy.health.nodeSelector.matches(node.labels):
        return False
    drivers = {device.driver for device in node.dra.devices} | node.dra.updating
    return is_accelerator_node(
        policy.accelerators, labels=node.labels, resources=node.capacity, drivers=drivers
    )


def left_alone(node: NodeFacts, policy: Policy) -> str:
    """Why gpuguard writes nothing to this node and evicts none of its pods (excluded, paused, someone
    else's: the node lifecycle controller's or another remediator's); "" when it may act. The node
    controller and the pod watcher both ask this. Events may still say why."""
    health = policy.health
    if node.labels.get(EXCLUDE_LABEL) == "true":
        return f"the node is labelled {EXCLUDE_LABEL}=true"
    if health.paused:
        return "remediation is paused (health.paused)"
    lifecycle = not_ready(node)
    if lifecycle:
        return f"the node lifecycle controller handles the node: {lifecycle}"
    other = next((t.key for t in node.taints if t.key in health.othersRemediatingTaints), None)
    if other is not None:
        return f"taint {other} shows someone else remediates the node"
    return ""


def _is_accelerator_request(name: str, policy: Policy) -> bool:
    """An accelerator resource, or a resource claim (`claim:` names) that counts: the controllers do
    not know what a claim asks for, so any claim when the policy counts claims."""
    accelerators = policy.accelerators
    return accelerators.is_accelerator_resource(name) or (
        name.startswith(CLAIM_PREFIX) and claim_counts(accelerators, None)
    )


def _is_accelerator_device(device: DeviceHealth, policy: Policy) -> bool:
    """A claim's device counts only when its driver is an accelerator driver: a pod holding a GPU and an
    RDMA NIC claim must not be evicted for the NIC. A device whose name does not say its driver (a CDI
    ID) is judged by its resource alone, as before."""
    driver = device_driver(device.device) if device.resource.startswith(CLAIM_PREFIX) else None
    return driver is None or policy.accelerators.is_accelerator_driver(driver)


def is_accelerator_pod(pod: PodFacts, policy: Policy) -> bool:
    return any(_is_accelerator_request(name, policy) for name in pod.requests)


def reported_devices(
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
        and _is_accelerator_device(device, policy)
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


@dataclass
class _Findings:
    """What an assessment of one node finds: its signals, each timed from its first sighting in
    gpuguard's record, and the shapes it suppresses."""

    node: NodeFacts
    record: NodeRecord
    policy: Policy
    now: datetime.datetime
    signals: list[Signal] = field(default_factory=list)
    suppressed: list[Suppressed] = field(default_factory=list)

    def signal(
        self,
        key: str,
        kind: SignalKind,
        message: str,
        for_seconds: float,
        *,
        continues: str = "",
        **extra: Any,
    ) -> None:
        """A signal timed from its first sighting, or from that of the signal it `continues` (the same
        failure seen another way), whichever came first."""
        sightings = self.record.signals
        since = min(sightings.get(key, self.now), sightings.get(continues, self.now))
        self.signals.append(Signal(key, kind, message, for_seconds, since, **extra))

    def suppress(self, kind: SignalKind, message: str) -> None:
        self.suppressed.append(Suppressed(kind, message))


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
    signals_policy = policy.health.signals
    in_scope = in_health_scope(node, policy)
    capacities = {
        name: capacity
        for name, capacity in sorted(node.capacity.items())
        if policy.accelerators.is_accelerator_resource(name)
    }
    # Allocatable missing or unreadable beside a capacity: unknown, so no gap can be told.
    devices = {
        name: (node.allocatable[name], capacity)
        for name, capacity in capacities.items()
        if name in node.allocatable
    }
    found = _Findings(node, record, policy, now)
    correlated = _correlated_failures(pods, policy, now) if in_scope else 0
    live_pods = [pod for pod in pods if not pod.terminal and is_accelerator_pod(pod, policy)]
    dra = _dra_devices(node, policy)

    if in_scope:
        plugins = _plugin_pods(pods, policy)
        settled = _settled(plugins, policy, now)
        _gap_signals(found, devices, plugins, settled=settled, correlated=correlated)
        _missing_signals(found)
        _plugin_signals(found, capacities, plugins)
        for wanted in signals_policy.nodeConditions:
            if node.conditions.get(wanted.type) == wanted.status:
                found.signal(
                    f"nodeCondition/{wanted.type}",
                    "nodeCondition",
                    f"{wanted.type}={wanted.status}",
                    wanted.forSeconds,
                    whole_node=True,
                )
        for driver, driver_devices in sorted(dra.items()):
            _dra_signals(driver, driver_devices, signals_policy, found.signal)
        _pod_report_signals(found, live_pods, dra, settled=settled)

    devices.update(_dra_counts(dra, signals_policy))
    due = [s for s in found.signals if s.due(now)]
    return Assessment(
        node=node.name,
        pool=policy.health.pool_of(node.labels),
        in_scope=in_scope,
        signals=tuple(found.signals),
        suppressed=tuple(found.suppressed),
        devices=devices,
        correlated_failures=correlated,
        state=_state(due, found.signals, _holds_marks(node, record)),
        failed_share=_failed_share(due, devices),
        # Terminating pods still hold their devices until the kubelet ends them.
        drained=not any(_drain_evicts(pod, policy) for pod in live_pods),
    )


def _gap_signals(
    found: _Findings,
    devices: Mapping[str, tuple[int, int]],
    plugins: Sequence[PodFacts],
    *,
    settled: bool,
    correlated: int,
) -> None:
    """Fewer devices allocatable than in capacity, unless the device plugin is restarting."""
    signals_policy = found.policy.health.signals
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
            found.signal(
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
            found.suppress("deviceGap", f"{message}: the device plugin is restarting")
        else:
            # No plugin pod to ask: a plugin this policy does not select, or one being replaced.
            wait = max(gap_seconds, signals_policy.devicePlugin.capacityVanishedForSeconds)
            found.signal(
                f"deviceGap/{resource}",
                "deviceGap",
                f"{message}; no device plugin pod seen",
                wait,
                resource=resource,
                devices=missing,
            )


def _missing_signals(found: _Findings) -> None:
    """Fewer devices than gpuguard saw on the node, or than the policy expects of it."""
    gap_seconds = found.policy.health.signals.deviceGap.forSeconds
    for resource, (capacity, expected) in missing_devices(found.node, found.record, found.policy).items():
        # A device gone from capacity does not come back by itself: only a new node, a new layout
        # or an operator's acknowledgement clears this. A failed device that a plugin restart stopped
        # enumerating (8/7 became 7/7) is the same failure: its wait goes on from the gap's sighting.
        # A DRA driver (a name without a "/") publishes its devices in ResourceSlices, and a device
        # it tainted and then stopped publishing is the same failure too.
        plugin = "/" in resource
        shown = f"capacity {capacity}" if plugin else f"{capacity} in its ResourceSlices"
        found.signal(
            f"deviceMissing/{resource}",
            "deviceMissing",
            f"{resource}: {expected - capacity} of {expected} expected devices missing ({shown})",
            gap_seconds,
            continues=f"deviceGap/{resource}" if plugin else f"deviceTaint/{resource}",
            resource=resource,
            devices=expected - capacity,
        )


def _plugin_signals(found: _Findings, capacities: Mapping[str, int], plugins: Sequence[PodFacts]) -> None:
    """Accelerator capacity gone to 0, or a device plugin not Ready; neither while the node comes up."""
    plugin_policy = found.policy.health.signals.devicePlugin
    # Bring-up: no accelerator capacity registered yet and the plugin has not started (a new node whose
    # driver installs, its plugin Pending in init containers). Nothing there has failed yet.
    registered = any(capacity > 0 for capacity in capacities.values())
    starting = [] if registered else [pod for pod in plugins if pod.phase == "Pending"]
    # Vanished needs something that was there: the kubelet writes an explicit 0 for a resource whose
    # plugin went away (or, after its own restart, until the plugin registers again). A node with an
    # accelerator label and no accelerator resource at all (DRA, passthrough, no plugin by design)
    # has no device-plugin capacity to lose.
    if capacities and not registered:
        if starting:
            found.suppress(
                "capacityVanished",
                f"no accelerator capacity registered yet: device plugin pod {starting[0].key} "
                "has not started (bring-up)",
            )
        else:
            found.signal(
                "capacityVanished",
                "capacityVanished",
                "no accelerator capacity reported",
                plugin_policy.capacityVanishedForSeconds,
                whole_node=True,
            )
    for pod in plugins:
        if pod in starting:
            found.suppress(
                "devicePlugin",
                f"device plugin pod {pod.key} has not started on a node that never registered "
                "accelerator capacity (bring-up)",
            )
        elif not pod.ready:
            found.signal(
                "devicePlugin",
                "devicePlugin",
                f"device plugin pod {pod.key} is not Ready",
                plugin_policy.notReadyForSeconds,
                whole_node=True,
            )
            break


def _pod_report_signals(
    found: _Findings, live_pods: Sequence[PodFacts], dra: Mapping[str, Sequence[DraDevice]], *, settled: bool
) -> None:
    """Devices the pods' statuses report Unhealthy (or Unknown, when the policy gives that a wait)."""
    signals_policy = found.policy.health.signals
    published = {device.id for devices in dra.values() for device in devices}
    reports: list[tuple[Literal["Unhealthy", "Unknown"], SignalKind, int]] = [
        ("Unhealthy", "podDevice", signals_policy.deviceGap.forSeconds)
    ]
    unknown_wait = signals_policy.podDeviceHealth.unknownForSeconds
    if unknown_wait is not None:
        reports.append(("Unknown", "podDeviceUnknown", unknown_wait))
    for health_state, kind, wait in reports:
        reported: dict[str, set[str]] = {}
        for pod in live_pods:
            for device in reported_devices(pod, found.policy, health_state, driver_settled=settled):
                reported.setdefault(device.resource, set()).add(device.device)
        for resource, ids in sorted(reported.items()):
            message = (
                f"{resource}: {len(ids)} devices reported {health_state} by pods ({', '.join(sorted(ids))})"
            )
            # A claim's devices count for their driver's share of the node.
            drivers = set(dra).intersection(device_driver(i) for i in ids)
            share_of = drivers.pop() if len(drivers) == 1 else resource
            # Only an Unhealthy device is fenced: the device, not the pod, is what failed.
            fenceable = tuple(sorted(ids & published)) if ids <= published and kind == "podDevice" else ()
            found.signal(
                f"{kind}/{resource}",
                kind,
                message,
                wait,
                resource=share_of,
                devices=len(ids),
                device_ids=fenceable,
            )


def _state(due: Sequence[Signal], found: Sequence[Signal], holds_marks: bool) -> HealthState:
    if due or (found and holds_marks):
        return "unhealthy"
    if found:
        return "suspect"
    if holds_marks:
        return "recovering"
    return "healthy"


def _dra_devices(node: NodeFacts, policy: Policy) -> dict[str, list[DraDevice]]:
    """The node's published devices of accelerator drivers, by driver."""
    drivers: dict[str, list[DraDevice]] = {}
    for device in node.dra.devices:
        if policy.accelerators.is_accelerator_driver(device.driver):
            drivers.setdefault(device.driver, []).append(device)
    return drivers


def failing_taints(device: DraDevice, taints: DeviceTaintSignal) -> tuple[Taint, ...]:
    """The device's taints that fail it: NoSchedule or NoExecute with a key the policy names (any
    when it names none). Effect None is informational, and gpuguard's own key is never its signal."""
    return tuple(t for t in device.taints if t.key != TAINT_KEY and taints.fails(t.key, t.effect))


def taint_text(taint: Taint) -> str:
    """<key>[=<value>]:<effect>, as kubectl shows a taint."""
    return f"{taint.key}={taint.value}:{taint.effect}" if taint.value else f"{taint.key}:{taint.effect}"


def _dra_counts(dra: Mapping[str, Sequence[DraDevice]], signals: HealthSignals) -> dict[str, tuple[int, int]]:
    return {
        driver: (sum(1 for d in published if not failing_taints(d, signals.deviceTaints)), len(published))
        for driver, published in sorted(dra.items())
    }


def listed(devices: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(devices[:most])
    return shown + (f" and {len(devices) - most} more" if len(devices) > most else "")


def _dra_signals(
    driver: str, published: Sequence[DraDevice], signals: HealthSignals, signal: Callable[..., None]
) -> None:
    """A driver's tainted devices, and its devices showing a claim condition the policy names."""
    tainted = [(device, failing_taints(device, signals.deviceTaints)) for device in published]
    tainted = [(device, taints) for device, taints in tainted if taints]
    if tainted:
        named = [
            f"{d.id} ({', '.join(taint_text(t) for t in taints)}, ResourceSlice {d.slice})"
            for d, taints in tainted
        ]
        signal(
            f"deviceTaint/{driver}",
            "deviceTaint",
            f"{driver}: {len(tainted)} of {len(published)} devices tainted by their driver: {listed(named)}",
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
                f"{wanted.type}={wanted.status}: {listed(showing)}",
                wanted.forSeconds,
                resource=driver,
                devices=len(showing),
                device_ids=tuple(ids),
            )


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


# The node lifecycle controller's taints: the node does not answer, and that controller handles it.
NODE_LIFECYCLE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def not_ready(node: NodeFacts) -> str:
    """Why the node does not answer (its pods' readiness says nothing of its devices); "" when it does."""
    ready = node.conditions.get("Ready", "True")
    if ready != "True":
        return f"its Ready condition is {ready}"
    taint = next((t.key for t in node.taints if t.key in NODE_LIFECYCLE_TAINTS), None)
    return f"it carries taint {taint}" if taint is not None else ""


def registered_devices(node: NodeFacts, policy: Policy) -> dict[str, int]:
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


def missing_devices(node: NodeFacts, record: NodeRecord, policy: Policy) -> dict[str, tuple[int, int]]:
    """resource -> (capacity, expected) where the node reports fewer devices than the most gpuguard
    recorded on it (same resources) or the policy's expectedDevices for its class."""
    reported = registered_devices(node, policy)
    updating = {d: record.expected[d] for d in node.dra.updating if d in record.expected}
    seen = record.expected if set(record.expected) == set(reported) | set(updating) else {}
    baseline = policy.health.expected_devices(node.labels)
    missing = {}
    for name, capacity in sorted(reported.items()):
        expected = max(seen.get(name, 0), baseline.get(name, 0))
        if capacity < expected:
            missing[name] = (capacity, expected)
    return missing

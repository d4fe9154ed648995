"""Which DRA devices the pods on a node hold have failed (pure): the node agent's counterpart, for the
devices pods hold through resource claims, of `holdings.loss` for the device plugins' devices.

A DRA device is in no allocatable set; it has failed as the controllers read it: its driver taints it
in the node's ResourceSlices with a taint that fails it (`signals.failing_taints`: NoSchedule or
NoExecute; None is informational), or it has left its pool (`observed.node_devices` keeps of each pool
its newest generation only, published in full, and the device is not in it). Unlike a device
plugin's device, which says nothing once gone, a slice states the device's failure, so no transition
need be seen: a first poll may find one. Who holds a device is the kubelet's view (`ClaimHolding`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from webhook.policy.health.holdings import ClaimHolding, Holding, PodView
from webhook.policy.health.observed import CLAIM_PREFIX, SliceFacts, node_devices
from webhook.policy.health.signals import failing_taints, taint_text
from webhook.policy.model_health import DeviceTaintSignal


@dataclass(frozen=True, slots=True)
class ClaimLoss:
    # One holding per container, claim and failed device: resource `claim:<the pod's claim name>`, as
    # the kubelet names the pod's DRA devices in allocatedResourcesStatus.
    lost: tuple[Holding, ...] = ()
    # device id (<driver>/<pool>/<device>) -> why it failed, for the condition's message.
    why: Mapping[str, str] = field(default_factory=dict)
    # Pods holding a device whose pool is not known in full (its driver publishing a new generation,
    # or no slice of it at all: a driver restarting or gone says nothing about any one device). They
    # keep what their condition says.
    unsure: frozenset[str] = frozenset()


def claim_loss(
    claims: Iterable[ClaimHolding],
    slices: Iterable[SliceFacts],
    pods: Mapping[str, PodView],
    taints: DeviceTaintSignal,
) -> ClaimLoss:
    """The failed DRA devices the pods hold, given the node's ResourceSlices; `pods` names their
    claims as the pods do (a pod not cached yet is named by its claim's own name)."""
    slices = list(slices)
    published = node_devices(slices)
    devices = {device.id: device for device in published.devices}
    pools = {(piece.driver, piece.pool) for piece in slices}
    lost: dict[Holding, None] = {}
    why: dict[str, str] = {}
    unsure: set[str] = set()
    for holding in claims:
        if holding.driver in published.updating or (holding.driver, holding.pool) not in pools:
            unsure.add(holding.pod_key)
            continue
        device = devices.get(holding.device_id)
        if device is None:
            reason = f"gone from pool {holding.pool} of driver {holding.driver}"
        else:
            failing = failing_taints(device, taints)
            if not failing:
                continue
            shown = ", ".join(taint_text(taint) for taint in failing)
            reason = f"tainted by its driver ({shown}, ResourceSlice {device.slice})"
        why[holding.device_id] = reason
        pod = pods.get(holding.pod_key)
        claim = pod.claim_name(holding.claim) if pod is not None else holding.claim
        resource = f"{CLAIM_PREFIX}{claim}"
        lost[
            Holding(
                holding.namespace, holding.pod, holding.container, resource, frozenset({holding.device_id})
            )
        ] = None
    return ClaimLoss(tuple(lost), why, frozenset(unsure))

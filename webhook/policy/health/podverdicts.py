"""Whether a pod should be evicted (`pod_verdict`), and how long to wait after a refused eviction.

A pod is evicted for the devices it holds (reported Unhealthy, Unknown for long enough, fenced by
gpuguard's DeviceTaintRules) or because its node is drained; DaemonSet and static pods never are.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from webhook.policy.health.observed import TAINT_KEY, DeviceHealth, PodFacts
from webhook.policy.health.signals import is_accelerator_pod, reported_devices
from webhook.policy.model import Policy

EvictReason = Literal["DeviceUnhealthy", "DeviceUnknown", "NodeDrain"]


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
    unhealthy = reported_devices(pod, policy, "Unhealthy", driver_settled=driver_settled)
    if unhealthy:
        return PodVerdict(True, "DeviceUnhealthy", f"{_devices(unhealthy)} reported Unhealthy")
    if fenced:
        note = f"DRA device {', '.join(fenced)} failed, fenced by DeviceTaintRule {TAINT_KEY}:NoSchedule"
        return PodVerdict(True, "DeviceUnhealthy", note)
    unknown = reported_devices(pod, policy, "Unknown", driver_settled=driver_settled)
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
    return bool(reported_devices(pod, policy, "Unknown", driver_settled=driver_settled))


def _devices(devices: Sequence[DeviceHealth]) -> str:
    return ", ".join(f"{d.resource} {d.device} (container {d.container})" for d in devices)


def eviction_retry_seconds(policy: Policy, attempts: int) -> float:
    """Backoff after the n-th refused eviction: retrySeconds, doubling, at most maxRetrySeconds."""
    eviction = policy.health.eviction
    return float(min(eviction.retrySeconds * 2 ** max(attempts - 1, 0), eviction.maxRetrySeconds))

"""gpuguard's DeviceTaintRules: a failed DRA device fenced alone, one rule per device.

Which devices the due signals fail (`failed_devices`), with which effect (`fence_effect`: who evicts
the pods using the device, `eviction_path`), the rule written for each (`rule_object`) and how gpuguard
knows its own rules among the cluster's (`own_rule`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from webhook.policy.health.holdings import device_id
from webhook.policy.health.observed import TAINT_KEY, DeviceUser, NodeFacts
from webhook.policy.health.records import as_mapping
from webhook.policy.health.signals import Signal
from webhook.policy.model import Policy

DeviceTaintEffect = Literal["None", "NoSchedule", "NoExecute"]
EvictionPath = Literal["evictionAPI", "deviceTaint"]


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


def failed_devices(node: NodeFacts, due: Sequence[Signal]) -> dict[str, DeviceFence]:
    """The node's DRA devices the due signals fail (a None fence each, the effect chosen later)."""
    published = {device.id: device for device in node.dra.devices}
    return {
        key: DeviceFence(published[key].driver, published[key].pool, published[key].name, "None")
        for signal in due
        for key in signal.device_ids
        if key in published
    }


def eviction_path(policy: Policy, user: DeviceUser) -> EvictionPath:
    """Who is to evict a pod from its fenced device: the Eviction API, which consults the pod's
    PodDisruptionBudget, or the device-taint-eviction controller, which deletes without. `auto` leaves
    a pod a budget selects to the Eviction API."""
    choice = policy.dra_evict(user.namespace, user.namespace_labels)
    if choice == "auto":
        return "evictionAPI" if user.budgeted else "deviceTaint"
    return choice


def fence_effect(policy: Policy, users: Sequence[DeviceUser] = ()) -> DeviceTaintEffect:
    """NoExecute when the device-taint-eviction controller is to remove every pod using the device
    (each one's path deviceTaint, evictions enforced in each one's namespace); NoSchedule otherwise, and
    the pod watcher evicts them through the Eviction API under each namespace's mode. A device no pod
    is known to use goes NoExecute only when the policy says deviceTaint outright: under `auto`, a pod
    not seen yet may have a budget, and a NoSchedule rule is made NoExecute once its pods are known."""
    if not users:
        evicting = policy.health.dra.evict == "deviceTaint" and policy.health_mode("evict") == "enforce"
        return "NoExecute" if evicting else "NoSchedule"
    evicting = all(
        policy.health_mode("evict", user.namespace, user.namespace_labels) == "enforce"
        and eviction_path(policy, user) == "deviceTaint"
        for user in users
    )
    return "NoExecute" if evicting else "NoSchedule"

"""The health: section of the policy: what the controllers and the node agent watch, and what they may
do to a node or a pod (each action with its own mode), at what pace and within what budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from webhook.policy.model_types import (
    MAX_PATTERNS,
    LabelKey,
    LabelSelector,
    ModeField,
    NamespaceName,
    Seconds,
    StrictModel,
    WaitSeconds,
)

# What the controllers may do to a node or a pod, each with its own mode (`health.actions`).
HealthAction = Literal["condition", "taint", "evict", "drain"]
HEALTH_ACTIONS: tuple[HealthAction, ...] = ("condition", "taint", "evict", "drain")
# The most past remediations a node's record keeps (health.recovery.escalation.remediations).
MAX_REMEMBERED_REMEDIATIONS = 100
# Bounds of the health: section, far above any real fleet (Kubernetes supports 5,000 nodes a cluster).
MAX_NODES = 1_000_000
MAX_RATE_PER_MINUTE = 100_000
# A number of nodes, or a share of them written "20%" (rounded up, as Karpenter and NHC round).
CountOrPercent = (
    Annotated[int, Field(ge=0, le=MAX_NODES)] | Annotated[str, Field(pattern=r"^(100|[1-9]?[0-9])%$")]
)


def _condition_status(value: object) -> object:
    # YAML 1.2 still reads an unquoted `status: False` as a boolean. Unlike a mode, its meaning is no
    # guess: a condition's status is the word for that boolean, so True and False are taken as written.
    return str(value) if isinstance(value, bool) else value


def scaled_count(value: int | str, total: int) -> int:
    """`value` as a number of nodes out of `total`: a count as is, a percentage rounded up."""
    if isinstance(value, int):
        return value
    return -(-total * int(value.rstrip("%")) // 100)


class HealthActionMode(StrictModel):
    mode: ModeField | None = None


class DrainAction(HealthActionMode):
    # Share of a node's accelerator devices (percent) that must have failed before it is drained.
    threshold: int = Field(ge=1, le=100)


class HealthActions(StrictModel):
    condition: HealthActionMode
    taint: HealthActionMode
    evict: HealthActionMode
    drain: DrainAction


class DeviceGapSignal(StrictModel):
    forSeconds: WaitSeconds


class DevicePluginSignal(StrictModel):
    # The device plugin's pods: any selector matching (in `namespaces`, or anywhere when empty).
    selectors: list[LabelSelector] = Field(max_length=MAX_PATTERNS)
    namespaces: list[NamespaceName] = Field(max_length=MAX_PATTERNS)
    notReadyForSeconds: WaitSeconds
    # After the plugin (re)starts, allocatable 0 means it has not registered yet, not dead devices.
    restartGraceSeconds: WaitSeconds
    capacityVanishedForSeconds: WaitSeconds

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        if self.namespaces and namespace not in self.namespaces:
            return False
        return any(selector.matches(labels) for selector in self.selectors)


class ConditionSignal(StrictModel):
    type: str = Field(min_length=1, max_length=316)
    status: Annotated[Literal["True", "False", "Unknown"], BeforeValidator(_condition_status)]
    forSeconds: WaitSeconds


class DeviceTaintSignal(StrictModel):
    # Taint keys (of effect NoSchedule or NoExecute) that fail a device; empty: any key.
    keys: list[LabelKey] = Field(max_length=MAX_PATTERNS)
    forSeconds: WaitSeconds

    def fails(self, key: str, effect: str) -> bool:
        return effect in ("NoSchedule", "NoExecute") and (not self.keys or key in self.keys)


class PodDeviceHealthSignal(StrictModel):
    # None: Unknown never counts. Most DRA drivers stream no health, and the kubelet says Unknown then.
    unknownForSeconds: WaitSeconds | None


class CorrelationSignal(StrictModel):
    windowSeconds: Seconds
    minFailures: int = Field(ge=1, le=MAX_RATE_PER_MINUTE)


class HealthSignals(StrictModel):
    deviceGap: DeviceGapSignal
    devicePlugin: DevicePluginSignal
    nodeConditions: list[ConditionSignal] = Field(max_length=MAX_PATTERNS)
    deviceTaints: DeviceTaintSignal
    claimDeviceConditions: list[ConditionSignal] = Field(max_length=MAX_PATTERNS)
    podDeviceHealth: PodDeviceHealthSignal
    correlation: CorrelationSignal

    @model_validator(mode="after")
    def _condition_types_unique(self) -> HealthSignals:
        for name, conditions in (
            ("nodeConditions", self.nodeConditions),
            ("claimDeviceConditions", self.claimDeviceConditions),
        ):
            types = [condition.type for condition in conditions]
            if len(types) != len(set(types)):
                raise ValueError(f"{name}: each condition type may be listed once")
        return self


class Escalation(StrictModel):
    # This many remediations of one node within windowSeconds (the latest included) keep gpuguard's
    # marks on it when its devices are clear again, until an operator acknowledges it; 0: never.
    remediations: int = Field(ge=0, le=MAX_REMEMBERED_REMEDIATIONS)
    windowSeconds: Seconds


class Recovery(StrictModel):
    afterSeconds: WaitSeconds
    escalation: Escalation


class ExpectedDevices(StrictModel):
    """The device counts a class of nodes (those its selector matches) must report: fewer is a failure,
    even on a node gpuguard never saw with more."""

    selector: LabelSelector
    resources: dict[LabelKey, Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=MAX_PATTERNS)


class Eviction(StrictModel):
    retrySeconds: Seconds
    maxRetrySeconds: Seconds
    timeoutSeconds: Seconds
    perNodePerMinute: int = Field(ge=1, le=MAX_RATE_PER_MINUTE)
    perNamespacePerMinute: int = Field(ge=1, le=MAX_RATE_PER_MINUTE)

    @model_validator(mode="after")
    def _retry_order(self) -> Eviction:
        if self.maxRetrySeconds < self.retrySeconds:
            raise ValueError(
                f"maxRetrySeconds ({self.maxRetrySeconds}) must be at least retrySeconds ({self.retrySeconds})"
            )
        return self


class Budget(StrictModel):
    maxUnhealthy: CountOrPercent


class CircuitBreaker(StrictModel):
    maxNodes: CountOrPercent
    windowSeconds: Seconds


DraEvict = Literal["auto", "evictionAPI", "deviceTaint"]


class Dra(StrictModel):
    # Who evicts the pods of a DRA device gpuguard fences once evictions are enforced: the Eviction API
    # (PodDisruptionBudgets respected), or the device-taint-eviction controller, through a NoExecute
    # DeviceTaintRule (it deletes without consulting PodDisruptionBudgets); auto: the Eviction API for
    # a pod a PodDisruptionBudget selects, the device-taint-eviction controller for any other.
    evict: DraEvict


class Health(StrictModel):
    enabled: bool
    mode: ModeField
    paused: bool
    actions: HealthActions
    nodeSelector: LabelSelector
    poolLabels: list[LabelKey] = Field(max_length=MAX_PATTERNS)
    # Taint keys are qualified names, as label keys are.
    othersRemediatingTaints: list[LabelKey] = Field(max_length=MAX_PATTERNS)
    signals: HealthSignals
    # The first entry whose selector matches a node gives its expected device counts.
    expectedDevices: list[ExpectedDevices] = Field(max_length=MAX_PATTERNS)
    dra: Dra
    recovery: Recovery
    eviction: Eviction
    budget: Budget
    circuitBreaker: CircuitBreaker

    def pool_of(self, labels: Mapping[str, str]) -> str:
        """The node's pool: the value of the first of `poolLabels` it carries; "" for none."""
        return next((labels[key] for key in self.poolLabels if key in labels), "")

    def expected_devices(self, labels: Mapping[str, str]) -> Mapping[str, int]:
        """The device counts the policy expects of a node with these labels; empty for none."""
        return next((e.resources for e in self.expectedDevices if e.selector.matches(labels)), {})

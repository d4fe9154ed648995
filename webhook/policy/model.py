"""The policy: a frozen pydantic model, parsed from the YAML a ConfigMap or file holds.

Every check that can be made without a cluster happens here, at load time, so that admission never
meets a bad policy: unknown keys are rejected, errors name the field, types are strict (a boolean is not
a number, a string is neither), every number is bounded by the API field it ends up in, and
combinations the API server would reject later (exit code 0 under `In`, a preStop longer than the grace
period) or that defeat each other (an injected class the guard then denies) are refused. Whatever a
request needs from the policy (the compiled patterns, the namespace index) is built here too, on the
thread that loads it, never on a request.

The health: section is in model_health.py; the pieces both build on (the strict base model, the
mode, bounded seconds, names and label selectors) are in model_types.py.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping
from functools import cache, cached_property
from importlib import resources
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, PrivateAttr, ValidationError, model_validator

from webhook.policy import hostpaths, images, kinds
from webhook.policy.errors import DNS_SUBDOMAIN, describe_errors, yaml_problem
from webhook.policy.loader import PolicyTextError, load_policy_yaml
from webhook.policy.merge import over_default
from webhook.policy.model_health import DraEvict, Health, HealthAction, HealthActionMode
from webhook.policy.model_types import (
    MAX_PATTERNS,
    MAX_SECONDS,
    LabelKey,
    ModeField,
    NamespaceName,
    Seconds,
    StrictModel,
    WaitSeconds,
)

# Callers read a policy in these words (a rule's Mode, a namespace override's LabelSelector): they are
# the schema's, wherever they are defined.
from webhook.policy.model_types import LabelSelector as LabelSelector
from webhook.policy.model_types import Mode as Mode

RuleId = Literal[
    "readinessTolerations",
    "podFailurePolicy",
    "gracefulTermination",
    "priority",
    "driverCompatibility",
    "acceleratorNodeGuard",
    "trustedDeviceSoftware",
]
MUTATING_RULES: tuple[RuleId, ...] = (
    "readinessTolerations",
    "podFailurePolicy",
    "gracefulTermination",
    "priority",
    "driverCompatibility",
)
# driverCompatibility is in both: it mutates, and its validating check sees what the API server stores.
VALIDATING_RULES: tuple[RuleId, ...] = (
    "acceleratorNodeGuard",
    "trustedDeviceSoftware",
    "driverCompatibility",
)
RULE_IDS: tuple[RuleId, ...] = (*MUTATING_RULES, "acceleratorNodeGuard", "trustedDeviceSoftware")
SYSTEM_PRIORITY_PREFIX = "system-"
HIGHEST_USER_PRIORITY = 1_000_000_000
LOWEST_PRIORITY = -(2**31)  # PriorityClass.value is an int32
# Bounds on the policy's own lists, on MAX_PATTERNS' grounds: far above any real policy.
MAX_NAMESPACE_ENTRIES = 1_000
MAX_NAMESPACE_NAMES = 10_000
MAX_PRIORITY_CLASSES = 1_000
MAX_WORKLOAD_KINDS = 100
# The key of the policy ConfigMap that holds the policy YAML.
CONFIGMAP_KEY = "policy.yaml"
MAX_REMEMBERED_NAMES = 1024


Pattern = Annotated[str, Field(min_length=1, max_length=512)]
Patterns = Annotated[list[Pattern], Field(max_length=MAX_PATTERNS)]
ClassName = Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN)]
ExitCode = Annotated[int, Field(ge=1, le=255)]
# The API server wants exit codes sorted and unique; normalising here lets users write them in any order.
ExitCodes = Annotated[list[ExitCode], AfterValidator(lambda codes: sorted(set(codes)))]


def _host_path_pattern(pattern: str) -> str:
    parts = hostpaths.components(pattern)
    if parts is None or ".." in pattern.split("/"):
        raise ValueError(f"{pattern!r}: a host path pattern is absolute and has no '..'")
    return pattern


def _image_pattern(pattern: str) -> str:
    # Patterns are matched against the normalised reference, which always starts with a registry.
    first = pattern.partition("/")[0]
    if "/" not in pattern or not ("." in first or ":" in first or "*" in first or first == "localhost"):
        raise ValueError(f"{pattern!r} names no registry: write it in full, e.g. docker.io/{pattern}")
    return pattern


HostPathPattern = Annotated[str, AfterValidator(_host_path_pattern)]
ImagePrefix = Annotated[str, AfterValidator(images.normalise_prefix)]
ImagePattern = Annotated[str, AfterValidator(_image_pattern)]


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the field."""


class _Verdicts(dict[str, bool]):
    """Pattern matches remembered: a request asks about the same few resource names (cpu, memory,
    nvidia.com/gpu) several times, and a dict lookup costs a fraction of a call and a match. Bounded,
    since the names come from the objects admitted."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def __missing__(self, name: str) -> bool:
        if len(self) >= MAX_REMEMBERED_NAMES:
            self.clear()
        verdict = self[name] = self.pattern.match(name) is not None
        return verdict


class Accelerators(StrictModel):
    resources: Patterns
    resourceClaims: bool
    deviceClasses: Patterns
    nodeLabels: Patterns
    taintKeys: Patterns
    # DRA drivers (ResourceSlice spec.driver, glob patterns) whose devices the controllers watch.
    draDrivers: Patterns

    @cached_property
    def _resource_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.resources) or r"(?!)")

    @cached_property
    def resource_verdicts(self) -> Mapping[str, bool]:
        """`verdicts[name]`: whether `name` is an accelerator resource, as a plain lookup after the first."""
        return _Verdicts(self._resource_pattern)

    def is_accelerator_resource(self, name: str) -> bool:
        return self.resource_verdicts[name]

    @cached_property
    def _device_class_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.deviceClasses) or r"(?!)")

    def is_accelerator_device_class(self, name: str) -> bool:
        return self._device_class_pattern.match(name) is not None

    @cached_property
    def _dra_driver_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.draDrivers) or r"(?!)")

    def is_accelerator_driver(self, name: str) -> bool:
        return self._dra_driver_pattern.match(name) is not None


class _Rule(StrictModel):
    mode: ModeField | None = None


class ReadinessTolerations(_Rule):
    # At least a second: 0 would evict a workload the moment its node looks unready.
    batchSeconds: Seconds
    servingSeconds: Seconds
    apiServerDefaultSeconds: int = Field(ge=0, le=MAX_SECONDS)


GangChoice = Literal["auto", "always", "never"]


class Gangs(StrictModel):
    # auto: a JobSet running more than one pod in all is a gang.
    jobSets: GangChoice
    # auto: an Indexed Job whose parallelism (> 1) equals its completions, every member at once.
    indexedJobs: GangChoice


class PodFailurePolicyRule(_Rule):
    deviceFailureExitCodes: ExitCodes = Field(max_length=255)
    deviceFailureAction: Literal["Count", "FailJob", "FailIndex", "Ignore"]
    nonRetriableExitCodes: ExitCodes = Field(max_length=255)
    ignoreDisruptions: bool
    onFailureJobs: Literal["skip", "convert"]
    gang: Gangs

    @model_validator(mode="after")
    def _codes_disjoint(self) -> PodFailurePolicyRule:
        both = set(self.deviceFailureExitCodes) & set(self.nonRetriableExitCodes)
        if both:
            raise ValueError(
                f"exit codes {sorted(both)} are in both deviceFailureExitCodes and nonRetriableExitCodes"
            )
        return self


class PreStop(StrictModel):
    action: Literal["sleep", "exec"]
    seconds: Seconds
    command: list[str] = Field(max_length=MAX_PATTERNS)

    @model_validator(mode="after")
    def _command_matches_action(self) -> PreStop:
        if self.action == "exec" and not self.command:
            raise ValueError("command is required when action is exec")
        if self.action == "sleep" and self.command:
            raise ValueError("command is only used when action is exec")
        return self


class GracefulTermination(_Rule):
    preStop: PreStop
    minGracePeriodSeconds: Seconds
    marginSeconds: int = Field(ge=0, le=MAX_SECONDS)

    @model_validator(mode="after")
    def _prestop_fits(self) -> GracefulTermination:
        if self.preStop.seconds >= self.minGracePeriodSeconds:
            raise ValueError(
                f"preStop.seconds ({self.preStop.seconds}) must be shorter than "
                f"minGracePeriodSeconds ({self.minGracePeriodSeconds})"
            )
        if self.preStop.seconds + self.marginSeconds > MAX_SECONDS:
            raise ValueError(
                f"preStop.seconds + marginSeconds ({self.preStop.seconds + self.marginSeconds}) is more "
                f"than the {MAX_SECONDS} s a grace period may be"
            )
        return self

    @property
    def grace_period_seconds(self) -> int:
        return max(self.minGracePeriodSeconds, self.preStop.seconds + self.marginSeconds)


class Priority(_Rule):
    # A PriorityClass name is a DNS subdomain; anything else would make every patched pod invalid.
    className: ClassName

    @model_validator(mode="after")
    def _not_system(self) -> Priority:
        if self.className.startswith(SYSTEM_PRIORITY_PREFIX):
            raise ValueError(f"className {self.className!r}: system-* classes are never assigned")
        return self


class AcceleratorNodeGuard(_Rule):
    minPriority: int = Field(ge=0, le=HIGHEST_USER_PRIORITY)


class TrustedDeviceSoftware(_Rule):
    hostPaths: list[HostPathPattern] = Field(max_length=MAX_PATTERNS)
    trustedImages: list[ImagePrefix] = Field(max_length=MAX_PATTERNS)
    requireDigest: bool

    @cached_property
    def host_path_patterns(self) -> list[tuple[str, hostpaths.Pattern]]:
        return [
            (pattern, hostpaths.compile_pattern(hostpaths.components(pattern) or ()))
            for pattern in self.hostPaths
        ]


class DriverNodeLabels(StrictModel):
    driverMajor: LabelKey
    driverVersion: LabelKey
    cudaVersion: LabelKey
    product: LabelKey
    pools: list[LabelKey] = Field(max_length=MAX_PATTERNS)


class ImageDriverRequirement(StrictModel):
    image: ImagePattern
    minDriverMajor: int = Field(ge=1, le=99_999)


class MultiNode(StrictModel):
    sameDriverVersion: bool
    minParallelism: int = Field(ge=2, le=2**31 - 1)  # Job.spec.parallelism is an int32
    completionModes: list[Literal["Indexed", "NonIndexed"]] = Field(min_length=1)


class DriverCompatibility(_Rule):
    annotation: LabelKey
    images: list[ImageDriverRequirement] = Field(max_length=MAX_PATTERNS)
    nodeLabels: DriverNodeLabels
    multiNode: MultiNode


TemplatePath = Annotated[str, Field(min_length=1, max_length=256)]


class CustomWorkloadKind(StrictModel):
    """A kind gpuguard does not know, with where its pod templates are (kinds.parse_path's syntax)."""

    group: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
    version: Annotated[str, Field(min_length=1, max_length=63)]
    kind: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Z][A-Za-z0-9]*$")]
    # The plural the API serves it under: the audit lists it by this name.
    resource: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z][a-z0-9]*$")]
    podTemplates: list[TemplatePath] = Field(default_factory=list, max_length=16)
    batch: bool = False

    @model_validator(mode="after")
    def _paths_parse(self) -> CustomWorkloadKind:
        if not self.podTemplates:
            raise ValueError(f"{self.kind}: podTemplates names no template")
        for path in self.podTemplates:
            kinds.parse_path(path)
        return self

    def workload_kind(self) -> kinds.WorkloadKind:
        paths = tuple(kinds.parse_path(path) for path in self.podTemplates)
        return kinds.WorkloadKind(
            self.group, (self.version,), self.kind, self.resource, pod_templates=paths, batch=self.batch
        )


class Rules(StrictModel):
    readinessTolerations: ReadinessTolerations
    podFailurePolicy: PodFailurePolicyRule
    gracefulTermination: GracefulTermination
    priority: Priority
    driverCompatibility: DriverCompatibility
    acceleratorNodeGuard: AcceleratorNodeGuard
    trustedDeviceSoftware: TrustedDeviceSoftware


class NamespaceOverride(StrictModel):
    """Namespaces chosen by name, or by a label selector on the Namespace (needs cluster access).

    `mode` and `rules` are the admission rules' modes there; `health` is the mode of what the
    controllers do to pods there (evictions), which admission modes never change.
    """

    # A name that is not a namespace name (`Kube-System`) would silently never match.
    names: list[NamespaceName] = Field(default_factory=list, max_length=MAX_NAMESPACE_NAMES)
    selector: LabelSelector | None = None
    mode: ModeField | None = None
    rules: dict[RuleId, ModeField] = Field(default_factory=dict)
    health: ModeField | None = None
    # `health.dra.evict` for the pods there.
    draEvict: DraEvict | None = None

    @model_validator(mode="after")
    def _names_or_selector(self) -> NamespaceOverride:
        if bool(self.names) == (self.selector is not None):
            raise ValueError("give exactly one of names and selector")
        return self


class Audit(StrictModel):
    # How often the controllers' leader rewrites the audit's PolicyReports (and soon after a policy
    # change); 0: never.
    reportIntervalSeconds: WaitSeconds


AdmissionMode = Literal["webhook", "native", "hybrid"]


class Admission(StrictModel):
    # Who decides admission: gpuguard's webhooks alone, or also the API server's own admission policies
    # (`gpuguard policy compile`), which the controllers' leader keeps in step with this policy.
    mode: AdmissionMode


class Policy(StrictModel):
    enabled: bool
    mode: ModeField
    accelerators: Accelerators
    rules: Rules
    priorityClasses: dict[ClassName, Annotated[int, Field(ge=LOWEST_PRIORITY, le=HIGHEST_USER_PRIORITY)]] = (
        Field(max_length=MAX_PRIORITY_CLASSES)
    )
    namespaces: list[NamespaceOverride] = Field(max_length=MAX_NAMESPACE_ENTRIES)
    workloadKinds: list[CustomWorkloadKind] = Field(max_length=MAX_WORKLOAD_KINDS)
    health: Health
    audit: Audit
    admission: Admission
    _hash: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _workload_kinds_new(self) -> Policy:
        seen = {(kind.group, kind.kind) for kind in kinds.BUILTIN_KINDS}
        for index, custom in enumerate(self.workloadKinds):
            if (custom.group, custom.kind) in seen:
                raise ValueError(
                    f"workloadKinds[{index}]: {custom.kind}.{custom.group} is built in or listed twice"
                )
            seen.add((custom.group, custom.kind))
        return self

    @cached_property
    def workload_kinds(self) -> kinds.Registry:
        """The kinds gpuguard handles: the built-in ones and the policy's own."""
        if not self.workloadKinds:
            return kinds.BUILTIN
        return kinds.Registry((*kinds.BUILTIN_KINDS, *(k.workload_kind() for k in self.workloadKinds)))

    @cached_property
    def hash(self) -> str:
        """The hash of the effective policy, set by parse_policy; names it in annotations and metrics.
        Kept once read (parse_policy reads it once set): a private attribute is read through pydantic's
        __getattr__, 40 times slower, and every object the webhook mutates is stamped with it."""
        return self._hash

    @model_validator(mode="after")
    def _namespaces_unique(self) -> Policy:
        seen: set[str] = set()
        for index, override in enumerate(self.namespaces):
            for name in override.names:
                if name in seen:
                    raise ValueError(f"namespaces[{index}]: namespace {name!r} is listed twice")
                seen.add(name)
        if len(seen) > MAX_NAMESPACE_NAMES:
            raise ValueError(f"namespaces name {len(seen)} namespaces, more than {MAX_NAMESPACE_NAMES}")
        return self

    @model_validator(mode="after")
    def _injected_class_passes_the_guard(self) -> Policy:
        # The priority rule gives class-less accelerator workloads this class; the guard then judges
        # them by its value. Below minPriority, every such workload bound for accelerator nodes would be
        # mutated only to be denied.
        class_name = self.rules.priority.className
        value = self.priorityClasses.get(class_name)
        threshold = self.rules.acceleratorNodeGuard.minPriority
        if value is not None and value < threshold:
            raise ValueError(
                f"rules.priority.className {class_name} has value {value} (priorityClasses), below "
                f"rules.acceleratorNodeGuard.minPriority {threshold}: the guard would deny every "
                "accelerator workload the priority rule gives it to"
            )
        return self

    @cached_property
    def _namespace_index(self) -> Mapping[str, NamespaceOverride]:
        # An index, so that a policy with thousands of namespace overrides costs one lookup per request.
        return {name: override for override in self.namespaces for name in override.names}

    @cached_property
    def _selector_overrides(self) -> list[NamespaceOverride]:
        return [override for override in self.namespaces if override.selector is not None]

    def namespace_override(
        self, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> NamespaceOverride | None:
        """The override by name, else the first whose selector matches the namespace's labels."""
        override = self._namespace_index.get(namespace or "")
        if override is not None or labels is None:
            return override
        return next((o for o in self._selector_overrides if o.selector and o.selector.matches(labels)), None)

    @cached_property
    def _modes_by_namespace(self) -> dict[str | None, Mapping[RuleId, Mode]]:
        # Filled as namespaces are asked about; it lives and dies with this policy object (a new policy
        # is a new object), so it can never answer for another policy.
        return {}

    def modes_for(
        self, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> Mapping[RuleId, Mode]:
        """`mode_for` of every rule, remembered per namespace where the labels cannot change the answer
        (no selector override, or no labels to match): each request asks all of them."""
        if labels is not None and self._selector_overrides:
            return {rule: self.mode_for(rule, namespace, labels) for rule in RULE_IDS}
        modes = self._modes_by_namespace.get(namespace)
        if modes is None:
            if len(self._modes_by_namespace) >= MAX_REMEMBERED_NAMES:
                self._modes_by_namespace.clear()  # bounded: namespaces come from the requests
            modes = {rule: self.mode_for(rule, namespace) for rule in RULE_IDS}
            self._modes_by_namespace[namespace] = modes
        return modes

    def rule(self, rule: RuleId) -> _Rule:
        rule_model: _Rule = getattr(self.rules, rule)
        return rule_model

    def mode_for(self, rule: RuleId, namespace: str | None, labels: Mapping[str, str] | None = None) -> Mode:
        """The most specific mode: namespace+rule, namespace, rule, global. Disabled means off.

        `labels` are the namespace's labels when the cluster is known; selector overrides need them.
        """
        return self.mode_under(rule, self.namespace_override(namespace, labels))

    def mode_under(self, rule: RuleId, override: NamespaceOverride | None) -> Mode:
        """The rule's mode where `override` is the most specific namespace entry (None: none is)."""
        if not self.enabled:
            return "off"
        if override is not None:
            if rule in override.rules:
                return override.rules[rule]
            if override.mode is not None:
                return override.mode
        return self.rule(rule).mode or self.mode

    def health_mode(
        self, action: HealthAction, namespace: str | None = None, labels: Mapping[str, str] | None = None
    ) -> Mode:
        """The mode of one controller action: off when either kill switch is off, else the
        namespace's `health` (evictions only), the action's own mode, then `health.mode`.

        The admission modes (top-level `mode`, a namespace's `mode` and `rules`) never reach here:
        a team enforcing admission rules has not asked for its pods to be evicted.
        """
        if not self.enabled or not self.health.enabled:
            return "off"
        if action == "evict" and namespace is not None:
            override = self.namespace_override(namespace, labels)
            if override is not None and override.health is not None:
                return override.health
        action_mode: HealthActionMode = getattr(self.health.actions, action)
        return action_mode.mode or self.health.mode

    def dra_evict(self, namespace: str, labels: Mapping[str, str] | None = None) -> DraEvict:
        """Who evicts the namespace's pods from a fenced DRA device: its `draEvict`, else `health.dra.evict`."""
        override = self.namespace_override(namespace, labels)
        if override is not None and override.draEvict is not None:
            return override.draEvict
        return self.health.dra.evict

    def priority_value(self, class_name: str) -> int | None:
        return self.priorityClasses.get(class_name)


def _load_mapping(text: str) -> dict[str, Any]:
    try:
        data: Any = load_policy_yaml(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"policy is not valid YAML: {yaml_problem(exc)}") from exc
    except PolicyTextError as exc:
        raise PolicyError(f"policy refused: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy must be a mapping, got {type(data).__name__}")
    return data


def parse_policy(text: str) -> Policy:
    """Parses and validates policy YAML over the embedded default; raises PolicyError naming the field.

    The embedded default-policy.yaml is the one place defaults are written: a field the text leaves
    out takes its value from there.
    """
    default, given = _load_mapping(default_policy_text()), _load_mapping(text)
    data = over_default(default, given)
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"invalid policy: {describe_errors(exc, Policy)}") from exc
    # Hash the effective policy as validated, so that equal policies (the same text under a newer
    # default gets a new one; exit codes in another order do not) get equal hashes.
    canonical = json.dumps(policy.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    policy._hash = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    _prepare(policy)
    return policy


def _prepare(model: BaseModel) -> None:
    """Computes every cached_property of the policy and its parts (compiled patterns, indexes) now."""
    for name in dir(type(model)):
        if isinstance(getattr(type(model), name, None), cached_property):
            getattr(model, name)
    for field in type(model).model_fields:
        value = getattr(model, field)
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, BaseModel):
                _prepare(part)


@cache
def default_policy_text() -> str:
    return resources.files("webhook").joinpath("default-policy.yaml").read_text(encoding="utf-8")


def default_policy() -> Policy:
    return parse_policy(default_policy_text())

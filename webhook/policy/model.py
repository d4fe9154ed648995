"""The policy: a frozen pydantic model, parsed from the YAML a ConfigMap or file holds.

Every check that can be made without a cluster happens here, at load time, so that admission never
meets a bad policy: unknown keys are rejected, errors name the field, and combinations the API server
would reject later (exit code 0 under `In`, a preStop longer than the grace period) are refused.
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
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from webhook.policy import hostpaths, images

Mode = Literal["enforce", "warn", "audit", "off"]
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


def _yaml_off_is_off(value: object) -> object:
    # YAML 1.1 reads an unquoted `off` as the boolean false; a user who wrote `mode: off` means "off".
    return "off" if value is False else value


ModeField = Annotated[Mode, BeforeValidator(_yaml_off_is_off)]
ExitCode = Annotated[int, Field(ge=1, le=255)]
# The API server wants exit codes sorted and unique; normalising here lets users write them in any order.
ExitCodes = Annotated[list[ExitCode], AfterValidator(lambda codes: sorted(set(codes)))]


# A label or annotation key: an optional DNS-subdomain prefix and a name (metav1 validation's qualified name).
_QUALIFIED_NAME = re.compile(
    r"(?:(?=[^/]{1,253}/)[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=[^/]{1,63}$)[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def _qualified_name(key: str) -> str:
    if not _QUALIFIED_NAME.fullmatch(key):
        raise ValueError(f"{key!r} is not a valid label or annotation key")
    return key


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


LabelKey = Annotated[str, AfterValidator(_qualified_name)]
HostPathPattern = Annotated[str, AfterValidator(_host_path_pattern)]
ImagePrefix = Annotated[str, AfterValidator(images.normalise_prefix)]
ImagePattern = Annotated[str, AfterValidator(_image_pattern)]


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Accelerators(_Model):
    resources: list[str]
    resourceClaims: bool
    deviceClasses: list[str]
    nodeLabels: list[str]
    taintKeys: list[str]

    @cached_property
    def _resource_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.resources) or r"(?!)")

    def is_accelerator_resource(self, name: str) -> bool:
        return self._resource_pattern.match(name) is not None

    @cached_property
    def _device_class_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.deviceClasses) or r"(?!)")

    def is_accelerator_device_class(self, name: str) -> bool:
        return self._device_class_pattern.match(name) is not None


class _Rule(_Model):
    mode: ModeField | None = None


class ReadinessTolerations(_Rule):
    batchSeconds: int = Field(ge=0)
    servingSeconds: int = Field(ge=0)
    apiServerDefaultSeconds: int = Field(ge=0)


class PodFailurePolicyRule(_Rule):
    deviceFailureExitCodes: ExitCodes = Field(max_length=255)
    deviceFailureAction: Literal["Count", "FailJob", "FailIndex", "Ignore"]
    nonRetriableExitCodes: ExitCodes = Field(max_length=255)
    ignoreDisruptions: bool
    onFailureJobs: Literal["skip", "convert"]

    @model_validator(mode="after")
    def _codes_disjoint(self) -> PodFailurePolicyRule:
        both = set(self.deviceFailureExitCodes) & set(self.nonRetriableExitCodes)
        if both:
            raise ValueError(
                f"exit codes {sorted(both)} are in both deviceFailureExitCodes and nonRetriableExitCodes"
            )
        return self


class PreStop(_Model):
    action: Literal["sleep", "exec"]
    seconds: int = Field(ge=1)
    command: list[str]

    @model_validator(mode="after")
    def _command_matches_action(self) -> PreStop:
        if self.action == "exec" and not self.command:
            raise ValueError("command is required when action is exec")
        if self.action == "sleep" and self.command:
            raise ValueError("command is only used when action is exec")
        return self


class GracefulTermination(_Rule):
    preStop: PreStop
    minGracePeriodSeconds: int = Field(ge=1)
    marginSeconds: int = Field(ge=0)

    @model_validator(mode="after")
    def _prestop_fits(self) -> GracefulTermination:
        if self.preStop.seconds >= self.minGracePeriodSeconds:
            raise ValueError(
                f"preStop.seconds ({self.preStop.seconds}) must be shorter than "
                f"minGracePeriodSeconds ({self.minGracePeriodSeconds})"
            )
        return self

    @property
    def grace_period_seconds(self) -> int:
        return max(self.minGracePeriodSeconds, self.preStop.seconds + self.marginSeconds)


class Priority(_Rule):
    # A PriorityClass name is a DNS subdomain; anything else would make every patched pod invalid.
    className: str = Field(
        max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    )

    @model_validator(mode="after")
    def _not_system(self) -> Priority:
        if self.className.startswith(SYSTEM_PRIORITY_PREFIX):
            raise ValueError(f"className {self.className!r}: system-* classes are never assigned")
        return self


class AcceleratorNodeGuard(_Rule):
    minPriority: int = Field(ge=0, le=HIGHEST_USER_PRIORITY)


class TrustedDeviceSoftware(_Rule):
    hostPaths: list[HostPathPattern]
    trustedImages: list[ImagePrefix]
    requireDigest: bool

    @cached_property
    def host_path_patterns(self) -> list[tuple[str, hostpaths.Components]]:
        return [(pattern, hostpaths.components(pattern) or ()) for pattern in self.hostPaths]


class DriverNodeLabels(_Model):
    driverMajor: LabelKey
    driverVersion: LabelKey
    cudaVersion: LabelKey
    product: LabelKey
    pools: list[LabelKey]


class ImageDriverRequirement(_Model):
    image: ImagePattern
    minDriverMajor: int = Field(ge=1, le=99_999)


class MultiNode(_Model):
    sameDriverVersion: bool
    minParallelism: int = Field(ge=2)
    completionModes: list[Literal["Indexed", "NonIndexed"]] = Field(min_length=1)


class DriverCompatibility(_Rule):
    annotation: LabelKey
    images: list[ImageDriverRequirement]
    nodeLabels: DriverNodeLabels
    multiNode: MultiNode


class Rules(_Model):
    readinessTolerations: ReadinessTolerations
    podFailurePolicy: PodFailurePolicyRule
    gracefulTermination: GracefulTermination
    priority: Priority
    driverCompatibility: DriverCompatibility
    acceleratorNodeGuard: AcceleratorNodeGuard
    trustedDeviceSoftware: TrustedDeviceSoftware


class SelectorRequirement(_Model):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> SelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"values are required with operator {self.operator}")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"values must be empty with operator {self.operator}")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        present = self.key in labels and labels[self.key] in self.values
        return present if self.operator == "In" else not present


class LabelSelector(_Model):
    """A Kubernetes label selector (matchLabels and matchExpressions, all must hold)."""

    matchLabels: dict[str, str] = Field(default_factory=dict)
    matchExpressions: list[SelectorRequirement] = Field(default_factory=list)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.matchLabels.items()) and all(
            requirement.matches(labels) for requirement in self.matchExpressions
        )


class NamespaceOverride(_Model):
    """Namespaces chosen by name, or by a label selector on the Namespace (needs cluster access)."""

    names: list[str] = Field(default_factory=list)
    selector: LabelSelector | None = None
    mode: ModeField | None = None
    rules: dict[RuleId, ModeField] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _names_or_selector(self) -> NamespaceOverride:
        if bool(self.names) == (self.selector is not None):
            raise ValueError("give exactly one of names and selector")
        return self


class Policy(_Model):
    enabled: bool
    mode: ModeField
    accelerators: Accelerators
    rules: Rules
    priorityClasses: dict[str, Annotated[int, Field(le=HIGHEST_USER_PRIORITY)]]
    namespaces: list[NamespaceOverride]
    _hash: str = PrivateAttr(default="")

    @property
    def hash(self) -> str:
        """The hash of the source text, set by parse_policy; names the policy in annotations and metrics."""
        return self._hash

    @model_validator(mode="after")
    def _namespaces_unique(self) -> Policy:
        seen: set[str] = set()
        for index, override in enumerate(self.namespaces):
            for name in override.names:
                if name in seen:
                    raise ValueError(f"namespaces[{index}]: namespace {name!r} is listed twice")
                seen.add(name)
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

    def rule(self, rule: RuleId) -> _Rule:
        rule_model: _Rule = getattr(self.rules, rule)
        return rule_model

    def mode_for(self, rule: RuleId, namespace: str | None, labels: Mapping[str, str] | None = None) -> Mode:
        """The most specific mode: namespace+rule, namespace, rule, global. Disabled means off.

        `labels` are the namespace's labels when the cluster is known; selector overrides need them.
        """
        if not self.enabled:
            return "off"
        override = self.namespace_override(namespace, labels)
        if override is not None:
            if rule in override.rules:
                return override.rules[rule]
            if override.mode is not None:
                return override.mode
        return self.rule(rule).mode or self.mode

    def priority_value(self, class_name: str) -> int | None:
        return self.priorityClasses.get(class_name)


def _format_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"{location}: {item['msg']}")
    return "; ".join(lines)


def _load_mapping(text: str) -> dict[str, Any]:
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(f"policy is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy must be a mapping, got {type(data).__name__}")
    return data


def _overlay(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (lists included) in `override` replaces the base value."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _overlay(merged[key], value)
        else:
            merged[key] = value
    return merged


def _merge_namespaces(default: list[Any], given: list[Any]) -> list[Any]:
    """The given overrides first; the default ones stay for every namespace the given ones do not name.

    Replacing the list whole, as for other lists, would silently drop the infrastructure exemptions
    (kube-system, the GPU operator's namespaces) from a policy that only meant to add a team.
    """
    named = {
        name
        for entry in given
        if isinstance(entry, dict) and isinstance(entry.get("names"), list)
        for name in entry["names"]
        if isinstance(name, str)
    }
    kept = []
    for entry in default:
        names = [name for name in entry.get("names", []) if name not in named]
        if names or "selector" in entry:
            kept.append({**entry, "names": names} if "names" in entry else entry)
    return [*given, *kept]


def parse_policy(text: str) -> Policy:
    """Parses and validates policy YAML over the embedded default; raises PolicyError naming the field.

    The embedded default-policy.yaml is the one place defaults are written: a field the text leaves
    out takes its value from there.
    """
    default, given = _load_mapping(default_policy_text()), _load_mapping(text)
    data = _overlay(default, given)
    if isinstance(given.get("namespaces"), list):
        data["namespaces"] = _merge_namespaces(default["namespaces"], given["namespaces"])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"invalid policy: {_format_error(exc)}") from exc
    # Hash the effective policy, so the same text under a newer embedded default gets a new hash.
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    policy._hash = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    return policy


@cache
def default_policy_text() -> str:
    return resources.files("webhook").joinpath("default-policy.yaml").read_text(encoding="utf-8")


def default_policy() -> Policy:
    return parse_policy(default_policy_text())

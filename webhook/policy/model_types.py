"""The pieces every section of the policy's schema is built from: the strict base model, the mode, the
bounded seconds and lists, and names, label keys and label selectors as the Kubernetes API validates them.

model.py (the admission sections and the policy as a whole) and model_health.py (the health: section) both
build on these; neither imports the other's sections through here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from webhook.policy.errors import DNS_LABEL

Mode = Literal["enforce", "warn", "audit", "off"]
# Seconds end up in tolerationSeconds, terminationGracePeriodSeconds and a preStop sleep: int64 fields
# that Kubernetes turns into a Go time.Duration (int64 nanoseconds). More than this overflows there
# (a toleration would then evict at once), and past 2**63 the API server cannot even decode the patch.
MAX_SECONDS = (2**63 - 1) // 10**9  # about 292 years
# Bounds on the lists a request walks or the load compiles: far above any real policy, far below what
# would stall a load (hundreds of thousands of patterns take a minute to compile).
MAX_PATTERNS = 256


def _no_boolean_mode(value: object) -> object:
    # A mode is a word. Policy YAML has only `true` and `false` as booleans (webhook.policy.loader), so a
    # bare `off` already arrives as "off"; a boolean here was written as one, and its meaning is a guess.
    if isinstance(value, bool):
        raise ValueError(f"a mode is one of enforce, warn, audit, off, not the boolean {str(value).lower()}")
    return value


ModeField = Annotated[Mode, BeforeValidator(_no_boolean_mode)]
Seconds = Annotated[int, Field(ge=1, le=MAX_SECONDS)]
NamespaceName = Annotated[str, Field(max_length=63, pattern=DNS_LABEL)]
# A wait the controllers time from their own observation; 0 acts on the first sight (benchmarks, tests).
WaitSeconds = Annotated[int, Field(ge=0, le=MAX_SECONDS)]

# A label or annotation key: an optional DNS-subdomain prefix and a name (metav1 validation's qualified name).
_QUALIFIED_NAME = re.compile(
    r"(?:(?=[^/]{1,253}/)[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=[^/]{1,63}$)[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
)


def _qualified_name(key: str) -> str:
    if not _QUALIFIED_NAME.fullmatch(key):
        raise ValueError(f"{key!r} is not a valid label or annotation key")
    return key


LabelKey = Annotated[str, AfterValidator(_qualified_name)]


class StrictModel(BaseModel):
    # strict: no coercion, so `true` is not 1, "3600" is not a number and "no" is not a boolean.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


class SelectorRequirement(StrictModel):
    key: str = Field(min_length=1, max_length=316)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=MAX_PATTERNS)

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


class LabelSelector(StrictModel):
    """A Kubernetes label selector (matchLabels and matchExpressions, all must hold)."""

    matchLabels: dict[str, str] = Field(default_factory=dict, max_length=MAX_PATTERNS)
    matchExpressions: list[SelectorRequirement] = Field(default_factory=list, max_length=MAX_PATTERNS)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.matchLabels.items()) and all(
            requirement.matches(labels) for requirement in self.matchExpressions
        )

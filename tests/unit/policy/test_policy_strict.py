"""A policy that is wrong is refused: strict types, numbers bounded by the API fields they end up in,
rules that would defeat each other, and text too large, too deep or too aliased to read safely."""

from __future__ import annotations

import pytest

from tests.harness.manifests import defaulted_gpu_pod
from webhook.policy import engine
from webhook.policy.loader import MAX_DEPTH, MAX_TEXT_BYTES, MAX_VALUES
from webhook.policy.model import MAX_NAMESPACE_NAMES, PolicyError, default_policy, parse_policy
from webhook.policy.model_types import MAX_PATTERNS, MAX_SECONDS


def refusal(text: str) -> str:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text)
    return str(caught.value)


def tolerations(key: str, value: str) -> str:
    return f"rules:\n  readinessTolerations:\n    {key}: {value}\n"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param(tolerations("batchSeconds", "true"), "batchSeconds", id="boolean-as-seconds"),
        pytest.param(tolerations("batchSeconds", "'3600'"), "batchSeconds", id="string-as-seconds"),
        pytest.param(tolerations("batchSeconds", "1800.0"), "batchSeconds", id="float-as-seconds"),
        pytest.param("enabled: 'yes'\n", "enabled", id="quoted-yes"),
        pytest.param("enabled: 'no'\n", "enabled", id="quoted-no"),
        pytest.param("enabled: 1\n", "enabled", id="number-as-boolean"),
        pytest.param("accelerators:\n  resourceClaims: 'false'\n", "resourceClaims", id="string-as-bool"),
        pytest.param("priorityClasses: {gpu-workload: '10000'}\n", "priorityClasses", id="string-value"),
        pytest.param(
            "rules:\n  podFailurePolicy:\n    deviceFailureExitCodes: ['74']\n",
            "deviceFailureExitCodes",
            id="string-exit-code",
        ),
    ],
)
def test_types_are_strict(text: str, field: str) -> None:
    assert field in refusal(text)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        # YAML 1.1 reads these as booleans; in a policy they are the words they look like.
        pytest.param("mode: no\n", "mode", id="mode-no"),
        pytest.param("mode: false\n", "a mode is one of enforce, warn, audit, off", id="mode-false"),
        pytest.param("enabled: no\n", "enabled", id="enabled-bare-no"),
        pytest.param("enabled: off\n", "enabled", id="enabled-bare-off"),
        pytest.param("enabled: yes\n", "enabled", id="enabled-bare-yes"),
    ],
)
def test_only_true_and_false_are_booleans(text: str, field: str) -> None:
    assert field in refusal(text)


def test_bare_off_is_the_mode_off_and_true_false_are_booleans() -> None:
    policy = parse_policy("enabled: false\nmode: off\n")
    assert (policy.enabled, policy.mode) == (False, "off")
    assert parse_policy("enabled: True\n").enabled is True


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param(tolerations("batchSeconds", "0"), "batchSeconds", id="batch-zero"),
        pytest.param(tolerations("servingSeconds", "0"), "servingSeconds", id="serving-zero"),
        pytest.param(tolerations("batchSeconds", str(2**70)), "batchSeconds", id="batch-2**70"),
        pytest.param(tolerations("servingSeconds", str(2**63)), "servingSeconds", id="serving-2**63"),
        pytest.param(
            tolerations("servingSeconds", str(MAX_SECONDS + 1)), "servingSeconds", id="past-go-duration"
        ),
        pytest.param(
            tolerations("apiServerDefaultSeconds", str(2**63)), "apiServerDefaultSeconds", id="default-2**63"
        ),
        pytest.param(
            f"rules:\n  gracefulTermination:\n    minGracePeriodSeconds: {2**63}\n",
            "minGracePeriodSeconds",
            id="grace-2**63",
        ),
        pytest.param(
            f"rules:\n  gracefulTermination:\n    marginSeconds: {2**64}\n", "marginSeconds", id="margin"
        ),
        pytest.param(
            f"rules:\n  gracefulTermination:\n    minGracePeriodSeconds: {MAX_SECONDS}\n"
            f"    marginSeconds: {MAX_SECONDS}\n",
            "preStop.seconds + marginSeconds",
            id="grace-sum-overflows",
        ),
        pytest.param(
            f"priorityClasses: {{low: {-(2**70)}}}\n", "priorityClasses.low", id="class-below-int32"
        ),
        pytest.param(f"priorityClasses: {{low: {-(2**31) - 1}}}\n", "priorityClasses.low", id="int32-min-1"),
        pytest.param(
            f"rules:\n  acceleratorNodeGuard:\n    minPriority: {2**70}\n", "minPriority", id="min-priority"
        ),
    ],
)
def test_numbers_are_bounded_by_the_api_fields_they_end_up_in(text: str, field: str) -> None:
    assert field in refusal(text)


def test_the_largest_accepted_seconds_fit_every_field_they_are_written_to() -> None:
    policy = parse_policy(tolerations("servingSeconds", str(MAX_SECONDS)))
    result = engine.mutate(defaulted_gpu_pod(), policy, namespace="default")
    seconds = {t.get("tolerationSeconds") for t in result.obj["spec"]["tolerations"]}
    assert seconds == {MAX_SECONDS}
    assert MAX_SECONDS * 10**9 < 2**63  # as a Go time.Duration too
    assert parse_policy(f"priorityClasses: {{floor: {-(2**31)}}}\n").priorityClasses["floor"] == -(2**31)


def test_an_injected_class_the_guard_would_deny_is_refused() -> None:
    message = refusal(
        "rules:\n  priority:\n    className: low\n  acceleratorNodeGuard:\n    minPriority: 1000\n"
        "priorityClasses: {low: 10}\n"
    )
    assert "rules.priority.className low has value 10" in message
    assert "rules.acceleratorNodeGuard.minPriority 1000" in message
    # At the threshold it passes, and a class the policy does not value cannot be checked here.
    parse_policy("rules:\n  priority:\n    className: low\npriorityClasses: {low: 1000}\n")
    parse_policy("rules:\n  priority:\n    className: unvalued\n")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param(
            "namespaces:\n- names: [Kube-System]\n  mode: audit\n", "namespaces[0].names[0]", id="upper"
        ),
        pytest.param(
            "namespaces:\n- names: ['team a']\n  mode: audit\n", "namespaces[0].names[0]", id="space"
        ),
        pytest.param("priorityClasses: {Gpu: 10}\n", "priorityClasses", id="class-name"),
    ],
)
def test_names_that_could_never_match_are_refused(text: str, field: str) -> None:
    message = refusal(text)
    assert field in message
    assert "is not a valid name: lower-case letters" in message


def test_equivalent_policies_have_one_hash() -> None:
    assert parse_policy("mode: off\n").hash == parse_policy('mode: "off"\n').hash
    reordered = "rules:\n  podFailurePolicy:\n    deviceFailureExitCodes: [75, 74, 74]\n"
    assert parse_policy(reordered).hash == default_policy().hash
    assert parse_policy("{}").hash == default_policy().hash
    assert parse_policy("mode: warn\n").hash != default_policy().hash


# --- text too large, too deep, too aliased ----------------------------------------------------------


def nested(depth: int) -> str:
    return "a: " + "[" * depth + "]" * depth + "\n"


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    assert f"nests deeper than {MAX_DEPTH}" in refusal(nested(20_000))
    assert f"nests deeper than {MAX_DEPTH}" in refusal(nested(MAX_DEPTH + 1))


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    bomb = "\n".join(levels) + "\n"  # 10**9 values once expanded, from about 400 bytes
    assert len(bomb) < 1000
    assert f"more than {MAX_VALUES} values" in refusal(bomb)


def test_an_alias_deepening_past_the_bound_is_refused() -> None:
    text = "a: &a [[[[[[[[[[[[[[[[[[[[x]]]]]]]]]]]]]]]]]]]]\nb: [[[[[[[[[[[[[[[*a]]]]]]]]]]]]]]]\n"
    assert "once aliases expand" in refusal(text)


def test_a_recursive_alias_is_refused() -> None:
    assert "alias" in refusal("a: &a [*a]\n")


def test_text_larger_than_a_policy_may_be_is_refused() -> None:
    text = "# " + "x" * MAX_TEXT_BYTES + "\n"
    assert f"more than the {MAX_TEXT_BYTES} a policy may hold" in refusal(text)


def test_lists_a_request_walks_are_bounded() -> None:
    patterns = ", ".join(f"example{i}.com/gpu" for i in range(MAX_PATTERNS + 1))
    assert "accelerators.resources" in refusal(f"accelerators:\n  resources: [{patterns}]\n")
    names = ", ".join(f"ns-{i}" for i in range(MAX_NAMESPACE_NAMES + 1))
    assert "namespaces" in refusal(f"namespaces:\n- names: [{names}]\n  mode: audit\n")


def test_everything_a_request_needs_is_built_when_the_policy_loads() -> None:
    # A regex compiled on the first GPU request would stall every endpoint for as long as it takes.
    policy = parse_policy("accelerators:\n  resources: [example.com/gpu]\n")
    built = vars(policy.accelerators)
    assert {"_resource_pattern", "_device_class_pattern"} <= set(built)
    assert {"_namespace_index", "_selector_overrides"} <= set(vars(policy))


def health(section: str) -> str:
    return "health:\n" + "".join(f"  {line}\n" for line in section.splitlines())


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param(
            health(f"signals:\n  deviceGap: {{forSeconds: {MAX_SECONDS + 1}}}"),
            "health.signals.deviceGap.forSeconds",
            id="wait-past-go-duration",
        ),
        pytest.param(
            health(f"recovery: {{afterSeconds: {2**63}}}"), "health.recovery.afterSeconds", id="recovery"
        ),
        pytest.param(health("eviction: {retrySeconds: 0}"), "health.eviction.retrySeconds", id="retry-zero"),
        pytest.param(
            health("eviction: {perNodePerMinute: 1000000}"),
            "health.eviction.perNodePerMinute",
            id="rate-unbounded",
        ),
        pytest.param(health("budget: {maxUnhealthy: 2000000}"), "health.budget.maxUnhealthy", id="count"),
        pytest.param(health("budget: {maxUnhealthy: 150%}"), "health.budget.maxUnhealthy", id="percent"),
        pytest.param(health("mode: false"), "a mode is one of enforce, warn, audit, off", id="mode-false"),
        pytest.param(health("paused: no"), "health.paused", id="paused-bare-no"),
        pytest.param(health("poolLabels: ['-bad-']"), "health.poolLabels[0]", id="pool-label"),
        pytest.param(
            health("othersRemediatingTaints: ['a/b/c']"), "health.othersRemediatingTaints[0]", id="taint-key"
        ),
        pytest.param(
            health("signals:\n  devicePlugin: {namespaces: [GPU-Operator]}"),
            "health.signals.devicePlugin.namespaces[0]",
            id="plugin-namespace",
        ),
        pytest.param(
            health("poolLabels: [" + ", ".join(f"l{i}" for i in range(MAX_PATTERNS + 1)) + "]"),
            "health.poolLabels",
            id="pool-labels-bounded",
        ),
        pytest.param(
            "namespaces:\n- names: [research]\n  health: no\n", "namespaces[0].health", id="namespace-health"
        ),
    ],
)
def test_the_health_section_is_as_strict_as_the_rest(text: str, field: str) -> None:
    assert field in refusal(text)


def test_a_node_condition_status_written_as_a_boolean_is_that_word() -> None:
    # YAML 1.2 still reads a bare False as a boolean; for a condition status its meaning is no guess.
    section = health("signals:\n  nodeConditions: [{type: GPUHealthy, status: False, forSeconds: 0}]")
    (condition,) = parse_policy(section).health.signals.nodeConditions
    assert (condition.status, condition.forSeconds) == ("False", 0)

"""webhook.policy.health: what a node or pod shows, where ordinary fleet events look like failed devices.

Each case here was once read as a device failure: a DRA device the kubelet reports Unknown because its
driver streams no health, a node that never had device-plugin capacity, a node whose driver is still
being installed, a NIC reported unhealthy on a GPU pod, a count the API server wrote as "1k".
"""

from __future__ import annotations

import pytest

from tests.harness.manifests import make_policy
from tests.unit.policy.test_health import (
    ENFORCE,
    FREE,
    GPU,
    NOW,
    actions,
    applied,
    device_plugin,
    later,
    node,
    pod,
    raw_device_plugin,
    raw_node,
    raw_pod,
)
from webhook.policy.health import holdings, ladder, observed, podverdicts, records, signals
from webhook.policy.model import Policy

CLAIM = "claim:gpu/req"
DEVICE = "k8s.gpu.nvidia.com/claim=uid-gpu-0"
# Unknown acted on, as an operator who runs a DRA driver that streams health would set it.
UNKNOWN_300 = make_policy(
    {"health": {"mode": "enforce", "signals": {"podDeviceHealth": {"unknownForSeconds": 300}}}}
)


def dra_pod(state: str, *, reported_before: bool = False) -> observed.PodFacts:
    facts = pod(gpus=0, claims=["gpu"], devices=[(f"{CLAIM} {DEVICE}", state)])
    return observed.with_reported(facts, frozenset({(CLAIM, DEVICE)})) if reported_before else facts


def planned_twice(
    facts: observed.NodeFacts, pods: list[observed.PodFacts], policy: Policy, seconds: float
) -> ladder.NodePlan:
    """The plan at first sight, written, then the plan `seconds` later."""
    first = ladder.plan_node(facts, pods, policy, FREE, NOW)
    return ladder.plan_node(applied(facts, first), pods, policy, FREE, later(seconds))


# --- DRA Unknown -------------------------------------------------------------------------------------


def test_unknown_from_a_driver_that_never_streamed_health_is_no_failure() -> None:
    """The kubelet starts every DRA device at Unknown and keeps it there for a driver with no health
    stream: neither the pod nor the node acts on it, even with Unknown turned on."""
    never = dra_pod("Unknown")
    for policy in (ENFORCE, UNKNOWN_300):
        verdict = podverdicts.pod_verdict(never, policy, later(3600), unknown_since=NOW, driver_settled=True)
        assert not verdict.evict
        assert not podverdicts.has_unknown_device(never, policy, driver_settled=True)
    n = node(labels={"nvidia.com/gpu.present": "true"})
    plug = device_plugin(started=later(-3600))
    plan = planned_twice(n, [plug, never], UNKNOWN_300, 300)
    assert plan.assessment.signals == () and actions(plan) == []


def test_unknown_is_off_by_default_even_after_the_device_reported() -> None:
    assert ENFORCE.health.signals.podDeviceHealth.unknownForSeconds is None
    known = dra_pod("Unknown", reported_before=True)
    assert not podverdicts.pod_verdict(
        known, ENFORCE, later(3600), unknown_since=NOW, driver_settled=True
    ).evict
    assessment = signals.assess(node(), [device_plugin(), known], ENFORCE, NOW)
    assert assessment.signals == ()


def test_unknown_after_healthy_counts_once_it_persisted_while_the_driver_runs() -> None:
    known = dra_pod("Unknown", reported_before=True)
    assert podverdicts.has_unknown_device(known, UNKNOWN_300, driver_settled=True)
    waiting = podverdicts.pod_verdict(known, UNKNOWN_300, NOW, unknown_since=later(-100), driver_settled=True)
    assert not waiting.evict and waiting.requeue_after == pytest.approx(200)
    verdict = podverdicts.pod_verdict(known, UNKNOWN_300, NOW, unknown_since=later(-300), driver_settled=True)
    assert verdict.reason == "DeviceUnknown"
    (signal,) = signals.assess(node(), [device_plugin(), known], UNKNOWN_300, NOW).signals
    assert (signal.kind, signal.resource, signal.for_seconds) == ("podDeviceUnknown", CLAIM, 300)


@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param(device_plugin(ready=False, started=later(-3600)), id="driver-not-ready"),
        pytest.param(device_plugin(started=later(-20)), id="driver-just-restarted"),
        pytest.param(None, id="no-driver-pod-seen"),
    ],
)
def test_unknown_while_the_driver_restarts_is_no_failure(plugin: observed.PodFacts | None) -> None:
    """A driver whose health stream ends leaves all its devices Unknown until the new one streams."""
    known = dra_pod("Unknown", reported_before=True)
    node_pods = [known] if plugin is None else [plugin, known]
    settled = signals.plugins_settled(node_pods, UNKNOWN_300, NOW)
    assert not settled
    assert not podverdicts.has_unknown_device(known, UNKNOWN_300, driver_settled=settled)
    verdict = podverdicts.pod_verdict(
        known, UNKNOWN_300, NOW, unknown_since=later(-3600), driver_settled=settled
    )
    assert not verdict.evict
    kinds = [s.kind for s in signals.assess(node(), node_pods, UNKNOWN_300, NOW).signals]
    assert "podDeviceUnknown" not in kinds


def test_the_pod_converter_remembers_only_dra_devices_reported_healthy_or_unhealthy() -> None:
    raw = raw_pod(
        gpus=1,
        claims=["gpu", "nic"],
        devices=[
            (f"{CLAIM} dev-healthy", "Healthy"),
            (f"{CLAIM} dev-unhealthy", "Unhealthy"),
            (f"{CLAIM} dev-unknown", "Unknown"),
            ("claim:nic/req nic-0", "Healthy"),
            (f"{GPU} GPU-0", "Healthy"),
        ],
    )
    facts = observed.pod_facts(raw)
    assert facts is not None
    # A device plugin never says Unknown, so its devices need no remembering.
    assert facts.reported == {(CLAIM, "dev-healthy"), (CLAIM, "dev-unhealthy"), ("claim:nic/req", "nic-0")}
    assert observed.with_reported(facts, frozenset({(CLAIM, "dev-healthy")})) is facts


# --- capacity that vanished --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels",
    [
        pytest.param({"feature.node.kubernetes.io/pci-10de.present": "true"}, id="dra-node-nfd-label"),
        pytest.param({"cloud.google.com/gke-accelerator": "nvidia-l4"}, id="gke-pool-label"),
        pytest.param({"nvidia.com/gpu.present": "true"}, id="gpu-present-no-plugin"),
    ],
)
def test_a_node_that_never_had_accelerator_capacity_has_nothing_to_lose(labels: dict[str, str]) -> None:
    """DRA-only, passthrough and plugin-less nodes carry accelerator labels and no accelerator resource."""
    facts = observed.node_facts(raw_node(capacity=None, allocatable=None, labels=labels))
    assert facts is not None
    claim_pod = pod(gpus=0, claims=["gpu"])
    plan = planned_twice(facts, [claim_pod], ENFORCE, 601)
    assert plan.assessment.in_scope
    assert plan.assessment.signals == () and actions(plan) == [] and not plan.unschedulable
    assert not podverdicts.pod_verdict(claim_pod, ENFORCE, later(602), draining=plan.unschedulable).evict


def test_an_explicit_zero_is_capacity_that_vanished() -> None:
    (signal,) = signals.assess(node(capacity=0, allocatable=0), [], ENFORCE, NOW).signals
    assert signal.kind == "capacityVanished"


def test_a_zero_beside_another_accelerator_resource_with_capacity_is_no_vanishing() -> None:
    """A MIG layout change leaves the old resource at 0 beside the new ones."""
    raw = raw_node(capacity=0, allocatable=0)
    raw["status"]["capacity"]["nvidia.com/mig-1g.10gb"] = "7"
    raw["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "7"
    facts = observed.node_facts(raw)
    assert facts is not None
    assert signals.assess(facts, [device_plugin()], ENFORCE, NOW).signals == ()


# --- bring-up ----------------------------------------------------------------------------------------


def installing_plugin() -> observed.PodFacts:
    """The GPU operator's plugin on a new node: Pending in its init containers while the driver installs."""
    facts = observed.pod_facts(raw_device_plugin(ready=False, phase="Pending"))
    assert facts is not None
    return facts


@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param(None, id="new-node-no-resource-yet"),
        pytest.param(0, id="zero-until-the-plugin-registers"),
    ],
)
def test_a_node_whose_driver_installs_is_not_a_device_failure(capacity: int | None) -> None:
    facts = node(capacity=capacity, allocatable=capacity, labels={"nvidia.com/gpu.present": "true"})
    plan = planned_twice(facts, [installing_plugin()], ENFORCE, 3600)
    assert plan.assessment.signals == ()
    assert actions(plan) == [] and plan.record is None
    suppressed = {s.kind for s in plan.assessment.suppressed}
    assert suppressed == ({"devicePlugin"} if capacity is None else {"devicePlugin", "capacityVanished"})


def test_a_plugin_that_stopped_on_a_node_with_registered_capacity_still_counts() -> None:
    """Bring-up ends once the node registered devices: a plugin Pending again after that (a driver
    reinstall that hangs) is the node's devices becoming unusable."""
    record = records.NodeRecord(signals={"devicePlugin": later(-301)})
    assessment = signals.assess(node(), [installing_plugin()], ENFORCE, NOW, record)
    assert [s.kind for s in assessment.signals] == ["devicePlugin"]
    assert assessment.state == "unhealthy"


# --- devices that are not accelerators ---------------------------------------------------------------


def rdma_pod() -> observed.PodFacts:
    raw = raw_pod(devices=[("rdma/hca_shared_devices_a mlx5_0", "Unhealthy")])
    raw["spec"]["containers"][0]["resources"]["limits"]["rdma/hca_shared_devices_a"] = "1"
    facts = observed.pod_facts(raw)
    assert facts is not None
    return facts


def test_an_unhealthy_nic_on_a_gpu_pod_neither_evicts_it_nor_marks_the_node() -> None:
    nic = rdma_pod()
    assert not podverdicts.pod_verdict(nic, ENFORCE, NOW).evict
    plan = planned_twice(node(), [device_plugin(started=later(-3600)), nic], ENFORCE, 301)
    assert plan.assessment.signals == () and actions(plan) == []


def test_a_device_the_policy_names_counts() -> None:
    named = make_policy(
        {"health": {"mode": "enforce"}, "accelerators": {"resources": [GPU, "rdma/hca_shared_devices_*"]}}
    )
    nic = rdma_pod()
    assert podverdicts.pod_verdict(nic, named, NOW).reason == "DeviceUnhealthy"
    (signal,) = signals.assess(node(), [device_plugin(), nic], named, NOW).signals
    assert (signal.kind, signal.resource) == ("podDevice", "rdma/hca_shared_devices_a")


def agent_reports(resource: str, device: str) -> dict[str, str]:
    """The node agent's condition on a pod whose container `main` lost `device` of `resource`."""
    lost = holdings.Holding("ml", "trainer", "main", resource, frozenset({device}))
    message = holdings.lost_condition([lost], {device: "gone from its pool"}).message
    return {"type": holdings.CONDITION_TYPE, "status": "False", "message": message}


def dra_nic_pod(*, agent_condition: bool = False) -> observed.PodFacts:
    """A GPU pod that also holds an RDMA NIC through a DRA claim whose driver is no accelerator driver;
    the NIC is reported Unhealthy by the kubelet (`agent_condition`: by the node agent instead)."""
    nic = "rdma.example.com/n1/nic0"
    raw = raw_pod(claims=["nic"], devices=[] if agent_condition else [("claim:nic " + nic, "Unhealthy")])
    if agent_condition:
        raw["status"]["conditions"].append(agent_reports("claim:nic", nic))
    facts = observed.pod_facts(raw)
    assert facts is not None
    return facts


@pytest.mark.parametrize("agent_condition", [False, True], ids=["kubelet", "node-agent"])
def test_an_unhealthy_dra_nic_on_a_gpu_pod_does_not_evict_it(agent_condition: bool) -> None:
    """Claims count (the default), but the NIC's driver matches no accelerators.draDrivers pattern."""
    nic = dra_nic_pod(agent_condition=agent_condition)
    assert not podverdicts.pod_verdict(nic, ENFORCE, NOW).evict
    assert signals.assess(node(), [device_plugin(), nic], ENFORCE, NOW).signals == ()


def test_an_unhealthy_dra_gpu_the_kubelet_reports_evicts_the_pod() -> None:
    gpu = dra_pod("Unhealthy")  # named by its CDI device ID, which does not name the driver: judged as before
    named = pod(gpus=0, claims=["gpu"], devices=[(f"{CLAIM} gpu.nvidia.com/n1/gpu-0", "Unhealthy")])
    for holder in (gpu, named):
        assert podverdicts.pod_verdict(holder, ENFORCE, NOW).reason == "DeviceUnhealthy"


def test_the_node_agents_dra_report_is_left_to_the_controllers_own_slices() -> None:
    """The agent fails a DRA device on any taint of any driver, without the policy's keys or forSeconds;
    the controllers judge the same ResourceSlices themselves, so its DRA entries count for nothing here."""
    gpu = pod(gpus=0, claims=["gpu"])
    raw = raw_pod(gpus=0, claims=["gpu"])
    raw["status"]["conditions"].append(agent_reports("claim:gpu", "gpu.nvidia.com/n1/gpu-0"))
    reported = observed.pod_facts(raw)
    assert reported is not None and reported.devices == gpu.devices == ()
    assert not podverdicts.pod_verdict(reported, ENFORCE, NOW).evict


def test_claims_count_only_when_the_policy_counts_claims() -> None:
    no_claims = make_policy({"health": {"mode": "enforce"}, "accelerators": {"resourceClaims": False}})
    broken = pod(claims=["gpu"], devices=[(f"{CLAIM} {DEVICE}", "Unhealthy")])
    assert not podverdicts.pod_verdict(broken, no_claims, NOW).evict
    assert signals.assess(node(), [device_plugin(), broken], no_claims, NOW).signals == ()
    assert podverdicts.pod_verdict(broken, ENFORCE, NOW).reason == "DeviceUnhealthy"


# --- quantities --------------------------------------------------------------------------------------


def test_counts_in_any_quantity_form_are_read_as_the_api_server_reads_them() -> None:
    raw = raw_node(capacity=None, allocatable=None)
    for name, capacity, allocatable in [
        ("gpu.intel.com/millicores", "8k", "7k"),
        ("example.com/gpu", "1Ki", "1e3"),
        ("other.com/gpu", "1.5k", "1500"),
    ]:
        raw["status"]["capacity"][name] = capacity
        raw["status"]["allocatable"][name] = allocatable
    facts = observed.node_facts(raw)
    assert facts is not None
    assert facts.capacity == {
        "gpu.intel.com/millicores": 8000,
        "example.com/gpu": 1024,
        "other.com/gpu": 1500,
    }
    assessment = signals.assess(facts, [device_plugin()], ENFORCE, NOW)
    assert {(s.resource, s.devices) for s in assessment.signals} == {
        ("gpu.intel.com/millicores", 1000),
        ("example.com/gpu", 24),
    }


def test_a_count_written_as_1k_is_not_read_as_zero() -> None:
    """The review's case: 11 GPUs of 100 vGPU cores, one failed; allocatable "1k" read as 0 drained the node."""
    raw = raw_node(capacity=None, allocatable=None)
    raw["status"]["capacity"]["volcano.sh/vgpu-cores"] = "1100"
    raw["status"]["allocatable"]["volcano.sh/vgpu-cores"] = "1k"
    facts = observed.node_facts(raw)
    assert facts is not None
    plan = planned_twice(facts, [device_plugin(started=later(-3600))], ENFORCE, 301)
    (signal,) = plan.assessment.signals
    assert signal.message == "volcano.sh/vgpu-cores: 100 of 1100 devices unhealthy (allocatable 1000)"
    assert actions(plan) == [("condition", "do"), ("taint", "do")] and not plan.unschedulable


@pytest.mark.parametrize("allocatable", [None, "lots"], ids=["missing", "unparsable"])
def test_allocatable_that_cannot_be_read_is_unknown_never_zero(allocatable: str | None) -> None:
    raw = raw_node(allocatable=None)
    if allocatable is not None:
        raw["status"]["allocatable"][GPU] = allocatable
    facts = observed.node_facts(raw)
    assert facts is not None
    plan = planned_twice(facts, [device_plugin(started=later(-3600))], ENFORCE, 3600)
    assert plan.assessment.signals == () and actions(plan) == []
    assert plan.assessment.devices == {}


def test_huge_counts_are_counts() -> None:
    facts = node(capacity=10**30, allocatable=10**30 - 1)
    (signal,) = signals.assess(facts, [device_plugin()], ENFORCE, NOW).signals
    assert (signal.kind, signal.devices) == ("deviceGap", 1)

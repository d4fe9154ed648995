"""The node agent: reading the PodResources API's protobuf answers, deciding which pods hold lost
devices, and writing only the condition differences (the kubelet itself is in tests/node)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from webhook.agent.nodeagent import NodeAgent, Options
from webhook.agent.podresources import WireError, decode_allocatable, decode_claims, decode_list, fields
from webhook.kube.events import EventRecorder
from webhook.kube.remediation import ConflictError
from webhook.policy.health import holdings, observed
from webhook.policy.health.holdings import ClaimHolding, Condition, Holding, PodView
from webhook.processes import node_agent
from webhook.runtime.metrics import Registry

# --- protobuf, written out field by field as the kubelet sends it ------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value: bytes | str | int) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def devices(resource: str, *ids: str, numa: int | None = None) -> bytes:
    topology = field(3, field(1, field(1, numa))) if numa is not None else b""
    return field(1, resource) + b"".join(field(2, i) for i in ids) + topology


def container(name: str, *held: bytes, cpus: tuple[int, ...] = ()) -> bytes:
    packed = field(3, b"".join(varint(c) for c in cpus)) if cpus else b""
    return field(1, name) + b"".join(field(2, d) for d in held) + packed


def pod(name: str, namespace: str, *containers: bytes) -> bytes:
    return field(1, name) + field(2, namespace) + b"".join(field(3, c) for c in containers)


def test_a_list_answer_becomes_holdings_per_container_and_resource() -> None:
    answer = field(
        1,
        pod(
            "train-0",
            "ml",
            container(
                "main",
                devices("nvidia.com/gpu", "gpu-0", numa=0),
                devices("nvidia.com/gpu", "gpu-1", numa=1),  # split by topology: joined
                cpus=(2, 3),
            ),
            container("sidecar"),
        ),
    ) + field(1, pod("infer", "serve", container("main", devices("nvidia.com/gpu", "gpu-3"))))
    assert sorted(decode_list(answer), key=lambda h: h.pod) == [
        Holding("serve", "infer", "main", "nvidia.com/gpu", frozenset({"gpu-3"})),
        Holding("ml", "train-0", "main", "nvidia.com/gpu", frozenset({"gpu-0", "gpu-1"})),
    ]


def claim_resource(driver: str, pool: str, device: str, *cdi: str) -> bytes:
    """ClaimResource: cdi_devices = 1 { name = 1 }, driver_name = 2, pool_name = 3, device_name = 4."""
    return (
        b"".join(field(1, field(1, name)) for name in cdi)
        + field(2, driver)
        + field(3, pool)
        + field(4, device)
    )


def dynamic(claim: str, namespace: str, *resources: bytes) -> bytes:
    """A container's DynamicResource (its field 5): claim_name = 2, claim_namespace = 3, claim_resources = 4."""
    return field(5, field(2, claim) + field(3, namespace) + b"".join(field(4, r) for r in resources))


DRA = "gpu.example.com"


def test_a_list_answer_names_the_dra_devices_each_container_holds_through_its_claims() -> None:
    shared = dynamic("train-gpu", "ml", claim_resource(DRA, "node-a", "gpu-3", f"{DRA}/gpu=gpu-3"))
    answer = field(
        1,
        pod(
            "train-0",
            "ml",
            container("main", devices("nvidia.com/gpu", "gpu-0")) + shared,
            container("sidecar") + shared,
        ),
    ) + field(
        1,
        pod(
            "infer",
            "serve",
            container("main")
            + dynamic(
                "pair",
                "serve",
                claim_resource(DRA, "node-a", "gpu-4"),
                claim_resource(DRA, "node-a", "gpu-5"),
            )
            + dynamic("incomplete", "serve", claim_resource("", "node-a", "gpu-6")),
        ),
    )
    claims = decode_claims(answer)
    assert claims == [
        ClaimHolding("ml", "train-0", "main", "ml", "train-gpu", DRA, "node-a", "gpu-3"),
        ClaimHolding("ml", "train-0", "sidecar", "ml", "train-gpu", DRA, "node-a", "gpu-3"),
        ClaimHolding("serve", "infer", "main", "serve", "pair", DRA, "node-a", "gpu-4"),
        ClaimHolding("serve", "infer", "main", "serve", "pair", DRA, "node-a", "gpu-5"),
    ]
    # The device plugins' view of the same answer is unchanged by the DRA fields.
    assert decode_list(answer) == [Holding("ml", "train-0", "main", "nvidia.com/gpu", frozenset({"gpu-0"}))]
    assert holdings.dra_holders(claims) == {
        f"{DRA}/node-a/gpu-3": holdings.DeviceHolders(DRA, ("ml/train-0",), ("ml/train-gpu",)),
        f"{DRA}/node-a/gpu-4": holdings.DeviceHolders(DRA, ("serve/infer",), ("serve/pair",)),
        f"{DRA}/node-a/gpu-5": holdings.DeviceHolders(DRA, ("serve/infer",), ("serve/pair",)),
    }


def test_an_allocatable_answer_skips_cpus_and_memory() -> None:
    answer = field(1, devices("nvidia.com/gpu", "gpu-0", "gpu-2")) + field(2, b"\x01\x02") + field(3, b"")
    assert decode_allocatable(answer) == {"nvidia.com/gpu": frozenset({"gpu-0", "gpu-2"})}
    assert decode_allocatable(b"") == {}


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x0a\x05ab", id="length past the end"),
        pytest.param(b"\x08\xff", id="truncated varint"),
        pytest.param(b"\x0b", id="group wire type"),
        pytest.param(b"\x08" + b"\xff" * 11, id="overlong varint"),
    ],
)
def test_a_malformed_answer_is_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        list(fields(data))


def test_a_number_where_a_message_belongs_is_refused() -> None:
    with pytest.raises(WireError):
        decode_list(field(1, 7))


# --- the pure decision --------------------------------------------------------------------------------

GPU = "nvidia.com/gpu"


def held(pod_name: str, *ids: str, container_name: str = "main", namespace: str = "ml") -> Holding:
    return Holding(namespace, pod_name, container_name, GPU, frozenset(ids))


def offered(*ids: str) -> dict[str, frozenset[str]]:
    return {GPU: frozenset(ids)}


def after(*polls: dict[str, frozenset[str]]) -> dict[str, holdings.Registration]:
    """What the agent remembers once it polled these allocatable sets, in order."""
    known: dict[str, holdings.Registration] = {}
    for allocatable in polls:
        known = dict(holdings.loss([], allocatable, known).registrations)
    return known


def test_a_loss_is_a_device_that_left_the_allocatable_set_while_the_rest_stayed() -> None:
    pods = [held("a", "gpu-0", "gpu-1"), held("b", "gpu-2")]
    known = after(offered("gpu-0", "gpu-1", "gpu-2", "gpu-3"))
    loss = holdings.loss(pods, offered("gpu-0", "gpu-2", "gpu-3"), known)
    assert loss.lost == (held("a", "gpu-1"),)
    assert (loss.unregistered, loss.reregistered) == ((), ())
    # It stays lost on later polls, while it stays away, and is no longer lost once it is back.
    later = holdings.loss(pods, offered("gpu-0", "gpu-2", "gpu-3"), loss.registrations)
    assert later.lost == (held("a", "gpu-1"),)
    assert holdings.loss(pods, offered("gpu-0", "gpu-1", "gpu-2"), later.registrations).lost == ()


def test_a_device_never_seen_allocatable_is_not_lost() -> None:
    # The first poll (a new or restarted agent) saw no transition: a held ID absent from the set may be
    # a name from an earlier registration, so nothing is lost until a device leaves a set seen before.
    assert holdings.loss([held("a", "gpu-1")], offered("gpu-0", "gpu-2"), {}).lost == ()


def test_a_device_plugin_restart_that_renames_every_device_is_no_loss() -> None:
    # Time-slicing turns GPU-<uuid> into GPU-<uuid>::<n>: the running pods keep the IDs they were
    # allocated, none of which is allocatable any more, and nothing failed.
    pods = [held("a", "GPU-a"), held("b", "GPU-b")]
    known = after(offered("GPU-a", "GPU-b", "GPU-c", "GPU-d"))
    renamed = offered(*(f"GPU-{gpu}::{n}" for gpu in "abcd" for n in range(4)))
    loss = holdings.loss(pods, renamed, known)
    assert (loss.lost, loss.reregistered) == ((), (GPU,))
    assert holdings.loss(pods, renamed, loss.registrations) == holdings.Loss((), (), (), loss.registrations)
    # Through an empty set (the plugin stopped, then registered under the new IDs): the same.
    gone = holdings.loss(pods, {}, known)
    assert gone.unregistered == (GPU,)
    assert holdings.loss(pods, renamed, gone.registrations).reregistered == (GPU,)
    # A device that fails after the rename is a loss of the new set.
    pods = [held("c", "GPU-c::0", "GPU-c::1")]
    assert holdings.loss(pods, offered(*(renamed[GPU] - {"GPU-c::1"})), loss.registrations).lost == (
        held("c", "GPU-c::1"),
    )


def test_a_renaming_forgets_what_had_left_the_old_set() -> None:
    known = after(offered("gpu-0", "gpu-1", "gpu-2", "gpu-3"), offered("gpu-0", "gpu-2", "gpu-3"))
    assert known[GPU].departed == frozenset({"gpu-1"})
    loss = holdings.loss([held("a", "gpu-1")], offered("x-0", "x-1", "x-2"), known)
    assert loss.lost == () and loss.registrations[GPU] == holdings.Registration(
        frozenset({"x-0", "x-1", "x-2"})
    )


def test_half_the_set_staying_is_a_loss_less_than_half_a_renaming() -> None:
    pods = [held("a", "gpu-0")]
    assert holdings.loss(pods, offered("gpu-1"), after(offered("gpu-0", "gpu-1"))).lost == tuple(pods)
    four = after(offered("gpu-0", "gpu-1", "gpu-2", "gpu-3"))
    assert holdings.loss(pods, offered("gpu-3"), four).reregistered == (GPU,)


def test_a_report_on_the_pod_stands_while_its_device_stays_away() -> None:
    # The agent restarted (it remembers no transition), or the plugin renamed its devices since: the pod
    # already says it lost gpu-1, and gpu-1 is still not allocatable, so it is still lost.
    reported = {("ml/a", "main", GPU, "gpu-1")}
    pods = [held("a", "gpu-0", "gpu-1")]
    assert holdings.loss(pods, offered("gpu-0"), {}, reported).lost == (held("a", "gpu-1"),)
    assert holdings.loss(pods, offered("gpu-0", "gpu-1"), {}, reported).lost == ()


def test_a_resource_with_nothing_allocatable_names_no_pod() -> None:
    # A device plugin restarting offers nothing for a moment: no single device is known to have failed.
    known = after(offered("gpu-0", "gpu-1"))
    loss = holdings.loss([held("a", "gpu-0")], {}, known)
    assert loss == holdings.Loss((), (GPU,), (), known)


def test_the_condition_message_round_trips() -> None:
    condition = holdings.lost_condition(
        [held("a", "gpu-1", "gpu-0"), held("a", "gpu-3", container_name="init")]
    )
    assert condition == Condition(
        "False",
        "DeviceNotAllocatable",
        '[{"resource": "nvidia.com/gpu", "container": "init", "devices": ["gpu-3"]},'
        ' {"resource": "nvidia.com/gpu", "container": "main", "devices": ["gpu-0", "gpu-1"]}]',
    )
    assert holdings.lost_devices(condition.message) == (
        holdings.LostDevice("init", GPU, "gpu-3"),
        holdings.LostDevice("main", GPU, "gpu-0"),
        holdings.LostDevice("main", GPU, "gpu-1"),
    )
    assert holdings.lost_devices("written by hand") == ()
    assert holdings.lost_devices("[" * 5000 + "]" * 5000) == ()
    assert (
        holdings.lost_devices('[{"resource": 1}, 2, {"container": "c", "resource": "r", "devices": [3]}]')
        == ()
    )


@pytest.mark.parametrize("device", ["", "a b", "a,b", "a; b", "x (container y)", "GPU-a::0", "é"])
def test_any_device_id_reads_back_as_written(device: str) -> None:
    lost = [held("a", device), held("a", "gpu-9", container_name="side; car")]
    assert set(holdings.lost_devices(holdings.lost_condition(lost).message)) == {
        holdings.LostDevice("main", GPU, device),
        holdings.LostDevice("side; car", GPU, "gpu-9"),
    }


def test_an_earlier_agents_message_is_still_read() -> None:
    assert holdings.lost_devices(
        "nvidia.com/gpu gpu-0,gpu-1 (container main); x.io/y d (container init)"
    ) == (
        holdings.LostDevice("main", GPU, "gpu-0"),
        holdings.LostDevice("main", GPU, "gpu-1"),
        holdings.LostDevice("init", "x.io/y", "d"),
    )


def test_a_loss_is_reported_once_it_lasted_or_was_reported_before() -> None:
    lost = [held("a", "gpu-1")]
    key = ("ml/a", "main", GPU, "gpu-1")
    assert holdings.confirmed(lost, {key: 100.0}, (), now=110.0, confirm_seconds=30) == []
    assert holdings.confirmed(lost, {key: 100.0}, (), now=130.0, confirm_seconds=30) == lost
    # Reported before (an agent restart forgot when it first saw it): still reported, no new delay.
    assert holdings.confirmed(lost, {key: 129.0}, {key}, now=130.0, confirm_seconds=30) == lost


def view(name: str, condition: Condition | None = None) -> PodView:
    return PodView("ml", name, f"uid-{name}", "7", condition)


def test_writes_say_what_is_lost_undo_what_recovered_and_repeat_nothing() -> None:
    lost = [held("a", "gpu-1")]
    written = holdings.lost_condition(lost)
    pods = {"ml/a": view("a"), "ml/b": view("b")}
    assert holdings.writes(pods, lost) == [holdings.Write(view("a"), written)]
    # Already said: nothing to write (idempotent).
    assert holdings.writes({"ml/a": view("a", written), "ml/b": view("b")}, lost) == []
    # Recovered: the agent undoes its own False, and only that.
    assert holdings.writes({"ml/a": view("a", written)}, []) == [
        holdings.Write(view("a", written), holdings.RESTORED)
    ]
    assert holdings.writes({"ml/a": view("a", holdings.RESTORED)}, []) == []
    # While the plugin is unregistered nothing is known: the pod keeps its condition.
    assert holdings.writes({"ml/a": view("a", written)}, [], unsure={"ml/a"}) == []


def test_the_pod_watcher_reads_the_agents_condition_as_an_unhealthy_device() -> None:
    condition = holdings.lost_condition([held("a", "gpu-1")])
    raw: dict[str, Any] = {
        "metadata": {"name": "a", "namespace": "ml", "uid": "u"},
        "spec": {"nodeName": "n1", "containers": [{"name": "main", "resources": {"limits": {GPU: 1}}}]},
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": holdings.CONDITION_TYPE,
                    "status": "False",
                    "reason": condition.reason,
                    "message": condition.message,
                }
            ],
        },
    }
    facts = observed.pod_facts(raw)
    assert facts is not None
    assert facts.devices == (observed.DeviceHealth("main", GPU, "gpu-1", "Unhealthy"),)
    raw["status"]["conditions"][0].update(status="True", message=holdings.RESTORED.message)
    restored = observed.pod_facts(raw)
    assert restored is not None and restored.devices == ()


# --- one poll, with the kubelet and the API server played by plain objects --------------------------


class Kubelet:
    def __init__(self) -> None:
        self.holdings = [held("a", "gpu-0"), held("b", "gpu-1")]
        self.offered = {GPU: frozenset({"gpu-0", "gpu-1"})}
        self.claimed: list[ClaimHolding] = []
        self.broken = False

    def listed(self) -> tuple[list[Holding], list[ClaimHolding]]:
        if self.broken:
            raise ConnectionError("socket gone")
        return list(self.holdings), list(self.claimed)

    def allocatable(self) -> dict[str, frozenset[str]]:
        return dict(self.offered)


class Pods:
    def __init__(self, *pods: PodView) -> None:
        self.pods: dict[Hashable, PodView] = {p.key: p for p in pods}

    def snapshot(self) -> dict[Hashable, PodView]:
        return dict(self.pods)

    def has_synced(self) -> bool:
        return True


class Writer:
    def __init__(self, pods: Pods) -> None:
        self.pods = pods
        self.patches: list[tuple[str, str, dict[str, Any]]] = []
        self.conflict = False

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.conflict:
            raise ConflictError("changed")
        self.patches.append((namespace, name, patch))
        (written,) = patch["status"]["conditions"]
        key = f"{namespace}/{name}"
        old = self.pods.pods[key]
        condition = Condition(written["status"], written["reason"], written["message"])
        self.pods.pods[key] = replace(old, resource_version="8", condition=condition)
        return {}


class Slices:
    """The agent's cache of its node's ResourceSlices."""

    def __init__(self, *slices: observed.SliceFacts) -> None:
        self.slices: dict[Hashable, observed.SliceFacts] = {piece.name: piece for piece in slices}
        self.synced = True

    def snapshot(self) -> dict[Hashable, observed.SliceFacts]:
        return dict(self.slices)

    def has_synced(self) -> bool:
        return self.synced


def agent_with(
    kubelet: Kubelet, pods: Pods, writer: Writer, clock: list[float], slices: Slices | None = None
) -> tuple[NodeAgent, Registry, list[str]]:
    sent: list[str] = []
    registry = Registry()
    events = EventRecorder(lambda namespace, body: sent.append(body["reason"]), stop=threading.Event())
    agent = NodeAgent(
        Options(node="n1", confirm_seconds=20),
        resources=kubelet,
        pods=pods,
        slices=slices or Slices(),
        writer=writer,
        events=events,
        registry=registry,
        stop=threading.Event(),
        clock=lambda: clock[0],
    )
    return agent, registry, sent


def test_a_poll_reports_a_confirmed_loss_once_and_undoes_it_on_recovery() -> None:
    kubelet, pods = Kubelet(), Pods(view("a"), view("b"))
    writer = Writer(pods)
    clock = [1000.0]
    agent, registry, _ = agent_with(kubelet, pods, writer, clock)

    agent.poll()
    assert writer.patches == []  # all allocatable
    kubelet.offered = {GPU: frozenset({"gpu-0"})}  # gpu-1, held by b, failed
    agent.poll()
    assert writer.patches == []  # not yet confirmed
    clock[0] += 20
    agent.poll()
    ((namespace, name, patch),) = writer.patches
    assert (namespace, name) == ("ml", "b")
    assert patch["metadata"] == {"resourceVersion": "7"}  # written at the version read
    (condition,) = patch["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        holdings.CONDITION_TYPE,
        "False",
        "DeviceNotAllocatable",
    )
    assert holdings.lost_devices(condition["message"]) == (holdings.LostDevice("main", GPU, "gpu-1"),)
    assert "lastTransitionTime" in condition
    agent.poll()
    assert len(writer.patches) == 1  # said once
    assert 'gpuguard_node_agent_lost_devices{resource="nvidia.com/gpu"} 1' in registry.render()

    kubelet.offered = {GPU: frozenset({"gpu-0", "gpu-1"})}
    agent.poll()
    assert [p[2]["status"]["conditions"][0]["status"] for p in writer.patches] == ["False", "True"]
    assert [p[1] for p in writer.patches] == ["b", "b"]  # a was never touched


def test_an_unreadable_kubelet_or_a_conflict_changes_nothing() -> None:
    kubelet, pods = Kubelet(), Pods(view("a"), view("b"))
    writer = Writer(pods)
    agent, registry, _ = agent_with(kubelet, pods, writer, [0.0])
    agent.poll()
    kubelet.broken = True
    agent.poll()
    assert registry.value("gpuguard_node_agent_polls_total", "error") == 1
    kubelet.broken, kubelet.offered = False, {GPU: frozenset({"gpu-0"})}
    agent.poll()  # first seen: gpu-1 left a set the agent saw before the failed read
    writer.conflict = True
    agent.options = Options(node="n1", confirm_seconds=0)
    agent.poll()
    assert writer.patches == []
    assert registry.value("gpuguard_node_agent_condition_writes_total", "False", "conflict") == 1
    writer.conflict = False
    agent.poll()  # the next poll decides again, on what the cache holds
    assert [p[1] for p in writer.patches] == ["b"]


def test_a_poll_reports_which_pod_holds_which_dra_device_and_writes_nothing_while_no_slice_names_it() -> None:
    kubelet, pods = Kubelet(), Pods(view("a"), view("b"))
    kubelet.claimed = [
        ClaimHolding("ml", "a", "main", "ml", "a-gpu", DRA, "n1", "gpu-3"),
        ClaimHolding("ml", "b", "main", "ml", "shared", DRA, "n1", "gpu-4"),
        ClaimHolding("ml", "c", "main", "ml", "shared", DRA, "n1", "gpu-4"),
    ]
    writer = Writer(pods)
    agent, registry, _ = agent_with(kubelet, pods, writer, [0.0])
    agent.poll()
    assert agent.observation.dra == {
        f"{DRA}/n1/gpu-3": holdings.DeviceHolders(DRA, ("ml/a",), ("ml/a-gpu",)),
        f"{DRA}/n1/gpu-4": holdings.DeviceHolders(DRA, ("ml/b", "ml/c"), ("ml/shared",)),
    }
    assert 'gpuguard_node_agent_dra_devices{driver="gpu.example.com"} 2' in registry.render()
    assert writer.patches == []
    kubelet.broken = True
    agent.poll()
    assert agent.observation.dra == {}  # an unreadable kubelet says nothing of who holds what


def test_a_pod_holding_a_dra_device_its_driver_taints_gets_the_condition_until_the_taint_goes() -> None:
    kubelet, pods = Kubelet(), Pods(view("a"), view("b"), view("c"))
    kubelet.claimed = [
        ClaimHolding("ml", "b", "main", "ml", "b-gpu", DRA, "n1", "gpu-3"),
        ClaimHolding("ml", "c", "main", "ml", "c-gpu", DRA, "n1", "gpu-4"),
    ]
    xid = observed.Taint(f"{DRA}/xid", "79", "NoExecute")

    def publish(*taints: observed.Taint, generation: int = 1) -> observed.SliceFacts:
        devices = (
            observed.DraDevice(DRA, "n1", "gpu-3", "n1-gpus", taints),
            observed.DraDevice(DRA, "n1", "gpu-4"),
        )
        return observed.SliceFacts("n1-gpus", DRA, "n1", generation, 1, "n1", devices)

    slices = Slices(publish())
    slices.synced = False
    writer, clock = Writer(pods), [1000.0]
    agent, registry, _ = agent_with(kubelet, pods, writer, clock, slices)
    agent.poll()
    slices.synced = True
    slices.slices["n1-gpus"] = publish(xid, generation=2)
    agent.poll()
    assert writer.patches == []  # not yet confirmed
    clock[0] += 20
    agent.poll()
    ((_, name, patch),) = writer.patches
    assert name == "b"  # c's device is healthy: c is never touched
    (condition,) = patch["status"]["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "DeviceNotAllocatable")
    assert holdings.lost_devices(condition["message"]) == (
        holdings.LostDevice("main", "claim:b-gpu", f"{DRA}/n1/gpu-3"),
    )
    why = f"tainted by its driver ({DRA}/xid=79:NoExecute, ResourceSlice n1-gpus)"
    assert f'"why": "{why}"' in condition["message"]
    assert agent.observation.dra_failed == {f"{DRA}/n1/gpu-3": why}
    agent.poll()
    assert len(writer.patches) == 1  # said once

    slices.slices["n1-gpus"] = publish(observed.Taint(f"{DRA}/xid", "79", "None"), generation=3)
    agent.poll()  # an informational taint fails nothing: the device is healthy again
    assert [(p[1], p[2]["status"]["conditions"][0]["status"]) for p in writer.patches] == [
        ("b", "False"),
        ("b", "True"),
    ]
    assert registry.value("gpuguard_node_agent_condition_writes_total", "True", "written") == 1


def test_a_dra_report_stands_while_the_slices_are_not_known() -> None:
    kubelet, pods = Kubelet(), Pods(view("b"))
    kubelet.holdings, kubelet.offered = [], {}
    kubelet.claimed = [ClaimHolding("ml", "b", "main", "ml", "b-gpu", DRA, "n1", "gpu-3")]
    gone = observed.SliceFacts("n1-gpus", DRA, "n1", 2, 1, "n1", ())
    slices = Slices(gone)
    writer = Writer(pods)
    agent, _, _ = agent_with(kubelet, pods, writer, [0.0], slices)
    agent.options = Options(node="n1", confirm_seconds=0)
    agent.poll()
    assert [p[2]["status"]["conditions"][0]["status"] for p in writer.patches] == ["False"]
    assert "gone from pool n1" in writer.patches[0][2]["status"]["conditions"][0]["message"]
    slices.slices = {}  # the driver publishes nothing: restarting, or gone
    agent.poll()
    slices.synced = False
    agent.poll()
    assert len(writer.patches) == 1  # b keeps its report


@dataclass
class Rig:
    """One agent polling a scripted kubelet, writing to scripted pods, on a fake clock."""

    kubelet: Kubelet
    pods: Pods
    writer: Writer
    clock: list[float]
    agent: NodeAgent
    registry: Registry
    sent: list[str]

    def poll(self, times: int = 1, *, every: float = 0.0) -> None:
        for _ in range(times):
            self.agent.poll()
            self.clock[0] += every

    def written(self) -> list[tuple[str, str]]:
        """(pod, condition status) of each write, in order."""
        return [(name, patch["status"]["conditions"][0]["status"]) for _, name, patch in self.writer.patches]


def rig(*names: str) -> Rig:
    kubelet, pods = Kubelet(), Pods(*(view(name) for name in names))
    writer = Writer(pods)
    clock = [1000.0]
    agent, registry, sent = agent_with(kubelet, pods, writer, clock)
    return Rig(kubelet, pods, writer, clock, agent, registry, sent)


def test_a_device_plugin_restart_renaming_every_device_writes_nothing() -> None:
    node = rig("a", "b")
    node.poll()
    # The device plugin comes back with a time-slicing config: every ID renamed, the pods keep theirs.
    node.kubelet.offered = {GPU: frozenset(f"gpu-{gpu}::{n}" for gpu in range(2) for n in range(4))}
    node.poll(10, every=10)
    assert (node.written(), node.sent) == ([], [])
    assert node.registry.value("gpuguard_node_agent_reregistrations_total", GPU) == 1
    assert 'gpuguard_node_agent_lost_devices{resource="nvidia.com/gpu"}' not in node.registry.render()
    # A replica of the renamed set that fails later is reported as before.
    node.kubelet.holdings.append(held("c", "gpu-1::2"))
    node.pods.pods["ml/c"] = view("c")
    node.kubelet.offered = {GPU: node.kubelet.offered[GPU] - {"gpu-1::2"}}
    node.poll(2, every=20)
    assert node.written() == [("c", "False")]


def test_a_report_survives_a_renaming_while_its_device_stays_away() -> None:
    node = rig("a", "b")
    node.poll()
    node.kubelet.offered = {GPU: frozenset({"gpu-0"})}
    node.poll(2, every=20)
    assert node.written() == [("b", "False")]
    node.kubelet.offered = {GPU: frozenset({"gpu-0::0", "gpu-0::1"})}
    node.poll(3, every=20)
    assert node.written() == [("b", "False")]  # b's report stands: it was never undone


def test_the_transition_time_moves_only_with_the_status() -> None:
    node = rig("a")
    node.kubelet.holdings = [held("a", "gpu-0", "gpu-1")]
    node.kubelet.offered = {GPU: frozenset({"gpu-0", "gpu-1", "gpu-2", "gpu-3"})}
    node.poll()
    for remaining in ({"gpu-0", "gpu-2", "gpu-3"}, {"gpu-2", "gpu-3"}, {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}):
        node.kubelet.offered = {GPU: frozenset(remaining)}
        node.poll(2, every=20)
    written = [p[2]["status"]["conditions"][0] for p in node.writer.patches]
    assert [(c["status"], len(holdings.lost_devices(c["message"]))) for c in written] == [
        ("False", 1),
        ("False", 2),  # another device of the same pod: the message changes, the status does not
        ("True", 0),
    ]
    assert ["lastTransitionTime" in c for c in written] == [True, False, True]
    assert all("lastProbeTime" in c for c in written)


# --- the process's pods informer (processes/node_agent.py) ---------------------------------------------


def test_the_pods_informer_keeps_each_pod_by_namespace_and_name_with_the_agents_condition() -> None:
    raw = {
        "metadata": {"name": "train-0", "namespace": "ml", "uid": "u-1", "resourceVersion": "7"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": holdings.CONDITION_TYPE, "status": "False", "reason": "DeviceLost", "message": "m"},
            ]
        },
    }
    assert node_agent._pod(raw) == (
        "ml/train-0",
        PodView("ml", "train-0", "u-1", "7", Condition("False", "DeviceLost", "m")),
    )


@pytest.mark.parametrize(
    "raw",
    [{"metadata": {"name": "no-namespace"}}, {"metadata": "x"}, {}],
    ids=["no-namespace", "bad-metadata", "empty"],
)
def test_the_pods_informer_leaves_out_what_is_not_a_pod_it_can_write(raw: dict[str, Any]) -> None:
    assert node_agent._pod(raw) is None

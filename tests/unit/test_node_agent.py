"""The node agent: reading the PodResources API's protobuf answers, deciding which pods hold lost
devices, and writing only the condition differences (the kubelet itself is in tests/node)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import pytest

from webhook.agent.nodeagent import NodeAgent, Options
from webhook.agent.podresources import WireError, decode_allocatable, decode_list, fields
from webhook.kube.events import EventRecorder
from webhook.kube.remediation import ConflictError
from webhook.metrics import Registry
from webhook.policy import health, holdings
from webhook.policy.holdings import Condition, Holding, PodView

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


def test_loss_keeps_only_the_devices_no_longer_allocatable() -> None:
    loss = holdings.loss(
        [held("a", "gpu-0", "gpu-1"), held("b", "gpu-2")], {GPU: frozenset({"gpu-0", "gpu-2"})}
    )
    assert loss.lost == (held("a", "gpu-1"),)
    assert loss.unregistered == ()


def test_a_resource_with_nothing_allocatable_names_no_pod() -> None:
    # A device plugin restarting offers nothing for a moment: no single device is known to have failed.
    loss = holdings.loss([held("a", "gpu-0")], {})
    assert loss == holdings.Loss((), (GPU,))


def test_the_condition_message_round_trips() -> None:
    condition = holdings.lost_condition(
        [held("a", "gpu-1", "gpu-0"), held("a", "gpu-3", container_name="init")]
    )
    assert condition == Condition(
        "False",
        "DeviceNotAllocatable",
        "nvidia.com/gpu gpu-0,gpu-1 (container main); nvidia.com/gpu gpu-3 (container init)",
    )
    assert holdings.lost_devices(condition.message) == (
        holdings.LostDevice("main", GPU, "gpu-0"),
        holdings.LostDevice("main", GPU, "gpu-1"),
        holdings.LostDevice("init", GPU, "gpu-3"),
    )
    assert holdings.lost_devices("written by hand") == ()


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
    facts = health.pod_facts(raw)
    assert facts is not None
    assert facts.devices == (health.DeviceHealth("main", GPU, "gpu-1", "Unhealthy"),)
    raw["status"]["conditions"][0].update(status="True", message=holdings.RESTORED.message)
    restored = health.pod_facts(raw)
    assert restored is not None and restored.devices == ()


# --- one poll, with the kubelet and the API server played by plain objects --------------------------


class Kubelet:
    def __init__(self) -> None:
        self.holdings = [held("a", "gpu-0"), held("b", "gpu-1")]
        self.offered = {GPU: frozenset({"gpu-0", "gpu-1"})}
        self.broken = False

    def held(self) -> list[Holding]:
        if self.broken:
            raise ConnectionError("socket gone")
        return list(self.holdings)

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
        self.pods.pods[key] = PodView(
            old.namespace,
            old.name,
            old.uid,
            "8",
            Condition(written["status"], written["reason"], written["message"]),
        )
        return {}


def agent_with(
    kubelet: Kubelet, pods: Pods, writer: Writer, clock: list[float]
) -> tuple[NodeAgent, Registry, list[str]]:
    sent: list[str] = []
    registry = Registry()
    events = EventRecorder(lambda namespace, body: sent.append(body["reason"]), stop=threading.Event())
    agent = NodeAgent(
        Options(node="n1", confirm_seconds=20),
        resources=kubelet,
        pods=pods,
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
    assert condition["message"] == "nvidia.com/gpu gpu-1 (container main)"
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
    kubelet.broken = True
    agent.poll()
    assert registry.value("gpuguard_node_agent_polls_total", "error") == 1
    kubelet.broken, kubelet.offered = False, {GPU: frozenset({"gpu-0"})}
    agent.poll()  # first seen
    writer.conflict = True
    agent.options = Options(node="n1", confirm_seconds=0)
    agent.poll()
    assert writer.patches == []
    assert registry.value("gpuguard_node_agent_condition_writes_total", "False", "conflict") == 1
    writer.conflict = False
    agent.poll()  # the next poll decides again, on what the cache holds
    assert [p[1] for p in writer.patches] == ["b"]

"""What `gpuguard nodes` prints: the report's verdicts in the command's table, from listed facts."""

from __future__ import annotations

import datetime

from tests.harness.manifests import make_policy
from tests.unit.policy.test_health import pod, raw_node
from webhook.cli import nodes as cli_nodes
from webhook.controllers import status
from webhook.controllers.breaker import BreakerState
from webhook.policy.health import observed, records

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
POLICY = make_policy({"health": {"mode": "enforce", "budget": {"maxUnhealthy": 1}}})


def facts(name: str, **kwargs: object) -> observed.NodeFacts:
    node = observed.node_facts(raw_node(name, labels={"karpenter.sh/nodepool": "a100"}, **kwargs))  # type: ignore[arg-type]
    assert node is not None
    return node


def test_the_table_shows_devices_signals_state_and_the_budget_hold() -> None:
    five_minutes = NOW - datetime.timedelta(minutes=5)
    acted = records.NodeRecord(
        signals={"deviceGap/nvidia.com/gpu": five_minutes},
        unhealthy_since=five_minutes,
        admitted_at=five_minutes,
        last_action="taint",
        last_action_at=NOW - datetime.timedelta(minutes=4),
    )
    waiting = records.NodeRecord(
        signals={"deviceGap/nvidia.com/gpu": five_minutes}, unhealthy_since=five_minutes
    )
    cluster = status.Cluster(
        nodes=[
            facts(
                "gpu-001",
                allocatable=7,
                record=acted,
                taints=[{"key": observed.TAINT_KEY, "effect": "NoSchedule"}],
            ),
            facts("gpu-002", allocatable=6, record=waiting),
            facts("gpu-003"),
            facts("cpu-001", capacity=None, allocatable=None),
        ],
        pods=[pod(node_name="gpu-001")],
        breaker=BreakerState(),
    )
    text = cli_nodes.health_table(status.plans(cluster, POLICY, NOW), cluster.breaker, NOW)
    lines = text.splitlines()
    assert lines[0].split() == ["NODE", "POOL", "DEVICES", "SIGNALS", "STATE", "LAST", "ACTION", "SINCE"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:4]}
    assert rows["gpu-001"] == [
        "a100",
        "nvidia.com/gpu=7/8",
        "deviceGap",
        "unhealthy",
        "taint",
        "4m",
        "ago",
        "5m",
    ]
    assert rows["gpu-002"][3] == "unhealthy,held"
    assert rows["gpu-003"][2:4] == ["<none>", "healthy"]
    assert "cpu-001" not in text
    assert lines[-1] == "circuit breaker: closed"


def test_explain_says_why_a_node_is_held_and_what_comes_next() -> None:
    cluster = status.Cluster(
        nodes=[facts("gpu-002", allocatable=7)],
        pods=[],
        breaker=BreakerState(True, NOW, "3 of 4 nodes due", None, ""),
    )
    (row,) = status.plans(cluster, POLICY, NOW)
    text = cli_nodes.explain(row, POLICY, cluster.breaker, NOW)
    assert "deviceGap/nvidia.com/gpu: nvidia.com/gpu: 1 of 8 devices unhealthy" in text
    assert "due in 5m" in text
    assert "Modes:       condition enforce, taint enforce, drain enforce, evict enforce" in text
    assert text.rstrip().endswith("(gpuguard nodes reset-breaker)")


def test_an_escalated_node_says_so_and_how_to_acknowledge_it() -> None:
    episode = NOW - datetime.timedelta(hours=2)
    record = records.NodeRecord(
        unhealthy_since=episode,
        admitted_at=episode,
        clear_since=NOW - datetime.timedelta(hours=1),
        expected={"nvidia.com/gpu": 8},
        remediations=(NOW - datetime.timedelta(days=1),),
    )
    tainted = [{"key": observed.TAINT_KEY, "effect": "NoSchedule"}]
    cluster = status.Cluster(
        nodes=[facts("gpu-004", record=record, taints=tainted)], pods=[], breaker=BreakerState()
    )
    (row,) = status.plans(cluster, POLICY, NOW)
    assert (
        cli_nodes.health_table([row], cluster.breaker, NOW).splitlines()[1].split()[4]
        == "recovering,escalated"
    )
    text = cli_nodes.explain(row, POLICY, cluster.breaker, NOW)
    assert "expected devices: nvidia.com/gpu=8" in text and "remediated before: 1d ago" in text
    assert "Escalated:   remediated 2 times within 604800 s" in text and "gpuguard nodes ack gpu-004" in text


def test_acknowledging_a_node_annotates_it_with_the_time() -> None:
    class Patches:
        def __init__(self) -> None:
            self.sent: list[tuple[str, dict[str, object]]] = []

        def patch(self, name: str, patch: dict[str, object]) -> dict[str, object]:
            self.sent.append((name, patch))
            return {}

    nodes = Patches()
    moment = NOW + datetime.timedelta(seconds=0.5)
    assert status.acknowledge(nodes, "gpu-004", moment) == "2026-03-01T12:00:00.500000Z"
    assert nodes.sent == [
        ("gpu-004", {"metadata": {"annotations": {records.ACK_ANNOTATION: "2026-03-01T12:00:00.500000Z"}}})
    ]
    raw = raw_node("gpu-004")
    raw["metadata"]["annotations"] = {records.ACK_ANNOTATION: "2026-03-01T12:00:00.500000Z"}
    read = observed.node_facts(raw)
    assert read is not None and read.acknowledged_at == moment

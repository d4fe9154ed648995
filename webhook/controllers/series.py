"""The metric series the controllers keep, registered in one place so dashboards can rely on them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from webhook.runtime.metrics import LabelValues, Registry

REMEDIATIONS = "gpuguard_remediations_total"
RECONCILES = "gpuguard_controller_reconcile_total"
RECONCILE_SECONDS = "gpuguard_controller_reconcile_duration_seconds"
NATIVE_POLICY_WRITES = "gpuguard_native_policy_writes_total"
TIME_TO_ACT = "gpuguard_remediation_time_to_act_seconds"
# From seconds (a failure confirmed by correlated exits acts at once) to hours (a long signal wait, a
# node held by the budget until a place came free).
TIME_TO_ACT_BUCKETS = (
    1.0,
    5.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1800.0,
    3600.0,
    7200.0,
    21600.0,
)


def register(
    registry: Registry,
    *,
    node_health: Callable[[], Iterable[LabelValues]],
    breaker_open: Callable[[], bool],
    held_nodes: Callable[[], int],
    queue_depths: Callable[[], Iterable[tuple[str, int]]],
    leader: Callable[[], bool],
) -> None:
    registry.counter(
        REMEDIATIONS,
        "Remediation steps by action (condition, taint, drain, recover, cancel, evict) and outcome"
        " (done, would, held, blocked, stuck, failed).",
        ("action", "outcome"),
    )
    registry.counter(RECONCILES, "Reconciles by controller and result.", ("controller", "result"))
    registry.histogram(RECONCILE_SECONDS, "Time one reconcile took.", ("controller",))
    registry.counter(
        NATIVE_POLICY_WRITES,
        "Writes of gpuguard's own native admission policies and bindings (admission.mode), by verb"
        " (create, update, delete), and of its webhooks' match condition (narrow, widen).",
        ("verb",),
    )
    registry.histogram(
        TIME_TO_ACT,
        "Seconds from gpuguard's first sight of a node's failure signals to each step done on it: its"
        " condition written, its taint written, a pod evicted, the node drained.",
        ("step",),
        TIME_TO_ACT_BUCKETS,
    )
    registry.gauge(
        "gpuguard_node_device_health",
        "1 for each accelerator node, labelled with its pool and state (healthy, suspect, unhealthy, recovering).",
        ("node", "pool", "state"),
        lambda: [(labels, 1.0) for labels in node_health()],
    )
    registry.gauge(
        "gpuguard_circuit_breaker_open",
        "1 while the circuit breaker is open: nothing new is tainted, drained or evicted.",
        (),
        lambda: [((), 1.0 if breaker_open() else 0.0)],
    )
    registry.gauge(
        "gpuguard_remediation_held_nodes",
        "Nodes due for remediation that gpuguard holds back (budget, breaker, someone else's cordon).",
        (),
        lambda: [((), float(held_nodes()))],
    )
    registry.gauge(
        "gpuguard_workqueue_depth",
        "Keys waiting for a worker, by controller.",
        ("controller",),
        lambda: [((name,), float(depth)) for name, depth in queue_depths()],
    )
    registry.gauge(
        "gpuguard_leader_election_master_status",
        "1 on the replica that holds the controllers' Lease, 0 on a standby.",
        (),
        lambda: [((), 1.0 if leader() else 0.0)],
    )

"""The node health controller on DRA nodes, wired as the manager wires it: ResourceSlices and claims
from their informers joined to the Node, in whichever order they arrive."""

from __future__ import annotations

from webhook.policy import health

from .builders import make_policy
from .test_health import raw_node
from .test_health_dra import DRIVER, raw_claim, raw_slice, tainted
from .wired import Wired

ENFORCE = make_policy(
    {
        "health": {
            "mode": "enforce",
            "signals": {
                "deviceTaints": {"keys": [], "forSeconds": 0},
                "claimDeviceConditions": [{"type": "Healthy", "status": "False", "forSeconds": 0}],
            },
        }
    }
)


def dra_node(name: str = "gpu-1") -> dict[str, object]:
    """A Node with no extended resource and no accelerator label: only its slices say it has GPUs."""
    return raw_node(name, capacity=None, allocatable=None, labels={"karpenter.sh/nodepool": "h100"})


def test_a_driver_taint_in_a_slice_marks_its_node_which_counts_in_its_pool() -> None:
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice(taints=tainted(3))])
    assert wired.ledger.pool_size("h100") == 1
    wired.node_health.reconcile("gpu-1")
    (kind, status), (node_kind, _) = wired.writes.calls
    (condition,) = status["status"]["conditions"]
    assert (kind, node_kind, condition["status"]) == ("status", "node", "False")
    assert f"{DRIVER}: 1 of 8 devices tainted by their driver: {DRIVER}/gpu-1/gpu-3" in condition["message"]


def test_a_slice_that_arrives_after_its_node_brings_the_node_into_its_pool_and_back_to_the_queue() -> None:
    wired = Wired(ENFORCE, [dra_node()])
    assert wired.ledger.pool_size("h100") == 0
    queue = wired.node_health.controller.queue
    assert queue.get(timeout=0) == "gpu-1"  # the node's first sighting
    queue.done("gpu-1")
    assert queue.get(timeout=0) is None
    wired.list_slices(raw_slice(taints=tainted(3)))
    assert wired.ledger.pool_size("h100") == 1
    assert queue.get(timeout=0) == "gpu-1"
    wired.list_slices()
    assert wired.ledger.pool_size("h100") == 0


def test_a_claim_condition_reaches_the_node_publishing_its_device() -> None:
    condition = {"type": "Healthy", "status": "False", "reason": "XID79"}
    wired = Wired(ENFORCE, [dra_node()], slices=[raw_slice()], claims=[raw_claim(conditions=[condition])])
    wired.node_health.reconcile("gpu-1")
    (_, status), _ = wired.writes.calls
    assert f"{DRIVER}/gpu-1/gpu-3 (XID79)" in status["status"]["conditions"][0]["message"]
    assert status["status"]["conditions"][0]["type"] == health.CONDITION_TYPE

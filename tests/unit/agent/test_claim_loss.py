"""Which DRA devices the pods on a node hold have failed, from the node's ResourceSlices (claimloss)."""

from __future__ import annotations

from webhook.agent.nodeagent import ANY_DEVICE_TAINT
from webhook.policy.health import holdings
from webhook.policy.health.claimloss import claim_loss
from webhook.policy.health.holdings import ClaimHolding, Holding, PodView
from webhook.policy.health.observed import DraDevice, SliceFacts, Taint
from webhook.policy.model_health import DeviceTaintSignal

DRIVER = "gpu.example.com"
XID = Taint("gpu.example.com/xid", "79", "NoExecute")


def device(name: str, *taints: Taint) -> DraDevice:
    return DraDevice(DRIVER, "n1", name, "n1-gpus", taints)


def published(*devices: DraDevice, generation: int = 1, slice_count: int = 1) -> SliceFacts:
    return SliceFacts(f"n1-gpus-{generation}", DRIVER, "n1", generation, slice_count, "n1", devices)


def holds(pod: str, name: str, claim: str = "") -> ClaimHolding:
    return ClaimHolding("ml", pod, "main", "ml", claim or f"{pod}-gpu", DRIVER, "n1", name)


def lost(pod: str, name: str, claim: str = "") -> Holding:
    return Holding("ml", pod, "main", f"claim:{claim or f'{pod}-gpu'}", frozenset({f"{DRIVER}/n1/{name}"}))


def test_a_device_its_driver_taints_is_lost_by_every_pod_holding_it_and_says_why() -> None:
    found = claim_loss(
        [holds("a", "gpu-0"), holds("b", "gpu-1"), holds("c", "gpu-1", "shared")],
        [published(device("gpu-0"), device("gpu-1", XID))],
        {},
        ANY_DEVICE_TAINT,
    )
    assert found.lost == (lost("b", "gpu-1"), lost("c", "gpu-1", "shared"))  # a's healthy device: nothing
    assert found.why == {
        f"{DRIVER}/n1/gpu-1": "tainted by its driver (gpu.example.com/xid=79:NoExecute, ResourceSlice n1-gpus)"
    }
    assert found.unsure == frozenset()


def test_an_informational_taint_or_one_the_policy_does_not_name_fails_nothing() -> None:
    note = Taint("gpu.example.com/ecc-corrected", "", "None")
    claims = [holds("a", "gpu-0"), holds("b", "gpu-1")]
    pods: dict[str, PodView] = {}
    slices = [published(device("gpu-0", note), device("gpu-1", XID))]
    assert claim_loss(claims, slices, pods, ANY_DEVICE_TAINT).lost == (lost("b", "gpu-1"),)
    other_keys = DeviceTaintSignal(keys=["gpu.example.com/thermal"], forSeconds=0)
    assert claim_loss(claims, slices, pods, other_keys).lost == ()
    # gpuguard's own key is never a device's failure: it is what gpuguard does about one.
    own = Taint("gpuguard.io/device-unhealthy", "", "NoExecute")
    assert claim_loss(claims[:1], [published(device("gpu-0", own))], pods, ANY_DEVICE_TAINT).lost == ()


def test_a_device_gone_from_its_pools_newest_generation_is_lost() -> None:
    slices = [published(device("gpu-0"), device("gpu-1")), published(device("gpu-0"), generation=2)]
    found = claim_loss([holds("a", "gpu-0"), holds("b", "gpu-1")], slices, {}, ANY_DEVICE_TAINT)
    assert found.lost == (lost("b", "gpu-1"),)
    assert found.why == {f"{DRIVER}/n1/gpu-1": f"gone from pool n1 of driver {DRIVER}"}


def test_a_pool_not_known_in_full_fails_nothing_and_its_holders_keep_what_they_say() -> None:
    claims = [holds("a", "gpu-0"), holds("b", "gpu-1")]
    # Generation 2 is published in two slices, one of them not yet: the pool is being rewritten.
    updating = [
        published(device("gpu-0"), device("gpu-1")),
        published(device("gpu-0"), generation=2, slice_count=2),
    ]
    for slices in (updating, []):  # or the driver publishes nothing (restarting, or gone)
        found = claim_loss(claims, slices, {}, ANY_DEVICE_TAINT)
        assert (found.lost, found.unsure) == ((), frozenset({"ml/a", "ml/b"}))


def test_a_recovered_device_is_lost_no_more() -> None:
    claims = [holds("a", "gpu-0")]
    assert claim_loss(claims, [published(device("gpu-0", XID))], {}, ANY_DEVICE_TAINT).lost
    found = claim_loss(claims, [published(device("gpu-0"), generation=2)], {}, ANY_DEVICE_TAINT)
    assert (found.lost, found.why, found.unsure) == ((), {}, frozenset())


def test_the_lost_claim_is_named_as_the_pod_names_it() -> None:
    raw = {
        "metadata": {"name": "a", "namespace": "ml", "uid": "u", "resourceVersion": "3"},
        "spec": {"resourceClaims": [{"name": "shared", "resourceClaimName": "team-gpus"}]},
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "a-gpu-x7k2p"}]},
    }
    pod = holdings.pod_view(raw)
    assert pod is not None and pod.claims == (("a-gpu-x7k2p", "gpu"), ("team-gpus", "shared"))
    claims = [holds("a", "gpu-0", "a-gpu-x7k2p"), holds("a", "gpu-1", "team-gpus")]
    slices = [published(device("gpu-0", XID), device("gpu-1", XID))]
    found = claim_loss(claims, slices, {"ml/a": pod}, ANY_DEVICE_TAINT)
    assert found.lost == (lost("a", "gpu-0", "gpu"), lost("a", "gpu-1", "shared"))


def test_the_condition_names_the_device_and_why_and_reads_back_as_the_watcher_reads_it() -> None:
    found = claim_loss([holds("a", "gpu-0")], [published(device("gpu-0", XID))], {}, ANY_DEVICE_TAINT)
    condition = holdings.lost_condition(found.lost, found.why)
    assert condition.message == (
        '[{"resource": "claim:a-gpu", "container": "main", "devices": ["gpu.example.com/n1/gpu-0"],'
        ' "why": "tainted by its driver (gpu.example.com/xid=79:NoExecute, ResourceSlice n1-gpus)"}]'
    )
    assert holdings.lost_devices(condition.message) == (
        holdings.LostDevice("main", "claim:a-gpu", f"{DRIVER}/n1/gpu-0"),
    )
    pod = PodView("ml", "a", "u", "3", condition)
    assert holdings.reported_devices([pod]) == {("ml/a", "main", "claim:a-gpu", f"{DRIVER}/n1/gpu-0")}

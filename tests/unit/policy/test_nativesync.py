"""`admission.mode` and what the controllers' leader keeps for it: the objects each mode wants and the
writes from what gpuguard owns to them (pure; the writes on a real API server are tests/e2e/test_hybrid.py's)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any

import jsonpatch
import pytest
from kubernetes.client import ApiClient

from tests.harness.manifests import gpu_pod, job, make_policy, pod
from tests.harness.wired import Listed, registry
from tests.unit.policy.test_nativenarrow import MUTATING, VALIDATING, configuration
from webhook.controllers.nativesync import KEY, NativePolicies, owned_informers
from webhook.kube.controller import TerminalError
from webhook.kube.remediation import Fence, InvalidObjectError, NativePolicyWriter, NotLeaderError
from webhook.policy import engine
from webhook.policy.model import Policy, PolicyError, default_policy, parse_policy
from webhook.policy.native import Compiled, compile_policy
from webhook.policy.nativecel import MANAGED_BY
from webhook.policy.nativenarrow import CONDITION_NAME, CONFIGURATION_KINDS, configuration_patch, narrowing
from webhook.policy.nativesync import (
    HASH_ANNOTATION,
    OWNER,
    OWNER_LABEL,
    RESOURCES,
    Owned,
    failing_closed,
    holds,
    namespace_owner,
    owned,
    plan,
    wanted,
)
from webhook.policy.workload import JSON

NAMESPACE = namespace_owner("gpuguard", "6c1f0e4e-uid")


def _wanted(policy: Policy, compile: Callable[[Policy], Compiled] = compile_policy) -> list[JSON]:
    return wanted(policy, NAMESPACE, compile)


def _stored(obj: JSON, resource_version: str = "1") -> JSON:
    """`obj` as the API server lists it: defaults filled in, a resourceVersion."""
    stored = copy.deepcopy(obj)
    stored["metadata"]["resourceVersion"] = resource_version
    stored["metadata"]["uid"] = "u-" + obj["metadata"]["name"]
    stored["spec"].setdefault("matchPolicy", "Equivalent")
    return stored


def _have(objects: list[JSON]) -> list[Owned]:
    found = [owned(_stored(obj)) for obj in objects]
    return [o for o in found if o is not None]


def test_the_default_policy_runs_admission_in_the_webhook_and_the_mode_is_validated() -> None:
    assert default_policy().admission.mode == "webhook"
    for mode in ("webhook", "native", "hybrid"):
        assert make_policy({"admission": {"mode": mode}}).admission.mode == mode
    with pytest.raises(PolicyError, match=r"admission\.mode"):
        parse_policy("admission: {mode: both}")
    with pytest.raises(PolicyError, match="admission"):
        parse_policy("admission: {mod: hybrid}")


def test_the_mode_changes_the_policy_hash_and_nothing_the_webhook_decides() -> None:
    webhook, hybrid = make_policy({}), make_policy({"admission": {"mode": "hybrid"}})
    assert webhook.hash != hybrid.hash
    assert webhook.rules == hybrid.rules and webhook.namespaces == hybrid.namespaces


@pytest.mark.parametrize("mode", ["native", "hybrid"])
def test_the_engine_answers_the_same_in_every_mode_but_for_the_policy_hash_it_writes(mode: str) -> None:
    webhook, other = make_policy({}), make_policy({"admission": {"mode": mode}})
    outcomes: set[str] = set()
    for obj in (gpu_pod(), job(), pod(nodeSelector={"nvidia.com/gpu.present": "true"})):
        for run in (engine.mutate, engine.validate):
            first, second = run(copy.deepcopy(obj), webhook), run(copy.deepcopy(obj), other)
            assert first.decisions == second.decisions
            assert json.dumps(first.obj).replace(webhook.hash, other.hash) == json.dumps(second.obj)
            outcomes |= {d.outcome for d in first.decisions}
    assert {"applied", "denied"} <= outcomes


def test_webhook_mode_wants_nothing_and_hybrid_and_native_want_every_compiled_object_marked_as_owned() -> (
    None
):
    assert _wanted(make_policy({})) == []
    for mode in ("hybrid", "native"):
        policy = make_policy({"admission": {"mode": mode}})
        objects = _wanted(policy)
        compiled = compile_policy(policy).objects
        assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
            (o["kind"], o["metadata"]["name"]) for o in compiled
        ]
        for obj, plain in zip(objects, compiled, strict=True):
            assert obj["metadata"]["labels"] == {**MANAGED_BY, OWNER_LABEL: OWNER}
            # Uninstalling (the Namespace deleted) takes them too, through the garbage collector.
            assert obj["metadata"]["ownerReferences"] == [
                {"apiVersion": "v1", "kind": "Namespace", "name": "gpuguard", "uid": "6c1f0e4e-uid"}
            ]
            assert obj["spec"] == plain["spec"]
            assert OWNER_LABEL not in plain["metadata"]["labels"]  # compile's own output is not marked


def test_the_kill_switch_wants_no_native_object_in_any_mode() -> None:
    assert _wanted(make_policy({"enabled": False, "admission": {"mode": "hybrid"}})) == []


def test_a_policy_that_does_not_compile_raises_for_the_caller_to_keep_what_it_has() -> None:
    def broken(_: object) -> object:
        raise ValueError("no CEL for this")

    with pytest.raises(ValueError, match="no CEL"):
        _wanted(make_policy({"admission": {"mode": "hybrid"}}), broken)  # type: ignore[arg-type]


def test_the_hash_names_what_the_policy_says_and_changes_with_it() -> None:
    first = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    again = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    changed = _wanted(
        make_policy(
            {"admission": {"mode": "hybrid"}, "rules": {"gracefulTermination": {"marginSeconds": 25}}}
        )
    )
    hashes = [
        {o["metadata"]["name"]: o["metadata"]["annotations"][HASH_ANNOTATION] for o in objs}
        for objs in (first, again, changed)
    ]
    assert hashes[0] == hashes[1]
    assert hashes[0]["gpuguard-mutations"] != hashes[2]["gpuguard-mutations"]


def test_a_namespace_made_again_gets_every_object_owned_by_the_new_one() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    before = _wanted(policy)
    after = wanted(policy, namespace_owner("gpuguard", "another-uid"))
    assert [w.verb for w in plan(after, _have(before))] == ["update"] * len(before)


def test_from_nothing_every_object_is_created_policies_before_bindings() -> None:
    want = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    writes = plan(want, [])
    assert [w.verb for w in writes] == ["create"] * len(want)
    kinds = [w.kind for w in writes]
    last_policy = max(i for i, k in enumerate(kinds) if not k.endswith("Binding"))
    first_binding = min(i for i, k in enumerate(kinds) if k.endswith("Binding"))
    assert last_policy < first_binding
    assert {w.name for w in writes} == {o["metadata"]["name"] for o in want}


def test_what_the_cluster_holds_already_gets_no_write_though_the_server_filled_in_defaults() -> None:
    want = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    assert plan(want, _have(want)) == []


def test_an_owned_object_someone_edited_is_written_back() -> None:
    want = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    stored = [_stored(o) for o in want]
    binding = next(o for o in stored if o["kind"] == "ValidatingAdmissionPolicyBinding")
    binding["spec"]["validationActions"] = ["Warn"]
    have = [o for o in (owned(obj) for obj in stored) if o is not None]
    writes = plan(want, have)
    assert [(w.verb, w.kind, w.name) for w in writes] == [
        ("update", binding["kind"], binding["metadata"]["name"])
    ]


def test_what_was_sent_holds_in_what_the_server_stored_with_its_defaults_and_not_after_an_edit() -> None:
    sent = {"spec": {"rules": [{"a": 1}], "actions": ["Deny"]}, "metadata": {"labels": {"x": "1"}}}
    labels = {"labels": {"x": "1", "other": "2"}}
    spec: JSON = {"rules": [{"a": 1, "scope": "*"}], "actions": ["Deny"], "matchPolicy": "Equivalent"}
    assert holds({"spec": spec, "metadata": labels}, sent)
    assert not holds({"spec": {**spec, "actions": ["Warn"]}, "metadata": labels}, sent)
    assert not holds({"spec": {**spec, "rules": [{"a": 1}, {"a": 2}]}, "metadata": labels}, sent)
    assert not holds({"metadata": labels}, sent)


def test_a_policy_change_updates_what_changed_at_the_version_read_and_deletes_what_is_no_longer_wanted() -> (
    None
):
    before = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    # gracefulTermination changes (the mutating rules' MAP); trustedDeviceSoftware goes off everywhere (its
    # VAP and bindings go).
    after = _wanted(
        make_policy(
            {
                "admission": {"mode": "hybrid"},
                "rules": {
                    "gracefulTermination": {"marginSeconds": 25},
                    "trustedDeviceSoftware": {"mode": "off"},
                },
            }
        )
    )
    writes = plan(after, _have(before))
    updates = {w.name: w for w in writes if w.verb == "update"}
    assert set(updates) == {"gpuguard-mutations"}
    update = updates["gpuguard-mutations"]
    assert update.resource_version == "1" and update.body is not None
    assert update.body["metadata"]["resourceVersion"] == "1"
    deletes = [(w.kind, w.name) for w in writes if w.verb == "delete"]
    assert deletes == [
        ("ValidatingAdmissionPolicyBinding", "gpuguard-trusted-device-software-0"),
        ("ValidatingAdmissionPolicyBinding", "gpuguard-trusted-device-software-1"),
        ("ValidatingAdmissionPolicy", "gpuguard-trusted-device-software"),
    ]
    assert all(w.resource_version == "1" for w in writes if w.verb == "delete")
    assert not [w for w in writes if w.verb == "create"]


def test_switching_back_to_webhook_deletes_every_owned_object_bindings_first() -> None:
    before = _wanted(make_policy({"admission": {"mode": "hybrid"}}))
    writes = plan(_wanted(make_policy({})), _have(before))
    assert {w.verb for w in writes} == {"delete"}
    assert len(writes) == len(before)
    kinds = [w.kind for w in writes]
    assert max(i for i, k in enumerate(kinds) if k.endswith("Binding")) < min(
        i for i, k in enumerate(kinds) if not k.endswith("Binding")
    )


def test_objects_without_the_owner_label_are_never_taken_for_gpuguards() -> None:
    # What `gpuguard policy compile | kubectl apply` leaves: managed-by gpuguard, but the operator's.
    applied_by_hand = _stored(compile_policy(make_policy({})).objects[0])
    assert owned(applied_by_hand) is None
    assert owned({"kind": "ConfigMap", "metadata": {"labels": {OWNER_LABEL: OWNER}}}) is None
    mine = owned(_stored(_wanted(make_policy({"admission": {"mode": "native"}}))[0], "42"))
    assert mine is not None and mine.resource_version == "42" and mine.hash


def _failing(kind: str, *choices: str) -> JSON:
    """A webhook configuration of `kind` whose webhooks fail as `choices` say, in order."""
    stored = configuration(kind)
    stored["webhooks"] = [
        {**stored["webhooks"][0], "name": f"{n}.gpuguard.io", "failurePolicy": choice}
        for n, choice in enumerate(choices)
    ]
    return stored


DEPLOYED = {MUTATING: _failing(MUTATING, "Ignore"), VALIDATING: _failing(VALIDATING, "Ignore", "Ignore")}
# deploy/fail-closed/: each configuration's first webhook; the device-software one for kube-system stays Ignore.
FAIL_CLOSED = {MUTATING: _failing(MUTATING, "Fail"), VALIDATING: _failing(VALIDATING, "Fail", "Ignore")}


def test_each_kind_of_compiled_policy_fails_closed_where_a_webhook_it_stands_in_for_does() -> None:
    assert failing_closed({}) == failing_closed(dict.fromkeys(CONFIGURATION_KINDS)) == frozenset()
    assert failing_closed(DEPLOYED) == frozenset()
    assert failing_closed(FAIL_CLOSED) == {"MutatingAdmissionPolicy", "ValidatingAdmissionPolicy"}
    assert failing_closed({**DEPLOYED, VALIDATING: FAIL_CLOSED[VALIDATING]}) == {"ValidatingAdmissionPolicy"}


def test_a_policy_failing_closed_is_another_object_and_its_bindings_are_the_same() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    open_, closed = _wanted(policy), wanted(policy, NAMESPACE, closed=frozenset({"MutatingAdmissionPolicy"}))
    for before, after in zip(open_, closed, strict=True):
        if after["kind"] == "MutatingAdmissionPolicy":
            assert (before["spec"]["failurePolicy"], after["spec"]["failurePolicy"]) == ("Ignore", "Fail")
            assert (
                after["metadata"]["annotations"][HASH_ANNOTATION]
                != before["metadata"]["annotations"][HASH_ANNOTATION]
            )
        else:
            assert after == before
    # So the leader rewrites exactly the MAPs when the operator makes the mutating webhook fail closed.
    writes = plan(closed, _have(open_))
    assert writes and {(w.verb, w.kind) for w in writes} == {("update", "MutatingAdmissionPolicy")}


# --- the leader's controller over real informers, its writes recorded -------------------------------


class RecordedNativeWrites:
    def __init__(self, refuse: str = "") -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.bodies: dict[str, JSON] = {}  # by name: what was last sent
        self.refuse = refuse

    def create(self, resource: str, body: dict[str, Any]) -> None:
        if body["metadata"]["name"] == self.refuse:
            raise InvalidObjectError(f"{self.refuse}: spec.variables[0].expression: compilation failed")
        self.calls.append(("create", resource, body["metadata"]["name"]))
        self.bodies[body["metadata"]["name"]] = body

    def replace(self, resource: str, name: str, body: dict[str, Any]) -> None:
        self.calls.append(("update", resource, name))
        self.bodies[name] = body

    def delete(self, resource: str, name: str, resource_version: str) -> None:
        self.calls.append(("delete", resource, name))


def _controller(
    policy: Policy, stored: list[JSON], writes: RecordedNativeWrites, **options: Any
) -> NativePolicies:
    def listed(resource: str) -> Listed:
        return Listed(*(o for o in stored if RESOURCES[o["kind"]] == resource))

    informers = owned_informers(listed, threading.Event())
    for informer in informers:
        assert informer.sync()
    return NativePolicies(
        owned=informers,
        policy=lambda: policy,
        writes=writes,
        owner=lambda: NAMESPACE,
        registry=registry(),
        stop=threading.Event(),
        **options,
    )


def test_the_leader_creates_what_hybrid_wants_and_then_has_nothing_left_to_write() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    writes = RecordedNativeWrites()
    _controller(policy, [], writes).reconcile(KEY)
    want = _wanted(policy)
    assert [(verb, name) for verb, _, name in writes.calls] == [(w.verb, w.name) for w in plan(want, [])]
    again = RecordedNativeWrites()
    _controller(policy, [_stored(o) for o in want], again).reconcile(KEY)
    assert again.calls == []


def test_the_leader_deletes_only_its_own_objects_when_the_mode_goes_back_to_webhook() -> None:
    mine = [_stored(o) for o in _wanted(make_policy({"admission": {"mode": "hybrid"}}))]
    by_hand = [_stored(o) for o in compile_policy(make_policy({})).objects]  # same names, not labelled
    writes = RecordedNativeWrites()
    _controller(make_policy({}), mine + by_hand, writes).reconcile(KEY)
    assert {verb for verb, _, _ in writes.calls} == {"delete"}
    assert len(writes.calls) == len(mine)


def test_a_policy_that_does_not_compile_keeps_the_objects_in_place() -> None:
    mine = [_stored(o) for o in _wanted(make_policy({"admission": {"mode": "hybrid"}}))]

    def broken(_: Policy) -> Compiled:
        raise ValueError("unbalanced braces")

    writes = RecordedNativeWrites()
    changed = make_policy(
        {"admission": {"mode": "hybrid"}, "rules": {"gracefulTermination": {"marginSeconds": 25}}}
    )
    controller = _controller(changed, mine, writes, compile=broken)
    controller.reconcile(KEY)
    assert writes.calls == []
    problem = controller.status()["problem"]
    assert isinstance(problem, str) and "does not compile" in problem and "unbalanced braces" in problem


def test_an_object_the_api_server_refuses_is_reported_and_the_others_are_still_written() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    writes = RecordedNativeWrites(refuse="gpuguard-mutations")
    controller = _controller(policy, [], writes)
    with pytest.raises(TerminalError, match="gpuguard-mutations"):
        controller.reconcile(KEY)
    assert len(writes.calls) == len(_wanted(policy)) - 1
    assert "refused MutatingAdmissionPolicy gpuguard-mutations" in str(controller.status()["problem"])
    # Once the server takes it, the problem is gone.
    writes.refuse = ""
    controller.reconcile(KEY)
    assert controller.status()["problem"] is None


def test_a_replica_that_may_not_lead_sends_no_write() -> None:
    writer = NativePolicyWriter(ApiClient(), Fence(lambda: 0.0))
    with pytest.raises(NotLeaderError):
        writer.create("validatingadmissionpolicies", {"metadata": {"name": "gpuguard-x"}})
    with pytest.raises(NotLeaderError):
        writer.delete("validatingadmissionpolicies", "gpuguard-x", "1")


# --- the webhooks narrowed: only once the native objects have settled, widened before they change ----


class RecordedWithConfigurations(RecordedNativeWrites):
    """Webhook configurations too, kept patched, their writes in the same log as the native objects'."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = {kind: configuration(kind) for kind in CONFIGURATION_KINDS}

    def read(self, kind: str) -> JSON | None:
        return copy.deepcopy(self.stored[kind])

    def patch(self, kind: str, operations: list[JSON]) -> None:
        self.stored[kind] = jsonpatch.apply_patch(self.stored[kind], operations)
        self.calls.append(("patch", kind, "gpuguard"))

    def conditions(self) -> list[str | None]:
        return [
            next((c["expression"] for c in w.get("matchConditions", []) if c["name"] == CONDITION_NAME), None)
            for stored in self.stored.values()
            for w in stored["webhooks"]
        ]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _narrowing(
    policy: Policy, stored: list[JSON], recorded: RecordedWithConfigurations, clock: Clock, **options: Any
) -> NativePolicies:
    return _controller(
        policy, stored, recorded, configurations=recorded, settle_seconds=5.0, clock=clock, **options
    )


def test_the_webhooks_are_narrowed_only_once_the_native_objects_have_settled() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    recorded, clock = RecordedWithConfigurations(), Clock()
    assert _narrowing(policy, [], recorded, clock).reconcile(KEY).requeue_after == 5.0
    assert recorded.calls and {verb for verb, _, _ in recorded.calls} == {"create"}
    assert recorded.conditions() == [None, None]

    # The objects are there, but only just: the leader waits out the rest of the settling time.
    settled = _narrowing(policy, [_stored(o) for o in _wanted(policy)], recorded, clock)
    clock.now += 2.0
    assert settled.reconcile(KEY).requeue_after == pytest.approx(3.0)
    assert recorded.conditions() == [None, None]
    clock.now += 3.0
    assert settled.reconcile(KEY).requeue_after is None
    assert recorded.conditions() == list(narrowing(policy).conditions.values())
    assert settled.status()["narrowed"] == dict.fromkeys(CONFIGURATION_KINDS, True)


def test_the_leader_makes_the_native_policies_fail_as_the_installed_webhooks_do() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    recorded, clock = RecordedWithConfigurations(), Clock()
    recorded.stored = {**DEPLOYED, MUTATING: FAIL_CLOSED[MUTATING]}
    _narrowing(policy, [], recorded, clock).reconcile(KEY)
    failing = {
        body["kind"]: body["spec"]["failurePolicy"]
        for body in recorded.bodies.values()
        if not body["kind"].endswith("Binding")
    }
    assert failing == {"MutatingAdmissionPolicy": "Fail", "ValidatingAdmissionPolicy": "Ignore"}


def test_the_leader_binds_no_native_policy_in_the_namespace_it_runs_in() -> None:
    recorded, clock = RecordedWithConfigurations(), Clock()
    _narrowing(
        make_policy({"admission": {"mode": "hybrid"}}), [], recorded, clock, namespace="gpu-system"
    ).reconcile(KEY)
    left_out = {
        tuple(body["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][-1]["values"])
        for body in recorded.bodies.values()
        if body["kind"].endswith("Binding")
    }
    assert left_out == {("kube-system", "kube-node-lease", "gpu-system", "gpuguard-node")}


def _narrowed(policy: Policy, recorded: RecordedWithConfigurations, clock: Clock) -> list[JSON]:
    """The native objects `policy` wants, stored and settled, and the webhooks narrowed for them."""
    objects = [_stored(o) for o in _wanted(policy)]
    settled = _narrowing(policy, objects, recorded, clock)
    clock.now += 10.0
    settled.reconcile(KEY)
    assert recorded.calls
    for kind, parts in narrowing(policy).parts.items():
        assert configuration_patch(recorded.stored[kind], parts) == []  # as `policy` wants them
    recorded.calls.clear()
    return objects


def test_the_webhooks_are_widened_and_settled_before_any_native_object_changes() -> None:
    recorded, clock = RecordedWithConfigurations(), Clock()
    objects = _narrowed(make_policy({"admission": {"mode": "hybrid"}}), recorded, clock)
    # Back to webhook: both configurations widened; the API server sees that through its own watch of
    # them, so the objects are deleted only on the next pass, the settle time later.
    back = _narrowing(make_policy({}), objects, recorded, clock)
    assert back.reconcile(KEY).requeue_after == 5.0
    assert [verb for verb, _, _ in recorded.calls] == ["patch", "patch"]
    assert recorded.conditions() == [None, None]
    clock.now += 5.0
    back.reconcile(KEY)
    assert {verb for verb, _, _ in recorded.calls[2:]} == {"delete"}


def test_a_new_leader_narrows_only_once_what_its_predecessor_wrote_has_settled() -> None:
    """A replica that waited long as a standby takes over just after the old leader wrote the objects:
    its settle time starts when it begins to lead, not when it started."""
    policy = make_policy({"admission": {"mode": "hybrid"}})
    recorded, clock = RecordedWithConfigurations(), Clock()
    standby = _narrowing(policy, [_stored(o) for o in _wanted(policy)], recorded, clock)
    clock.now += 3600.0
    standby.start_leading()
    try:
        assert standby.reconcile(KEY).requeue_after == 5.0
        assert recorded.conditions() == [None, None]
        clock.now += 5.0
        assert standby.reconcile(KEY).requeue_after is None
        assert recorded.conditions() == list(narrowing(policy).conditions.values())
    finally:
        standby.controller.stop.set()
        standby.controller.shutdown()


def test_a_policy_that_does_not_compile_leaves_the_webhooks_whole() -> None:
    policy = make_policy({"admission": {"mode": "hybrid"}})
    recorded, clock = RecordedWithConfigurations(), Clock()
    objects = _narrowed(policy, recorded, clock)

    def broken(_: Policy) -> Compiled:
        raise ValueError("unbalanced braces")

    _narrowing(policy, objects, recorded, clock, compile=broken).reconcile(KEY)
    assert recorded.conditions() == [None, None]
    assert not any(verb in ("create", "update", "delete") for verb, _, _ in recorded.calls)


def test_a_namespace_in_warn_mode_gets_an_entry_of_its_own_and_webhook_mode_restores_the_configuration() -> (
    None
):
    recorded, clock = RecordedWithConfigurations(), Clock()
    deployed = copy.deepcopy(recorded.stored)
    policy = make_policy(
        {"admission": {"mode": "hybrid"}, "namespaces": [{"names": ["team-a"], "mode": "warn"}]}
    )
    objects = _narrowed(policy, recorded, clock)
    mutating = recorded.stored[CONFIGURATION_KINDS[0]]["webhooks"]
    # The webhook as it was, narrowed, and an entry for team-a sending it what the first one does not.
    assert [w["name"] for w in mutating] == [
        f"{p}mutatingwebhookconfiguration.gpuguard.io" for p in ("", "region-1.")
    ]
    assert (
        mutating[0]["namespaceSelector"]
        == deployed[CONFIGURATION_KINDS[0]]["webhooks"][0]["namespaceSelector"]
    )
    assert mutating[1]["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}
    ]
    narrowed, rest = recorded.conditions()[:2]
    assert narrowed is not None and rest == f"!({narrowed})"
    assert len(recorded.stored[CONFIGURATION_KINDS[1]]["webhooks"]) == 1
    # Back to webhook: one write per configuration, and they are as deployed.
    back = _narrowing(make_policy({}), objects, recorded, clock)
    back.reconcile(KEY)
    assert [verb for verb, _, _ in recorded.calls] == ["patch", "patch"]
    for kind, stored in recorded.stored.items():
        assert stored["webhooks"] == deployed[kind]["webhooks"]


def test_webhooks_someone_else_un_narrowed_are_narrowed_again_at_once_and_a_conflict_is_read_again() -> None:
    policy = make_policy(
        {"admission": {"mode": "hybrid"}, "namespaces": [{"names": ["team-a"], "mode": "warn"}]}
    )
    recorded, clock = RecordedWithConfigurations(), Clock()
    leader = _narrowing(policy, [_stored(o) for o in _wanted(policy)], recorded, clock)
    clock.now += 5.0
    leader.reconcile(KEY)
    narrowed = copy.deepcopy(recorded.stored)
    recorded.calls.clear()
    # deploy/ applied again: as it ships, at another resourceVersion.
    recorded.stored = {kind: configuration(kind) for kind in CONFIGURATION_KINDS}
    assert leader.reconcile(KEY).requeue_after is None  # the native objects are in force: no wait
    assert {verb for verb, _, _ in recorded.calls} == {"patch"}
    assert recorded.stored == narrowed
    recorded.calls.clear()
    assert leader.reconcile(KEY).requeue_after is None
    assert recorded.calls == []  # level-triggered: nothing differs, nothing written

    # Changed between the read and the write: the patch fails its test and is raised, to be retried.
    recorded.stored = {kind: configuration(kind) for kind in CONFIGURATION_KINDS}
    moved = recorded.read

    def read_then_changed(kind: str) -> JSON | None:
        found = moved(kind)
        recorded.stored[kind]["metadata"]["resourceVersion"] = "8"
        return found

    recorded.read = read_then_changed  # type: ignore[method-assign]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        leader.reconcile(KEY)
    recorded.read = moved  # type: ignore[method-assign]
    leader.reconcile(KEY)
    assert [w["name"] for w in recorded.stored[CONFIGURATION_KINDS[0]]["webhooks"]] == [
        w["name"] for w in narrowed[CONFIGURATION_KINDS[0]]["webhooks"]
    ]

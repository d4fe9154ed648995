"""driverCompatibility: what a workload states, the node affinity merged from it, the validating check,
one driver version per multi-node Job, and the properties every mutation here must keep."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.manifests import (
    JSON,
    apply,
    assert_same_json,
    container,
    cronjob,
    job,
    make_policy,
    mutated,
    pod,
    spec_of,
    templated,
)
from webhook import cli
from webhook.cli.nodes import drivers_table
from webhook.policy import drivers, engine, nodeaffinity, patch
from webhook.policy.facts import ClusterFacts, NodeInfo, nodes_of
from webhook.policy.model import Policy, PolicyError
from webhook.runtime.metrics import Metrics
from webhook.runtime.policy_store import PolicyStatus

ANNOTATION = "gpuguard.io/min-driver-major"
MAJOR = "nvidia.com/cuda.driver-version.major"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
AT_LEAST_550 = {"key": MAJOR, "operator": "Gt", "values": ["549"]}
PRODUCT = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}


def needing(minimum: str = "550", **spec: Any) -> JSON:
    return pod(container(gpus=1), annotations={ANNOTATION: minimum}, priorityClassName="gpu-workload", **spec)


def with_terms(*terms: JSON) -> JSON:
    return {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": list(terms)}}}


def terms_of(obj: JSON) -> Any:
    return spec_of(obj)["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]


def check(obj: JSON, policy: Policy, **kwargs: Any) -> list[tuple[str, str]]:
    result = engine.validate(obj, policy, **kwargs)
    return [(d.outcome, d.message) for d in result.decisions if d.rule == "driverCompatibility"]


# --- the merge -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("affinity", "terms"),
    [
        pytest.param(None, [{"matchExpressions": [AT_LEAST_550]}], id="no-affinity"),
        pytest.param(
            with_terms({"matchExpressions": [PRODUCT]}),
            [{"matchExpressions": [PRODUCT, AT_LEAST_550]}],
            id="into-the-existing-term",
        ),
        pytest.param(
            with_terms(
                {"matchExpressions": [PRODUCT]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
            ),
            [
                {"matchExpressions": [PRODUCT, AT_LEAST_550]},
                {
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}],
                    "matchExpressions": [AT_LEAST_550],
                },
            ],
            id="every-term-gets-it",
        ),
        pytest.param(
            with_terms({}, {"matchExpressions": [PRODUCT]}),
            [{}, {"matchExpressions": [PRODUCT, AT_LEAST_550]}],
            id="an-empty-term-matches-no-node-and-stays-empty",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["569"]}]}),
            [{"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["569"]}]}],
            id="a-stricter-gt-is-kept",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["500"]}]}),
            [{"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["500"]}, AT_LEAST_550]}],
            id="a-weaker-gt-is-narrowed-not-replaced",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": MAJOR, "operator": "In", "values": ["550", "570"]}]}),
            [{"matchExpressions": [{"key": MAJOR, "operator": "In", "values": ["550", "570"]}]}],
            id="in-only-new-enough-versions",
        ),
        pytest.param(
            with_terms({"matchExpressions": [{"key": MAJOR, "operator": "In", "values": ["535", "570"]}]}),
            [
                {
                    "matchExpressions": [
                        {"key": MAJOR, "operator": "In", "values": ["535", "570"]},
                        AT_LEAST_550,
                    ]
                }
            ],
            id="in-with-an-older-version",
        ),
        pytest.param(
            {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [PRODUCT]}}
                    ]
                }
            },
            [{"matchExpressions": [AT_LEAST_550]}],
            id="beside-a-preference",
        ),
        pytest.param(
            {"podAntiAffinity": {REQUIRED: [{"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}]}},
            [{"matchExpressions": [AT_LEAST_550]}],
            id="beside-pod-anti-affinity",
        ),
    ],
)
def test_the_requirement_is_merged_into_every_required_term(
    policy: Policy, affinity: JSON | None, terms: list[JSON]
) -> None:
    obj = needing() if affinity is None else needing(affinity=affinity)
    out = mutated(obj, policy)
    assert terms_of(out) == terms
    assert not engine.mutate(out, policy).changed
    assert check(out, policy) == []


def test_a_node_selector_that_already_guarantees_it_is_enough(policy: Policy) -> None:
    obj = needing(nodeSelector={MAJOR: "570"})
    assert "affinity" not in spec_of(engine.mutate(obj, policy).obj)
    assert check(obj, policy) == []


@pytest.mark.parametrize(
    "make", [lambda s: templated("Deployment", **s), lambda s: job(template=s), lambda s: cronjob(template=s)]
)
def test_templates_get_it_from_a_template_annotation(policy: Policy, make: Any) -> None:
    obj = make({"affinity": with_terms({"matchExpressions": [PRODUCT]})})
    template_holder = obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"]
    template_holder["template"]["metadata"] = {"annotations": {ANNOTATION: "550"}}
    assert terms_of(mutated(obj, policy)) == [{"matchExpressions": [PRODUCT, AT_LEAST_550]}]


def test_or_from_the_workloads_own_annotations(policy: Policy) -> None:
    obj = templated("Deployment")
    obj["metadata"]["annotations"] = {ANNOTATION: "550"}
    assert terms_of(mutated(obj, policy)) == [{"matchExpressions": [AT_LEAST_550]}]


def test_the_image_map_and_the_highest_requirement_win() -> None:
    policy = make_policy(
        {
            "rules": {
                "driverCompatibility": {
                    "images": [
                        {"image": "nvcr.io/nvidia/pytorch:25.*", "minDriverMajor": 570},
                        {"image": "docker.io/library/app:*", "minDriverMajor": 535},
                    ]
                }
            }
        }
    )
    ngc = {
        "name": "train",
        "image": "nvcr.io/nvidia/pytorch:25.01-py3",
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    result = engine.mutate(pod(ngc, annotations={ANNOTATION: "550"}), policy)
    assert terms_of(result.obj) == [
        {"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["569"]}]}
    ]
    assert any("(image nvcr.io/nvidia/pytorch:25.01-py3)" in d.message for d in result.decisions)
    short = {"name": "app", "image": "app:1", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert terms_of(mutated(pod(short), policy)) == [
        {"matchExpressions": [{"key": MAJOR, "operator": "Gt", "values": ["534"]}]}
    ]


def test_image_patterns_need_a_registry() -> None:
    with pytest.raises(
        PolicyError, match=r"rules\.driverCompatibility\.images\[0\]\.image: .*docker\.io/pytorch"
    ):
        make_policy(
            {"rules": {"driverCompatibility": {"images": [{"image": "pytorch/*", "minDriverMajor": 1}]}}}
        )


def test_label_keys_are_checked() -> None:
    with pytest.raises(PolicyError, match=r"rules\.driverCompatibility\.nodeLabels\.driverMajor"):
        make_policy({"rules": {"driverCompatibility": {"nodeLabels": {"driverMajor": "not a key!"}}}})


@pytest.mark.parametrize("obj", [pod(container(gpus=1)), pod(container(), annotations={ANNOTATION: "550"})])
def test_nothing_stated_or_no_accelerator_nothing_done(policy: Policy, obj: JSON) -> None:
    result = engine.mutate(obj, policy)
    assert "affinity" not in spec_of(result.obj)
    assert check(obj, policy) == []


def test_a_configurable_label() -> None:
    policy = make_policy(
        {"rules": {"driverCompatibility": {"nodeLabels": {"driverMajor": "nvidia.com/cuda.driver.major"}}}}
    )
    assert terms_of(mutated(needing(), policy)) == [
        {"matchExpressions": [{"key": "nvidia.com/cuda.driver.major", "operator": "Gt", "values": ["549"]}]}
    ]


# --- the validating check -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        pytest.param({"nodeSelector": {MAJOR: "470"}}, f"nodeSelector {MAJOR}=470", id="node-selector"),
        pytest.param({"nodeSelector": {MAJOR: "new"}}, f"nodeSelector {MAJOR}=new", id="not-a-number"),
        pytest.param(
            {
                "affinity": with_terms(
                    {"matchExpressions": [{"key": MAJOR, "operator": "In", "values": ["470", "535"]}]}
                )
            },
            f"every node affinity term (In 470,535 on {MAJOR})",
            id="in-older-versions",
        ),
        pytest.param(
            {
                "affinity": with_terms(
                    {"matchExpressions": [{"key": MAJOR, "operator": "Lt", "values": ["540"]}]}
                )
            },
            f"every node affinity term (Lt 540 on {MAJOR})",
            id="lt",
        ),
        pytest.param(
            {"affinity": with_terms({"matchExpressions": [{"key": MAJOR, "operator": "DoesNotExist"}]})},
            f"every node affinity term (DoesNotExist on {MAJOR})",
            id="does-not-exist",
        ),
    ],
)
def test_a_selection_ruling_out_every_new_enough_node_is_refused(
    policy: Policy, spec: JSON, reason: str
) -> None:
    out = engine.mutate(needing(**spec), policy).obj
    ((outcome, message),) = check(out, policy)
    assert outcome == "denied"
    assert (
        message == f"needs {MAJOR} >= 550 (annotation {ANNOTATION}), but {reason} rules out every such node"
    )


def test_one_satisfiable_term_is_enough(policy: Policy) -> None:
    old = {"matchExpressions": [{"key": MAJOR, "operator": "In", "values": ["470"]}]}
    out = mutated(needing(affinity=with_terms(old, {"matchExpressions": [PRODUCT]})), policy)
    assert check(out, policy) == []


def test_a_workload_stored_without_the_affinity_is_refused(policy: Policy) -> None:
    # What the API server would store had the mutation not run (gpuguard's mutating call failed open).
    ((outcome, message),) = check(needing(), policy)
    assert outcome == "denied"
    assert message.endswith("but its node selection admits older drivers")


@pytest.mark.parametrize("value", ["550.54", "five-fifty", "-1", "0", ""])
def test_a_malformed_annotation_is_refused_not_ignored(policy: Policy, value: str) -> None:
    obj = needing(value)
    assert "affinity" not in spec_of(engine.mutate(obj, policy).obj)
    ((outcome, message),) = check(obj, policy)
    assert (outcome, message) == (
        "denied",
        f"annotation {ANNOTATION}: {value!r} is not a driver major version (a whole number such as 550)",
    )


def test_no_current_node_new_enough_is_a_notice(policy: Policy) -> None:
    out = mutated(needing(nodeSelector={"pool": "a"}), policy)
    old_nodes = ClusterFacts(
        nodes={"n1": NodeInfo({MAJOR: "535", "pool": "a"}), "n2": NodeInfo({MAJOR: "570", "pool": "b"})}
    )
    assert check(out, policy, facts=old_nodes) == [
        ("notice", f"no node has {MAJOR} >= 550 and fits this workload: its pods would stay Pending")
    ]
    fits = ClusterFacts(nodes={"n3": NodeInfo({MAJOR: "550", "pool": "a"})})
    assert check(out, policy, facts=fits) == []
    assert check(out, policy) == []  # without cluster lookups nothing is known


def test_update_refuses_only_what_it_introduces(policy: Policy) -> None:
    stuck = templated("Deployment", nodeSelector={MAJOR: "470"})
    stuck["spec"]["template"]["metadata"]["annotations"] = {ANNOTATION: "550"}
    scaled = copy.deepcopy(stuck) | {"spec": {**stuck["spec"], "replicas": 3}}
    assert check(scaled, policy, operation="UPDATE", old=stuck) == []
    fine = templated("Deployment")
    assert [o for o, _ in check(stuck, policy, operation="UPDATE", old=fine)] == ["denied"]
    assert (
        check(needing(nodeSelector={MAJOR: "470"}), policy, operation="UPDATE", old=needing()) == []
    )  # pods: immutable


@pytest.mark.parametrize("mode", ["warn", "audit"])
def test_warn_and_audit_change_and_refuse_nothing(mode: str) -> None:
    policy = make_policy({"rules": {"driverCompatibility": {"mode": mode}}})
    result = engine.mutate(needing(), policy)
    assert "affinity" not in spec_of(result.obj)
    assert [d.outcome for d in result.decisions if d.rule == "driverCompatibility"] == ["would-apply"]
    assert [o for o, _ in check(result.obj, policy)] == ["would-deny"]


# --- one driver version per multi-node Job -----------------------------------------------------------

SAME_VERSION = make_policy({"rules": {"driverCompatibility": {"multiNode": {"sameDriverVersion": True}}}})
POD_AFFINITY = {
    "labelSelector": {"matchExpressions": [{"key": "batch.kubernetes.io/job-name", "operator": "Exists"}]},
    "matchLabelKeys": ["batch.kubernetes.io/controller-uid"],
    "topologyKey": "nvidia.com/cuda.driver-version.full",
}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            {"parallelism": 4, "completions": 4, "completionMode": "Indexed"}, True, id="indexed-parallel"
        ),
        pytest.param({"parallelism": 4, "completions": 4}, False, id="non-indexed"),
        pytest.param(
            {"parallelism": 1, "completions": 4, "completionMode": "Indexed"}, False, id="one-at-a-time"
        ),
        pytest.param({"completions": 4, "completionMode": "Indexed"}, False, id="parallelism-defaults-to-1"),
    ],
)
def test_multi_node_jobs_keep_to_one_driver_version(fields: JSON, expected: bool) -> None:
    out = engine.mutate(job(**fields), SAME_VERSION).obj
    affinity = spec_of(out).get("affinity") or {}
    assert (affinity.get("podAffinity") == {REQUIRED: [POD_AFFINITY]}) is expected
    assert not engine.mutate(out, SAME_VERSION).changed


def test_the_pod_affinity_joins_the_users_terms(policy: Policy) -> None:
    theirs = {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {"matchLabels": {"app": "x"}}}
    obj = cronjob(
        parallelism=2,
        completionMode="Indexed",
        completions=2,
        template={"affinity": {"podAffinity": {REQUIRED: [theirs]}}},
    )
    out = mutated(obj, SAME_VERSION)
    assert spec_of(out)["affinity"]["podAffinity"][REQUIRED] == [theirs, POD_AFFINITY]
    default = spec_of(engine.mutate(obj, policy).obj)["affinity"]["podAffinity"][REQUIRED]
    assert default == [theirs]  # off by default


# --- properties ------------------------------------------------------------------------------------

LABELS = {
    MAJOR: ["470", "535", "550", "570", "x"],
    "pool": ["a", "b"],
    "nvidia.com/gpu.product": ["H100", "L4"],
}
EXPRESSIONS = st.one_of(
    st.builds(
        lambda key, op, values: {"key": key, "operator": op, "values": values},
        st.sampled_from(sorted(LABELS)),
        st.sampled_from(["In", "NotIn"]),
        st.lists(st.sampled_from(["470", "535", "550", "570", "a", "H100"]), min_size=1, max_size=3),
    ),
    st.builds(
        lambda key, op: {"key": key, "operator": op},
        st.sampled_from(sorted(LABELS)),
        st.sampled_from(["Exists", "DoesNotExist"]),
    ),
    st.builds(
        lambda op, value: {"key": MAJOR, "operator": op, "values": [value]},
        st.sampled_from(["Gt", "Lt"]),
        st.sampled_from(["400", "534", "549", "560", "600"]),
    ),
)
TERMS = st.fixed_dictionaries(
    {},
    optional={
        "matchExpressions": st.lists(EXPRESSIONS, max_size=3),
        "matchFields": st.lists(
            st.builds(
                lambda v: {"key": "metadata.name", "operator": "In", "values": [v]},
                st.sampled_from(["n0", "n1", "n2"]),
            ),
            max_size=1,
        ),
    },
)
NODES = st.dictionaries(
    st.sampled_from([f"n{i}" for i in range(6)]),
    st.fixed_dictionaries({}, optional={key: st.sampled_from(values) for key, values in LABELS.items()}),
    max_size=6,
)


@st.composite
def specs(draw: st.DrawFn) -> JSON:
    spec: JSON = {"containers": [container(gpus=1)], "priorityClassName": "gpu-workload"}
    if draw(st.booleans()):
        spec["nodeSelector"] = draw(
            st.dictionaries(
                st.sampled_from(sorted(LABELS)), st.sampled_from(["550", "a", "H100"]), max_size=2
            )
        )
    if draw(st.booleans()):
        spec["affinity"] = with_terms(*draw(st.lists(TERMS, min_size=1, max_size=3)))
    return spec


DEFAULT = make_policy()  # parsed once: hypothesis calls the properties hundreds of times


def _selected(spec: JSON, nodes: dict[str, dict[str, str]]) -> set[str]:
    return {name for name, labels in nodes.items() if nodeaffinity.selects(spec, name, labels)}


@settings(max_examples=300, deadline=None)
@given(specs(), NODES, st.sampled_from(["535", "550", "571"]))
def test_the_merge_narrows_never_widens_guarantees_and_is_idempotent(
    spec: JSON, nodes: dict[str, dict[str, str]], minimum: str
) -> None:
    policy = DEFAULT
    obj = pod(annotations={ANNOTATION: minimum}, **{k: v for k, v in spec.items() if k != "containers"})
    obj["spec"]["containers"] = spec["containers"]
    result = engine.mutate(obj, policy)
    before, after = _selected(obj["spec"], nodes), _selected(result.obj["spec"], nodes)
    assert after <= before  # never a node the user's own selection ruled out
    # Exactly the user's nodes that are new enough: nothing more, nothing new-enough lost.
    assert after == {n for n in before if (nodeaffinity.integer(nodes[n].get(MAJOR)) or 0) >= int(minimum)}
    again = engine.mutate(result.obj, policy)
    assert not again.changed
    assert_same_json(apply(obj, patch.diff(obj, result.obj)), result.obj)


@settings(max_examples=200, deadline=None)
@given(specs(), st.lists(TERMS, min_size=1, max_size=2), st.booleans())
def test_convergence_when_another_webhook_changes_the_affinity_in_between(
    spec: JSON, added: list[JSON], replace: bool
) -> None:
    # reinvocationPolicy IfNeeded: another mutating webhook edits the node affinity after gpuguard, and
    # gpuguard is called again: one more pass restores the guarantee, and the pass after it changes nothing.
    policy = DEFAULT
    obj = pod(annotations={ANNOTATION: "550"}, **{k: v for k, v in spec.items() if k != "containers"})
    obj["spec"]["containers"] = spec["containers"]
    first = engine.mutate(obj, policy).obj
    edited = copy.deepcopy(first)
    if replace:
        edited["spec"]["affinity"] = with_terms(*added)
    else:
        affinity = edited["spec"].setdefault("affinity", {}).setdefault("nodeAffinity", {})
        affinity.setdefault(REQUIRED, {"nodeSelectorTerms": []})["nodeSelectorTerms"] += added
    second = engine.mutate(edited, policy).obj
    assert nodeaffinity.guarantees_minimum(second["spec"], MAJOR, 550)
    assert not engine.mutate(second, policy).changed


# --- nodes drivers ------------------------------------------------------------------------------------


def gfd_node(
    name: str, pool: str, driver: str, cuda: str = "12.8", product: str = "NVIDIA-H100-80GB-HBM3"
) -> JSON:
    labels = {
        "cloud.google.com/gke-nodepool": pool,
        "nvidia.com/gpu.product": product,
        "nvidia.com/cuda.driver-version.full": driver,
        "nvidia.com/cuda.driver-version.major": driver.split(".")[0],
        "nvidia.com/cuda.runtime-version.full": cuda,
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def test_driver_versions_by_pool_and_product(policy: Policy) -> None:
    listing = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            gfd_node("a", "train", "570.124.06"),
            gfd_node("b", "train", "570.86.15", cuda="12.8"),
            gfd_node("c", "serve", "550.54.15", cuda="12.4", product="NVIDIA-L4"),
            {
                "kind": "Node",
                "metadata": {"name": "cpu", "labels": {"cloud.google.com/gke-nodepool": "default"}},
            },
        ],
    }
    pools = drivers.summarise(nodes_of([listing]), policy.rules.driverCompatibility.nodeLabels)
    assert [(p.pool, p.product, p.nodes, dict(p.drivers), p.mixed) for p in pools] == [
        ("serve", "NVIDIA-L4", 1, {"550.54.15": 1}, False),
        ("train", "NVIDIA-H100-80GB-HBM3", 2, {"570.124.06": 1, "570.86.15": 1}, True),
    ]
    text = drivers_table(pools)
    assert "570.124.06 (1), 570.86.15 (1)" in text and text.splitlines()[2].endswith("MIXED")
    assert text.splitlines()[-1] == "2 GPU pools: 1 mixed, 1 on one driver and CUDA version"


def test_nodes_without_a_pool_label_or_full_version(policy: Policy) -> None:
    old_gfd = {"kind": "Node", "metadata": {"name": "x", "labels": {MAJOR: "535"}}}
    (pool,) = drivers.summarise(nodes_of([old_gfd]), policy.rules.driverCompatibility.nodeLabels)
    assert (pool.pool, pool.product, dict(pool.drivers)) == (drivers.NO_POOL, drivers.UNKNOWN, {"535": 1})
    assert drivers_table([]) == "no node carries a GPU product or driver label\n"


def test_nodes_drivers_command_reads_a_node_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.yaml"
    items = [gfd_node("a", "train", "570.124.06"), gfd_node("b", "train", "570.124.06")]
    nodes.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    assert cli.main(["nodes", "drivers", "-f", str(nodes)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["POOL", "PRODUCT", "NODES", "DRIVER", "CUDA"]
    assert out.splitlines()[1].split() == ["train", "NVIDIA-H100-80GB-HBM3", "2", "570.124.06", "12.8"]
    nodes.write_text(
        yaml.safe_dump_all([*items, gfd_node("c", "train", "550.54.15")])
    )  # one Node per document
    assert cli.main(["nodes", "drivers", "-f", str(nodes)]) == 1  # like validate: scripts can gate on it
    assert "MIXED" in capsys.readouterr().out


def test_the_mixed_pool_metric(policy: Policy) -> None:
    nodes = nodes_of([gfd_node("a", "train", "570.124.06"), gfd_node("b", "train", "550.54.15")])
    pools = drivers.summarise(nodes, policy.rules.driverCompatibility.nodeLabels)
    status = PolicyStatus(hash="abc", source="test", loaded_at=0.0, last_error=None, errors=0)
    text = Metrics().render(status, pools)
    assert 'gpuguard_driver_versions{pool="train",product="NVIDIA-H100-80GB-HBM3"} 2' in text
    assert "gpuguard_driver_mixed_pools 1" in text
    assert "gpuguard_driver_" not in Metrics().render(status)  # no node cache, no gauges

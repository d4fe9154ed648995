"""The audit's pure core: what it finds on objects already in a cluster, how owned objects fold into
their owner, the node checks, the report body and the table. The cluster side is tested end to end
(tests/e2e/test_audit.py)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import corpus
from tests.harness.manifests import (
    EXAMPLES,
    admission_review,
    container,
    cronjob,
    defaulted_gpu_pod,
    job,
    make_policy,
    mutated,
    pod,
    response_of,
    templated,
)
from webhook import cli
from webhook.admission import review
from webhook.audit import findings, output, reports
from webhook.cli import audit as cli_audit
from webhook.cli import inputs
from webhook.cli import output as cli_output
from webhook.policy import engine
from webhook.policy.facts import ClusterFacts, NodeInfo, PriorityClassInfo, Taint
from webhook.policy.model import MUTATING_RULES, RULE_IDS, Policy

JSON = dict[str, Any]
# What the default policy changes on a class-less GPU Job.
CHANGED_BY_DEFAULT = ("readinessTolerations", "podFailurePolicy", "gracefulTermination", "priority")
GPU_LABEL = "nvidia.com/gpu.present"
FACTS = ClusterFacts(
    priority_classes={"gpu-workload": PriorityClassInfo(10000), "low": PriorityClassInfo(10)},
    namespace_labels={"team": {}, "kube-system": {}},
    nodes={
        "gpu-bare": NodeInfo({GPU_LABEL: "true"}),
        "gpu-tainted": NodeInfo({}, ("nvidia.com/gpu",), (Taint("nvidia.com/gpu", "NoSchedule"),)),
        "gpu-soft": NodeInfo({GPU_LABEL: "true"}, (), (Taint("nvidia.com/gpu", "PreferNoSchedule"),)),
        "cpu": NodeInfo({}, ("cpu",)),
    },
    claims={},
    claim_templates={},
)


def placed(obj: JSON, namespace: str = "team", uid: str | None = None, owner: JSON | None = None) -> JSON:
    """`obj` as the API server lists it: in a namespace, with a uid and an owner when given."""
    metadata = obj["metadata"]
    metadata["namespace"] = namespace
    metadata["uid"] = uid or f"uid-{obj['kind']}-{metadata['name']}"
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    return obj


def verdicts(finding: findings.Finding | None) -> dict[str, str]:
    assert finding is not None
    return {r.rule: r.verdict for r in finding.results}


def test_an_unprotected_gpu_job_lacks_every_protection(policy: Policy) -> None:
    finding = findings.evaluate(placed(job()), policy, FACTS)
    assert verdicts(finding) == {
        "readinessTolerations": "change",
        "podFailurePolicy": "change",
        "gracefulTermination": "change",
        "priority": "change",
        "driverCompatibility": "skip",  # states no driver it needs: not applicable, not a pass
        "acceleratorNodeGuard": "pass",  # asks for a GPU, and gets a class that clears the guard
        "trustedDeviceSoftware": "skip",  # mounts no device software's paths
    }
    assert finding is not None and finding.worst() == "change"
    priority = finding.result("priority")
    assert priority is not None and priority.messages == ("set priorityClassName gpu-workload",)


def test_what_mutate_suggests_passes(policy: Policy) -> None:
    # The acceptance loop in small: apply `gpuguard mutate`'s output, audit again, every rule passes.
    for obj in (job(), cronjob(), templated("Deployment"), templated("StatefulSet")):
        fixed = placed(mutated(obj, policy, facts=FACTS))
        results = verdicts(findings.evaluate(fixed, policy, FACTS))
        assert set(results.values()) <= {"pass", "skip"}, (obj["kind"], results)


def test_rules_that_do_not_apply_are_skipped_with_a_reason(policy: Policy) -> None:
    deployment = findings.evaluate(placed(templated("Deployment")), policy, FACTS)
    assert deployment is not None
    skipped = deployment.result("podFailurePolicy")
    assert skipped is not None and (skipped.verdict, skipped.messages) == (
        "skip",
        ("Jobs, CronJobs, JobSets and LeaderWorkerSets only",),
    )
    off = make_policy({"rules": {"priority": {"mode": "off"}}})
    result = findings.evaluate(placed(job()), off, FACTS)
    assert result is not None and result.result("priority") == findings.RuleResult(
        "priority", "skip", "off", ("off in namespace team",)
    )


def test_workloads_no_rule_speaks_to_are_not_reported(policy: Policy) -> None:
    assert findings.evaluate(placed(pod(container(requests={"cpu": "1"}))), policy, FACTS) is None
    assert findings.evaluate(placed(templated("DaemonSet")), policy, FACTS) is None


def test_a_cpu_pod_bound_for_gpu_nodes_is_denied_and_nothing_else(policy: Policy) -> None:
    cpu_pod = placed(pod(container(requests={"cpu": "1"}), nodeSelector={GPU_LABEL: "true"}))
    finding = findings.evaluate(cpu_pod, policy, FACTS)
    results = verdicts(finding)
    assert results["acceleratorNodeGuard"] == "deny"
    assert {results[rule] for rule in MUTATING_RULES} == {"skip"}


def test_validation_sees_the_object_as_mutation_leaves_it(policy: Policy) -> None:
    # A class-less GPU pod gets gpu-workload (10000) from the priority rule before the guard looks, as
    # the API server runs the webhooks: a change, not a denial. With the priority rule in audit mode
    # nothing is mutated, so the guard sees priority 0 and would deny.
    gpu = placed(defaulted_gpu_pod(nodeSelector={GPU_LABEL: "true"}))
    assert verdicts(findings.evaluate(gpu, policy, FACTS))["acceleratorNodeGuard"] == "pass"
    dry = make_policy({"rules": {"priority": {"mode": "audit"}}})
    assert verdicts(findings.evaluate(gpu, dry, FACTS))["acceleratorNodeGuard"] == "deny"


def test_warn_and_audit_modes_report_what_the_rule_finds(policy: Policy) -> None:
    for mode in ("warn", "audit"):
        finding = findings.evaluate(placed(job()), make_policy({"mode": mode}), FACTS)
        assert finding is not None
        assert {r.verdict for r in finding.results if r.rule in CHANGED_BY_DEFAULT} == {"change"}
        assert {r.mode for r in finding.results} == {mode}


@pytest.mark.parametrize("namespace", ["default", "kube-system"])
def test_the_audit_agrees_with_admission_on_every_example_and_corpus_manifest(
    policy: Policy, namespace: str
) -> None:
    # The audit must never disagree with the webhook: the rules it reports as changes are the rules
    # /mutate applies, and the rules it reports as denials are the ones /validate refuses the mutated
    # object for (the device-software check on DaemonSets and the driver check included). kube-system
    # is exempt from every rule but trustedDeviceSoftware.
    # The policy-test cases' manifests count too; their folders also hold test definitions and policies
    # (no apiVersion) and cluster facts (a List), which are no workloads. Without the corpus: eight.
    examples = [*sorted(EXAMPLES.glob("*.yaml")), *sorted(EXAMPLES.glob("tests/*/*.yaml"))]
    documents = [
        doc
        for path in [*examples, *corpus.FILES]
        for doc in yaml.safe_load_all(path.read_text())
        if isinstance(doc, dict) and "apiVersion" in doc and doc.get("kind") != "List"
    ]
    assert len(documents) > (50 if corpus.PRESENT else 5)
    for doc in documents:
        obj = placed(doc, namespace=namespace, uid="x")
        finding = findings.evaluate(obj, policy, ClusterFacts())
        name = inputs.title(obj)
        mutation = review.review(admission_review(obj, namespace=namespace), endpoint="mutate", policy=policy)
        applied = {d.rule for d in mutation.decisions if d.outcome == "applied"}
        changes = {r.rule for r in finding.results if r.verdict == "change"} if finding else set()
        assert changes == applied, name
        after = engine.mutate(obj, policy, namespace=namespace).obj
        validation = review.review(
            admission_review(after, namespace=namespace), endpoint="validate", policy=policy
        )
        refused = {d.rule for d in validation.decisions if d.outcome == "denied"}
        denials = {r.rule for r in finding.results if r.verdict == "deny"} if finding else set()
        assert denials == refused, name
        assert bool(refused) == (not response_of(validation)["allowed"]), name


# --- owners first: each workload reported once ----------------------------------------------------------


def chain() -> list[JSON]:
    """A Deployment, its ReplicaSet and two pods; a CronJob, its Job and that Job's pod; a bare pod."""
    deployment = placed(templated("Deployment", name="serve"))
    replica_set = placed(templated("ReplicaSet", name="serve-5d8"), owner=deployment)
    serve_pods = [placed(defaulted_gpu_pod(name=f"serve-5d8-{i}"), owner=replica_set) for i in range(2)]
    nightly = placed(cronjob(name="nightly"))
    run = placed(job(name="nightly-290"), owner=nightly)
    run_pod = placed(defaulted_gpu_pod(name="nightly-290-x", restart_policy="Never"), owner=run)
    bare = placed(defaulted_gpu_pod(name="bare"))
    return [nightly, deployment, run, replica_set, *serve_pods, run_pod, bare]


def test_owned_objects_are_reported_through_their_owner(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS, check_nodes=False)
    reported = {(f.subject.kind, f.subject.name): f.pods for f in audit.findings}
    assert reported == {("CronJob", "nightly"): 1, ("Deployment", "serve"): 2, ("Pod", "bare"): 0}
    assert audit.scanned == {"CronJob": 1, "Deployment": 1, "Job": 1, "ReplicaSet": 1, "Pod": 4}


def test_a_pod_whose_owner_is_not_listed_is_judged_itself(policy: Policy) -> None:
    # Pods of an operator's custom resource: admission judged them at creation, so does the audit.
    custom_owner = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "r", "uid": "ray"}}
    worker = placed(defaulted_gpu_pod(name="worker"), owner=custom_owner)
    audit = findings.audit([worker], policy, FACTS, check_nodes=False)
    assert [f.subject.name for f in audit.findings] == ["worker"]


def test_kind_order_lists_every_kind_the_cluster_reader_reads() -> None:
    from webhook.kube import listing  # the Kubernetes client, for this test alone

    assert set(findings.KIND_ORDER) == set(listing.WORKLOAD_KINDS)


# --- running pods and nodes ----------------------------------------------------------------------------


def test_a_low_priority_pod_running_on_a_gpu_node_is_found_through_its_owner(policy: Policy) -> None:
    deployment = placed(templated("Deployment", container(requests={"cpu": "1"}), name="web"))
    replica_set = placed(templated("ReplicaSet", name="web-1"), owner=deployment)
    landed = placed(
        pod(container(requests={"cpu": "1"}), name="web-1-a", nodeName="gpu-bare", priority=0),
        owner=replica_set,
    )
    elsewhere = placed(
        pod(container(requests={"cpu": "1"}), name="web-1-b", nodeName="cpu", priority=0), owner=replica_set
    )
    audit = findings.audit([deployment, replica_set, landed, elsewhere], policy, FACTS, check_nodes=False)
    (finding,) = audit.findings
    assert (finding.subject.kind, finding.subject.name) == ("Pod", "web-1-a")
    (result,) = finding.results
    assert result.verdict == "deny"
    assert result.messages[0].startswith("running on accelerator node gpu-bare: priority 0")


def test_a_bare_pod_running_on_a_gpu_node_keeps_its_own_findings(policy: Policy) -> None:
    running = placed(defaulted_gpu_pod(name="old", nodeName="gpu-bare"))
    (finding,) = findings.audit([running], policy, FACTS, check_nodes=False).findings
    results = verdicts(finding)
    # Created today it would get gpu-workload; as it runs, its priority is 0, and it cannot change.
    assert results["priority"] == "change" and results["acceleratorNodeGuard"] == "deny"


def test_exempt_pods_on_gpu_nodes_are_not_findings(policy: Policy) -> None:
    system = placed(defaulted_gpu_pod(name="agent", nodeName="gpu-bare"), namespace="kube-system")
    exporter = placed(templated("DaemonSet", container(requests={"cpu": "1"}), name="dcgm"))
    daemon_pod = placed(
        pod(container(requests={"cpu": "1"}), name="dcgm-x", nodeName="gpu-bare", priority=0), owner=exporter
    )
    audit = findings.audit([exporter, system, daemon_pod], policy, FACTS, check_nodes=False)
    # kube-system: every rule off but trustedDeviceSoftware (device software lives there), which does
    # not apply to a pod mounting no device paths; the DaemonSet's pod is its DaemonSet's, which runs
    # no device software.
    (finding,) = audit.findings
    assert finding.subject.name == "agent"
    assert {r.rule: r.verdict for r in finding.results if r.mode != "off"} == {
        "trustedDeviceSoftware": "skip"
    }


def test_a_daemonset_running_untrusted_device_software_is_reported_once(policy: Policy) -> None:
    plugin = container(requests={"cpu": "10m"})
    plugin["image"] = "docker.io/someone/gpu-plugin:1"
    plugin["volumeMounts"] = [{"name": "sockets", "mountPath": "/var/lib/kubelet/device-plugins"}]
    volumes = [{"name": "sockets", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}]
    daemon_set = placed(templated("DaemonSet", plugin, name="plugin", volumes=volumes))
    daemon_pod = placed(pod(plugin, name="plugin-x", volumes=volumes, nodeName="gpu-bare"), owner=daemon_set)
    (finding,) = findings.audit([daemon_set, daemon_pod], policy, FACTS, check_nodes=False).findings
    assert (finding.subject.kind, finding.pods) == ("DaemonSet", 1)
    assert {r.rule: r.verdict for r in finding.results if r.verdict != "skip"} == {
        "trustedDeviceSoftware": "deny"
    }


def test_accelerator_nodes_need_a_taint_that_keeps_other_pods_off(policy: Policy) -> None:
    audit = findings.audit([], policy, FACTS, check_nodes=True)
    by_node = {f.subject.name: f.worst() for f in audit.findings}
    assert by_node == {"gpu-bare": "warn", "gpu-soft": "warn", "gpu-tainted": "pass"}
    assert (
        findings.audit([], make_policy({"rules": {"acceleratorNodeGuard": {"mode": "off"}}}), FACTS).findings
        == ()
    )
    assert findings.audit([], policy, ClusterFacts()).findings == ()  # nodes unknown: nothing said


# --- the report body ---------------------------------------------------------------------------------


def test_report_results_are_sorted_failures_first_and_summarised(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS, check_nodes=False)
    content = reports.body(audit.findings, None, now=100, policy_hash=policy.hash)
    results = content["results"]
    assert [r["result"] for r in results] == sorted(
        (r["result"] for r in results), key=reports._RANK.__getitem__
    )
    # Per workload: the guard passes; driverCompatibility and trustedDeviceSoftware do not apply.
    assert content["summary"] == {"pass": 3, "fail": 10, "warn": 0, "error": 0, "skip": 8}
    first = results[0]
    assert first["resources"] == [
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "name": "nightly",
            "namespace": "team",
            "uid": "uid-CronJob-nightly",
        }
    ]
    assert first["properties"] == {"verdict": "change", "mode": "enforce", "pods": "1"}
    assert (first["policy"], first["source"], first["severity"]) == ("gpuguard", "gpuguard", "medium")
    assert content["metadata"]["annotations"] == {
        reports.POLICY_ANNOTATION: policy.hash,
        reports.OMITTED_ANNOTATION: "0",
    }


def test_report_results_are_capped_and_say_how_many_were_left_out(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS, check_nodes=False)
    content = reports.body(audit.findings, None, now=100, policy_hash=policy.hash, limit=3)
    assert len(content["results"]) == 3 and {r["result"] for r in content["results"]} == {"fail"}
    assert content["metadata"]["annotations"][reports.OMITTED_ANNOTATION] == "18"
    assert sum(content["summary"].values()) == 3


def test_the_same_findings_make_the_same_report(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS, check_nodes=False)
    first = reports.body(audit.findings, None, now=100, policy_hash=policy.hash)
    again = reports.body(audit.findings, first, now=200, policy_hash=policy.hash)
    assert again == first  # timestamps say when a result was first found
    fixed = [f for f in audit.findings if f.subject.name != "bare"]
    later = reports.body(
        [
            *fixed,
            *findings.audit(
                [placed(mutated(defaulted_gpu_pod(name="bare"), policy, facts=FACTS))],
                policy,
                FACTS,
                check_nodes=False,
            ).findings,
        ],
        first,
        now=300,
        policy_hash=policy.hash,
    )
    stamps = {(r["resources"][0]["name"], r["rule"]): r["timestamp"]["seconds"] for r in later["results"]}
    assert stamps[("nightly", "priority")] == 100 and stamps[("bare", "priority")] == 300


# --- what people and programs read ---------------------------------------------------------------------


def test_the_table_groups_by_namespace_most_serious_first(policy: Policy) -> None:
    cpu_pod = placed(
        pod(container(requests={"cpu": "1"}), name="crowd", nodeSelector={GPU_LABEL: "true"}),
        namespace="other",
    )
    fixed = placed(mutated(templated("Deployment", name="ok"), policy, facts=FACTS), namespace="other")
    text = cli_audit.render(findings.audit([*chain(), fixed, cpu_pod], policy, FACTS), "table")
    lines = text.splitlines()
    assert lines[0].split() == ["NAMESPACE", "WORKLOAD", "RULE", "VERDICT", "MESSAGE"]
    assert lines[1].split()[:4] == ["other", "Pod/crowd", "acceleratorNodeGuard", "deny"]
    assert lines[2].split() == ["other", "Deployment/ok", "pass"]
    namespaces = [line.split()[0] for line in lines[1:-2]]  # the rows, not the summary
    assert namespaces == sorted(namespaces, key=lambda n: (n == output.CLUSTER, n))  # grouped, nodes last
    assert any(line.split()[1:3] == ["Deployment/serve", "(2"] for line in lines)
    assert sum(1 for line in lines if line.startswith(output.CLUSTER)) == 3
    assert lines[-1].startswith("8 findings: 1 deny, 3 change, 2 warn, 2 pass, 0 skip; read ")


def test_json_and_yaml_print_the_same_document(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS, check_nodes=False)
    document = output.document(audit)
    assert yaml.safe_load(cli_audit.render(audit, "json")) == document
    assert yaml.safe_load(cli_audit.render(audit, "yaml")) == document


def test_the_document_names_every_rule_of_every_finding(policy: Policy) -> None:
    document = output.document(findings.audit(chain(), policy, FACTS, check_nodes=False))
    assert document["summary"] == {"deny": 0, "change": 3, "warn": 0, "pass": 0, "skip": 0}
    deployment = next(f for f in document["findings"] if f["kind"] == "Deployment")
    assert deployment["pods"] == 2 and [r["rule"] for r in deployment["rules"]] == list(RULE_IDS)


def test_rule_selection_keeps_only_those_results(policy: Policy) -> None:
    audit = findings.audit(chain(), policy, FACTS).only(["acceleratorNodeGuard"])
    assert {r.rule for f in audit.findings for r in f.results} == {"acceleratorNodeGuard"}


# --- the command line, without a cluster ---------------------------------------------------------------


def test_the_audit_command_parses_its_options() -> None:
    args = cli.parser().parse_args(
        ["audit", "-n", "team", "-o", "json", "--rule", "priority", "--fail-on", "deny"]
    )
    assert (args.namespace, args.output, args.rule, args.fail_on) == ("team", "json", ["priority"], "deny")
    assert args.policy_configmap == cli_audit.DEFAULT_POLICY_CONFIGMAP and not args.report
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["audit", "-n", "team", "-A"])


def test_a_kubeconfig_that_is_not_one_exits_with_the_usage_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for content in ("just a string", "- a\n- list\n", "{}"):
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(content)
        assert cli.main(["audit", "--kubeconfig", str(kubeconfig)]) == cli_output.EXIT_USAGE
        captured = capsys.readouterr()
        assert captured.out == "" and "no usable cluster credentials" in captured.err


class Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_shows_on_a_terminal_only_and_clears_its_line() -> None:
    for tty in (True, False):
        stream = Terminal(tty)
        with cli_output.Progress(0, "gpuguard audit: reading", stream) as progress:
            progress.show("pods: 500")
        line = "gpuguard audit: reading pods: 500"
        assert stream.getvalue() == (f"\r{line}\r{' ' * len(line)}\r" if tty else "")


def test_progress_keeps_quiet_while_work_is_quick() -> None:
    stream = Terminal(True)
    with cli_output.Progress(0, "reading", stream, after=3600.0) as progress:
        progress.show("pods: 500")
    assert stream.getvalue() == ""


def test_a_policy_configmap_that_names_no_configmap_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for value in ("gpuguard", "/gpuguard-policy", "a/b/c"):
        assert cli.main(["audit", "--policy-configmap", value]) == cli_output.EXIT_USAGE
        captured = capsys.readouterr()
        assert captured.out == "" and "expected NAMESPACE/NAME" in captured.err

"""What the offline commands read, read as kubectl reads it: -f (repeated, directories, stdin, kind: List),
-n against the objects' own namespaces, --policy as a ConfigMap, --facts; every error names the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.manifests import EXAMPLES, Gpuguard
from webhook.cli import inputs, output
from webhook.policy.facts import NodeInfo, PriorityClassInfo

JOB = EXAMPLES / "gpu-training-job.yaml"
CPU_ON_GPU_NODE = EXAMPLES / "cpu-pod-on-gpu-node.yaml"


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def kinds(text: str) -> list[str]:
    return [document["kind"] for document in yaml.safe_load_all(text)]


def write(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_a_list_is_expanded_by_mutate_and_validate(gpuguard: Gpuguard, tmp_path: Path) -> None:
    listed = write(tmp_path / "list.yaml", output.as_list([load(JOB), load(CPU_ON_GPU_NODE)]))
    mutated = gpuguard("mutate", "-f", str(listed))
    assert kinds(mutated.out) == ["Job", "Pod"]
    assert "gpuguard.io/rules" in mutated.out
    validated = gpuguard("validate", "-f", str(listed))
    assert validated.code == 1
    assert validated.out.splitlines()[-1] == "2 objects: 1 passed, 0 warned, 1 denied"


def test_lists_nest_and_any_kind_of_list_expands(tmp_path: Path) -> None:
    nested = {"apiVersion": "v1", "kind": "PodList", "items": [output.as_list([load(CPU_ON_GPU_NODE)])]}
    (manifest,) = inputs.read_manifests([str(write(tmp_path / "nested.yaml", nested))])
    assert manifest.title == "Pod/log-shipper"


def test_every_f_is_read_in_order(gpuguard: Gpuguard) -> None:
    run = gpuguard("mutate", "-f", str(CPU_ON_GPU_NODE), "-f", str(JOB), "--filename", str(CPU_ON_GPU_NODE))
    assert kinds(run.out) == ["Pod", "Job", "Pod"]


def test_a_directory_is_read_like_kubectl_reads_it(gpuguard: Gpuguard, tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    (folder / "nested").mkdir(parents=True)
    write(folder / "b-job.yml", JOB.read_text())
    (folder / "a-pod.json").write_text(json.dumps(load(CPU_ON_GPU_NODE)))
    write(folder / "notes.txt", "not a manifest")
    write(folder / "nested" / "c-job.yaml", JOB.read_text())
    assert kinds(gpuguard("mutate", "-f", str(folder)).out) == ["Pod", "Job"]  # sorted; .txt skipped
    assert kinds(gpuguard("mutate", "-R", "-f", str(folder)).out) == ["Pod", "Job", "Job"]
    empty = gpuguard("mutate", "-f", str(folder / "nested" / ".." / "nested" / "missing"))
    assert empty.code == 2 and "missing: no such file" in empty.err


def test_a_namespace_conflicting_with_the_objects_is_refused(gpuguard: Gpuguard, tmp_path: Path) -> None:
    pod = load(CPU_ON_GPU_NODE)
    pod["metadata"]["namespace"] = "kube-system"
    manifest = write(tmp_path / "pod.yaml", pod)
    refused = gpuguard("validate", "-f", str(manifest), "-n", "team")
    assert refused.code == 2
    assert refused.err == (
        f"gpuguard: {manifest}: Pod/log-shipper: the namespace from the provided object 'kube-system' does"
        " not match the namespace 'team' given with -n: drop -n, or pass -n kube-system\n"
    )
    assert refused.out == ""  # refused before anything is printed
    # The same namespace, or none given: the object's own namespace decides (kube-system is exempt).
    for extra in (["-n", "kube-system"], []):
        assert gpuguard("validate", "-f", str(manifest), *extra).code == 0


def test_n_applies_to_objects_without_a_namespace(tmp_path: Path) -> None:
    listed = write(tmp_path / "list.yaml", output.as_list([load(JOB), load(CPU_ON_GPU_NODE)]))
    manifests = inputs.read_manifests([str(listed)], namespace="research")
    assert [m.namespace for m in manifests] == ["research", "research"]
    assert [m.namespace for m in inputs.read_manifests([str(listed)])] == ["default", "default"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "just a string\n", "document 1: not a Kubernetes object: a str, not a mapping", id="string"
        ),
        pytest.param(
            "foo: bar\n", "document 1: not a Kubernetes object: apiVersion and kind not set", id="map"
        ),
        pytest.param("- a\n- b\n", "document 1: not a Kubernetes object: a list, not a mapping", id="list"),
        pytest.param(
            "kind: Pod\n", "document 1: not a Kubernetes object: apiVersion not set", id="no-version"
        ),
        pytest.param(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\n42\n",
            "document 2: not a Kubernetes",
            id="second",
        ),
        pytest.param(
            "apiVersion: v1\nkind: List\nitems: [{apiVersion: v1, kind: Pod}, x]\n",
            "document 1, items[1]: not a Kubernetes object",
            id="list-item",
        ),
    ],
)
def test_documents_that_are_not_objects_are_refused(
    gpuguard: Gpuguard, tmp_path: Path, text: str, message: str
) -> None:
    manifest = write(tmp_path / "odd.yaml", text)
    for command in ("mutate", "validate"):
        run = gpuguard(command, "-f", str(manifest))
        assert run.code == 2
        assert run.err.startswith(f"gpuguard: {manifest}: {message}"), run.err


def test_yaml_errors_name_the_file_and_line(gpuguard: Gpuguard, tmp_path: Path) -> None:
    manifest = write(tmp_path / "broken.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: [\n")
    run = gpuguard("validate", "-f", str(manifest))
    assert run.code == 2
    assert run.err.startswith(f"gpuguard: {manifest}: not valid YAML: line 4, column 1: ")
    assert "<unicode string>" not in run.err
    piped = gpuguard("validate", "-f", "-", stdin="a: b: c\n")
    assert piped.err.startswith("gpuguard: stdin: not valid YAML: line 1, column 5: ")


def test_unreadable_files_are_named(gpuguard: Gpuguard, tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"apiVersion: v1\nkind: \xff\xfe\n")
    run = gpuguard("mutate", "-f", str(binary))
    assert (run.code, run.err) == (2, f"gpuguard: {binary}: not UTF-8 text (byte 0xff at offset 21)\n")
    missing = gpuguard("mutate", "-f", "absent.yaml")
    assert (missing.code, missing.err) == (2, "gpuguard: absent.yaml: no such file\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = gpuguard("mutate", "-f", str(empty))
    assert nothing.code == 2 and "no .yaml, .yml, .json files" in nothing.err


# --- --policy ---------------------------------------------------------------------------------------------


def configmap(policy_yaml: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gpuguard-policy", "namespace": "gpuguard"},
        "data": {"policy.yaml": policy_yaml, **data} if policy_yaml else data,
    }


def test_a_configmap_is_read_as_its_policy(gpuguard: Gpuguard, tmp_path: Path) -> None:
    warn = write(tmp_path / "configmap.yaml", configmap("rules:\n  acceleratorNodeGuard: {mode: warn}\n"))
    run = gpuguard("validate", "-f", str(CPU_ON_GPU_NODE), "--policy", str(warn))
    assert run.code == 0 and run.out.splitlines()[-1] == "1 object: 0 passed, 1 warned, 0 denied"


def test_a_configmap_without_the_policy_key_is_named(tmp_path: Path) -> None:
    other = write(tmp_path / "configmap.yaml", configmap("", config="x"))
    with pytest.raises(output.UsageError) as caught:
        inputs.load_policy(str(other))
    assert str(caught.value) == (
        f"{other}: ConfigMap gpuguard/gpuguard-policy has no data.policy.yaml (its data keys: config);"
        " gpuguard reads the policy from that key"
    )


def test_a_manifest_given_as_the_policy_is_called_one(tmp_path: Path) -> None:
    with pytest.raises(output.UsageError, match="a Job manifest, not a policy"):
        inputs.load_policy(str(JOB))


def test_errors_in_a_configmaps_policy_say_where(tmp_path: Path) -> None:
    bad = write(tmp_path / "configmap.yaml", configmap("rules:\n  priorty: {}\n"))
    with pytest.raises(output.UsageError) as caught:
        inputs.load_policy(str(bad))
    assert str(caught.value) == (
        f"{bad} (ConfigMap gpuguard/gpuguard-policy, key policy.yaml): invalid policy:"
        " rules.priorty: unknown key; did you mean 'priority'?"
    )


# --- --facts ----------------------------------------------------------------------------------------------

CLUSTER = EXAMPLES / "tests" / "cluster-facts" / "facts.yaml"


def test_facts_are_read_by_the_servers_converters() -> None:
    facts = inputs.load_facts(str(CLUSTER))
    assert facts is not None
    assert facts.priority_classes is not None
    assert facts.priority_classes["batch-low"] == PriorityClassInfo(100, "PreemptLowerPriority", False)
    assert facts.labels_of("research") == {
        "kubernetes.io/metadata.name": "research",
        "gpuguard.io/mode": "audit",
    }
    assert facts.nodes is not None
    assert facts.nodes["gpu-node-1"] == NodeInfo(
        {"kubernetes.io/hostname": "gpu-node-1", "nvidia.com/gpu.present": "true"}, ("cpu", "nvidia.com/gpu")
    )
    assert (facts.claims, facts.claim_templates) == (None, None)  # not in the file: unknown, as offline


def test_facts_change_the_answer_as_they_change_the_servers(gpuguard: Gpuguard, tmp_path: Path) -> None:
    pod = write(
        tmp_path / "pod.yaml",
        {
            **load(CPU_ON_GPU_NODE),
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "c", "image": "busybox"}]},
        },
    )
    offline = gpuguard("validate", "-f", str(pod))
    assert offline.code == 0  # without facts, a node name says nothing
    informed = gpuguard("validate", "-f", str(pod), "--facts", str(CLUSTER))
    assert informed.code == 1
    assert "denied" in informed.out


def test_facts_refuse_what_the_server_does_not_watch(gpuguard: Gpuguard) -> None:
    run = gpuguard("validate", "-f", str(JOB), "--facts", str(JOB))
    assert run.code == 2
    assert run.err.startswith(
        f"gpuguard: {JOB}: Job/llm-finetune: not a cluster fact; --facts reads PriorityClass"
    )

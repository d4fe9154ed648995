"""Real-world manifests (shared/corpus): no exceptions, GPU workloads mutated, node agents untouched.

Every file in the corpus is listed below with what should happen to each of its documents, so a new
file must be classified here before the suite passes. The corpus lives outside the repository
(tests/corpus.py): without it these tests are skipped, and the run's summary says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from tests.harness import corpus
from tests.harness.manifests import apply, assert_same_json, job_errors, pod_spec_errors
from webhook.policy import engine, patch
from webhook.policy.model import Policy
from webhook.policy.rules import device_software
from webhook.policy.workload import locate

CORPUS = corpus.CORPUS
pytestmark = pytest.mark.corpus

Expect = Literal["mutated", "untouched"]
M: Expect = "mutated"
U: Expect = "untouched"

# Per document, in file order. Namespaces, DRA claims/templates and DeviceClasses are never workloads.
EXPECTED: dict[str, tuple[Expect, ...]] = {
    "aws-neuron-eks-samples--qwen-vllm-dra-resourceclaim-deployment.yaml": (M,),
    "aws-neuron-eks-samples--qwen-vllm-neuroncore-deployment.yaml": (M,),
    "aws-neuron-eks-samples--sd21-inf2-compile-job.yaml": (M,),
    "aws-neuron-eks-samples--xl-trn2-resourceclaimtemplate-v1beta1.yaml": (U,),
    "dra-example-driver--basic-resourceclaimtemplate.yaml": (U, U, M, M),
    # The second pod asks for example.com/gpu, the example driver's GPU.
    "dra-example-driver--extended-resource-request.yaml": (U, M, M),
    "dra-example-driver--initcontainer-shared-gpu.yaml": (U, U, M),
    "dra-example-driver--shared-resourceclaim-across-pods.yaml": (U, U, M, M),
    "gke-samples--kueue-suspended-indexed-finetune-job.yaml": (M,),
    "gke-samples--nccl-rdma-installer-daemonset.yaml": (U,),
    "gke-samples--saxml-tpu-v5e-deployment.yaml": (M,),
    "gke-samples--tensorflow-gpu-statefulset.yaml": (M,),
    "gke-samples--tgi-llama3-70b-2gpu-spot-deployment.yaml": (M,),
    "gke-samples--tpu-checkpoint-converter-job.yaml": (M,),
    "gke-samples--triton-l4-deployment.yaml": (M,),
    "gke-samples--vllm-gemma-2b-l4-deployment.yaml": (M,),
    "ibm-autopilot--gpu-pcie-bw-cronjob.yaml": (M,),
    "intel-device-plugins--intelgpu-i915-job.yaml": (M,),
    # An Intel NPU (npu.intel.com/accel): an accelerator workload like the TPU and Neuron ones.
    "intel-device-plugins--npu-workload-job.yaml": (M,),
    "intel-device-plugins--pytorch-xpu-training-pod.yaml": (M,),
    "k8s-website--job-backoff-limit-per-index-failindex.yaml": (U,),
    "k8s-website--job-pod-failure-policy-config-issue.yaml": (U,),
    "k8s-website--job-pod-failure-policy-example.yaml": (U,),
    "k8s-website--job-pod-failure-policy-failjob-flow-style.yaml": (U,),
    "k8s-website--job-pod-failure-policy-ignore.yaml": (U,),
    "kueue--cpu-only-cronjob.yaml": (U,),
    "kueue--dra-resourceclaimtemplate-job.yaml": (U, M),
    "kueue--hami-vgpu-deployment.yaml": (U, M),
    "kueue--provisioning-gpu-job-generatename.yaml": (M,),
    "llm-on-openshift--vllm-gaudi-hpu-deployment.yaml": (M,),
    "llm-on-openshift--vllm-gpu-exported-style-deployment.yaml": (M,),
    "nvidia-dcgm-exporter--daemonset.yaml": (U,),
    "nvidia-dcgm-exporter--nbody-gpu-pod.yaml": (M,),
    # Reaches GPUs through env vars and a CDI annotation, requests none: nothing marks it for mutation.
    "nvidia-gpu-operator--cuda-validator-pod-no-gpu-limit.yaml": (U,),
    "nvidia-gpu-operator--plugin-test-deployment-shared-gpu.yaml": (M,),
    "nvidia-gpu-operator--test-gpu-pod.yaml": (M,),
    "nvidia-k8s-device-plugin--device-plugin-daemonset.yaml": (U,),
    "nvidia-k8s-device-plugin--e2e-gpu-job.yaml": (M,),
    "nvidia-k8s-device-plugin--gfd-daemonset-mig-mixed.yaml": (U,),
    "nvidia-k8s-device-plugin--readme-gpu-pod.yaml": (M,),
    "nvidia-k8s-dra-driver-gpu--deployment-mig-resourceclaimtemplate.yaml": (U, U, M),
    "nvidia-k8s-dra-driver-gpu--deviceclass-mig-extended-resource-pod.yaml": (U, U, M),
    "nvidia-k8s-dra-driver-gpu--pod-mps-shared-gpu-claim.yaml": (U, U, M),
    "nvidia-nim-deploy--nim-cache-download-gpu-job.yaml": (M,),
    "nvidia-nim-deploy--nim-llm-statefulset-aks-taint.yaml": (M,),
    "ollama--gpu-deployment.yaml": (U, M),
    "rocm-k8s-device-plugin--amdgpu-device-plugin-daemonset.yaml": (U,),
    "rocm-k8s-device-plugin--jax-multi-gpu-pod.yaml": (M,),
    "rocm-k8s-device-plugin--pytorch-amd-gpu-pod.yaml": (M,),
    "rocm-k8s-device-plugin--vllm-serve-deployment.yaml": (M,),
    # GPU sharing through Volcano's device plugin: volcano.sh/gpu-memory, volcano.sh/vgpu-number.
    "volcano-devices--gpu-share-memory-pod.yaml": (M,),
    "volcano-devices--vgpu-number-memory-pod.yaml": (M,),
}
DAEMONSETS = sorted(name for name in EXPECTED if "daemonset" in name)


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _namespace(doc: Any) -> str:
    return (doc.get("metadata") or {}).get("namespace") or "default"


def _spec_and_job(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if obj["kind"] == "Pod":
        return obj["spec"], None
    job_spec = obj["spec"]["jobTemplate"]["spec"] if obj["kind"] == "CronJob" else obj["spec"]
    return job_spec["template"]["spec"], job_spec if obj["kind"] in ("Job", "CronJob") else None


def test_every_corpus_file_is_classified() -> None:
    assert sorted(path.name for path in corpus.FILES) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=lambda name: name.removesuffix(".yaml"))
def test_corpus_manifest(policy: Policy, name: str) -> None:
    documents = _documents(CORPUS / name)
    expected = EXPECTED[name]
    assert len(documents) == len(expected), "documents in the file changed"
    for index, (doc, expect) in enumerate(zip(documents, expected, strict=True)):
        where = f"{name}[{index}] {doc.get('kind')}"
        namespace = _namespace(doc)
        result = engine.mutate(doc, policy, namespace=namespace)
        engine.validate(result.obj, policy, namespace=namespace)
        assert ("mutated" if result.changed else "untouched") == expect, f"{where}: skipped={result.skipped}"
        assert not engine.mutate(result.obj, policy, namespace=namespace).changed, f"{where}: not idempotent"
        if not result.changed:
            assert result.obj is doc
            continue
        assert_same_json(apply(doc, patch.diff(doc, result.obj)), result.obj)
        spec_in, job_in = _spec_and_job(doc)
        spec_out, job_out = _spec_and_job(result.obj)
        assert pod_spec_errors(spec_out) == [], where
        if job_in is not None and job_out is not None and not job_errors(job_in, spec_in):
            assert job_errors(job_out, spec_out) == [], where


@pytest.mark.parametrize("name", DAEMONSETS, ids=lambda name: name.removesuffix(".yaml"))
def test_corpus_daemonset_pods_are_neither_mutated_nor_denied(policy: Policy, name: str) -> None:
    # What the DaemonSet controller creates from these templates: node agents on GPU nodes, exempt.
    (daemonset,) = _documents(CORPUS / name)
    template = daemonset["spec"]["template"]
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "1", "controller": True}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "generateName": "agent-", "ownerReferences": [owner]},
        "spec": template["spec"],
    }
    namespace = _namespace(daemonset)
    assert not engine.mutate(pod, policy, namespace=namespace).changed
    assert engine.validate(pod, policy, namespace=namespace).denials == []


def _device_software(daemonset: dict[str, Any], policy: Policy) -> list[str]:
    workload = locate(daemonset, daemonsets=True)
    assert workload is not None
    return [c["name"] for _, c, _ in device_software(workload, policy.rules.trustedDeviceSoftware)]


# The vendors' own device software in the corpus, by container: what the default policy recognises.
DEVICE_SOFTWARE = {
    "gke-samples--nccl-rdma-installer-daemonset.yaml": ["nccl-rdma-installer"],  # GKE's driver directory
    "nvidia-dcgm-exporter--daemonset.yaml": ["dcgm-exporter"],  # pod-resources
    "nvidia-k8s-device-plugin--device-plugin-daemonset.yaml": ["nvidia-device-plugin-ctr"],
    "nvidia-k8s-device-plugin--gfd-daemonset-mig-mixed.yaml": ["gpu-feature-discovery"],  # features.d
    "rocm-k8s-device-plugin--amdgpu-device-plugin-daemonset.yaml": ["amdgpu-dp-cntr"],
}


@pytest.mark.parametrize("name", DAEMONSETS, ids=lambda name: name.removesuffix(".yaml"))
def test_corpus_device_software_from_its_vendor_passes_and_from_elsewhere_is_refused(
    policy: Policy, name: str
) -> None:
    (daemonset,) = _documents(CORPUS / name)
    namespace = _namespace(daemonset)  # kube-system for most: checked there too
    assert _device_software(daemonset, policy) == DEVICE_SOFTWARE[name]
    assert engine.validate(daemonset, policy, namespace=namespace).decisions == ()
    spec = daemonset["spec"]["template"]["spec"]
    for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        if container["name"] in DEVICE_SOFTWARE[name]:
            container["image"] = "quay.io/example/lookalike:1"
    denials = engine.validate(daemonset, policy, namespace=namespace).denials
    assert len(denials) == len(DEVICE_SOFTWARE[name])
    assert all("image quay.io/example/lookalike:1 is not from a trusted source" in d for d in denials)


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=lambda name: name.removesuffix(".yaml"))
def test_corpus_workloads_are_no_device_software(policy: Policy, name: str) -> None:
    # GPU workloads, privileged ones included, never reach a device software path.
    for doc in _documents(CORPUS / name):
        if doc.get("kind") != "DaemonSet":
            result = engine.validate(engine.mutate(doc, policy).obj, policy, namespace=_namespace(doc))
            assert [
                d for d in result.decisions if d.rule in ("trustedDeviceSoftware", "driverCompatibility")
            ] == []

"""The AdmissionReviews the bench sends, built in memory: the shapes the API server really sends.

The API server posts the object *after* its own defaulting and after the managedFields of the create have
been computed, so a plain 1 KB manifest arrives as a ~10 KB review: defaulted tolerations (the 300 s
not-ready/unreachable pair), the projected service-account volume, terminationMessagePath and friends on
every container, and a managedFields entry whose fieldsV1 mirrors the object. That is what is built here.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

from tests.harness import manifests

JSON = dict[str, Any]

NAMESPACE = "ml-team"
USER = "system:serviceaccount:kube-system:job-controller"
KIB = 1024


# A CREATE by the Job controller's ServiceAccount, through kubectl's field manager: what a real review names.
USER_INFO: JSON = {
    "username": USER,
    "uid": "c3d43d5b-7a5e-4d40-9d52-3b3f8b3a9f1e",
    "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"],
    "extra": {"authentication.kubernetes.io/credential-id": ["JTI=6d4b4b1e-0c8a-4c8e-9d1e-0e3e1c8f5a2b"]},
}
OPTIONS: JSON = {**manifests.CREATE_OPTIONS, "fieldManager": "kubectl-create"}


def admission_review(obj: JSON, *, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002") -> JSON:
    """An admission.k8s.io/v1 review of `obj` with every field the API server fills in for a CREATE."""
    return manifests.admission_review_json(
        obj, uid=uid, namespace=NAMESPACE, user_info=USER_INFO, options=OPTIONS
    )


def _service_account_volume(suffix: str) -> JSON:
    return {
        "name": f"kube-api-access-{suffix}",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
            "defaultMode": 420,
        },
    }


def _container(name: str, image: str, *, gpus: int, env: int, suffix: str) -> JSON:
    resources: JSON = {"limits": {"cpu": "8", "memory": "64Gi"}, "requests": {"cpu": "4", "memory": "32Gi"}}
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = str(gpus)
        resources["requests"]["nvidia.com/gpu"] = str(gpus)
    return {
        "name": name,
        "image": image,
        "command": ["torchrun", "--nproc-per-node=8", "train.py"],
        "args": ["--config", "/etc/train/config.yaml", "--checkpoint-dir", "/checkpoints"],
        "ports": [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}],
        "env": [{"name": f"TRAIN_SETTING_{i:02d}", "value": f"value-{i:04d}"} for i in range(env)]
        + [
            {
                "name": "POD_NAME",
                "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
            }
        ],
        "resources": resources,
        "volumeMounts": [
            {"name": "checkpoints", "mountPath": "/checkpoints"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {
                "name": f"kube-api-access-{suffix}",
                "readOnly": True,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            },
        ],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _fields_v1(obj: JSON) -> JSON:
    """A managedFields fieldsV1 tree in the API server's `f:` notation for every field of `obj`."""

    def tree(value: Any) -> Any:
        if isinstance(value, dict):
            return {f"f:{key}": tree(item) for key, item in value.items()} | {".": {}}
        if isinstance(value, list):
            return {
                f'k:{{"name":"{item.get("name", i)}"}}': tree(item)
                for i, item in enumerate(value)
                if isinstance(item, dict)
            } | {".": {}}
        return {}

    fields: JSON = tree({key: obj[key] for key in ("metadata", "spec") if key in obj})
    fields.pop(".", None)
    return fields


def _managed(obj: JSON, manager: str = "kubectl-create") -> JSON:
    entry = {
        "manager": manager,
        "operation": "Update",
        "apiVersion": obj.get("apiVersion", "v1"),
        "time": "2026-05-12T09:14:03Z",
        "fieldsType": "FieldsV1",
        "fieldsV1": _fields_v1(obj),
    }
    obj["metadata"]["managedFields"] = [entry]
    return obj


def _pod_spec(*, gpus: int, env: int, suffix: str, restart: str = "Always") -> JSON:
    """A pod spec as the API server has defaulted it."""
    return {
        "volumes": [
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            _service_account_volume(suffix),
        ],
        "containers": [
            _container("trainer", "nvcr.io/nvidia/pytorch:24.05-py3", gpus=gpus, env=env, suffix=suffix),
            _container("log-shipper", "fluent/fluent-bit:3.0", gpus=0, env=2, suffix=suffix),
        ],
        "initContainers": [
            _container("fetch-dataset", "busybox:1.36", gpus=0, env=2, suffix=suffix),
        ],
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "securityContext": {"runAsNonRoot": True, "fsGroup": 1000},
        "schedulerName": "default-scheduler",
        "tolerations": [
            {
                "key": "node.kubernetes.io/not-ready",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            },
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 300,
            },
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }


def _metadata(name: str, *, labels: dict[str, str] | None = None) -> JSON:
    return {
        "name": name,
        "namespace": NAMESPACE,
        "labels": labels or {"app.kubernetes.io/name": name, "team": "ml-research"},
        "annotations": {"example.com/owner": "ml-research@example.com"},
    }


def gpu_pod(*, env: int = 2) -> JSON:
    """The ~10 KB review of an 8-GPU training pod, defaulted and with managedFields, as the API server sends it."""
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": _metadata("llm-finetune-0"),
        "spec": _pod_spec(gpus=8, env=env, suffix="x7k2p"),
    }
    return admission_review(_managed(pod))


def small_cpu_pod() -> JSON:
    """A plain nginx pod (no accelerator): the common case gpuguard must pass through untouched."""
    suffix = "q8rtv"
    spec = _pod_spec(gpus=0, env=0, suffix=suffix)
    container = {
        "name": "web",
        "image": "nginx:1.27",
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    spec = {
        key: spec[key]
        for key in (
            "restartPolicy",
            "terminationGracePeriodSeconds",
            "dnsPolicy",
            "schedulerName",
            "priority",
        )
    } | {"containers": [container], "tolerations": spec["tolerations"][:2], "securityContext": {}}
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": _metadata("web-0", labels={"app": "web"}),
        "spec": spec,
    }
    return admission_review(pod)


def gpu_job() -> JSON:
    """A GPU training Job as the API server defaults it (completions, backoffLimit, podReplacementPolicy...)."""
    template_spec = _pod_spec(gpus=8, env=6, suffix="jb4w9", restart="Never")
    # Templates carry no defaulted tolerations, service-account volume or priority: those are pod-time.
    template_spec["tolerations"] = template_spec["tolerations"][2:]
    template_spec["volumes"] = template_spec["volumes"][:2]
    for container in (*template_spec["containers"], *template_spec["initContainers"]):
        container["volumeMounts"] = container["volumeMounts"][:2]
    del template_spec["priority"], template_spec["preemptionPolicy"], template_spec["serviceAccount"]
    template_spec["serviceAccountName"] = "trainer"
    job = {
        "kind": "Job",
        "apiVersion": "batch/v1",
        "metadata": _metadata("llm-finetune"),
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 4,
            "completionMode": "NonIndexed",
            "suspend": False,
            "manualSelector": False,
            "podReplacementPolicy": "TerminatingOrFailed",
            "template": {
                "metadata": {
                    "labels": {"batch.kubernetes.io/job-name": "llm-finetune", "job-name": "llm-finetune"}
                },
                "spec": template_spec,
            },
        },
    }
    return admission_review(_managed(job))


def deployment() -> JSON:
    """A GPU inference Deployment as the API server defaults it (strategy, revisionHistoryLimit...)."""
    template_spec = _pod_spec(gpus=1, env=4, suffix="dp3m1")
    template_spec["tolerations"] = template_spec["tolerations"][2:]
    template_spec["volumes"] = template_spec["volumes"][:2]
    for container in (*template_spec["containers"], *template_spec["initContainers"]):
        container["volumeMounts"] = container["volumeMounts"][:2]
    del template_spec["priority"], template_spec["preemptionPolicy"], template_spec["serviceAccount"]
    labels = {"app": "vllm-server"}
    deploy = {
        "kind": "Deployment",
        "apiVersion": "apps/v1",
        "metadata": _metadata("vllm-server", labels=labels),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": template_spec},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
            },
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": 600,
        },
    }
    return admission_review(_managed(deploy))


def minimal_gpu_pod() -> JSON:
    """The smallest realistic GPU pod review (~1 KB): the base of the size series."""
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": "cuda-0", "namespace": NAMESPACE},
        "spec": {
            "containers": [
                {
                    "name": "cuda",
                    "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "priority": 0,
        },
    }
    return admission_review(pod)


def sized_gpu_pod(target_bytes: int) -> JSON:
    """The minimal GPU pod grown to about `target_bytes` with env vars, as large pods are in practice.

    Env vars sit inside the GPU container, which the rules walk, so a size-dependent cost anywhere on the
    hot path (decode, copy, diff, encode) shows up here.
    """
    review = minimal_gpu_pod()
    base = len(orjson.dumps(review))
    if target_bytes <= base:
        return review
    container = review["request"]["object"]["spec"]["containers"][0]
    entry = len(orjson.dumps({"name": "SETTING_000000", "value": "v" * 80})) + 1
    count = (target_bytes - base) // entry
    container["env"] = [{"name": f"SETTING_{i:06d}", "value": "v" * 80} for i in range(count)]
    return review


def padded(review: JSON, fields: int) -> JSON:
    """`review` with `fields` extra fields where no rule looks: unknown top-level keys and a wide managedFields."""
    result = copy.deepcopy(review)
    request = result["request"]
    half = fields // 2
    request["x-padding"] = {f"unknown-field-{i:05d}": i for i in range(half)}
    managed = request["object"]["metadata"].setdefault("managedFields", [])
    managed.append(
        {
            "manager": "padding",
            "operation": "Update",
            "apiVersion": "v1",
            "fieldsType": "FieldsV1",
            "fieldsV1": {f"f:field-{i:05d}": {} for i in range(fields - half)},
        }
    )
    return result


PAYLOADS: dict[str, Any] = {
    "small CPU pod": small_cpu_pod,
    "10 KB GPU pod": gpu_pod,
    "GPU Job": gpu_job,
    "GPU Deployment": deployment,
    "1 MB GPU pod": lambda: sized_gpu_pod(1024 * KIB),
}


def encoded(review: JSON) -> bytes:
    return orjson.dumps(review)


if __name__ == "__main__":
    for label, build in PAYLOADS.items():
        print(f"{label}: {len(encoded(build()))} bytes")

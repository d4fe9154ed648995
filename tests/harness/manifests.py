"""Builders the tiers and the bench share: manifests, AdmissionReviews, policies and Kubernetes' own checks.

Manifests are plain dicts shaped like what the API server sends (or what a user writes), so a test
reads as the object it is about. The test modules import them (`from tests.harness.manifests import
...`); the unit tier's fixtures live in tests/unit/conftest.py.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import orjson
import yaml

from tests.harness import REPO_ROOT
from webhook import cli
from webhook.admission import review
from webhook.policy import engine
from webhook.policy.model import Policy, parse_policy
from webhook.policy.workload import locate

JSON = dict[str, Any]

EXAMPLES = REPO_ROOT / "examples"

GPU = "nvidia.com/gpu"
NOT_READY = "node.kubernetes.io/not-ready"
UNREACHABLE = "node.kubernetes.io/unreachable"
V1 = "admission.k8s.io/v1"
V1BETA1 = "admission.k8s.io/v1beta1"
RULES_ANNOTATION = "gpuguard.io/rules"
POLICY_ANNOTATION = "gpuguard.io/policy"
SUPPORTED_VERSIONS = (V1, V1BETA1)

# What kube-apiserver's DefaultTolerationSeconds plugin appends to every pod before webhooks run.
DEFAULTED_TOLERATIONS: tuple[JSON, ...] = (
    {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
    {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
)

# --- policies ----------------------------------------------------------------------------------------


def make_policy(overrides: Mapping[str, Any] | None = None) -> Policy:
    """The default policy with `overrides` laid over it, parsed exactly as a ConfigMap's YAML would be."""
    return parse_policy(yaml.safe_dump(dict(overrides or {})))


# --- manifests ---------------------------------------------------------------------------------------


def container(
    name: str = "main",
    *,
    gpus: int = 0,
    resource: str = GPU,
    limits: Mapping[str, Any] | None = None,
    requests: Mapping[str, Any] | None = None,
    claims: Iterable[str] = (),
    restart_policy: str | None = None,
    lifecycle: JSON | None = None,
    image: str | None = None,
) -> JSON:
    """A container; `gpus` > 0 asks for that many `resource` in its limits. The image is a made-up one
    unless given (objects a real API server or kubelet takes need one it can pull or has)."""
    result: JSON = {"name": name, "image": image or f"registry.example/{name}:1"}
    resources: JSON = {}
    all_limits = dict(limits or {})
    if gpus:
        all_limits[resource] = gpus
    if all_limits:
        resources["limits"] = all_limits
    if requests:
        resources["requests"] = dict(requests)
    claim_list = [{"name": claim} for claim in claims]
    if claim_list:
        resources["claims"] = claim_list
    if resources:
        result["resources"] = resources
    if restart_policy is not None:
        result["restartPolicy"] = restart_policy
    if lifecycle is not None:
        result["lifecycle"] = lifecycle
    return result


def pod_spec(
    *containers: JSON,
    init_containers: Iterable[JSON] = (),
    restart_policy: str | None = None,
    tolerations: Iterable[JSON] | None = None,
    **fields: Any,
) -> JSON:
    spec: JSON = {"containers": list(containers) or [container()]}
    init = list(init_containers)
    if init:
        spec["initContainers"] = init
    if restart_policy is not None:
        spec["restartPolicy"] = restart_policy
    if tolerations is not None:
        spec["tolerations"] = [dict(t) for t in tolerations]
    spec.update(fields)
    return spec


def pod(
    *containers: JSON,
    name: str | None = "trainer",
    generate_name: str | None = None,
    namespace: str | None = None,
    annotations: Mapping[str, str] | None = None,
    owner: str | None = None,
    **spec_fields: Any,
) -> JSON:
    """A bare Pod; `owner` names the kind of its controller (ownerReferences[].controller: true)."""
    metadata: JSON = {}
    if name is not None:
        metadata["name"] = name
    if generate_name is not None:
        metadata["generateName"] = generate_name
    if namespace is not None:
        metadata["namespace"] = namespace
    if annotations:
        metadata["annotations"] = dict(annotations)
    if owner is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner, "name": "owner", "uid": "1", "controller": True}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": pod_spec(*containers, **spec_fields),
    }


def gpu_pod(**kwargs: Any) -> JSON:
    """A Pod with one container asking for one nvidia.com/gpu, as a user writes it (no API defaults)."""
    return pod(container(gpus=1), **kwargs)


def defaulted_gpu_pod(**kwargs: Any) -> JSON:
    """A GPU Pod as a mutating webhook receives it: API defaults (tolerations, grace, priority) applied."""
    kwargs.setdefault("restart_policy", "Always")
    kwargs.setdefault("tolerations", DEFAULTED_TOLERATIONS)
    kwargs.setdefault("terminationGracePeriodSeconds", 30)
    kwargs.setdefault("priority", 0)
    kwargs.setdefault("preemptionPolicy", "PreemptLowerPriority")
    return gpu_pod(**kwargs)


def job(
    *containers: JSON,
    name: str = "train",
    restart_policy: str = "Never",
    template: Mapping[str, Any] | None = None,
    **job_fields: Any,
) -> JSON:
    """A batch/v1 Job whose template runs `containers` (one GPU container by default).

    `template` holds extra pod-spec fields for the template; `job_fields` go into the Job's spec.
    """
    template_spec = pod_spec(
        *(containers or (container(gpus=1),)), restart_policy=restart_policy, **dict(template or {})
    )
    spec: JSON = {"template": {"spec": template_spec}, **job_fields}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": spec}


def cronjob(
    *containers: JSON,
    name: str = "nightly",
    restart_policy: str = "Never",
    template: Mapping[str, Any] | None = None,
    **job_fields: Any,
) -> JSON:
    job_spec = job(*containers, restart_policy=restart_policy, template=template, **job_fields)["spec"]
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": name},
        "spec": {"schedule": "0 2 * * *", "jobTemplate": {"spec": job_spec}},
    }


def templated(kind: str, *containers: JSON, name: str = "serve", **spec_fields: Any) -> JSON:
    """A Deployment, StatefulSet, ReplicaSet or DaemonSet (apps/v1) with a pod template."""
    template_spec = pod_spec(*(containers or (container(gpus=1),)), **spec_fields)
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": template_spec},
        },
    }


def spec_of(obj: Any) -> JSON:
    """The pod spec inside any supported object (the Pod's own, or its template's)."""
    workload = locate(obj)
    assert workload is not None, f"not a workload: {obj!r}"
    return workload.pod_spec


def job_spec_of(obj: Any) -> JSON:
    workload = locate(obj)
    assert workload is not None and workload.job_spec is not None, f"not a Job or CronJob: {obj!r}"
    return workload.job_spec


def tolerations_for(obj: Any, key: str) -> list[JSON]:
    return [t for t in spec_of(obj).get("tolerations", []) if t.get("key") == key]


# --- AdmissionReviews -------------------------------------------------------------------------------


# Who kube-apiserver names as the requester unless a builder says otherwise.
USER_INFO: JSON = {"username": "alice", "groups": ["system:authenticated"]}
CREATE_OPTIONS: JSON = {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}


def _group_version_kind(obj: Any) -> JSON:
    api_version = obj.get("apiVersion", "v1") if isinstance(obj, dict) else "v1"
    group, _, version = api_version.rpartition("/")
    kind = obj.get("kind", "Pod") if isinstance(obj, dict) else "Pod"
    return {"group": group, "version": version, "kind": kind}


def admission_request(
    obj: Any,
    *,
    uid: str = "0f6a1d5e-uid",
    operation: str = "CREATE",
    namespace: str | None = None,
    dry_run: bool = False,
    old: Any = None,
    user_info: JSON = USER_INFO,
    options: JSON = CREATE_OPTIONS,
) -> JSON:
    """The `request` of an AdmissionReview for `obj`, with every field kube-apiserver fills in; in the
    object's namespace (or `default`) unless `namespace` says otherwise."""
    gvk = _group_version_kind(obj if obj is not None else old)
    gvr = {"group": gvk["group"], "version": gvk["version"], "resource": gvk["kind"].lower() + "s"}
    metadata = (obj or {}).get("metadata", {}) if isinstance(obj, dict) else {}
    return {
        "uid": uid,
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": metadata.get("name", ""),
        "namespace": namespace if namespace is not None else metadata.get("namespace", "default"),
        "operation": operation,
        "userInfo": user_info,
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": options,
    }


def admission_review_json(obj: Any, *, api_version: str = V1, **request_fields: Any) -> JSON:
    """An AdmissionReview for `obj`, as kube-apiserver posts it, parsed."""
    return {
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "request": admission_request(obj, **request_fields),
    }


def admission_review(obj: Any, *, api_version: str = V1, **request_fields: Any) -> bytes:
    """An AdmissionReview body for `obj`, as kube-apiserver posts it."""
    return orjson.dumps(admission_review_json(obj, api_version=api_version, **request_fields))


def well_formed(body: bytes) -> JSON:
    """The parsed AdmissionReview response, after checking the shape the API server insists on."""
    answer = json.loads(body)
    assert isinstance(answer, dict)
    assert answer["apiVersion"] in SUPPORTED_VERSIONS
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert isinstance(response, dict)
    assert isinstance(response["uid"], str)
    assert isinstance(response["allowed"], bool)
    assert ("patch" in response) == ("patchType" in response)
    if "patchType" in response:
        assert response["patchType"] == "JSONPatch"
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and len(warning) <= 120, warning
    for key, value in response.get("auditAnnotations", {}).items():
        assert "/" not in key and isinstance(value, str), key
    return answer


def response_of(answer: review.Answer) -> JSON:
    response: JSON = well_formed(answer.body)["response"]
    return response


def patch_of(response: Mapping[str, Any]) -> list[JSON]:
    """The JSON Patch operations in an AdmissionReview response ([] when there is no patch)."""
    if "patch" not in response:
        return []
    operations: list[JSON] = json.loads(base64.b64decode(response["patch"]))
    return operations


def apply(document: Any, operations: list[JSON]) -> Any:
    return jsonpatch.apply_patch(document, operations)


def mutate_review(obj: Any, policy: Policy, **request_fields: Any) -> JSON:
    """The /mutate response for `obj` (a CREATE in namespace default unless told otherwise)."""
    return response_of(
        review.review(admission_review(obj, **request_fields), endpoint="mutate", policy=policy)
    )


def validate_review(obj: Any, policy: Policy, **request_fields: Any) -> JSON:
    return response_of(
        review.review(admission_review(obj, **request_fields), endpoint="validate", policy=policy)
    )


# --- JSON equality as the API server sees it ----------------------------------------------------------


def canonical(value: Any) -> str:
    """A type-exact rendering: 1, True and 1.0 differ here although they are == in Python."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def assert_same_json(actual: Any, expected: Any) -> None:
    assert canonical(actual) == canonical(expected)


# --- Kubernetes' own validation, for what our patches touch --------------

MAX_POD_FAILURE_POLICY_RULES = 20
POD_FAILURE_ACTIONS = {"Count", "FailJob", "FailIndex", "Ignore"}


def job_errors(job_spec: JSON, template_spec: JSON) -> list[str]:
    """What batch validation would say about the podFailurePolicy and podReplacementPolicy we leave."""
    errors: list[str] = []
    failure_policy = job_spec.get("podFailurePolicy")
    if failure_policy is None:
        return errors
    if template_spec.get("restartPolicy") != "Never":
        errors.append('restartPolicy: only "Never" is supported when podFailurePolicy is specified')
    if job_spec.get("podReplacementPolicy", "Failed") != "Failed":
        errors.append(f'podReplacementPolicy: Unsupported value: "{job_spec["podReplacementPolicy"]}"')
    rules = failure_policy.get("rules", [])
    if len(rules) > MAX_POD_FAILURE_POLICY_RULES:
        errors.append(f"podFailurePolicy.rules: Too many: {len(rules)}: must have at most 20 items")
    for index, rule in enumerate(rules):
        where = f"podFailurePolicy.rules[{index}]"
        if rule.get("action") not in POD_FAILURE_ACTIONS:
            errors.append(f"{where}.action: Unsupported value {rule.get('action')!r}")
        if rule.get("action") == "FailIndex" and job_spec.get("backoffLimitPerIndex") is None:
            errors.append(f"{where}.action: requires the backoffLimitPerIndex to be set")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            errors.append(f"{where}: exactly one of OnExitCodes and OnPodConditions is required")
        on_exit = rule.get("onExitCodes")
        if on_exit is not None:
            values = on_exit.get("values", [])
            if not 1 <= len(values) <= 255:
                errors.append(f"{where}.onExitCodes.values: must have 1-255 values")
            if values != sorted(set(values)):
                errors.append(f"{where}.onExitCodes.values: must be ordered and unique")
            if on_exit.get("operator") == "In" and 0 in values:
                errors.append(f"{where}.onExitCodes.values: must not be 0 for the In operator")
    return errors


def pod_spec_errors(spec: JSON) -> list[str]:
    """Pod validation for what gpuguard adds: lifecycle placement, sleep length, tolerations."""
    errors: list[str] = []
    grace = spec.get("terminationGracePeriodSeconds", 30)
    for init in spec.get("initContainers", []):
        if "lifecycle" in init and init.get("restartPolicy") != "Always":
            errors.append(
                f"initContainers {init.get('name')}: lifecycle may not be set without restartPolicy=Always"
            )
    for each in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        sleep = ((each.get("lifecycle") or {}).get("preStop") or {}).get("sleep")
        if sleep is not None and not 1 <= sleep.get("seconds", 0) <= grace:
            errors.append(f"container {each.get('name')}: sleep seconds must be <= {grace}")
    for toleration in spec.get("tolerations", []):
        if not toleration.get("key") and toleration.get("operator") != "Exists":
            errors.append("tolerations: operator must be Exists when 'key' is empty")
        if "tolerationSeconds" in toleration and toleration.get("effect") != "NoExecute":
            errors.append("tolerations: effect must be 'NoExecute' when 'tolerationSeconds' is set")
    return errors


def mutated(obj: Any, policy: Policy, **kwargs: Any) -> JSON:
    """engine.mutate's output object, asserting the engine changed it."""
    result = engine.mutate(obj, policy, **kwargs)
    assert result.changed, f"expected a mutation, skipped={result.skipped} decisions={result.decisions}"
    out: JSON = result.obj
    return out


# --- the installed command --------------------------------------------------------------------------

# The console script pip wrote next to this interpreter, from [project.scripts]: what a user runs.
CONSOLE_SCRIPT = Path(sys.executable).parent / "gpuguard"
CLI_TIMEOUT_SECONDS = 60
# What would point a command at a cluster: neither runner lets the developer's own reach a test.
CLUSTER_CREDENTIALS = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")


@dataclass(frozen=True)
class CliRun:
    code: int
    out: str
    err: str


def run_gpuguard(*args: str, cwd: Path, stdin: str | bytes = b"") -> CliRun:
    """The installed `gpuguard` with `args`, in `cwd`, without any cluster credentials around."""
    assert CONSOLE_SCRIPT.is_file(), f"no console script at {CONSOLE_SCRIPT}: is gpuguard installed here?"
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_CREDENTIALS}
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        input=stdin.encode() if isinstance(stdin, str) else stdin,
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=CLI_TIMEOUT_SECONDS,
        check=False,
    )
    return CliRun(result.returncode, result.stdout.decode(), result.stderr.decode())


def run_gpuguard_in_process(*args: str, cwd: Path, stdin: str | bytes = b"") -> CliRun:
    """`webhook.cli.main(args)` as run_gpuguard runs the console script, without a process: stdin fed,
    stdout and stderr captured, in `cwd`, without cluster credentials; all of it restored after, and the
    root logger too (the long-running commands configure it for their process)."""
    import pytest  # here, not at the top: bench/payloads.py imports this module and runs without pytest

    out, err = io.StringIO(), io.StringIO()
    data = stdin.encode() if isinstance(stdin, str) else stdin
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logging.root, "handlers", logging.root.handlers[:])
        patch.setattr(logging.root, "level", logging.root.level)
        for name in CLUSTER_CREDENTIALS:
            patch.delenv(name, raising=False)
        patch.chdir(cwd)
        patch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(args)
            except SystemExit as exc:  # argparse: --help, --version and bad arguments
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return CliRun(code, out.getvalue(), err.getvalue())


# The `gpuguard` fixture (tests/integration/conftest.py, tests/unit/cli/conftest.py): one of the two
# runners above in the test's temp folder.
Gpuguard = Callable[..., CliRun]

"""Live policy: a second gpuguard watches its ConfigMap (and a mounted file) and applies edits without a
restart; invalid edits never take effect and are reported; /metrics, /policy and `gpuguard policy status`
name the active policy.

The module's gpuguard runs with `--kubeconfig --policy-configmap` and answers only for namespaces
labelled for it (OWNER_LABEL); the session's gpuguard leaves those alone. Each test that uses it starts
from BASELINE. A ConfigMap missing at start and a mounted policy file each get a gpuguard of their own.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO_ROOT
from tests.harness.admission import (
    API_SERVER_DEFAULT_SECONDS,
    PRE_STOP,
    READINESS_KEYS,
    RULES_ANNOTATION,
    LiveWebhook,
    WebhookProcess,
    create_namespace,
    dry_run,
    dry_run_until,
    gpu_job,
    gpu_pod,
    gpuguard_annotations,
    gpuguard_decisions,
    log_records,
    metric_samples,
    pinned_to_gpu_nodes,
    policy_configmap,
    policy_hash,
    read_back,
    readiness_tolerations,
    submit,
)
from tests.harness.controlplane import ControlPlane, http_get, log_tail
from tests.harness.manifests import admission_review_json, patch_of
from webhook.policy.model import default_policy

POLICY_ANNOTATION = "gpuguard.io/policy"
FLIP_SECONDS = 10.0  # "applies a change within seconds"
# Differs from the embedded default, so that a pod shows the ConfigMap's policy is the one in force.
BASELINE_SERVING_SECONDS = 700
BASELINE = f"""\
rules:
  readinessTolerations:
    servingSeconds: {BASELINE_SERVING_SECONDS}
"""
READINESS_AUDIT = BASELINE + "    mode: audit\n"


def serving_policy(seconds: int) -> str:
    return BASELINE.replace(str(BASELINE_SERVING_SECONDS), str(seconds))


@pytest.fixture(scope="module")
def live_webhook(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveWebhook]:
    webhook = LiveWebhook(control_plane, tmp_path_factory.mktemp("live-policy"), "gpuguard-e2e-policy")
    try:
        webhook.start(BASELINE)
        yield webhook
    finally:
        webhook.stop()


@pytest.fixture
def live(live_webhook: LiveWebhook) -> LiveWebhook:
    """The module's gpuguard, with BASELINE active and in its ConfigMap (a test may have changed both)."""
    live_webhook.set_policy(BASELINE)
    return live_webhook


@pytest.fixture
def live_ns(live: LiveWebhook, request: pytest.FixtureRequest) -> str:
    return live.namespace(request.node.originalname.removeprefix("test_")[:40].replace("_", "-"))


def serving_seconds(answer: subprocess.CompletedProcess[str]) -> list[int | None]:
    """The not-ready tolerationSeconds of a dry-run's object (a refusal reads as an empty list)."""
    if answer.returncode != 0:
        return []
    return readiness_tolerations(json.loads(answer.stdout)["spec"])[READINESS_KEYS[0]]


def mutated(answer: subprocess.CompletedProcess[str]) -> bool:
    return answer.returncode == 0 and bool(gpuguard_annotations(json.loads(answer.stdout)))


def refused(answers: list[subprocess.CompletedProcess[str]]) -> list[str]:
    return [a.stderr.strip() for a in answers if a.returncode != 0]


def policy_metrics(webhook: WebhookProcess) -> tuple[list[str], float, float]:
    """gpuguard_policy_info's hashes, gpuguard_policy_loaded_timestamp_seconds, gpuguard_policy_errors_total."""
    text = webhook.metrics()
    hashes = [labels["hash"] for labels, value in metric_samples(text, "gpuguard_policy_info") if value == 1]
    ((_, loaded),) = metric_samples(text, "gpuguard_policy_loaded_timestamp_seconds")
    ((_, errors),) = metric_samples(text, "gpuguard_policy_errors_total")
    return hashes, loaded, errors


def logged(webhook: WebhookProcess, match: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    return [record for record in log_records(webhook.log_path) if match(record)]


class Hammer:
    """Sends GPU-pod AdmissionReviews to gpuguard's /mutate back to back from a thread; records, in order,
    the policy hash each answer's patch carries, or why there was no good answer."""

    def __init__(self, webhook: WebhookProcess, namespace: str) -> None:
        self.webhook = webhook
        self.pod = gpu_pod("hammer", namespace)
        self.hashes: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                answer = self.webhook.request_json(
                    "POST", "/mutate", admission_review_json(self.pod, dry_run=True)
                )["response"]
                operations = patch_of(answer)
                marks = [op["value"] for op in operations if op["path"] == "/metadata/annotations"]
                if not answer["allowed"] or not marks:
                    self.failures.append(f"allowed={answer['allowed']} patch={operations}")
                else:
                    self.hashes.append(marks[0][POLICY_ANNOTATION])
            except Exception as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> Hammer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


# --- the ConfigMap ----------------------------------------------------------------------------------------


def test_configmap_policy_is_in_force_from_the_start(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str
) -> None:
    manifest = gpu_pod("gpu", live_ns)

    submit(control_plane, "apply", manifest)
    pod = read_back(control_plane, manifest)

    assert readiness_tolerations(pod["spec"]) == {key: [BASELINE_SERVING_SECONDS] for key in READINESS_KEYS}
    assert gpuguard_annotations(pod)[POLICY_ANNOTATION] == policy_hash(BASELINE)
    status = live.status()
    assert (status["hash"], status["source"]) == (policy_hash(BASELINE), f"ConfigMap {live.configmap_ref}")


def test_configmap_edit_switches_rule_from_enforce_to_audit(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str, summary: Callable[[str, str], None]
) -> None:
    first = gpu_pod("before", live_ns)
    submit(control_plane, "apply", first)
    assert readiness_tolerations(read_back(control_plane, first)["spec"])[READINESS_KEYS[0]] == [
        BASELINE_SERVING_SECONDS
    ]
    audit_before = gpuguard_decisions(
        live.process, rule="readinessTolerations", mode="audit", outcome="would-apply"
    )

    with Hammer(live.process, live_ns) as hammer:
        live.process.wait(lambda: bool(hammer.hashes), what="/mutate answering with the old policy")
        live.edit_policy(READINESS_AUDIT)  # kubectl apply of the edited ConfigMap
        seconds, answers = dry_run_until(
            control_plane,
            gpu_pod("probe", live_ns),
            lambda answer: serving_seconds(answer) == [API_SERVER_DEFAULT_SECONDS],
            what="readinessTolerations in audit mode",
            timeout=FLIP_SECONDS,
        )
        new = policy_hash(READINESS_AUDIT)
        live.process.wait(lambda: new in hammer.hashes, what="/mutate answering with the new policy")
    summary("live_policy_flip", f"ConfigMap edit took effect after {seconds:.2f} s ({len(answers)} dry-runs)")

    # No request was refused or answered badly while the policy changed, and the switch was whole: once an
    # answer carried the new policy, none carried the old one again.
    assert refused(answers) == []
    assert hammer.failures == []
    assert set(hammer.hashes) == {policy_hash(BASELINE), new}
    assert hammer.hashes == sorted(hammer.hashes, key=lambda h: h == new)

    second = gpu_pod("after", live_ns)
    submit(control_plane, "apply", second)
    pod = read_back(control_plane, second)
    assert readiness_tolerations(pod["spec"]) == {key: [API_SERVER_DEFAULT_SECONDS] for key in READINESS_KEYS}
    assert pod["spec"]["containers"][0]["lifecycle"] == {"preStop": PRE_STOP}  # the other rules enforce
    annotations = gpuguard_annotations(pod)
    assert "readinessTolerations" not in annotations[RULES_ANNOTATION].split(",")
    assert annotations[POLICY_ANNOTATION] == new
    assert (
        gpuguard_decisions(live.process, rule="readinessTolerations", mode="audit", outcome="would-apply")
        # One decision per toleration it would raise, for the applied pod only: dry runs are not counted.
        == audit_before + len(READINESS_KEYS)
    )


@pytest.mark.parametrize(
    ("text", "names"),
    [
        pytest.param("rules: [unclosed\n", ["not valid YAML", "line 1"], id="bad-yaml"),
        pytest.param(
            "rules:\n  priority:\n    classname: gpu-workload\n",
            ["rules.priority.classname"],
            id="unknown-key",
        ),
        pytest.param(
            "rules:\n  acceleratorNodeGuard:\n    minPriority: high\n",
            ["rules.acceleratorNodeGuard.minPriority"],
            id="wrong-type",
        ),
        pytest.param(
            "rules:\n  gracefulTermination:\n    preStop:\n      seconds: 90\n",
            ["rules.gracefulTermination", "preStop.seconds (90)", "minGracePeriodSeconds (60)"],
            id="prestop-longer-than-grace",
        ),
        # Once raised out of the reload path as a RecursionError, logged as a lookup warning only.
        pytest.param("a: " + "[" * 20_000 + "]" * 20_000 + "\n", ["nests deeper than 32"], id="deep-yaml"),
        pytest.param("enabled: 'no'\n", ["enabled", "valid boolean"], id="string-kill-switch"),
    ],
)
def test_invalid_edit_keeps_previous_policy_and_is_reported(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str, text: str, names: list[str]
) -> None:
    _, _, errors_before = policy_metrics(live.process)
    events_before = {e["metadata"]["name"] for e in live.events("InvalidPolicy")}

    live.edit_policy(text)
    live.process.wait(lambda: policy_metrics(live.process)[2] > errors_before, what="policy error counted")

    # The last good policy stays in force...
    status = live.status()
    assert status["hash"] == policy_hash(BASELINE)
    assert all(name in status["lastError"] for name in names), status["lastError"]
    answer = dry_run(control_plane, gpu_pod("probe", live_ns))
    assert serving_seconds(answer) == [BASELINE_SERVING_SECONDS], answer.stderr
    assert gpuguard_annotations(json.loads(answer.stdout))[POLICY_ANNOTATION] == policy_hash(BASELINE)
    assert policy_metrics(live.process)[0] == [policy_hash(BASELINE)]
    assert policy_metrics(live.process)[2] == errors_before + 1

    # ...and the refusal, naming the field, is a Warning Event on the ConfigMap and an error log line.
    def new_events() -> list[dict[str, Any]]:
        return [e for e in live.events("InvalidPolicy") if e["metadata"]["name"] not in events_before]

    live.process.wait(lambda: bool(new_events()), what="InvalidPolicy Event")
    (event,) = new_events()
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == live.CONFIGMAP
    assert all(name in event["message"] for name in names), event["message"]
    errors = logged(live.process, lambda r: r["level"] == "error" and "refused policy" in r["message"])
    assert errors, log_tail(live.process.log_path)
    assert all(name in errors[-1]["error"] for name in names), errors[-1]


def test_deleted_configmap_keeps_last_good_policy_and_recreated_one_applies(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str
) -> None:
    live.set_policy(serving_policy(800))
    last_good = policy_hash(serving_policy(800))
    _, _, errors_before = policy_metrics(live.process)

    control_plane.kubectl("delete", "configmap", live.CONFIGMAP, "-n", live.configmap_namespace)
    live.process.wait(
        lambda: bool(
            logged(
                live.process,
                lambda r: (
                    r["level"] == "warning" and f"ConfigMap {live.configmap_ref} is gone" in r["message"]
                ),
            )
        ),
        what="the deletion noticed",
    )

    assert live.status()["hash"] == last_good
    assert serving_seconds(dry_run(control_plane, gpu_pod("while-gone", live_ns))) == [800]
    assert policy_metrics(live.process)[2] == errors_before  # a deletion is not an invalid policy

    recreated = policy_configmap(live.configmap_namespace, live.CONFIGMAP, serving_policy(900))
    submit(control_plane, "create", recreated)
    _, answers = dry_run_until(
        control_plane,
        gpu_pod("recreated", live_ns),
        lambda answer: serving_seconds(answer) == [900],
        what="the recreated ConfigMap's policy",
        timeout=FLIP_SECONDS,
    )
    assert refused(answers) == []
    assert live.status()["hash"] == policy_hash(serving_policy(900))


def test_kill_switch_makes_every_rule_pass_through(
    control_plane: ControlPlane, live: LiveWebhook, live_ns: str
) -> None:
    live.edit_policy(BASELINE + "enabled: false\n")
    dry_run_until(
        control_plane,
        gpu_pod("probe", live_ns),
        lambda answer: answer.returncode == 0 and not mutated(answer),
        what="pass-through",
        timeout=FLIP_SECONDS,
    )

    job = gpu_job("train", live_ns)
    submit(control_plane, "apply", job)
    stored = read_back(control_plane, job)
    assert not gpuguard_annotations(stored)
    assert "podFailurePolicy" not in stored["spec"]
    # The guard passes through too: a priority-0 pod pinned to GPU nodes is admitted.
    crowder = pinned_to_gpu_nodes("crowder", live_ns)
    submit(control_plane, "apply", crowder)
    assert read_back(control_plane, crowder)["spec"]["priority"] == 0
    assert live.status()["enabled"] is False


# --- what the active policy is --------------------------------------------------------------------------


def test_metrics_and_readyz_name_the_active_policy_and_when_it_was_loaded(live: LiveWebhook) -> None:
    policy = serving_policy(650)
    before = time.time()
    live.set_policy(policy)
    after = time.time()

    hashes, loaded, _ = policy_metrics(live.process)
    assert hashes == [policy_hash(policy)]
    assert before <= loaded <= after
    assert live.status()["loadedAt"] == pytest.approx(loaded)
    context = ssl.create_default_context(cafile=str(live.process.cert_dir / "ca.crt"))
    assert http_get(live.process.port, "/readyz", context) == (
        200,
        f"ok policy={policy_hash(policy)}".encode(),
    )


def test_policy_status_command_shows_hash_source_and_load_time(live: LiveWebhook) -> None:
    policy = serving_policy(660)
    live.set_policy(policy)
    status = live.status()

    result = run_gpuguard(
        "policy", "status", "--url", live.process.url, "--cacert", str(live.process.cert_dir / "ca.crt")
    )

    assert result.returncode == 0, result.stderr
    assert policy_hash(policy) in result.stdout
    assert f"ConfigMap {live.configmap_ref}" in result.stdout
    loaded = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(status["loadedAt"])))
    assert loaded in result.stdout


def run_gpuguard(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args], capture_output=True, text=True, env=env, timeout=30
    )


# --- other sources: a ConfigMap missing at start, a mounted file ------------------------------------------


def test_missing_configmap_at_start_means_embedded_default_and_a_warning(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    namespace, name = create_namespace(control_plane, "policy-source"), "not-there-yet"
    webhook = WebhookProcess(
        tmp_path,
        extra_args=(
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "--policy-configmap",
            f"{namespace}/{name}",
        ),
    )
    webhook.start()
    try:
        status = webhook.request_json("GET", "/policy")
        assert (status["hash"], status["source"]) == (default_policy().hash, "embedded default")
        warnings = logged(
            webhook,
            lambda r: r["level"] == "warning" and f"{namespace}/{name}" in r["message"],
        )
        assert warnings, log_tail(webhook.log_path)

        submit(control_plane, "create", policy_configmap(namespace, name, serving_policy(720)))
        webhook.wait(
            lambda: webhook.request_json("GET", "/policy")["hash"] == policy_hash(serving_policy(720)),
            what="the created ConfigMap's policy",
            timeout=FLIP_SECONDS,
        )
        assert webhook.request_json("GET", "/policy")["source"] == f"ConfigMap {namespace}/{name}"
    finally:
        webhook.stop()
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def mount(directory: Path, text: str, version: int) -> None:
    """What the kubelet does to a ConfigMap volume: the new content in a fresh directory, then `..data`
    swapped to it in one rename; `policy.yaml` is a symlink through `..data`."""
    fresh = directory / f"..v{version}"
    fresh.mkdir()
    (fresh / "policy.yaml").write_text(text)
    (directory / "..data_tmp").symlink_to(fresh.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    if not (directory / "policy.yaml").is_symlink():
        (directory / "policy.yaml").symlink_to("..data/policy.yaml")


def test_mounted_policy_file_is_reloaded_on_change(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    mount(volume, BASELINE, 1)
    (tmp_path / "gpuguard").mkdir()
    webhook = WebhookProcess(tmp_path / "gpuguard")
    webhook.start(volume / "policy.yaml")
    try:

        def active() -> str:
            return str(webhook.request_json("GET", "/policy")["hash"])

        def serving() -> set[int]:
            answer = webhook.request_json("POST", "/mutate", admission_review_json(gpu_pod("gpu", "default")))
            (tolerations,) = [
                op["value"] for op in patch_of(answer["response"]) if op["path"] == "/spec/tolerations"
            ]
            return {t["tolerationSeconds"] for t in tolerations}

        assert (active(), serving()) == (policy_hash(BASELINE), {BASELINE_SERVING_SECONDS})

        mount(volume, serving_policy(750), 2)
        webhook.wait(
            lambda: active() == policy_hash(serving_policy(750)), what="file reloaded", timeout=FLIP_SECONDS
        )
        assert serving() == {750}

        mount(volume, "rules:\n  priority:\n    className: system-cluster-critical\n", 3)
        webhook.wait(
            lambda: webhook.request_json("GET", "/policy")["errors"] == 1, what="invalid file refused"
        )
        status = webhook.request_json("GET", "/policy")
        assert status["hash"] == policy_hash(serving_policy(750))
        assert "rules.priority" in status["lastError"]
        assert serving() == {750}
    finally:
        webhook.stop()

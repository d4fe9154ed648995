"""Idempotence under reinvocation: a second mutating webhook, called after gpuguard, changes the object, so
the API server calls gpuguard again (reinvocationPolicy IfNeeded) with its own output as input."""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.admission import (
    BATCH_SECONDS,
    GRACE_SECONDS,
    MUTATING_WEBHOOK,
    PRE_STOP,
    READINESS_KEYS,
    SERVING_SECONDS,
    admission_latency_buckets,
    gpu_job,
    gpu_pod,
    gpuguard_annotations,
    pod_spec_of,
    probe_until,
    read_back,
    readiness_tolerations,
    submit,
)
from tests.harness.controlplane import LOOPBACK, ControlPlane
from webhook.certs import tls

# Mutating webhooks are called in the order of their configurations' names: this one sorts after gpuguard's.
LABEL_CONFIG = "zz-label-gpuguard-e2e"
LABEL_WEBHOOK = "zz-label.gpuguard-e2e.io"
LABEL_KEY = "gpuguard-e2e.io/labelled"

pytestmark = pytest.mark.usefixtures("gpuguard")


class _LabelHandler(http.server.BaseHTTPRequestHandler):
    """Answers /mutate with a JSONPatch adding LABEL_KEY to the object's labels when it is absent."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        labels = request["object"]["metadata"].get("labels")
        patch: list[dict[str, Any]] = []
        if labels is None:
            patch = [{"op": "add", "path": "/metadata/labels", "value": {LABEL_KEY: "true"}}]
        elif LABEL_KEY not in labels:
            patch = [
                {"op": "add", "path": f"/metadata/labels/{LABEL_KEY.replace('/', '~1')}", "value": "true"}
            ]
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if patch:
            response |= {
                "patchType": "JSONPatch",
                "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
            }
        body = json.dumps(
            {"apiVersion": review["apiVersion"], "kind": "AdmissionReview", "response": response}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest's output clean
        pass


@dataclass
class LabelWebhook:
    server: http.server.ThreadingHTTPServer
    ca_pem: bytes

    @property
    def url(self) -> str:
        return f"https://{LOOPBACK}:{self.server.server_address[1]}/mutate"

    @classmethod
    def start(cls, cert_dir: Path) -> LabelWebhook:
        ca = tls.new_ca("zz-label-e2e-ca")
        serving = tls.issue(ca, "zz-label", sans=[LOOPBACK])
        (cert_dir / "tls.crt").write_bytes(serving.cert_pem)
        (cert_dir / "tls.key").write_bytes(serving.key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_dir / "tls.crt", cert_dir / "tls.key")
        server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _LabelHandler)
        server.daemon_threads = True
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name="zz-label-webhook", daemon=True).start()
        return cls(server, ca.cert_pem)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def configuration(self, namespace: str) -> dict[str, Any]:
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": LABEL_CONFIG},
            "webhooks": [
                {
                    "name": LABEL_WEBHOOK,
                    "clientConfig": {"url": self.url, "caBundle": base64.b64encode(self.ca_pem).decode()},
                    "rules": [
                        {
                            "apiGroups": ["", "batch"],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods", "jobs"],
                        }
                    ],
                    # Only this test's namespace, and never in anyone's way should it be gone too early.
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                    "failurePolicy": "Ignore",
                    "reinvocationPolicy": "IfNeeded",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 5,
                }
            ],
        }


@pytest.fixture
def label_webhook(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[LabelWebhook]:
    webhook = LabelWebhook.start(tmp_path)
    try:
        submit(control_plane, "apply", webhook.configuration(namespace))
        probe_until(
            control_plane,
            lambda r: r.returncode == 0 and LABEL_KEY in json.loads(r.stdout)["metadata"].get("labels", {}),
            what=f"{LABEL_WEBHOOK} labelling pods",
            namespace=namespace,
        )
        yield webhook
    finally:
        control_plane.kubectl("delete", "mutatingwebhookconfiguration", LABEL_CONFIG, "--ignore-not-found")
        webhook.stop()


def gpuguard_mutate_calls(plane: ControlPlane) -> float:
    return admission_latency_buckets(plane, (MUTATING_WEBHOOK,)).get("+Inf", 0.0)


def test_reinvoked_gpuguard_does_not_duplicate_its_work(
    control_plane: ControlPlane, namespace: str, label_webhook: LabelWebhook
) -> None:
    pod_manifest, job_manifest = gpu_pod("gpu", namespace), gpu_job("train", namespace)
    before = gpuguard_mutate_calls(control_plane)

    submit(
        control_plane, "create", {"apiVersion": "v1", "kind": "List", "items": [pod_manifest, job_manifest]}
    )

    # Two creates, each calling gpuguard, then the label webhook, then gpuguard again: four calls.
    assert gpuguard_mutate_calls(control_plane) - before == 4
    for manifest in (pod_manifest, job_manifest):
        stored = read_back(control_plane, manifest)
        assert stored["metadata"]["labels"][LABEL_KEY] == "true"
        assert gpuguard_annotations(stored)
        spec = pod_spec_of(stored)
        expected_seconds = SERVING_SECONDS if stored["kind"] == "Pod" else BATCH_SECONDS
        assert readiness_tolerations(spec) == {key: [expected_seconds] for key in READINESS_KEYS}
        assert [c.get("lifecycle") for c in spec["containers"]] == [{"preStop": PRE_STOP}]
        assert spec["terminationGracePeriodSeconds"] == GRACE_SECONDS
    job = read_back(control_plane, job_manifest)
    conditions = [r for r in job["spec"]["podFailurePolicy"]["rules"] if "onPodConditions" in r]
    exit_codes = [r for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    assert (len(conditions), len(exit_codes)) == (1, 1)

"""The real server: `python -m webhook serve` in a subprocess, spoken to over TLS with its own CA."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.harness.manifests import (
    V1BETA1,
    Gpuguard,
    admission_review,
    apply,
    assert_same_json,
    container,
    defaulted_gpu_pod,
    patch_of,
    pod,
    well_formed,
)
from webhook.policy import engine
from webhook.policy.model import Policy

STARTUP_SECONDS = 30.0
STOP_SECONDS = 35.0  # the server's own graceful-shutdown budget is 30 s
MAX_BODY_BYTES = 7 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    cert_dir: Path
    log: Path

    def client(self) -> httpx.Client:
        context = ssl.create_default_context(cafile=str(self.cert_dir / "ca.crt"))
        return httpx.Client(base_url=self.base_url, verify=context, timeout=10.0)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=STOP_SECONDS)


def start_server(workdir: Path, *flags: str) -> Server:
    """Starts gpuguard (with `flags` after the listener's) and returns once GET /readyz answers 200 over
    TLS (bounded by STARTUP_SECONDS)."""
    cert_dir = workdir / "certs"
    port = _free_port()
    log = workdir / "gpuguard.log"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")
    }
    argv = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [*argv, "--cert-dir", str(cert_dir), *flags],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
        )
    server = Server(process, f"https://127.0.0.1:{port}", cert_dir, log)
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if (cert_dir / "ca.crt").is_file():
            try:
                with server.client() as client:
                    if client.get("/readyz", timeout=1.0).status_code == 200:
                        return server
            except (httpx.TransportError, ssl.SSLError):
                pass  # not listening yet, or the certificate is still being written
        try:
            # Pace the polling on the process itself: an early exit ends the wait at once.
            process.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"gpuguard exited with {process.returncode} before ready:\n{server.log_tail()}")
    server.stop()
    raise AssertionError(f"gpuguard not ready within {STARTUP_SECONDS} s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("gpuguard"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def test_mutate_gpu_pod(client: httpx.Client, policy: Policy) -> None:
    obj = defaulted_gpu_pod()
    reply = client.post(
        "/mutate", content=admission_review(obj, uid="http-1"), headers={"content-type": "application/json"}
    )
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    response = well_formed(reply.content)["response"]
    assert (response["uid"], response["allowed"], response["patchType"]) == ("http-1", True, "JSONPatch")
    assert_same_json(apply(obj, patch_of(response)), engine.mutate(obj, policy).obj)


def test_each_answer_writes_one_decision_line(server: Server, client: httpx.Client) -> None:
    reply = client.post("/mutate", content=admission_review(defaulted_gpu_pod(), uid="http-logged"))
    assert reply.status_code == 200
    # The line is written just after the answer is sent: wait for it, paced, within a bound.
    deadline = time.monotonic() + 10.0
    while '"uid":"http-logged"' not in server.log.read_text():
        assert time.monotonic() < deadline, server.log_tail()
        with pytest.raises(subprocess.TimeoutExpired):  # paces the polling; exiting now fails
            server.process.wait(timeout=0.02)
    (line,) = [json.loads(text) for text in server.log.read_text().splitlines() if "http-logged" in text]
    assert list(line)[:5] == ["time", "level", "logger", "message", "uid"]
    assert (line["level"], line["logger"], line["message"]) == (
        "info",
        "gpuguard.admission",
        "admission allowed",
    )
    assert (line["endpoint"], line["kind"], line["operation"], line["allowed"], line["patched"]) == (
        "mutate",
        "Pod",
        "CREATE",
        True,
        True,
    )
    assert any(decision.startswith("priority: ") for decision in line["applied"]), line
    assert line["latencyMs"] > 0 and line["time"].endswith("+00:00")


def test_v1beta1_in_v1beta1_out(client: httpx.Client) -> None:
    reply = client.post(
        "/mutate", content=admission_review(defaulted_gpu_pod(), api_version=V1BETA1, uid="beta")
    )
    answer = well_formed(reply.content)
    assert answer["apiVersion"] == V1BETA1
    assert answer["response"]["uid"] == "beta"
    assert "patch" in answer["response"]


def test_validate_denies_cpu_pod_on_gpu_node(client: httpx.Client) -> None:
    cpu_pod = pod(
        container("shipper", limits={"cpu": "1"}), nodeSelector={"cloud.google.com/gke-accelerator": "l4"}
    )
    reply = client.post("/validate", content=admission_review(cpu_pod, uid="deny"))
    assert reply.status_code == 200
    response = well_formed(reply.content)["response"]
    assert (response["uid"], response["allowed"]) == ("deny", False)
    assert response["status"]["code"] == 403
    assert response["status"]["message"].startswith(
        "gpuguard acceleratorNodeGuard: priority 0 (no class) < 1000"
    )
    assert "patch" not in response


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(b"", 400, id="empty"),
        pytest.param(b"\x00\xffnot json at all", 400, id="garbage"),
        pytest.param(b'[{"kind": "AdmissionReview"}]', 400, id="json-array"),
        pytest.param(b" " * (MAX_BODY_BYTES + 1), 413, id="over-7MiB"),
    ],
)
@pytest.mark.parametrize("path", ["/mutate", "/validate"])
def test_bad_bodies_get_a_well_formed_review(client: httpx.Client, path: str, body: bytes, code: int) -> None:
    reply = client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200
    response = well_formed(reply.content)["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("", False, code)


def test_health_and_readiness(client: httpx.Client, policy: Policy) -> None:
    health = client.get("/healthz")
    assert (health.status_code, health.text) == (200, "ok")
    ready = client.get("/readyz")
    assert (ready.status_code, ready.text) == (200, f"ok policy={policy.hash}")


def metric_sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample; 0 when the series does not exist yet."""
    rendered = ",".join(f'{key}="{value}"' for key, value in labels.items())
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(rendered)}\}} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_decisions_but_not_dry_runs(client: httpx.Client) -> None:
    applied = {"rule": "priority", "mode": "enforce", "outcome": "applied"}
    before = metric_sample(client.get("/metrics").text, "gpuguard_decisions_total", **applied)

    assert (
        client.post("/mutate", content=admission_review(defaulted_gpu_pod(), dry_run=True)).status_code == 200
    )
    after_dry_run = client.get("/metrics")
    assert after_dry_run.headers["content-type"].startswith("text/plain")
    assert metric_sample(after_dry_run.text, "gpuguard_decisions_total", **applied) == before

    assert client.post("/mutate", content=admission_review(defaulted_gpu_pod())).status_code == 200
    text = client.get("/metrics").text
    assert metric_sample(text, "gpuguard_decisions_total", **applied) == before + 1
    assert (
        metric_sample(text, "gpuguard_admission_duration_seconds_bucket", endpoint="mutate", le="+Inf") >= 2
    )
    assert "# TYPE gpuguard_admission_duration_seconds histogram" in text


def test_sigterm_stops_the_server_with_exit_code_0(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        server.process.send_signal(signal.SIGTERM)
        returncode = server.process.wait(timeout=STOP_SECONDS)
        assert returncode == 0, f"exit status {returncode}:\n{server.log_tail()}"
    finally:
        server.stop()


def _read_until(stream: ssl.SSLSocket, marker: bytes, *, limit: int = 1 << 20) -> bytes:
    received = b""
    while marker not in received:
        chunk = stream.recv(65536)
        if not chunk or len(received) > limit:
            raise AssertionError(f"connection ended before {marker!r}; got {received[:500]!r}")
        received += chunk
    return received


def test_sigterm_finishes_the_request_in_flight(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        body = admission_review(defaulted_gpu_pod(), uid="in-flight")
        context = ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))
        port = int(server.base_url.rsplit(":", 1)[1])
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10.0) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as stream,
        ):
            # Expect: 100-continue makes uvicorn say when the app starts reading the body: from then on
            # the request is in flight, provably, before the signal arrives.
            stream.sendall(
                b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
            )
            assert _read_until(stream, b"\r\n\r\n").startswith(b"HTTP/1.1 100 Continue")
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            while "Shutting down" not in server.log_tail():  # the server's own word that shutdown began
                assert time.monotonic() < deadline, f"no shutdown began:\n{server.log_tail()}"
                with pytest.raises(subprocess.TimeoutExpired):  # paces the polling; exiting now fails
                    server.process.wait(timeout=0.02)
            stream.sendall(body)
            head, _, rest = _read_until(stream, b"\r\n\r\n").partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
            while len(rest) < length:
                rest += stream.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert well_formed(rest)["response"]["uid"] == "in-flight"
        assert server.process.wait(timeout=STOP_SECONDS) == 0, server.log_tail()
    finally:
        server.stop()


def _connected(server: Server) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))
    port = int(server.base_url.rsplit(":", 1)[1])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def test_an_answer_leaves_in_one_tls_record(server: Server) -> None:
    # A TLS read returns one record at most: the whole answer in the first read is head and body written
    # together, as one record (and one system call), not the head first and the body after it.
    body = admission_review(defaulted_gpu_pod(), uid="one-record")
    with _connected(server) as stream:
        stream.sendall(
            b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        head, _, rest = stream.recv(65536).partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(rest) == length
    assert well_formed(rest)["response"]["uid"] == "one-record"


def test_a_head_request_is_answered_and_the_connection_serves_on(server: Server) -> None:
    # A HEAD answer has no body to carry its head: it is written at once, and the next request is served.
    with _connected(server) as stream:
        stream.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_until(stream, b"\r\n\r\n").startswith(b"HTTP/1.1 ")
        stream.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_until(stream, b"ok").startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/mutate", "/validate"])
def test_an_admission_endpoint_answers_other_methods_405(
    client: httpx.Client, path: str, method: str
) -> None:
    reply = client.request(method, path)
    assert (reply.status_code, reply.headers["allow"]) == (405, "POST")
    assert "POST an AdmissionReview" in reply.json()["detail"]


def test_other_paths_still_answer_404(client: httpx.Client) -> None:
    assert client.get("/mutate/x").status_code == 404


# --- `gpuguard policy status` against this server ---------------------------------------------------------


def test_policy_status_shows_the_served_policy(server: Server, gpuguard: Gpuguard, policy: Policy) -> None:
    run = gpuguard("policy", "status", "--url", server.base_url, "--cacert", str(server.cert_dir / "ca.crt"))
    assert (run.code, run.err) == (0, "")
    assert run.out.startswith(f"policy {policy.hash} from embedded default, loaded 20")


def test_policy_status_says_the_certificate_is_not_trusted(
    server: Server, gpuguard: Gpuguard, tmp_path: Path
) -> None:
    assert gpuguard("certs", "generate", "--dir", "other").code == 0  # another CA, in the temp folder
    run = gpuguard("policy", "status", "--url", server.base_url, "--cacert", "other/ca.crt")
    assert run.code == 2
    assert run.err.startswith(
        f"gpuguard: {server.base_url}/policy: certificate not trusted by --cacert other/ca.crt ("
    ), run.err
    assert "Traceback" not in run.err


def test_policy_status_names_the_url_it_cannot_reach(server: Server, gpuguard: Gpuguard) -> None:
    url = f"https://127.0.0.1:{_free_port()}"
    run = gpuguard("policy", "status", "--url", url, "--cacert", str(server.cert_dir / "ca.crt"))
    assert (run.code, run.err) == (2, f"gpuguard: cannot reach {url}/policy: Connection refused\n")


def test_policy_status_names_a_missing_cacert(gpuguard: Gpuguard) -> None:
    run = gpuguard("policy", "status", "--cacert", "absent/ca.crt")
    assert run.code == 2
    assert run.err.startswith("gpuguard: --cacert absent/ca.crt: no such file")

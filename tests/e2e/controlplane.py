"""A throwaway Kubernetes control plane (etcd + kube-apiserver) on loopback, for end-to-end tests.

Modelled on controller-runtime's envtest: by default no kube-controller-manager, no scheduler, no
nodes. So pods stay Pending, namespaces never finish deleting, and the ServiceAccount admission
plugin is disabled (nothing creates `default` SAs). `start_controller_manager` adds the real one,
running only the controllers a test names.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from webhook.certs import tls

LOOPBACK = "127.0.0.1"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
ADMIN_USER = "gpuguard-e2e-admin"
POLL_INTERVAL = 0.2


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out on loopback; all sockets stay open until every port is picked."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def without_proxies(env: Mapping[str, str] | None = None) -> dict[str, str]:
    # Go only skips the proxy for loopback by convention; dropping the variables removes the doubt.
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in PROXY_VARS}


def _die_with_parent() -> None:
    # Runs in the child before exec: if pytest itself is killed (SIGKILL, OOM), the kernel kills the
    # child too, so nothing outlives the session even without teardown. SIGKILL, not SIGTERM: an
    # apiserver whose etcd dies at the same moment hangs in its graceful shutdown.
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    argv: Sequence[str | Path], log_path: Path, env: Mapping[str, str], cwd: Path | None = None
) -> Process:
    log = log_path.open("ab")
    try:
        popen = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            # Own session: a Ctrl-C in the terminal reaches only pytest, whose teardown then stops the
            # processes in order (the webhook configurations are deleted while the apiserver still runs).
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except BaseException:
        log.close()
        raise
    return Process(popen, log, log_path)


@dataclass
class Process:
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.running():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self.log.close()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"<{path} does not exist>"
    return "\n".join(text.splitlines()[-lines:])


def wait_until(
    ready: Callable[[], bool], *, timeout: float, what: str, process: Process | None = None
) -> float:
    """Polls `ready` until it is true; fails fast if `process` dies. Returns the seconds it took."""
    start = time.monotonic()
    while True:
        if process is not None and not process.running():
            raise RuntimeError(
                f"{what}: process exited with {process.popen.returncode}\n{log_tail(process.log_path)}"
            )
        if ready():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            tail = log_tail(process.log_path) if process is not None else ""
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s\n{tail}")
        time.sleep(POLL_INTERVAL)


def http_get(port: int, path: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """One GET on loopback; connection errors read as status 0. http.client never consults proxies."""
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    else:
        conn = http.client.HTTPSConnection(LOOPBACK, port, timeout=5, context=context)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


@dataclass(frozen=True)
class Pki:
    ca: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public: Path
    sa_private: Path

    @classmethod
    def create(cls, directory: Path) -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        ca = tls.new_ca("gpuguard-e2e-ca")
        # One CA both signs the serving cert and authenticates clients (--client-ca-file); tests only.
        serving = tls.issue(ca, "kube-apiserver", sans=["127.0.0.1", "localhost"])
        admin = tls.issue(ca, ADMIN_USER, organizations=["system:masters"], usage="client")
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        files = {
            "ca.crt": ca.cert_pem,
            "apiserver.crt": serving.cert_pem,
            "apiserver.key": serving.key_pem,
            "admin.crt": admin.cert_pem,
            "admin.key": admin.key_pem,
            "sa.pub": sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            "sa.key": sa_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        }
        for name, data in files.items():
            (directory / name).write_bytes(data)
        d = directory
        return cls(
            d / "ca.crt",
            d / "apiserver.crt",
            d / "apiserver.key",
            d / "admin.crt",
            d / "admin.key",
            d / "sa.pub",
            d / "sa.key",
        )

    def admin_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return context


@dataclass(frozen=True)
class KubectlCall:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"$ kubectl {' '.join(self.args)}  -> exit {self.returncode}\n{self.stdout}{self.stderr}"


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class ControlPlane:
    """Running etcd + kube-apiserver. Use `ControlPlane.start(...)`, then `stop()` (or `with`)."""

    def __init__(self, bin_dir: Path, workdir: Path) -> None:
        self.bin_dir = bin_dir
        self.workdir = workdir
        self.kubeconfig = workdir / "kubeconfig"
        self.apiserver_log = workdir / "apiserver.log"
        self.etcd_log = workdir / "etcd.log"
        self.version = ""
        self.etcd_version = ""
        self.startup_seconds = 0.0
        self.history: collections.deque[KubectlCall] = collections.deque(maxlen=6)
        self.etcd_port, self.etcd_peer_port, self.port = free_ports(3)
        self.pki = Pki.create(workdir / "pki")
        self._processes: list[Process] = []

    @classmethod
    def start(cls, bin_dir: Path, workdir: Path, timeout: float = 120.0) -> ControlPlane:
        plane = cls(bin_dir, workdir)
        try:
            plane._start(timeout)
        except BaseException:  # includes KeyboardInterrupt: never leave half a control plane running
            plane.stop()
            raise
        return plane

    def _start(self, timeout: float) -> None:
        begin = time.monotonic()
        etcd = self._start_etcd()
        wait_until(
            lambda: http_get(self.etcd_port, "/health")[0] == 200, timeout=30, what="etcd", process=etcd
        )
        self.etcd_version = json.loads(http_get(self.etcd_port, "/version")[1] or b"{}").get("etcdserver", "")
        apiserver = self._start_apiserver()
        self._write_kubeconfig()
        # /readyz with admin credentials: anonymous requests may be refused until RBAC bootstrap is done.
        context = self.pki.admin_context()
        wait_until(
            lambda: http_get(self.port, "/readyz", context)[0] == 200,
            timeout=timeout,
            what="kube-apiserver /readyz",
            process=apiserver,
        )
        self.version = str(json.loads(http_get(self.port, "/version", context)[1])["gitVersion"])
        self.startup_seconds = time.monotonic() - begin

    def _start_etcd(self) -> Process:
        client, peer = f"http://{LOOPBACK}:{self.etcd_port}", f"http://{LOOPBACK}:{self.etcd_peer_port}"
        argv: list[str | Path] = [
            self.bin_dir / "etcd",
            "--name=e2e",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e2e={peer}",
            "--unsafe-no-fsync",  # data is thrown away; fsync only costs seconds per write burst
            "--log-level=warn",
        ]
        return self._spawn(argv, self.etcd_log)

    def _start_apiserver(self) -> Process:
        pki = self.pki
        argv: list[str | Path] = [
            self.bin_dir / "kube-apiserver",
            f"--etcd-servers=http://{LOOPBACK}:{self.etcd_port}",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={self.port}",
            # Without a default route the apiserver can't guess an address; a loopback one is rejected
            # by the endpoint reconciler (k8s#28723, #138102), so turn reconciling off.
            f"--advertise-address={LOOPBACK}",
            "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer=https://{LOOPBACK}:{self.port}",
            f"--service-account-key-file={pki.sa_public}",
            f"--service-account-signing-key-file={pki.sa_private}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            # Without kube-controller-manager no namespace gets a `default` ServiceAccount, and this
            # plugin would reject every pod before the webhooks run.
            "--disable-admission-plugins=ServiceAccount",
            "--profiling=false",
        ]
        return self._spawn(argv, self.apiserver_log)

    def start_controller_manager(
        self, *, controllers: Sequence[str], flags: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> Process:
        """The real kube-controller-manager running `controllers` (names as `--controllers` takes them)
        under the admin's credentials, serving on a free loopback port. Waits for /healthz; stopped with
        the control plane."""
        (port,) = free_ports(1)
        all_flags = {
            "kubeconfig": str(self.kubeconfig),
            "bind-address": LOOPBACK,
            "secure-port": str(port),
            "tls-cert-file": str(self.pki.serving_cert),
            "tls-private-key-file": str(self.pki.serving_key),
            "leader-elect": "false",
            "controllers": ",".join(controllers),
            "profiling": "false",
            **(flags or {}),
        }
        log_path = self.workdir / "kube-controller-manager.log"
        argv: list[str | Path] = [
            self.bin_dir / "kube-controller-manager",
            *(f"--{name}={value}" for name, value in all_flags.items()),
        ]
        process = self._spawn(argv, log_path)
        context = ssl.create_default_context(cafile=str(self.pki.ca))  # /healthz is open to anyone
        wait_until(
            lambda: http_get(port, "/healthz", context)[0] == 200,
            timeout=timeout,
            what="kube-controller-manager /healthz",
            process=process,
        )
        return process

    def _spawn(self, argv: Sequence[str | Path], log_path: Path) -> Process:
        process = spawn(argv, log_path, without_proxies(), cwd=self.workdir)
        self._processes.append(process)
        return process

    def _write_kubeconfig(self) -> None:
        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {
                        "server": f"https://{LOOPBACK}:{self.port}",
                        "certificate-authority-data": b64(self.pki.ca),
                    },
                }
            ],
            "users": [
                {
                    "name": ADMIN_USER,
                    "user": {
                        "client-certificate-data": b64(self.pki.admin_cert),
                        "client-key-data": b64(self.pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {"name": "e2e", "context": {"cluster": "e2e", "user": ADMIN_USER, "namespace": "default"}}
            ],
            "current-context": "e2e",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2))  # JSON is YAML, kubectl reads it

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=without_proxies()
        )
        self.history.append(KubectlCall(args, result.returncode, result.stdout, result.stderr))
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl_json(self, *args: str, input: str | None = None) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", input=input).stdout)

    @property
    def running(self) -> bool:
        return bool(self._processes) and all(p.running() for p in self._processes)

    def stop(self) -> None:
        # apiserver first, so it doesn't spend its shutdown retrying a vanished etcd.
        for process in reversed(self._processes):
            process.stop()
        self._processes.clear()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

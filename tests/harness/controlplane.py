"""A throwaway Kubernetes control plane (etcd + kube-apiserver) on loopback, for end-to-end tests.

Modelled on controller-runtime's envtest: by default no kube-controller-manager, no scheduler, no
nodes. So pods stay Pending, namespaces never finish deleting, and the ServiceAccount admission
plugin is disabled (nothing creates `default` SAs). `start_controller_manager` and
`start_scheduler` add the real ones for tests that need them (the node tier, the controllers).
"""

from __future__ import annotations

import base64
import collections
import http.client
import json
import os
import socket
import ssl
import subprocess
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
# What a cluster needs for pods on real nodes to live and die as they would in production: nodes
# that stop reporting are tainted and their pods evicted, Jobs run and count failures against their
# podFailurePolicy, PodDisruptionBudgets are honoured, owned objects and namespaces are cleaned up.
CONTROLLERS = (
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "job-controller",
    "disruption-controller",
    "replicaset-controller",
    "deployment-controller",
    "garbage-collector-controller",
    "pod-garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
)


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


# Prefixed to every command: if pytest itself is killed (SIGKILL, OOM), the kernel kills the child
# too, so nothing outlives the session even without teardown. SIGKILL, not SIGTERM: an apiserver
# whose etcd dies at the same moment hangs in its graceful shutdown. setpriv sets the parent-death
# signal and execs, so no Python code runs between fork and exec (a preexec_fn would), which a
# process with gRPC threads running (the node tier's device plugins) does not survive.
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL", "--")


def spawn(
    argv: Sequence[str | Path], log_path: Path, env: Mapping[str, str], cwd: Path | None = None
) -> Process:
    log = log_path.open("ab")
    try:
        popen = subprocess.Popen(
            [*DIE_WITH_PARENT, *(str(a) for a in argv)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            # Own session: a Ctrl-C in the terminal reaches only pytest, whose teardown then stops the
            # processes in order (the webhook configurations are deleted while the apiserver still runs).
            start_new_session=True,
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


def http_get(
    port: int, path: str, context: ssl.SSLContext | None = None, host: str = LOOPBACK
) -> tuple[int, bytes]:
    """One GET, on loopback unless told; connection errors read as status 0. http.client never
    consults proxies."""
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
    else:
        conn = http.client.HTTPSConnection(host, port, timeout=5, context=context)
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
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public: Path
    sa_private: Path

    @classmethod
    def create(cls, directory: Path, serving_sans: Sequence[str] = ()) -> Pki:
        """`serving_sans`: names and addresses the API server is reached by besides loopback."""
        directory.mkdir(parents=True, exist_ok=True)
        ca = tls.new_ca("gpuguard-e2e-ca")
        # One CA both signs the serving cert and authenticates clients (--client-ca-file); tests only.
        serving = tls.issue(ca, "kube-apiserver", sans=["127.0.0.1", "localhost", *serving_sans])
        admin = tls.issue(ca, ADMIN_USER, organizations=["system:masters"], usage="client")
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        files = {
            "ca.crt": ca.cert_pem,
            "ca.key": ca.key_pem,
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
            d / "ca.key",
            d / "apiserver.crt",
            d / "apiserver.key",
            d / "admin.crt",
            d / "admin.key",
            d / "sa.pub",
            d / "sa.key",
        )

    def issue_client(self, user: str, groups: Sequence[str] = ()) -> tuple[Path, Path]:
        """A client certificate for `user` in `groups`, signed by the cluster CA: (cert, key) files."""
        ca = tls.KeyPair(self.ca.read_bytes(), self.ca_key.read_bytes())
        pair = tls.issue(ca, user, organizations=list(groups), usage="client")
        stem = self.ca.parent / user.replace(":", "-")
        cert, key = stem.with_suffix(".crt"), stem.with_suffix(".key")
        cert.write_bytes(pair.cert_pem)
        key.write_bytes(pair.key_pem)
        return cert, key

    def verify_context(self) -> ssl.SSLContext:
        """Trusts the cluster CA, which also signs the serving certificate of every component."""
        return ssl.create_default_context(cafile=str(self.ca))

    def admin_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return context


# A failing test prints the last kubectl calls: their output is cut to what can be read.
SHOWN_LINES = 40


def shown(text: str, *, keep: Callable[[str], bool] | None = None) -> str:
    """`text` cut to SHOWN_LINES lines (the first and the last ones), after `keep` picked the lines."""
    lines = text.splitlines()
    if keep is not None:
        picked = [line for line in lines if keep(line)]
        note = [f"[{len(picked)} of {len(lines)} lines shown: the ones about admission webhooks]"]
        lines = note + picked
    if len(lines) <= SHOWN_LINES:
        return "\n".join(lines) + ("\n" if lines else "")
    head, tail = lines[: SHOWN_LINES // 4], lines[-(SHOWN_LINES - SHOWN_LINES // 4) :]
    return "\n".join([*head, f"[... {len(lines) - len(head) - len(tail)} lines left out ...]", *tail]) + "\n"


def _about_webhooks(line: str) -> bool:
    return "admission_webhook" in line and not line.startswith("#")


@dataclass(frozen=True)
class KubectlCall:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        # The API server's /metrics is some 20,000 lines: only its admission-webhook series help.
        metrics = self.args[:3] == ("get", "--raw", "/metrics")
        stdout = shown(self.stdout, keep=_about_webhooks if metrics else None)
        return f"$ kubectl {' '.join(self.args)}  -> exit {self.returncode}\n{stdout}{shown(self.stderr)}"


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {shown(self.stdout)}\nstderr: {shown(self.stderr)}"


def _as_args(flags: Mapping[str, str]) -> list[str]:
    return [f"--{name}={value}" for name, value in flags.items()]


def _duration(seconds: float) -> str:
    """A Go duration flag value."""
    return f"{seconds:g}s"


class ControlPlane:
    """Running etcd + kube-apiserver. Use `ControlPlane.start(...)`, then `stop()` (or `with`).

    `apiserver_flags` override or add kube-apiserver flags by name (without the dashes), for
    example `{"authorization-mode": "Node,RBAC"}`. `address` is the one the API server binds and
    advertises (loopback unless a tier gives it one its pods can reach, see node.TierNetwork);
    `serving_sans` are further names its serving certificate holds (a Service's ClusterIP).
    """

    def __init__(
        self,
        bin_dir: Path,
        workdir: Path,
        apiserver_flags: Mapping[str, str] | None = None,
        *,
        address: str = LOOPBACK,
        serving_sans: Sequence[str] = (),
    ) -> None:
        self.bin_dir = bin_dir
        self.workdir = workdir
        self.apiserver_flags = dict(apiserver_flags or {})
        self.address = address
        self.kubeconfig = workdir / "kubeconfig"
        self.kube_cache = workdir / "kube-cache"
        self.apiserver_log = workdir / "apiserver.log"
        self.etcd_log = workdir / "etcd.log"
        self.controller_manager_log = workdir / "kube-controller-manager.log"
        self.scheduler_log = workdir / "kube-scheduler.log"
        self.version = ""
        self.etcd_version = ""
        self.startup_seconds = 0.0
        self.history: collections.deque[KubectlCall] = collections.deque(maxlen=6)
        self.etcd_port, self.etcd_peer_port, self.port = free_ports(3)
        self.pki = Pki.create(workdir / "pki", [address, *serving_sans])
        self._processes: list[Process] = []

    @classmethod
    def start(
        cls,
        bin_dir: Path,
        workdir: Path,
        timeout: float = 120.0,
        *,
        apiserver_flags: Mapping[str, str] | None = None,
        address: str = LOOPBACK,
        serving_sans: Sequence[str] = (),
    ) -> ControlPlane:
        plane = cls(bin_dir, workdir, apiserver_flags, address=address, serving_sans=serving_sans)
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
        self.write_kubeconfig(self.kubeconfig, ADMIN_USER, self.pki.admin_cert, self.pki.admin_key)
        # /readyz with admin credentials: anonymous requests may be refused until RBAC bootstrap is done.
        context = self.pki.admin_context()
        wait_until(
            lambda: http_get(self.port, "/readyz", context, self.address)[0] == 200,
            timeout=timeout,
            what="kube-apiserver /readyz",
            process=apiserver,
        )
        version = http_get(self.port, "/version", context, self.address)[1]
        self.version = str(json.loads(version)["gitVersion"])
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
        flags = {
            "etcd-servers": f"http://{LOOPBACK}:{self.etcd_port}",
            "bind-address": self.address,
            "secure-port": str(self.port),
            # Without a default route the apiserver can't guess an address; a loopback one is rejected
            # by the endpoint reconciler (k8s#28723, #138102), so turn reconciling off.
            "advertise-address": self.address,
            "endpoint-reconciler-type": "none",
            "cert-dir": str(self.workdir / "pki"),
            "tls-cert-file": str(pki.serving_cert),
            "tls-private-key-file": str(pki.serving_key),
            "client-ca-file": str(pki.ca),
            "authorization-mode": "RBAC",
            "service-account-issuer": f"https://{self.address}:{self.port}",
            "service-account-key-file": str(pki.sa_public),
            "service-account-signing-key-file": str(pki.sa_private),
            "service-cluster-ip-range": "10.0.0.0/24",
            # Its calls to kubelets (`kubectl logs`) at their Nodes' addresses, as the admin.
            "kubelet-preferred-address-types": "InternalIP",
            "kubelet-client-certificate": str(pki.admin_cert),
            "kubelet-client-key": str(pki.admin_key),
            "allow-privileged": "true",
            # Without kube-controller-manager no namespace gets a `default` ServiceAccount, and this
            # plugin would reject every pod before the webhooks run.
            "disable-admission-plugins": "ServiceAccount",
            "profiling": "false",
        }
        flags.update(self.apiserver_flags)
        argv: list[str | Path] = [self.bin_dir / "kube-apiserver", *_as_args(flags)]
        return self._spawn(argv, self.apiserver_log)

    def start_controller_manager(
        self,
        *,
        controllers: Sequence[str] = CONTROLLERS,
        node_monitor_period: float = 5.0,
        node_monitor_grace_period: float = 50.0,
        node_startup_grace_period: float = 60.0,
        flags: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Process:
        """The real kube-controller-manager running `controllers` with the admin's credentials (every
        controller under one identity: no per-controller ServiceAccounts, which a test does not need).

        The node-lifecycle timings are kube-controller-manager's defaults unless given (seconds):
        `node_monitor_grace_period` is how long a node may go without a heartbeat (its Lease) before
        it is marked Unknown and tainted `node.kubernetes.io/unreachable`; keep it a few times the
        kubelets' lease renew interval. `flags` add or override any other flag by name. Waits for
        /healthz; stopped with the control plane (or earlier through the returned Process).
        """
        own_flags = {
            "controllers": ",".join(controllers),
            "node-monitor-period": _duration(node_monitor_period),
            "node-monitor-grace-period": _duration(node_monitor_grace_period),
            "node-startup-grace-period": _duration(node_startup_grace_period),
            "service-account-private-key-file": str(self.pki.sa_private),
            "root-ca-file": str(self.pki.ca),
            **(flags or {}),
        }
        return self._start_component(
            "kube-controller-manager", self.controller_manager_log, "/healthz", timeout, own_flags
        )

    def start_scheduler(self, *, flags: Mapping[str, str] | None = None, timeout: float = 60.0) -> Process:
        """The real kube-scheduler with the admin's credentials and its default profile. Waits for
        /readyz; stopped with the control plane (or earlier through the returned Process)."""
        return self._start_component("kube-scheduler", self.scheduler_log, "/readyz", timeout, flags or {})

    def _start_component(
        self, binary: str, log_path: Path, health_path: str, timeout: float, flags: Mapping[str, str]
    ) -> Process:
        """`binary` on a free loopback port with the control plane's serving certificate, alone (no
        leader election, no profiling); `flags` add to those or override them. Waits for `health_path`."""
        (port,) = free_ports(1)
        all_flags = {
            "kubeconfig": str(self.kubeconfig),
            "bind-address": LOOPBACK,
            "secure-port": str(port),
            "tls-cert-file": str(self.pki.serving_cert),
            "tls-private-key-file": str(self.pki.serving_key),
            "leader-elect": "false",
            "profiling": "false",
            **flags,
        }
        process = self._spawn([self.bin_dir / binary, *_as_args(all_flags)], log_path)
        context = self.pki.verify_context()  # health paths are open to anonymous requests by default
        try:
            wait_until(
                lambda: http_get(port, health_path, context)[0] == 200,
                timeout=timeout,
                what=f"{binary} {health_path}",
                process=process,
            )
        except BaseException:
            process.stop()
            self._processes.remove(process)
            raise
        return process

    def _spawn(self, argv: Sequence[str | Path], log_path: Path) -> Process:
        process = spawn(argv, log_path, without_proxies(), cwd=self.workdir)
        self._processes.append(process)
        return process

    def write_kubeconfig(self, path: Path, user: str, cert: Path, key: Path) -> None:
        """A kubeconfig for this API server that authenticates as `user` with a client certificate."""

        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {
                        "server": f"https://{self.address}:{self.port}",
                        "certificate-authority-data": b64(self.pki.ca),
                    },
                }
            ],
            "users": [
                {"name": user, "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)}}
            ],
            "contexts": [
                {"name": "e2e", "context": {"cluster": "e2e", "user": user, "namespace": "default"}}
            ],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML, kubectl reads it

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=self.kubectl_env()
        )
        self.history.append(KubectlCall(args, result.returncode, result.stdout, result.stderr))
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl_env(self) -> dict[str, str]:
        # kubectl caches discovery and HTTP answers in ~/.kube/cache unless told otherwise: a test writes
        # nothing outside its own folders.
        return without_proxies() | {"KUBECACHEDIR": str(self.kube_cache)}

    def kubectl_json(self, *args: str, input: str | None = None) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", input=input).stdout)

    @property
    def running(self) -> bool:
        return bool(self._processes) and all(p.running() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        """etcd's and kube-apiserver's process ids: what a bench counts as the control plane's CPU."""
        return [p.popen.pid for p in self._processes]

    def stop(self) -> None:
        # Last started first: the controllers before the apiserver, the apiserver before etcd (so it
        # doesn't spend its shutdown retrying a vanished etcd).
        for process in reversed(self._processes):
            process.stop()
        self._processes.clear()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

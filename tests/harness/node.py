"""A real Kubernetes node on this machine: the Go-built kubelet and containerd (with Debian's runc),
in a private mount namespace, with its processes held in a cgroup tree of its own.

Isolation from the host. Inside the mount namespace, folders of the node's work directory are bound
over /var/lib, /var/log and /run (the kubelet hard-codes /var/lib/kubelet/device-plugins,
/var/log/pods and paths under /run), and the kernel tunables the kubelet would otherwise rewrite
host-wide (vm.overcommit_memory, kernel.panic, ...) are bound over with files holding the values it
wants.

The pod network (TierNetwork). The whole tier (etcd, the API server and its controllers, the kubelets,
containerd, gpuguard's processes and the test process itself) runs in a network namespace of its own,
entered once every build that needs the registries has run. In it a Linux bridge holds the gateway
address, the API server binds it, and each node's pods get addresses on the bridge from the reference
CNI `bridge` plugin with `host-local` IPAM, each node its own range of one subnet: every pod and the
tier share one L2, so nothing is forwarded (ip_forward stays 0) and the host's network namespace gets
no interface, route or rule.

Teardown and crash recovery. containerd, its shims, the kubelet and every container live under
the cgroup `gpuguard-node-<pid of the test session>-<node>` (the kubelet's cgroupRoot), so stopping
a node is: stop the kubelet and containerd, kill whatever is left in that tree, remove it; the
mount namespace then dies with its last process and takes every mount with it. A session that was
killed leaves shims and containers behind (the kubelet and containerd die with it): the next
session reclaims every such tree whose session is gone (`reclaim_leftovers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.controlplane import (
    ControlPlane,
    Process,
    free_ports,
    log_tail,
    spawn,
    wait_until,
    without_proxies,
)
from tests.harness.images import PAUSE_IMAGE, Image

CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "gpuguard-node-"
RUNC = Path("/usr/sbin/runc")
CNI_PLUGINS = Path("/usr/lib/cni")  # Debian's containernetworking-plugins; containerd runs `loopback`
# What the kubelet sets these to when they differ (pkg/kubelet/cm setupKernelTunables). In the node's
# mount namespace it reads them from files holding exactly these values, and so writes nothing.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": 1,
    "vm/panic_on_oom": 0,
    "kernel/panic": 10,
    "kernel/panic_on_oops": 1,
    "kernel/keys/root_maxkeys": 1000000,
    "kernel/keys/root_maxbytes": 25000000,
}
# Runs in the new mount namespace, then becomes containerd. Positional: $1 the work directory,
# $2 the cgroup.procs file to join, then containerd's command line.
NAMESPACE_SETUP = r"""
set -eu
work=$1 procs=$2
shift 2
echo $$ > "$procs"
mount --bind "$work/var-lib" /var/lib
mount --bind "$work/var-log" /var/log
mount --bind "$work/run" /run
for tunable in $(cd "$work/sysctl" && find . -type f); do
  mount --bind "$work/sysctl/$tunable" "/proc/sys/$tunable"
done
exec "$@"
"""
# Joins a cgroup, then runs the rest of its command line: $1 the cgroup.procs file.
JOIN_CGROUP = 'echo $$ > "$1"; shift; exec "$@"'
# The pod network (TierNetwork): one subnet, the bridge's gateway address in it, a range per node.
BRIDGE = "gpuguard0"
POD_SUBNET = "10.244.0.0/16"
GATEWAY = "10.244.0.1"
# The first address of kube-apiserver's --service-cluster-ip-range: the `kubernetes` Service's ClusterIP.
KUBERNETES_SERVICE_IP = "10.0.0.1"
CLONE_NEWNET = 0x40000000
# Where a kubelet and containerd write by default: on the host, they must stay as they were.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/log/pods",
    "/var/log/containers",
    "/run/containerd",
    "/run/netns",
    "/usr/libexec/kubernetes",
    "/etc/cni/net.d",
)


def node_tier_unavailable() -> str | None:
    """Why a node cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "needs root: the kubelet and containerd create cgroups, mounts and namespaces"
    for tool in ("unshare", "nsenter", "flock", "ip", "iptables", "go"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if shutil.which("apt-get") is None and not (RUNC.exists() and (CNI_PLUGINS / "loopback").exists()):
        return f"no apt-get to install runc and the CNI plugins, and {RUNC} or {CNI_PLUGINS} is missing"
    if not (CGROUP_FS / "pids" / "cgroup.procs").is_file():
        return f"needs the cgroup v1 hierarchies under {CGROUP_FS} (this harness drives those)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a mount namespace: {probe.stderr.strip() or probe.returncode}"
    return None


def host_state(network: TierNetwork | None = None) -> dict[str, Any]:
    """What the nodes must leave alone on the host: the default paths of a kubelet and containerd,
    the kernel tunables the kubelet sets (and ip_forward, which CNI bridges turn on), the host's
    network interfaces, and its mount points. Inside the tier's `network`, the network's are read in
    the host's namespace (in the tier's, /proc/sys/net and /proc/net show the tier's)."""
    mount_points = {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    read = ["cat", "/proc/sys/net/ipv4/ip_forward", "/proc/net/dev"]
    host = network.host_namespace if network is not None else None
    if host is not None:
        read = ["nsenter", f"--net=/proc/self/fd/{host}", "--", *read]
    lines = subprocess.run(
        read, capture_output=True, text=True, check=True, pass_fds=() if host is None else (host,)
    ).stdout.splitlines()
    return {
        "paths": {path: Path(path).exists() for path in HOST_PATHS},
        "sysctls": {
            **{tunable: Path("/proc/sys", tunable).read_text().strip() for tunable in KUBELET_SYSCTLS},
            "net/ipv4/ip_forward": lines[0].strip(),
        },
        # /proc/net/dev: two lines of headings, then `name: counters` for each interface.
        "interfaces": sorted(line.split(":")[0].strip() for line in lines[3:]),
        "mounts": sorted(mount_points),
    }


def _in_network_namespace(call: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, call)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{call}: {os.strerror(errno)}")


@dataclass
class TierNetwork:
    """The tier's own network namespace (see the module docstring). `enter()` moves the calling thread,
    and so every process it starts from then on, into a new one with loopback up and the pods' bridge
    holding GATEWAY; `leave()` moves it back, and the namespace, bridge and rules go with their last
    process. Enter from the main thread after every build that needs the registries: nothing in it
    reaches beyond the tier.

    Pods reach the API server at the `kubernetes` Service's ClusterIP (the kubelet sets
    KUBERNETES_SERVICE_HOST) through one DNAT rule (`route_kubernetes_service`), not a kube-proxy: the
    only Service a pod here dials is that one, since the API server calls webhook Services at their
    endpoints (--enable-aggregator-routing), and one rule needs no binary more to build and run and no
    conntrack tunables, which are host-wide."""

    # The namespace to go back to, open while the tier is in its own (a file descriptor).
    host_namespace: int | None = field(default=None, init=False)

    def enter(self) -> None:
        # unshare moves the calling thread only: the main thread starts the tier's processes and threads.
        assert threading.current_thread() is threading.main_thread(), (
            "enter the tier's network from the main thread"
        )
        self.host_namespace = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        _in_network_namespace("unshare", CLONE_NEWNET)
        for command in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "addr", "add", f"{GATEWAY}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE],
            ["ip", "link", "set", BRIDGE, "up"],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True)

    def route_kubernetes_service(self, apiserver_port: int) -> None:
        """The `kubernetes` Service (KUBERNETES_SERVICE_IP:443) to the API server, for the pods."""
        subprocess.run(
            [
                "iptables", "-t", "nat", "-A", "PREROUTING",
                "-d", f"{KUBERNETES_SERVICE_IP}/32", "-p", "tcp", "--dport", "443",
                "-j", "DNAT", "--to-destination", f"{GATEWAY}:{apiserver_port}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )  # fmt: skip

    def leave(self) -> None:
        if self.host_namespace is not None:
            _in_network_namespace("setns", self.host_namespace, CLONE_NEWNET)
            os.close(self.host_namespace)
            self.host_namespace = None


def cgroup_hierarchies() -> list[Path]:
    """The mounted v1 hierarchies (and the unified one of a hybrid host): where a tree must exist."""
    return sorted(p for p in CGROUP_FS.iterdir() if (p / "cgroup.procs").is_file())


def _walk_up(top: Path) -> list[Path]:
    """`top` and every cgroup under it, deepest first (the order rmdir needs)."""
    if not top.is_dir():
        return []
    found = [Path(root) for root, _, _ in os.walk(top)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _pids(top: Path) -> set[int]:
    pids: set[int] = set()
    for group in _walk_up(top):
        with contextlib.suppress(FileNotFoundError):
            pids.update(int(line) for line in (group / "cgroup.procs").read_text().split())
    return pids


@dataclass
class CgroupTree:
    """One node's cgroup `name` in every hierarchy; `system` (in the pids hierarchy) holds the
    node's own processes, the kubelet puts `kubepods` beside it."""

    name: str

    @property
    def pids_root(self) -> Path:
        return CGROUP_FS / "pids" / self.name

    @property
    def system_procs(self) -> Path:
        return self.pids_root / "system" / "cgroup.procs"

    def create(self) -> None:
        for hierarchy in cgroup_hierarchies():
            (hierarchy / self.name).mkdir(exist_ok=True)
        cpuset = CGROUP_FS / "cpuset"
        if (cpuset / "cpuset.cpus").is_file():  # a new cpuset admits no task until it has cpus and mems
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (cpuset / self.name / knob).write_text((cpuset / knob).read_text())
        (self.pids_root / "system").mkdir(exist_ok=True)

    def processes(self) -> set[int]:
        return _pids(self.pids_root)

    def kill_all(self, timeout: float = 30.0) -> int:
        """SIGKILLs every process in the tree until none is left; returns how many it killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while pids := self.processes():
            for pid in pids - killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.name}: processes {sorted(pids)} survive SIGKILL")
            time.sleep(0.05)  # the kernel empties the cgroup once the killed processes are reaped
        return len(killed)

    def remove(self) -> None:
        for hierarchy in cgroup_hierarchies():
            for group in _walk_up(hierarchy / self.name):
                group.rmdir()

    def exists(self) -> bool:
        return any((hierarchy / self.name).exists() for hierarchy in cgroup_hierarchies())


def session_cgroup_prefix(session_pid: int | None = None) -> str:
    return f"{CGROUP_PREFIX}{session_pid or os.getpid()}-"


def reclaim_leftovers() -> list[str]:
    """Kills and removes the cgroup trees of test sessions that are gone (killed before their
    teardown); trees of sessions still running (another worktree's) are left alone. Returns what
    it reclaimed."""
    owners: dict[str, int] = {}
    for hierarchy in cgroup_hierarchies():
        for group in hierarchy.glob(f"{CGROUP_PREFIX}*"):
            session = group.name.removeprefix(CGROUP_PREFIX).partition("-")[0]
            if session.isdigit():
                owners[group.name] = int(session)
    reclaimed = []
    for name, owner in sorted(owners.items()):
        if Path(f"/proc/{owner}").exists():
            continue
        tree = CgroupTree(name)
        killed = tree.kill_all()
        tree.remove()
        reclaimed.append(f"{name} ({killed} processes)")
    return reclaimed


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    runtime: Path  # containerd, containerd-shim-runc-v2, ctr, pause (tests/controlplane/runtime)


@dataclass
class Node:
    """One node: `start()` brings containerd up with the test images, then the kubelet, and waits
    until the Node is Ready. `stop_kubelet()`/`start_kubelet()` take the kubelet alone away and
    back (its pods keep running under containerd); `stop()` tears everything down. Started inside the
    tier's network (TierNetwork entered), whose bridge its pods join."""

    name: str
    index: int  # distinguishes the pods' addresses between nodes
    plane: ControlPlane
    binaries: NodeBinaries
    workdir: Path
    images: Sequence[Image]
    labels: dict[str, str] = field(default_factory=dict)
    # The kubelet renews its Lease every quarter of this: the heartbeat node-lifecycle watches.
    lease_seconds: int = 8
    status_update_seconds: int = 2
    cgroup: CgroupTree = field(init=False)
    kubelet_log: Path = field(init=False)
    containerd_log: Path = field(init=False)
    _containerd: Process | None = field(default=None, init=False)
    _kubelet: Process | None = field(default=None, init=False)
    # Held open from containerd's start to the end of teardown: while it is, the namespace's inode
    # number is not handed to another (another session's node, say), so looking for processes by
    # it finds this node's only.
    _mount_namespace_fd: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.cgroup = CgroupTree(f"{session_cgroup_prefix()}{self.name}")
        self.kubelet_log = self.workdir / "kubelet.log"
        self.containerd_log = self.workdir / "containerd.log"
        self.kubelet_port, self.healthz_port = free_ports(2)

    # --- paths as the test process (outside the node's mount namespace) sees them ---------------

    @property
    def kubelet_dir(self) -> Path:
        return self.workdir / "var-lib" / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        """The kubelet's device-plugin folder (`kubelet.sock`, and where plugins put theirs)."""
        return self.kubelet_dir / "device-plugins"

    @property
    def pod_resources_socket(self) -> Path:
        return self.kubelet_dir / "pod-resources" / "kubelet.sock"

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "run" / "containerd" / "containerd.sock"

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        try:
            self._prepare()
            self.cgroup.create()
            self._start_containerd(timeout)
            for image in self.images:
                self.ctr("images", "import", "--local", str(image.archive))
            self.start_kubelet(timeout)
        except BaseException:
            self.stop()
            raise

    def _prepare(self) -> None:
        w = self.workdir
        for folder in ("var-lib", "var-log", "run", "cni/conf", "cni/state", "volume-plugins"):
            (w / folder).mkdir(parents=True, exist_ok=True)
        for tunable, value in KUBELET_SYSCTLS.items():
            path = w / "sysctl" / tunable
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{value}\n")
        (w / "cni" / "conf" / "10-gpuguard-pods.conflist").write_text(json.dumps(self._pod_network()))
        (w / "containerd.toml").write_text(self._containerd_config())
        cert, key = self.plane.pki.issue_client(f"system:node:{self.name}", ["system:nodes"])
        self.plane.write_kubeconfig(w / "kubeconfig", f"system:node:{self.name}", cert, key)
        (w / "kubelet.yaml").write_text(json.dumps(self._kubelet_config(), indent=2))

    def _pod_network(self) -> dict[str, Any]:
        """The reference `bridge` plugin on the tier's bridge (which already holds the gateway: the
        plugin neither adds it nor turns on forwarding), `host-local` addresses from this node's range."""
        third = self.index + 1  # 10.244.<third>.0/24 of POD_SUBNET: GATEWAY's 10.244.0.0/24 is no node's
        prefix = GATEWAY.rsplit(".", 2)[0]
        addresses = {
            "subnet": POD_SUBNET,
            "rangeStart": f"{prefix}.{third}.1",
            "rangeEnd": f"{prefix}.{third}.254",
            "gateway": GATEWAY,
        }
        ipam = {
            "type": "host-local",
            "ranges": [[addresses]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(self.workdir / "cni" / "state"),
        }
        bridge = {"type": "bridge", "bridge": BRIDGE, "isGateway": False, "ipMasq": False, "ipam": ipam}
        return {"cniVersion": "1.0.0", "name": "gpuguard-pods", "plugins": [bridge]}

    def _containerd_config(self) -> str:
        cni_bins = json.dumps([str(CNI_PLUGINS)])
        # root, state and socket keep containerd's defaults: /var/lib and /run are the node's own.
        return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = false
  # This machine's root lacks CAP_SYS_RESOURCE: a negative oom_score_adj would fail every sandbox.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = {cni_bins}
    conf_dir = "{self.workdir / "cni" / "conf"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.grpc.v1.cri']
  # A port of its own (the default 10010 would clash with another node's).
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def _kubelet_config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": GATEWAY,  # where the API server finds it (the Node's address: --node-ip)
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.plane.pki.ca)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            # This machine binds every controller to cgroup v1; the kubelet still supports it when told.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup.name}",
            # Otherwise the kubelet installs iptables chains (with a DROP rule) in the host's namespace.
            "makeIPTablesUtilChains": False,
            "volumePluginDir": str(self.workdir / "volume-plugins"),  # default is under /usr/libexec
            "nodeLeaseDurationSeconds": self.lease_seconds,
            "nodeStatusUpdateFrequency": f"{self.status_update_seconds}s",
            "failSwapOn": False,
            "serializeImagePulls": False,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
        }

    def _start_containerd(self, timeout: float) -> None:
        env = without_proxies()
        env["PATH"] = (
            f"{self.binaries.runtime}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"  # the shim
        )
        argv: list[str | Path] = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            NAMESPACE_SETUP,
            "sh",
            self.workdir,
            self.cgroup.system_procs,
            self.binaries.runtime / "containerd",
            f"--config={self.workdir / 'containerd.toml'}",
        ]
        self._containerd = spawn(argv, self.containerd_log, env, cwd=self.workdir)
        wait_until(
            lambda: self.ctr("version", check=False).returncode == 0,
            timeout=timeout,
            what=f"{self.name}: containerd",
            process=self._containerd,
        )
        self._mount_namespace_fd = os.open(f"/proc/{self._containerd.popen.pid}/ns/mnt", os.O_RDONLY)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """containerd's own CLI on the node's socket, in the namespace the kubelet uses."""
        argv = [
            str(self.binaries.runtime / "ctr"),
            f"--address={self.containerd_socket}",
            "--namespace=k8s.io",
        ]
        return subprocess.run([*argv, *args], capture_output=True, text=True, check=check, timeout=60)

    def start_kubelet(self, timeout: float = 120.0) -> float:
        """Starts the kubelet in the node's mount namespace and waits until the Node is Ready (with a
        heartbeat newer than the start); returns the seconds that took."""
        if self._containerd is None or not self._containerd.running():
            raise RuntimeError(f"{self.name}: containerd is not running")
        argv: list[str | Path] = [
            "/bin/sh",
            "-c",
            JOIN_CGROUP,
            "sh",
            self.cgroup.system_procs,
            "nsenter",
            f"--mount=/proc/{self._containerd.popen.pid}/ns/mnt",
            "--",
            self.binaries.kubelet,
            f"--config={self.workdir / 'kubelet.yaml'}",
            f"--kubeconfig={self.workdir / 'kubeconfig'}",
            f"--hostname-override={self.name}",
            f"--node-ip={GATEWAY}",
            f"--node-labels={','.join(f'{k}={v}' for k, v in self.labels.items())}",
            "--v=2",
        ]
        begin = time.time()
        self._kubelet = spawn(argv, self.kubelet_log, without_proxies(), cwd=self.workdir)
        return wait_until(
            lambda: self.ready_since(begin),
            timeout=timeout,
            what=f"{self.name}: Node Ready",
            process=self._kubelet,
        )

    def wait_for(self, ready: Callable[[], bool], *, what: str, timeout: float = 60.0) -> float:
        """Polls `ready`, failing fast (with the log tail) if the kubelet dies."""
        return wait_until(ready, timeout=timeout, what=f"{self.name}: {what}", process=self._kubelet)

    def stop_kubelet(self) -> None:
        """SIGTERM to the kubelet only: the Node stops reporting, its containers keep running."""
        if self._kubelet is not None:
            self._kubelet.stop(timeout=30)
            self._kubelet = None

    @property
    def kubelet_running(self) -> bool:
        return self._kubelet is not None and self._kubelet.running()

    def node(self) -> dict[str, Any]:
        node: dict[str, Any] = self.plane.kubectl_json("get", "node", self.name)
        return node

    def ready_since(self, since: float) -> bool:
        """Ready=True with a heartbeat at or after `since` (epoch seconds): a Node object left from
        before a kubelet restart still says Ready until node-lifecycle notices."""
        result = self.plane.kubectl("get", "node", self.name, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        ready = condition(json.loads(result.stdout), "Ready")
        return (
            ready is not None
            and ready["status"] == "True"
            and parse_time(ready["lastHeartbeatTime"]) >= int(since)
        )

    def stop(self) -> list[str]:
        """Everything down, nothing left: no process in the node's cgroups, no cgroup, nothing in its
        mount namespace (which is gone), no socket in its work directory. Returns what was wrong."""
        problems: list[str] = []
        self.stop_kubelet()
        if self._containerd is not None:
            self._containerd.stop(timeout=30)  # shims and containers stay: containerd leaves them be
        killed = self.cgroup.kill_all() if self.cgroup.exists() else 0
        if killed:
            self.note(f"teardown killed {killed} processes (shims, containers)")
        if self.cgroup.exists():
            self.cgroup.remove()
        if self.cgroup.exists():
            problems.append(f"cgroup {self.cgroup.name} still exists")
        if self._mount_namespace_fd is not None:
            inode = os.fstat(self._mount_namespace_fd).st_ino
            with contextlib.suppress(TimeoutError):  # a killed process can take a moment to be gone
                wait_until(
                    lambda: not processes_in_mount_namespace(inode), timeout=10, what="namespace empty"
                )
            if holders := processes_in_mount_namespace(inode):
                problems.append(f"processes {holders} still in the node's mount namespace")
            os.close(self._mount_namespace_fd)  # the namespace, and every mount in it, goes now
            self._mount_namespace_fd = None
        for leftover in (self.workdir / "run", self.workdir / "var-lib"):
            # Sockets, image snapshots and pod volumes: nothing of it is needed once the node is gone.
            shutil.rmtree(leftover, ignore_errors=True)
        if sockets := [str(p) for p in _sockets(self.workdir)]:
            problems.append(f"sockets left: {sockets}")
        return problems

    def note(self, message: str) -> None:
        with self.kubelet_log.open("a") as log:
            log.write(f"# node tier: {message}\n")

    def log_tails(self) -> str:
        return (
            f"--- {self.kubelet_log}\n{log_tail(self.kubelet_log)}\n"
            f"--- {self.containerd_log}\n{log_tail(self.containerd_log)}"
        )


def processes_in_mount_namespace(inode: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "mnt").st_ino == inode:
                    found.append(int(entry.name))
    return found


def _sockets(directory: Path) -> Iterator[Path]:
    for root, _, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    yield path


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The status condition of type `kind` of a Node or Pod, if it has one."""
    conditions: list[dict[str, Any]] = obj.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def parse_time(stamp: str) -> float:
    """Epoch seconds of an API timestamp (RFC 3339 in UTC, whole seconds)."""
    return datetime.datetime.fromisoformat(stamp).timestamp()

"""Runs the app under uvicorn over TLS, wired to its policy source and, when asked, to the cluster."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from webhook.app import State, create_app
from webhook.policy import Policy, default_policy, parse_policy
from webhook.policy_store import FileWatcher, PolicyStore

if TYPE_CHECKING:
    from webhook import bootstrap

# The API server keeps idle webhook connections for 90 s; closing ours sooner makes it reconnect
# (a fresh TLS handshake) on the next admission. uvicorn's default is 5 s.
KEEP_ALIVE_SECONDS = 95
# On SIGTERM, requests in flight finish; the API server's timeoutSeconds is far below this.
GRACEFUL_SHUTDOWN_SECONDS = 30
CONFIGMAP_KEY = "policy.yaml"

log = logging.getLogger("gpuguard.server")


@dataclass(frozen=True)
class Options:
    host: str
    port: int
    cert_file: Path
    key_file: Path
    policy_file: Path | None = None
    # "namespace/name" of the ConfigMap holding the policy under CONFIGMAP_KEY.
    policy_configmap: str | None = None
    # Cluster lookups (PriorityClasses, namespaces, nodes, DRA claims): on when True.
    cluster: bool = False
    kubeconfig: str | None = None
    # Certificates from a Secret, shared by the replicas and rotated (webhook.bootstrap): the listener
    # starts on a placeholder in the settings' cert_dir (cert_file and key_file are unused) and switches
    # to the Secret's certificate once it is read.
    certificates: bootstrap.Settings | None = None


def _initial_policy(options: Options) -> tuple[Policy, str]:
    if options.policy_file is not None:
        return parse_policy(options.policy_file.read_text(encoding="utf-8")), f"file {options.policy_file}"
    return default_policy(), "embedded default"


def _connect_cluster(options: Options, state: State, stop: threading.Event) -> None:
    """Starts the fact caches and the ConfigMap watch; the first lists complete before serving."""
    from webhook import cluster  # the Kubernetes client is only needed with cluster access

    api = cluster.api_client(options.kubeconfig)
    facts = cluster.Facts(get=lambda: state.facts, put=lambda snapshot: setattr(state, "facts", snapshot))
    reflectors = cluster.fact_reflectors(api, facts, stop) if options.cluster else []
    if options.policy_configmap:
        namespace, _, name = options.policy_configmap.partition("/")
        source = f"ConfigMap {namespace}/{name}"
        configmap = cluster.PolicyConfigMap(
            api,
            namespace,
            name,
            key=CONFIGMAP_KEY,
            offer=lambda text: state.store.offer(text, source=source),
            stop=stop,
        )
        state.store.on_error = lambda error: configmap.event("InvalidPolicy", error, warning=True)

        def loaded(policy: Policy) -> None:
            configmap.event("PolicyLoaded", f"policy {policy.hash} is active", warning=False)
            if message := _missing_priority_class(state):
                configmap.event("PriorityClassMissing", message, warning=True)

        state.store.on_loaded = loaded
        reflectors.append(configmap.reflector)
    for reflector in reflectors:
        reflector.sync()
        reflector.start()
    _missing_priority_class(state)


def _missing_priority_class(state: State) -> str | None:
    """Says (and logs) when the policy's class is absent from the cluster: it is then never injected."""
    class_name = state.policy.rules.priority.className
    known = state.facts.priority_classes
    if known is None or class_name in known:
        return None
    message = f"PriorityClass {class_name} (rules.priority.className) does not exist: it is not injected"
    log.warning(message)
    return message


def build(options: Options, stop: threading.Event) -> tuple[uvicorn.Server, State]:
    policy, source = _initial_policy(options)
    state = State(PolicyStore(policy, source=source))
    if options.cluster or options.policy_configmap:
        _connect_cluster(options, state, stop)
    if options.policy_file is not None:
        FileWatcher(options.policy_file, state.store, stop).thread.start()
    cert_file, key_file = options.cert_file, options.key_file
    certificates = _certificate_manager(options, state, stop)
    if certificates is not None:
        placeholder = certificates.prepare()
        cert_file, key_file = placeholder.cert, placeholder.key
    config = uvicorn.Config(
        create_app(state),
        host=options.host,
        port=options.port,
        ssl_certfile=str(cert_file),
        ssl_keyfile=str(key_file),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        access_log=False,
        log_config=None,
        server_header=False,
    )
    if certificates is not None:
        # Made now rather than by uvicorn at startup, so the manager can switch what it presents.
        config.load()
        assert config.ssl is not None
        certificates.serving.attach(config.ssl)
        certificates.start()
    return uvicorn.Server(config), state


def _certificate_manager(
    options: Options, state: State, stop: threading.Event
) -> bootstrap.CertificateManager | None:
    if options.certificates is None:
        return None
    from webhook import bootstrap, cluster  # the Kubernetes client is only needed with cluster access

    manager = bootstrap.CertificateManager(
        cluster.api_client(options.kubeconfig), options.certificates, stop=stop
    )
    state.certificate_valid = manager.serving.valid
    return manager


def _exit_cleanly(signum: int, _: object) -> None:
    raise SystemExit(0)


def serve(options: Options) -> None:
    # uvicorn drains requests on SIGTERM, then re-raises the signal to the handler it found: make that
    # handler a clean exit, so a normal pod stop ends with status 0 rather than "killed by SIGTERM".
    signal.signal(signal.SIGTERM, _exit_cleanly)
    stop = threading.Event()
    server, _ = build(options, stop)
    try:
        server.run()
    finally:
        stop.set()

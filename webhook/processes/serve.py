"""The composition root: which parts `gpuguard serve` runs, wired to what, started in which order.

Nothing here decides anything about workloads; it builds the policy store, the cluster caches and the
policy ConfigMap source (when asked), the certificate manager (certificates from a Secret), the probes
and the admission app, then serves until SIGTERM. Imports that cost memory are made only when used:
the Kubernetes client with cluster access, `cryptography` only to generate or rotate certificates.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from webhook.admission.app import AdmissionApp, State
from webhook.admission.server import https_server
from webhook.policy import drivers
from webhook.policy.model import CONFIGMAP_KEY, Policy
from webhook.processes import serve_workers
from webhook.runtime import logs, probes
from webhook.runtime.policy_store import FileWatcher, PolicyStore, initial_policy

if TYPE_CHECKING:
    import uvicorn

    from webhook.certs import rotation as certificates
    from webhook.kube.client import ApiClient
    from webhook.kube.informer import Informer

log = logging.getLogger("gpuguard.manager")


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
    # Certificates from a Secret, shared by the replicas and rotated (webhook.certs.rotation): the
    # listener starts on a placeholder in the settings' cert_dir (cert_file and key_file are unused) and
    # switches to the Secret's certificate once it is read.
    certificates: certificates.Settings | None = None
    # Processes answering on one socket (webhook.processes.serve_workers); 1: this process serves alone.
    workers: int = 1


def _connect_cluster(api: ApiClient, options: Options, state: State, stop: threading.Event) -> None:
    """Starts the fact caches and the ConfigMap watch; the first lists complete before serving.

    The policy ConfigMap is read first, so that the node cache is filled once, under the policy that
    will be served, rather than once under the embedded one and again under the ConfigMap's.
    """
    from webhook.kube import fact_sources, policy_source
    from webhook.kube.events import EventRecorder, api_sender

    informers: list[Informer[Any]] = []
    configmap: policy_source.PolicyConfigMap | None = None
    if options.policy_configmap:
        namespace, _, name = options.policy_configmap.partition("/")
        source = f"ConfigMap {namespace}/{name}"
        events = EventRecorder(api_sender(api), stop=stop)
        events.start()
        configmap = policy_source.PolicyConfigMap(
            api,
            namespace,
            name,
            key=CONFIGMAP_KEY,
            offer=lambda text: state.store.offer(text, source=source),
            events=events,
            stop=stop,
        )
        state.store.on_error = lambda error: configmap.event("InvalidPolicy", error, warning=True)

        def loaded(policy: Policy) -> None:
            configmap.event("PolicyLoaded", f"policy {policy.hash} is active", warning=False)
            if message := _missing_priority_class(state):
                configmap.event("PriorityClassMissing", message, warning=True)

        state.store.on_loaded = loaded
        configmap.informer.sync()
        informers.append(configmap.informer)
    if options.cluster:
        publisher = fact_sources.FactsPublisher(
            get=lambda: state.facts, put=lambda snapshot: setattr(state, "facts", snapshot)
        )
        cluster = fact_sources.FactInformers(api, publisher, stop, state.policy)
        _also_on_loaded(state.store, cluster.policy_loaded)
        for informer in cluster.informers:
            informer.sync()
        informers += cluster.informers
    for informer in informers:
        informer.start()
    message = _missing_priority_class(state)
    if message and configmap is not None and state.store.source.startswith("ConfigMap"):
        # Loaded from the ConfigMap before the PriorityClasses were known: say it now that they are.
        configmap.event("PriorityClassMissing", message, warning=True)


def _also_on_loaded(store: PolicyStore, hook: Callable[[Policy], None]) -> None:
    previous = store.on_loaded

    def both(policy: Policy) -> None:
        previous(policy)
        hook(policy)

    store.on_loaded = both


def _missing_priority_class(state: State) -> str | None:
    """Says (and logs) when the policy's class is absent from the cluster: it is then never injected."""
    class_name = state.policy.rules.priority.className
    known = state.facts.priority_classes
    if known is None or class_name in known:
        return None
    message = f"PriorityClass {class_name} (rules.priority.className) does not exist: it is not injected"
    log.warning(message)
    return message


def _certificate_manager(
    api: ApiClient, settings: certificates.Settings, stop: threading.Event
) -> certificates.CertificateManager:
    from webhook.certs.rotation import CertificateManager
    from webhook.kube.certificates import SecretStore, WebhookConfigurations

    store = SecretStore(api, settings.namespace, settings.secret)
    configurations = WebhookConfigurations(api, settings.webhook_config) if settings.webhook_config else None
    return CertificateManager(settings, store, configurations, stop=stop)


def _probes(state: State, worker: serve_workers.Worker | None) -> probes.Probes:
    def status() -> dict[str, object]:
        return {
            **state.store.status().as_json(),
            "enabled": state.policy.enabled,
            "unavailableLookups": list(state.facts.unavailable),
        }

    def metrics() -> str:
        nodes = state.facts.nodes
        pools = (
            None
            if nodes is None
            else drivers.summarise(nodes, state.policy.rules.driverCompatibility.nodeLabels)
        )
        # With workers, every scrape adds up all of them, whichever one it reaches.
        counters = state.metrics if worker is None else worker.merged(state.metrics)
        return counters.render(state.store.status(), pools)

    return probes.Probes(detail=lambda: f"policy={state.policy.hash}", metrics=metrics, status=status)


def build(
    options: Options, stop: threading.Event, worker: serve_workers.Worker | None = None
) -> tuple[uvicorn.Server, State]:
    """Everything one serving process runs; `worker` when it is one of several (webhook.processes.serve_workers)."""
    policy, source, policy_bytes = initial_policy(options.policy_file)
    state = State(PolicyStore(policy, source=source))
    health = _probes(state, worker)
    if worker is not None:
        if worker.inherited is not None:
            state.metrics.add(worker.inherited)
        health.add_readiness_check(serve_workers.WORKERS_CHECK, worker.others_ready)
    api = None
    if options.cluster or options.policy_configmap or options.certificates:
        from webhook.kube.client import api_client  # the Kubernetes client only with cluster access

        api = api_client(options.kubeconfig)
    if api is not None and (options.cluster or options.policy_configmap):
        _connect_cluster(api, options, state, stop)
    if options.policy_file is not None:
        watcher = FileWatcher(options.policy_file, state.store, stop, loaded=policy_bytes)
        watcher.thread.start()
        # Not ready without it: a replica that no longer sees edits would miss the kill switch too.
        health.add_readiness_check("policy file", watcher.thread.is_alive)
    app = AdmissionApp(state, probes.create_app(health))
    if api is None or options.certificates is None:
        server = https_server(
            app, host=options.host, port=options.port, cert_file=options.cert_file, key_file=options.key_file
        )
    else:
        manager = _certificate_manager(api, options.certificates, stop)
        health.add_readiness_check("certificate", manager.serving.valid)
        placeholder = manager.prepare()
        server = https_server(
            app,
            host=options.host,
            port=options.port,
            cert_file=placeholder.cert,
            key_file=placeholder.key,
            adopt_context=manager.serving.attach,
        )
        manager.start()
    # Told to stop, the server drains before it ends: not ready from the signal on, so a worker that
    # stops is never again counted ready while its successor is yet to start.
    health.add_readiness_check("stopping", lambda: not server.should_exit)
    if worker is not None:
        # What a worker publishes is its own readiness: the others' is theirs to publish (and reading it
        # asks them to publish, which must not ask back).
        worker.publishing(
            lambda: health.failing(skipping=(serve_workers.WORKERS_CHECK,)), state.metrics, stop
        )
        # Its slot says it serves from the moment it does: a worker ended before its next publication
        # must not be taken for one that never served, which ends the whole server.
        health.on_started = worker.publish
    return server, state


def _exit_cleanly(signum: int, _: object) -> None:
    raise SystemExit(0)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024


def _return_large_buffers_to_the_system() -> None:
    """Makes glibc serve every allocation above 128 KiB (request bodies) from its own mapping.

    By default glibc raises that threshold the first time such a block is freed, and later large
    bodies then come from the heap, which fragments and never shrinks: a burst of big requests left
    the resident size where the burst took it. With the threshold fixed, it returns when they end.
    Small allocations (a typical review) are unaffected. Elsewhere than glibc this does nothing.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        log.info("mallopt unavailable; large request buffers stay with the allocator")


def _serve_one(
    options: Options, worker: serve_workers.Worker | None = None, sockets: list[socket.socket] | None = None
) -> None:
    # uvicorn drains requests on SIGTERM, then re-raises the signal to the handler it found: make that
    # handler a clean exit, so a normal pod stop ends with status 0 rather than "killed by SIGTERM".
    signal.signal(signal.SIGTERM, _exit_cleanly)
    stop = threading.Event()
    server, _ = build(options, stop, worker)
    # What starting made (modules, the policy, the caches' first lists) lives as long as the process:
    # kept out of every later collection, which then walks only what requests make.
    gc.freeze()
    try:
        server.run(sockets=sockets)
    finally:
        stop.set()
        if worker is not None:
            # Its last word, so its successor continues from every count.
            worker.publish()


def _worker_options(options: Options, slot: int) -> Options:
    """A worker's options: its own directory for the Secret's certificate files, which every worker
    writes when it adopts a certificate (one file per worker, never one written by two at once)."""
    if options.certificates is None:
        return options
    cert_dir = options.certificates.cert_dir / f"worker-{slot}"
    return dataclasses.replace(
        options, certificates=dataclasses.replace(options.certificates, cert_dir=cert_dir)
    )


def serve(options: Options) -> int:
    """Serves until SIGTERM; the exit status."""
    _return_large_buffers_to_the_system()
    if options.workers == 1:
        _serve_one(options)
        return 0
    listener = serve_workers.listen(options.host, options.port)

    def run(worker: serve_workers.Worker) -> int:
        logs.configure(worker=worker.slot)
        _serve_one(_worker_options(options, worker.slot), worker, [listener])
        return 0

    return serve_workers.Supervisor(options.workers, run).run()

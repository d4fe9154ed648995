"""gpuguard: admission and device-failure response for GPU and accelerator workloads on Kubernetes.

The folder is named `webhook` and the project's design keeps that name, but the admission webhook is
only one room of it (`webhook.admission`); the package is all of gpuguard. Logger names, metric
prefixes, annotations and the console script say `gpuguard`.

# Organization

One image, one `gpuguard` command, and these processes. The long-running ones each have one
composition root, in `webhook.processes`, which wires the rooms below and starts them:

    process                                   composition root              rooms it wires
    gpuguard serve (Deployment)               processes/serve.py            admission, certs, kube, runtime
      --workers N (the same, N processes)     processes/serve_workers.py
    gpuguard controllers (Deployment, Lease)  processes/controllers.py      controllers, kube, runtime, and
                                                                            the audit cli/controllers.py hands in
    gpuguard node-agent (DaemonSet)           processes/node_agent.py       agent, kube, runtime
    gpuguard audit (CronJob, or by hand)      cli/audit.py (one-shot)       audit, kube
    the offline CLI (validate, mutate, ...)   cli/workloads.py and others   policy

Every one of them decides through `webhook.policy`. The rooms:

    policy/       the pure engine: the policy, workloads, cluster facts, the rules, the device-health
                  verdicts; plain data in, data out (no web framework, Kubernetes client or crypto)
    admission/    the admission webhook: AdmissionReview bytes to answer bytes, its endpoints, its server
    certs/        the serving certificate: files, generation, rotation through a Secret
    kube/         everything that talks to the Kubernetes API, and the only code importing `kubernetes`
    controllers/  the node health controller and the pod device-health watcher, and what they report
    audit/        workloads already running, judged by the same engine, written as PolicyReports
    agent/        the node agent's poll loop and its kubelet PodResources client
    runtime/      what every long-running process shares: probes, metrics, logs, the policy store
    processes/    one composition root per long-running process
    cli/          the `gpuguard` command: argparse, one module per command group
    __main__.py   `python -m webhook`, the same as `gpuguard`

The import rules between the rooms are tests (tests/unit/test_layering.py); each room's docstring
names its modules, and tests/unit/test_rooms.py keeps that true.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

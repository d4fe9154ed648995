"""One composition root per long-running process (Kyverno's cmd folder holds one per binary): what the
process runs, wired to what, started in which order. Nothing here decides; a root may import any room
but the command line, which calls it (webhook.cli parses the flags, a root runs).

    serve.py          `gpuguard serve`: the policy store, the cluster facts, the certificates, the probes
                      and the admission app
    serve_workers.py  `gpuguard serve --workers N`: the supervisor and the board the workers share
    controllers.py    `gpuguard controllers`: every replica's caches and probes, the Lease, and what only
                      the leader runs
    node_agent.py     `gpuguard node-agent`: the pods informer, the PodResources client and the poll loop

The one-shot commands (the audit, the offline CLI) need no root: their command module does the work.
"""

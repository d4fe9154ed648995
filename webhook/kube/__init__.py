"""Everything that talks to the Kubernetes API, and the only code that imports the `kubernetes` client.
It imports nothing of gpuguard above it but the policy engine.

    client.py         the API client, and list/watch access to one resource as raw JSON
    informer.py       a list-then-watch cache of one kind: per-key changes, snapshots, `has_synced`
    fact_sources.py   the cluster facts admission reads, from one informer per resource
    policy_source.py  the policy ConfigMap, watched
    events.py         Events (`events.k8s.io/v1`), a fixed vocabulary, sent off the caller's thread
    certificates.py   the certificates' Secret and the caBundle of both webhook configurations
    queue.py          a rate-limited work queue of keys
    controller.py     the reconcile loop: workers take keys from the queue and converge each one
    lease.py          leader election on a Lease
    remediation.py    the controllers' and node agent's writes: Node and Pod-status patches, evictions
    listing.py        one-shot paginated reads: what the audit judges and the facts it needs
    reports.py        PolicyReport APIs and writing one report per namespace
"""

"""Controllers that respond to device failures (node health, pod device health): level-triggered
reconcilers over `webhook.kube` informers, deciding through the pure verdicts of `webhook.policy`.
Their composition root is webhook.processes.controllers.

    nodehealth.py  the node health controller: `health.plan_node` decides, this writes the difference
    podhealth.py   the pod device-health watcher: `health.pod_verdict` decides, the Eviction API acts
    fleet.py       the fleet as a whole: nodes per pool, the ledger, pod and DRA indexes, rate limits
    breaker.py     the circuit breaker and its state in a ConfigMap
    wiring.py      the two controllers wired to each other and their shared state (the one place the
                   root, the fleet-day bench and the tests build them)
    nativesync.py  the native admission policies kept in step with `admission.mode`, on the leader
    series.py      the metric series they keep
    status.py      what `gpuguard nodes` reports: their verdicts computed here and now
"""

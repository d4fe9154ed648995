"""What every long-running gpuguard process shares (`serve` and its workers, `controllers`,
`node-agent`), so that each answers its operator the same way. It imports nothing of gpuguard but the
policy engine; the composition roots in webhook.processes and the rooms they wire use it.

    probes.py        /healthz, /readyz (the readiness checks a root registers), /metrics and /policy
    metrics.py       Prometheus text without a client library: the serving counters and a Registry
    logs.py          JSON log lines on stderr
    policy_store.py  the active policy: a new one validated first, the last good one kept
"""

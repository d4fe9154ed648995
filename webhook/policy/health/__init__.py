"""Device health verdicts (pure): plain node, pod and device facts in, what gpuguard should do out.

Nothing here reads a clock, a cache or the cluster: the controllers and the node agent hand in what
they observed and `now`, and get back a verdict. The modules, from the bottom up:

    records.py      gpuguard's record of a node (the `gpuguard.io/remediation` annotation) and its times
    holdings.py     which pods hold devices their node no longer allocates (the node agent's
                    PodResources view), and the pod condition that reports them
    observed.py     the fields of Nodes, Pods, ResourceSlices and ResourceClaims the verdicts read,
                    converted from the API objects
    signals.py      which signals a node shows, what state they put it in, and which nodes the
                    controllers look after
    claimloss.py    which DRA devices the pods on a node hold have failed (the node agent's view of
                    its node's ResourceSlices)
    fences.py       gpuguard's DeviceTaintRules, a failed DRA device fenced alone
    ladder.py       the plan for a node (condition, taint, cordon and drain, undone on recovery), its
                    budget and the circuit breaker
    podverdicts.py  whether a pod should be evicted, and the backoff after a refused eviction

Each imports only the ones above it; callers import the module they need.
"""

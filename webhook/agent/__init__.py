"""`gpuguard node-agent`: one per node, reads the kubelet's PodResources API and reports pods holding
devices their node no longer allocates (webhook.policy.health.holdings decides; this room reads and
writes). Its composition root is webhook.processes.node_agent.

    nodeagent.py     the poll loop: read the kubelet, decide, keep each pod's condition true to it
    podresources.py  the kubelet's PodResources API (v1) over gRPC, its answers read field by field
"""

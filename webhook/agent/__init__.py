"""`gpuguard node-agent`: one per node, reads the kubelet's PodResources API and reports pods holding
devices their node no longer allocates (webhook.policy.health.holdings decides; this room reads and writes)."""

"""What every long-running gpuguard process shares: probes, metrics, logs, the policy store."""

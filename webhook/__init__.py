"""gpuguard: a Kubernetes admission webhook that makes GPU/accelerator workloads resilient.

The pure core (policy, workload, rules, engine, patch, review) takes plain dicts and returns data; the
shell (app, server, tls, cli) wraps it with HTTP, TLS and the command line.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

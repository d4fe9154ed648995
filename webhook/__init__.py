"""gpuguard: admission and device-failure response for GPU and accelerator workloads on Kubernetes.

`policy` is the pure engine (plain data in, data out); `admission`, `certs`, `kube`, `controllers` and
`audit` are the shell around it; `manager` wires them; `cli` is the command line. The import rules
between them are tests (tests/unit/test_layering.py).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

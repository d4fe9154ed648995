"""The pure policy engine: the policy model, workloads, cluster facts, the rules, the engine and the
patch differ. Plain data in, data out; nothing here imports a web framework, the Kubernetes client
or a crypto library (tests/unit/test_layering.py holds it to that). Why:
docs/design/2026-12-02-pure-core.md."""

"""The pure policy engine. Plain data in, data out; nothing here imports a web framework, the Kubernetes
client or a crypto library (tests/unit/test_layering.py holds it to that). Why:
docs/design/2026-12-02-pure-core.md.

The policy:

    model.py         the policy: a frozen pydantic model, and parsing it (the schema's entry point)
    model_types.py   what every section of the model is built from: the strict base, bounded fields, selectors
    model_health.py  the model's health: section, what the controllers watch and may do
    loader.py        policy YAML as gpuguard reads it (YAML 1.2 booleans, bounded)
    merge.py         a policy's text merged over the embedded default
    errors.py        the wording a user reads when a policy is refused

What it judges:

    kinds.py         the workload kinds: where each keeps its pod templates, which are gangs
    workload.py      one pod template, and what makes a workload an accelerator workload
    accelerators.py  what makes a node or a request an accelerator one: one definition for every process
    facts.py         what the cluster knows and an object does not (PriorityClasses, nodes, claims)
    quantity.py      resource quantities, read as the API server reads them
    nodeaffinity.py  node selection as the scheduler reads it, and a driver minimum merged into it
    images.py        image references, read as the container runtime reads them
    hostpaths.py     whether a hostPath mount reaches a device-software path
    drivers.py       driver and CUDA versions by node pool and GPU product
    fields.py        the parts of a JSON document a reader needs, and keeping only those

Deciding:

    rules.py         the rules: mutators edit a workload, validators return denials
    gangs.py         failure handling for a whole group of pods (JobSet, LeaderWorkerSet)
    engine.py        modes and decisions: a mutated copy and decisions out
    patch.py         a deterministic JSON Patch from the difference of two documents
    native.py        the policy compiled into the API server's own admission policies
    nativecel.py     the CEL text those policies share (literals, globs, the pod spec of each kind)
    nativemutating.py  the mutating rules as MutatingAdmissionPolicies
    nativevalidating.py  the validating rules as ValidatingAdmissionPolicies
    nativedriver.py  the driver minimum as node affinity added and checked natively
    nativesync.py    what the controllers' leader keeps in the cluster for `admission.mode`
    nativegaps.py    what each rule leaves to the webhook, as CEL over an admission request
    nativenarrow.py  which requests gpuguard's webhooks still see beside the native policies
    health/          the device-health verdicts of the controllers and the node agent
"""

"""The test harness the unit, integration, e2e and node tiers and the bench share (as controller-runtime's
envtest is a library, not a test): import it as `tests.harness.<module>`, from the repository root.

Builders, pure:
  manifests.py      pods, Jobs, CronJobs and AdmissionReviews shaped as the API server sends them,
                    policies, Kubernetes' own validation of what the patches touch, the CLI as a process
  corpus.py         where the shared corpus of real-world manifests is, and whether this run has it
  third_party.py    the shared third-party sources (JobSet), unpacked into the cache
The control plane and gpuguard on it:
  controlplane.py   etcd + kube-apiserver on loopback (envtest's shape), kubectl, processes, waiting
  admission.py      `gpuguard serve` as a process, registered as the cluster's admission webhook, and
                    the named objects the e2e and node tiers submit (gpu_pod(name, namespace), ...)
  controllers.py    `gpuguard controllers` with the test in the kubelet's place
  install.py        the deploy folder applied, replicas run as its ServiceAccount
  chart.py          Helm and the chart
  jobset.py         JobSet's CRD and controller manager
  scheduling.py     a scheduler of the tests' own, nodes that are API objects only
  (the CRDs the tests install, PolicyReports and structural workload kinds, are in the crds folder)
Real nodes (the node tier):
  node.py           kubelet + containerd in a private mount namespace and cgroup tree
  images.py         container images built without a registry
  kubelet_api.py    the kubelet's gRPC APIs, compiled from the pinned .proto files
  device_plugin.py  a fake accelerator device plugin on the kubelet's device plugin API
  dra_driver.py     a fake DRA driver on the kubelet's DRA and device health APIs, with its ResourceSlice
  responders.py     gpuguard's controllers and node agents on the real nodes
  workloads.py      workloads for real nodes and what the cluster did with them
The run:
  suite.py          the suite's pytest plugin (`-p tests.harness.suite`): header, corpus, summary
  session.py        building the Go binaries, writing past pytest's capture
The unit tier's seams:
  wired.py          both controllers wired as in production over real informers on listed objects,
                    writes and Events recorded, a clock the test moves
  apiserver.py      an in-process API server behind the real Kubernetes client's connection pool:
                    lists, watches held open, writes at a resourceVersion, injected refusals, no socket
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

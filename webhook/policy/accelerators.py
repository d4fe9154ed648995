"""What makes a node, or a request of a pod, an accelerator one: one definition for every process.

Admission, the audit and the controllers all ask "is this an accelerator node?" and "does this pod ask
for accelerators?", each from what it sees: admission and the audit a Node object (its labels and the
names in its capacity), the controllers the same plus the node's ResourceSlices. The answers come from
here alone, so they differ only by what each one sees: a node whose only sign of accelerators is the
devices of an accelerator DRA driver in its ResourceSlices is one to the controllers, which read those
slices, and not to admission, which does not.

Which accelerator nodes the controllers look after is a second question with its own name
(`health.signals.in_health_scope`: also selected by `health.nodeSelector`). The node agent asks
neither: it reports every device a pod holds and its node no longer allocates, and the controllers
keep those of accelerator requests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from webhook.policy.model import Accelerators


def is_accelerator_node(
    accelerators: Accelerators,
    *,
    labels: Collection[str],
    resources: Iterable[str],
    drivers: Iterable[str] = (),
) -> bool:
    """A node carrying an accelerator node label, an accelerator resource in its capacity (at any
    count, 0 included: the kubelet writes 0 for a resource whose device plugin went away), or devices
    of an accelerator DRA driver in its ResourceSlices (`drivers`, when the caller reads them)."""
    return (
        any(key in labels for key in accelerators.nodeLabels)
        or any(accelerators.is_accelerator_resource(name) for name in resources)
        or any(accelerators.is_accelerator_driver(driver) for driver in drivers)
    )


def claim_counts(accelerators: Accelerators, device_classes: Collection[str] | None) -> bool:
    """A DRA resource claim counts as an accelerator request when the policy counts claims and the
    claim asks for an accelerator device class, or what it asks for is not known (None)."""
    if not accelerators.resourceClaims:
        return False
    if device_classes is None:
        return True
    return any(accelerators.is_accelerator_device_class(name) for name in device_classes)

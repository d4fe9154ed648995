"""The native admission policies kept in step with the live policy (`admission.mode`), on the leader.

One key, reconciled whenever the policy loads or an object gpuguard owns changes (someone edited or
deleted it): the wanted objects (webhook.policy.nativesync.wanted) against what the informers hold of
gpuguard's own, and the writes between them, each at the resourceVersion read (an object changed meanwhile
is a conflict, retried with backoff on a fresher cache). Every write goes through the writer's fence, so a
replica that may no longer lead sends nothing.

A policy that does not compile changes nothing: the objects of the last one that did stay, as the
webhook keeps the last good policy. An object the API server refuses (422) is left as it was; the rest of
the writes still go.

Then gpuguard's webhook configurations: their match condition of gpuguard's, and the entries added for
the namespaces that need every request (webhook.policy.nativenarrow), are written only when the native
objects are as wanted and have been for SETTLE_SECONDS (the API server's admission plugins take them from
their own watch), and undone (the configurations as deploy/ shaped them) before any native object is
written, so the webhooks see every request whenever the native side is changing. A policy that does not
compile, or `webhook` mode, leaves the webhooks un-narrowed. The configurations are watched too: a change
by anyone else wakes the key, which reads them afresh and writes only what differs (a conflict is read
again, never forced).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

from webhook.controllers import series
from webhook.kube.client import metadata_of
from webhook.kube.controller import Controller, Result, TerminalError
from webhook.kube.informer import Change, Informer
from webhook.kube.remediation import InvalidObjectError, NotFoundError
from webhook.policy import nativenarrow, nativesync
from webhook.policy.model import Policy
from webhook.policy.native import DEFAULT_NAMESPACE, Compiled, compile_policy
from webhook.policy.nativesync import RESOURCES, Owned, Write
from webhook.policy.workload import JSON
from webhook.runtime.metrics import Registry

NAME = "native-policies"
KEY = "native-policies"  # the one key: every object is decided together
# How long the native objects stay as wanted before the webhooks are narrowed: the API server's
# admission plugins load policies and bindings from their own watch, which lags a write.
SETTLE_SECONDS = 5.0

log = logging.getLogger("gpuguard.nativesync")


class NativeWrites(Protocol):
    def create(self, resource: str, body: dict[str, Any]) -> None: ...

    def replace(self, resource: str, name: str, body: dict[str, Any]) -> None: ...

    def delete(self, resource: str, name: str, resource_version: str) -> None: ...


class WebhookConfigurationWrites(Protocol):
    def read(self, kind: str) -> JSON | None:
        """The configuration of that kind, as stored; None when there is none."""

    def patch(self, kind: str, operations: list[JSON]) -> None: ...


def converter(raw: dict[str, Any]) -> tuple[Hashable, Owned] | None:
    found = nativesync.owned(raw)
    return (found.key, found) if found is not None else None


class NativePolicies:
    def __init__(
        self,
        *,
        owned: Sequence[Informer[Owned]],
        policy: Callable[[], Policy],
        writes: NativeWrites,
        owner: Callable[[], JSON],
        registry: Registry,
        stop: threading.Event,
        namespace: str = DEFAULT_NAMESPACE,
        compile: Callable[[Policy], Compiled] | None = None,
        configurations: WebhookConfigurationWrites | None = None,
        watched: Sequence[Informer[str]] = (),
        settle_seconds: float = SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.owned = owned
        self.policy = policy
        self.writes = writes
        self.owner = owner
        self.registry = registry
        # gpuguard's own namespace, where no native policy binds (as no webhook of it calls there).
        self.namespace = namespace
        self.compile = compile or functools.partial(compile_policy, namespace=namespace)
        self.configurations = configurations
        self.settle_seconds = settle_seconds
        self.clock = clock
        # When the native objects were last seen to change, were written, or this replica began to lead:
        # it cannot know they are in force before the API server's admission plugins have had the settle
        # time to load them from their own watch.
        self.changed_at = clock()
        # Whether some webhook of each configuration carries gpuguard's condition, as last written or
        # read (for /policy).
        self.narrowed: dict[str, bool] = {}
        # Why the objects are not what the policy wants, when retrying cannot help (shown by /policy).
        self.problem: str | None = None
        self.controller: Controller[str] = Controller(NAME, self.reconcile, stop=stop, observe=self._observed)
        for informer in owned:
            informer.on_change(self.owned_changed)
        # The webhook configurations themselves: a change by anyone else (deploy/ applied again, an edit)
        # is undone on the next reconcile, which reads them afresh and writes only what differs.
        for watch in watched:
            watch.on_change(lambda change: self.controller.enqueue(KEY))

    def _observed(self, outcome: str, seconds: float) -> None:
        self.registry.inc(series.RECONCILES, NAME, outcome)
        self.registry.observe(series.RECONCILE_SECONDS, seconds, NAME)

    def owned_changed(self, change: Change[Owned]) -> None:
        self.changed_at = self.clock()
        self.controller.enqueue(KEY)

    def start_leading(self) -> None:
        """Reconcile as the new leader: what the last one wrote may not be in force yet."""
        self.changed_at = self.clock()
        self.controller.start()
        self.controller.enqueue(KEY)

    def policy_changed(self) -> None:
        self.controller.enqueue(KEY)

    def reconcile(self, key: str) -> Result:
        policy = self.policy()
        owner = self.owner() if policy.admission.mode != "webhook" else {}
        stored = self._configurations()
        try:
            want = nativesync.wanted(policy, owner, self.compile, nativesync.failing_closed(stored))
        except Exception as exc:  # whatever compiling raised: the objects in place stay
            self.problem = f"policy {policy.hash} does not compile (the last good objects stay): {exc}"
            log.warning("native admission policies: %s", self.problem)
            self._narrow(nativenarrow.UNNARROWED, policy, stored)
            return Result()
        unserved = [informer.name for informer in self.owned if not informer.served]
        if want and unserved:
            self.problem = (
                f"admission.mode {policy.admission.mode} needs {', '.join(unserved)}, which the API server"
                " does not serve"
            )
            raise TerminalError(self.problem)
        have = [found for informer in self.owned for found in informer.current().values()]
        writes = nativesync.plan(want, have)
        if not writes:
            return self._narrow_when_settled(policy, stored)
        # The native side changes: the webhooks see everything until it is in force again. Widening is
        # seen by the API server through another watch than the native objects: the objects change only
        # once the widened webhooks have had the settle time, or a request could reach neither.
        if self._narrow(nativenarrow.UNNARROWED, policy, stored):
            return Result(requeue_after=self.settle_seconds)
        refused: list[str] = []
        for write in writes:
            try:
                self._send(write, policy)
            except InvalidObjectError as exc:
                refused.append(f"{write.kind} {write.name}: {exc}")
        self.changed_at = self.clock()
        if refused:
            self.problem = "the API server refused " + "; ".join(refused)
            raise TerminalError(self.problem)
        self.problem = None
        return Result(requeue_after=self.settle_seconds)

    def _configurations(self) -> dict[str, JSON | None]:
        """The webhook configurations as stored now, by kind (none read without `configurations`): the
        native policies follow their failurePolicy, and the narrowing patches them at the version read."""
        if self.configurations is None:
            return {}
        return {kind: self.configurations.read(kind) for kind in nativenarrow.CONFIGURATION_KINDS}

    def _narrow_when_settled(self, policy: Policy, stored: Mapping[str, JSON | None]) -> Result:
        narrowing = nativenarrow.narrowing(policy, self.namespace)
        waited = self.clock() - self.changed_at
        if narrowing.narrows() and waited < self.settle_seconds:
            return Result(requeue_after=self.settle_seconds - waited)
        self.problem = None
        self._narrow(narrowing, policy, stored)
        return Result()

    def _narrow(
        self, narrowing: nativenarrow.Narrowing, policy: Policy, stored: Mapping[str, JSON | None]
    ) -> bool:
        """Each configuration's webhooks (`stored`, read at the start of the reconcile) given their
        conditions and entries as `narrowing` says, patched at the version read (a conflict is raised, and
        retried on a fresh read); whether any was patched."""
        patched = False
        if self.configurations is None:
            return patched
        for kind, parts in narrowing.parts.items():
            configuration = stored.get(kind)
            if configuration is None:
                self.narrowed.pop(kind, None)
                continue  # not installed (or an operator deleted it): nothing calls gpuguard through it
            wanted = nativenarrow.shaped(configuration, parts)
            operations = nativenarrow.patch_to(configuration, wanted)
            narrowed = nativenarrow.narrowed(wanted)
            if operations:
                try:
                    self.configurations.patch(kind, operations)
                except InvalidObjectError as exc:
                    self.problem = f"the API server refused the webhooks of {kind}: {exc}"
                    raise TerminalError(self.problem) from exc
                patched = True
                self.registry.inc(series.NATIVE_POLICY_WRITES, "narrow" if narrowed else "widen")
                log.info(
                    "%s the webhooks of %s for admission.mode %s (%d entries)",
                    "narrowed" if narrowed else "un-narrowed",
                    kind,
                    policy.admission.mode,
                    len(wanted),
                    extra={"fields": {"controller": NAME, "kind": kind, "narrowed": narrowed}},
                )
            self.narrowed[kind] = narrowed
        return patched

    def status(self) -> dict[str, object]:
        """For /policy: how many objects gpuguard owns, by kind, and what keeps them from the policy."""
        counts: dict[str, int] = {}
        for informer in self.owned:
            for found in informer.current().values():
                counts[found.kind] = counts.get(found.kind, 0) + 1
        return {"owned": counts, "narrowed": dict(self.narrowed), "problem": self.problem}

    def _send(self, write: Write, policy: Policy) -> None:
        resource = RESOURCES[write.kind]
        if write.verb == "create":
            assert write.body is not None
            self.writes.create(resource, write.body)
        elif write.verb == "update":
            assert write.body is not None
            self.writes.replace(resource, write.name, write.body)
        else:
            with contextlib.suppress(NotFoundError):  # gone already: what the delete was for
                self.writes.delete(resource, write.name, write.resource_version)
        self.registry.inc(series.NATIVE_POLICY_WRITES, write.verb)
        log.info(
            "%s %s %s for admission.mode %s",
            {"create": "created", "update": "updated", "delete": "deleted"}[write.verb],
            write.kind,
            write.name,
            policy.admission.mode,
            extra={
                "fields": {"controller": NAME, "kind": write.kind, "name": write.name, "verb": write.verb}
            },
        )


def _version(raw: dict[str, Any]) -> tuple[Hashable, str] | None:
    metadata = metadata_of(raw)
    return str(metadata.get("name", "")), str(metadata.get("resourceVersion", ""))


def configuration_informers(listwatch: Callable[[str], Any], stop: threading.Event) -> list[Informer[str]]:
    """One informer per webhook configuration kind, holding gpuguard's configuration's resourceVersion:
    what changed is read by the reconcile itself."""
    return [Informer(kind, listwatch(kind), _version, stop=stop) for kind in nativenarrow.CONFIGURATION_KINDS]


def owned_informers(listwatch: Callable[[str], Any], stop: threading.Event) -> list[Informer[Owned]]:
    """One informer per admission policy resource, each holding gpuguard's own objects only."""
    return [Informer(resource, listwatch(resource), converter, stop=stop) for resource in RESOURCES.values()]

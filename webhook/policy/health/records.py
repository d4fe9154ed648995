"""gpuguard's record of a node: what it keeps in the node's `gpuguard.io/remediation` annotation.

When gpuguard first saw each signal and what it did, so that a restart or a new leader reaches the same
verdict and undoes only its own marks. The times are RFC 3339 as the API server writes them, and the
reading is strict: whatever is in the annotation, an unreadable record is that node's alone.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

RECORD_ANNOTATION = "gpuguard.io/remediation"
# An operator's acknowledgement of a node (an RFC 3339 time, `gpuguard nodes ack`): it clears the
# repeated-failure hold and the expected device counts recorded before it.
ACK_ANNOTATION = "gpuguard.io/acknowledged"


def parse_time(value: object) -> datetime.datetime | None:
    """An RFC 3339 time (UTC when it names no zone); None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


def format_time(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC with seconds, as the API server writes times."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def as_mapping(value: object) -> Mapping[str, Any]:
    """A JSON object as itself, anything else as an empty one: how the converters read API objects."""
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class NodeRecord:
    """What gpuguard keeps on a node (the `gpuguard.io/remediation` annotation): when it first saw each
    signal and what it did, so that a restart or a new leader reaches the same verdict and undoes only
    its own marks."""

    signals: Mapping[str, datetime.datetime] = field(default_factory=dict)
    unhealthy_since: datetime.datetime | None = None
    clear_since: datetime.datetime | None = None
    # When the node took a place in its pool's budget: from then on gpuguard acts on it.
    admitted_at: datetime.datetime | None = None
    # gpuguard set spec.unschedulable itself (so it, and only it, undoes it).
    cordoned: bool = False
    draining_since: datetime.datetime | None = None
    # An operator uncordoned what gpuguard cordoned: hands off until the node is healthy again.
    cancelled_at: datetime.datetime | None = None
    last_action: str = ""
    last_action_at: datetime.datetime | None = None
    # The Node (uid) the expected counts and the history below were seen on.
    uid: str = ""
    # The most devices seen per accelerator resource on this node: fewer is a device gone, not a
    # recovery. Kept while the record is, set again when the resources change (a new MIG layout).
    expected: Mapping[str, int] = field(default_factory=dict)
    # When each past episode gpuguard acted on became due (bounded by health.recovery.escalation).
    remediations: tuple[datetime.datetime, ...] = ()
    # The operator's acknowledgement (annotation gpuguard.io/acknowledged) already taken into account.
    acknowledged_at: datetime.datetime | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "signals": {key: format_record_time(t) for key, t in sorted(self.signals.items())}
        }
        for name in _RECORD_TIMES:
            moment = getattr(self, name)
            if moment is not None:
                data[_camel(name)] = format_record_time(moment)
        if self.cordoned:
            data["cordoned"] = True
        if self.last_action:
            data["lastAction"] = self.last_action
            if self.last_action_at is not None:
                data["lastActionAt"] = format_record_time(self.last_action_at)
        if self.uid:
            data["uid"] = self.uid
        if self.expected:
            data["expected"] = dict(sorted(self.expected.items()))
        if self.remediations:
            data["remediations"] = [format_record_time(moment) for moment in self.remediations]
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeRecord:
        """Raises ValueError for anything but a record this module wrote (too long, too deep, a field
        of the wrong type): whatever is in the annotation, the error is this node's alone."""
        if len(text) > MAX_RECORD_CHARS:
            raise ValueError(f"the record is longer than {MAX_RECORD_CHARS} characters")
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("the record is nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError("the record is not a JSON object")
        signals = {key: parse_time(value) for key, value in as_mapping(data.get("signals")).items()}
        times = {name: parse_time(data.get(_camel(name))) for name in _RECORD_TIMES}
        expected = as_mapping(data.get("expected"))
        if not all(type(count) is int and count >= 0 for count in expected.values()):
            raise ValueError("the record's expected device counts are not counts")
        remediations = data.get("remediations", [])
        if not isinstance(remediations, list):
            raise ValueError("the record's remediations are not a list")
        last_action, uid = data.get("lastAction", ""), data.get("uid", "")
        if not isinstance(last_action, str) or not isinstance(uid, str):
            raise ValueError("the record's lastAction and uid must be strings")
        return cls(
            signals={key: moment for key, moment in signals.items() if moment is not None},
            cordoned=data.get("cordoned") is True,
            last_action=last_action,
            last_action_at=parse_time(data.get("lastActionAt")),
            uid=uid,
            expected=dict(expected),
            remediations=tuple(sorted(m for m in map(parse_time, remediations) if m is not None)),
            **times,
        )


_RECORD_TIMES = (
    "unhealthy_since",
    "clear_since",
    "admitted_at",
    "draining_since",
    "cancelled_at",
    "acknowledged_at",
)


# The longest record annotation read: a record of gpuguard's own stays far below it.
MAX_RECORD_CHARS = 16_384


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def format_record_time(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC, with the fraction of a second when there is one: a wait timed from a record
    must never end early because the record dropped a fraction."""
    moment = moment.astimezone(datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if moment.microsecond else "%Y-%m-%dT%H:%M:%SZ")


def clamped(record: NodeRecord, now: datetime.datetime) -> tuple[NodeRecord, tuple[str, ...]]:
    """The record with every time later than `now` set to `now`, and the fields that were: a time in
    the future (a tampered record, a previous leader's clock running ahead) would hold a wait off.
    The acknowledgement is not a time gpuguard took: it is kept as the operator wrote it."""
    later = [name for name in _CLOCK_TIMES if (getattr(record, name) or now) > now]
    later += [f"signals[{key}]" for key, moment in sorted(record.signals.items()) if moment > now]
    later += ["remediations"] if any(moment > now for moment in record.remediations) else []
    if not later:
        return record, ()
    times: dict[str, Any] = {name: now for name in _CLOCK_TIMES if name in later}
    return replace(
        record,
        signals={key: min(moment, now) for key, moment in record.signals.items()},
        remediations=tuple(min(moment, now) for moment in record.remediations),
        **times,
    ), tuple(later)


_CLOCK_TIMES = (*(name for name in _RECORD_TIMES if name != "acknowledged_at"), "last_action_at")


def sightings_only(record: NodeRecord) -> bool:
    """A record of nothing but when signals were first seen (and what is known of the node itself): the
    controllers keep it in memory and do not write it to the node, so a signal that clears before it is
    due (a kubelet or device-plugin restart, a reboot, a driver install) causes no write at all. A new
    leader starts those clocks again: that delays an action, never hastens one."""
    return (
        replace(record, signals={}, clear_since=None, uid="", expected={}, acknowledged_at=None)
        == NodeRecord()
    )

"""Prometheus text exposition for the few series gpuguard keeps; no client library on the hot path."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from webhook.policy.drivers import PoolDrivers
from webhook.policy.engine import Decision
from webhook.runtime.policy_store import PolicyStatus

# Fine buckets at the bottom: the API server's own webhook histogram starts at 5 ms, ours far below it.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    def render(self, name: str, **labels: str) -> Iterable[str]:
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            yield f"{name}_bucket{_labels(**labels, le=le)} {cumulative}"
        yield f"{name}_sum{_labels(**labels)} {self.total}"
        yield f"{name}_count{_labels(**labels)} {cumulative}"


class Metrics:
    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.latency: dict[str, Histogram] = {}

    def observe(self, endpoint: str, result: str, seconds: float, decisions: Iterable[Decision]) -> None:
        self.requests[(endpoint, result)] += 1
        histogram = self.latency.get(endpoint)
        if histogram is None:  # not setdefault: that would build a Histogram for every request
            histogram = self.latency[endpoint] = Histogram()
        histogram.observe(seconds)
        for decision in decisions:
            self.decisions[(decision.rule, decision.mode, decision.outcome)] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters as JSON-ready data, for the other workers of one server (webhook.processes.serve_workers).

        Each part is copied in one step (a dict copy does not release the GIL), so a snapshot taken
        while the event loop counts is consistent per series.
        """
        latency = dict(self.latency)
        return {
            "requests": [[*key, count] for key, count in dict(self.requests).items()],
            "decisions": [[*key, count] for key, count in dict(self.decisions).items()],
            "latency": {
                endpoint: {"counts": list(histogram.counts), "total": histogram.total}
                for endpoint, histogram in latency.items()
            },
        }

    def add(self, snapshot: Mapping[str, Any]) -> None:
        """Adds another worker's snapshot (or this slot's earlier worker's) to these counters."""
        for endpoint, result, count in snapshot["requests"]:
            self.requests[(endpoint, result)] += count
        for rule, mode, outcome, count in snapshot["decisions"]:
            self.decisions[(rule, mode, outcome)] += count
        for endpoint, histogram in snapshot["latency"].items():
            mine = self.latency.setdefault(endpoint, Histogram())
            mine.counts = [a + b for a, b in zip(mine.counts, histogram["counts"], strict=True)]
            mine.total += histogram["total"]

    def render(self, policy: PolicyStatus, driver_pools: Sequence[PoolDrivers] | None = None) -> str:
        """The exposition; `driver_pools` (from the node cache, None without one) adds the driver gauges."""
        lines = [
            "# HELP gpuguard_admission_requests_total AdmissionReviews answered, by endpoint and result.",
            "# TYPE gpuguard_admission_requests_total counter",
        ]
        for (endpoint, result), count in sorted(self.requests.items()):
            lines.append(
                f"gpuguard_admission_requests_total{_labels(endpoint=endpoint, result=result)} {count}"
            )
        lines += [
            "# HELP gpuguard_decisions_total Rule decisions, by rule, mode and outcome (dry-run requests excluded).",
            "# TYPE gpuguard_decisions_total counter",
        ]
        for (rule, mode, outcome), count in sorted(self.decisions.items()):
            labels = _labels(rule=rule, mode=mode, outcome=outcome)
            lines.append(f"gpuguard_decisions_total{labels} {count}")
        lines += [
            "# HELP gpuguard_admission_duration_seconds Time to answer one AdmissionReview.",
            "# TYPE gpuguard_admission_duration_seconds histogram",
        ]
        for endpoint, histogram in sorted(self.latency.items()):
            lines += histogram.render("gpuguard_admission_duration_seconds", endpoint=endpoint)
        lines += [
            "# HELP gpuguard_policy_info The active policy, by hash.",
            "# TYPE gpuguard_policy_info gauge",
            f"gpuguard_policy_info{_labels(hash=policy.hash)} 1",
            "# HELP gpuguard_policy_loaded_timestamp_seconds When the active policy was loaded.",
            "# TYPE gpuguard_policy_loaded_timestamp_seconds gauge",
            f"gpuguard_policy_loaded_timestamp_seconds {policy.loaded_at}",
            "# HELP gpuguard_policy_errors_total Policies refused because they were invalid.",
            "# TYPE gpuguard_policy_errors_total counter",
            f"gpuguard_policy_errors_total {policy.errors}",
        ]
        if driver_pools is not None:
            lines += [
                "# HELP gpuguard_driver_versions Driver versions among the GPU nodes of one pool and product (>1: mixed).",
                "# TYPE gpuguard_driver_versions gauge",
            ]
            for pool in driver_pools:
                labels = _labels(pool=pool.pool, product=pool.product)
                lines.append(f"gpuguard_driver_versions{labels} {len(pool.drivers)}")
            lines += [
                "# HELP gpuguard_driver_mixed_pools Pools (by product) whose GPU nodes mix driver or CUDA versions.",
                "# TYPE gpuguard_driver_mixed_pools gauge",
                f"gpuguard_driver_mixed_pools {sum(pool.mixed for pool in driver_pools)}",
            ]
        return "\n".join(lines) + "\n"


LabelValues = tuple[str, ...]


class Registry:
    """Series that components register and update, rendered as one exposition.

    Counters and histograms are kept here, keyed by label values; gauges are read from their owner
    at render time (`collect` returns label values and a value per series), so a gauge never goes
    stale and its owner keeps no second copy of its state.
    """

    def __init__(self) -> None:
        self._families: list[tuple[str, str, str, tuple[str, ...]]] = []
        self._counters: dict[str, dict[LabelValues, float]] = {}
        self._histograms: dict[str, dict[LabelValues, Histogram]] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}
        self._gauges: dict[str, Callable[[], Iterable[tuple[LabelValues, float]]]] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help_text: str, labels: tuple[str, ...]) -> None:
        self._families.append((name, help_text, "counter", labels))
        self._counters[name] = {}

    def histogram(
        self, name: str, help_text: str, labels: tuple[str, ...], buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> None:
        self._families.append((name, help_text, "histogram", labels))
        self._histograms[name] = {}
        self._buckets[name] = tuple(buckets)

    def gauge(
        self,
        name: str,
        help_text: str,
        labels: tuple[str, ...],
        collect: Callable[[], Iterable[tuple[LabelValues, float]]],
    ) -> None:
        self._families.append((name, help_text, "gauge", labels))
        self._gauges[name] = collect

    def inc(self, name: str, *values: str, amount: float = 1) -> None:
        with self._lock:
            self._counters[name][values] = self._counters[name].get(values, 0.0) + amount

    def observe(self, name: str, seconds: float, *values: str) -> None:
        with self._lock:
            histograms = self._histograms[name]
            if values not in histograms:
                histograms[values] = Histogram(self._buckets[name])
            histograms[values].observe(seconds)

    def value(self, name: str, *values: str) -> float:
        """A counter's current value (what tests and the CLI read back)."""
        with self._lock:
            return self._counters[name].get(values, 0.0)

    def render(self) -> str:
        lines: list[str] = []
        for name, help_text, kind, labels in self._families:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if kind == "counter":
                with self._lock:
                    samples = sorted(self._counters[name].items())
                lines += [
                    f"{name}{_labels(**dict(zip(labels, key, strict=True)))} {v:g}" for key, v in samples
                ]
            elif kind == "histogram":
                with self._lock:
                    histograms = sorted(self._histograms[name].items())
                for key, histogram in histograms:
                    lines += histogram.render(name, **dict(zip(labels, key, strict=True)))
            else:
                for key, v in sorted(self._gauges[name]()):
                    lines.append(f"{name}{_labels(**dict(zip(labels, key, strict=True)))} {v:g}")
        return "\n".join(lines) + "\n"

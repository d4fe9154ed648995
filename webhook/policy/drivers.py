"""Driver and CUDA versions across a fleet, by node pool and GPU product, from node labels alone.

A pool whose GPU nodes run different drivers is where a multi-node job meets two driver versions and
fails (or hangs in its first collective): `gpuguard nodes drivers` and the mixed-pool metric show them.
Pure: it reads `NodeInfo`s, whoever listed them (a file, the API, the serve process' watch cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from webhook.policy.facts import NodeInfo
from webhook.policy.model import DriverNodeLabels

NO_POOL = "(none)"
UNKNOWN = "?"


@dataclass(frozen=True)
class PoolDrivers:
    pool: str
    product: str
    nodes: int
    drivers: Mapping[str, int]  # driver version -> nodes
    cuda: Mapping[str, int]  # CUDA version -> nodes

    @property
    def mixed(self) -> bool:
        return len(self.drivers) > 1 or len(self.cuda) > 1


def _version(labels: Mapping[str, str], full: str, major: str) -> str:
    # Without the full version label (an older feature discovery), the major version is all there is.
    return labels.get(full) or labels.get(major) or UNKNOWN


def _pool(labels: Mapping[str, str], keys: Iterable[str]) -> str:
    return next((labels[key] for key in keys if labels.get(key)), NO_POOL)


def summarise(nodes: Mapping[str, NodeInfo], keys: DriverNodeLabels) -> list[PoolDrivers]:
    """One entry per (pool, product) of the nodes that carry a GPU product or driver label."""
    groups: dict[tuple[str, str], list[Mapping[str, str]]] = {}
    for node in nodes.values():
        labels = node.labels
        if not any(key in labels for key in (keys.product, keys.driverVersion, keys.driverMajor)):
            continue
        groups.setdefault((_pool(labels, keys.pools), labels.get(keys.product, UNKNOWN)), []).append(labels)
    return [
        PoolDrivers(
            pool,
            product,
            len(members),
            dict(sorted(Counter(_version(m, keys.driverVersion, keys.driverMajor) for m in members).items())),
            dict(sorted(Counter(m.get(keys.cudaVersion, UNKNOWN) for m in members).items())),
        )
        for (pool, product), members in sorted(groups.items())
    ]


def _versions(counts: Mapping[str, int]) -> str:
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{version} ({count})" for version, count in counts.items())


def table(pools: list[PoolDrivers]) -> str:
    """What `gpuguard nodes drivers` prints: one line per pool and product, MIXED where versions differ."""
    rows = [("POOL", "PRODUCT", "NODES", "DRIVER", "CUDA", "")]
    rows += [
        (p.pool, p.product, str(p.nodes), _versions(p.drivers), _versions(p.cuda), "MIXED" if p.mixed else "")
        for p in pools
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    mixed = sum(p.mixed for p in pools)
    lines.append(
        f"{len(pools)} pool(s) with GPU nodes, {mixed} with mixed driver or CUDA versions"
        if pools
        else "no node carries a GPU product or driver label"
    )
    return "\n".join(lines) + "\n"

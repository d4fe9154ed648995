"""How a policy's text is merged over the embedded default: the mapping validation then sees.

The embedded default-policy.yaml is the one place defaults are written, so a policy names only what it
changes: mappings merge key by key, other values (lists included) replace the default's, except the
namespace overrides, which keep the default's exemptions for every namespace the policy does not name.
"""

from __future__ import annotations

from typing import Any


def over_default(default: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The policy mapping `given` over the `default` one."""
    data = _overlay(default, given)
    if isinstance(given.get("namespaces"), list):
        data["namespaces"] = _merge_namespaces(default["namespaces"], given["namespaces"])
    return data


def _overlay(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (lists included) in `override` replaces the base value."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _overlay(merged[key], value)
        else:
            merged[key] = value
    return merged


def _merge_namespaces(default: list[Any], given: list[Any]) -> list[Any]:
    """The given overrides first; the default ones stay for every namespace the given ones do not name.

    Replacing the list whole, as for other lists, would silently drop the infrastructure exemptions
    (kube-system, the GPU operator's namespaces) from a policy that only meant to add a team.
    """
    named = {
        name
        for entry in given
        if isinstance(entry, dict) and isinstance(entry.get("names"), list)
        for name in entry["names"]
        if isinstance(name, str)
    }
    kept = []
    for entry in default:
        names = [name for name in entry.get("names", []) if name not in named]
        if names or "selector" in entry:
            kept.append({**entry, "names": names} if "names" in entry else entry)
    return [*given, *kept]

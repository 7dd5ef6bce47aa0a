"""`stowage up --topology FILE`: hosts, cells, CPU sets, racks and zones described in YAML.

```yaml
defaults:                 # optional, applied to every host
  cells: 2
  cores_per_cell: 8
  threads_per_core: 2
  memory_mb_per_cell: 32768
hosts:
  - name: host1
    availability_zone: az1
    labels: {rack: r1}
  - name: host2
    cells: 1
    cpu_dedicated_set: "0-3"   # Nova's syntax; overrides the default half/half split
    cpu_shared_set: "4-7"
    count: 3                 # host2-1, host2-2, host2-3
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stowage.domain.errors import InvalidSpec
from stowage.domain.topology import HostSpec, HostTopology, parse_cpu_set

__all__ = ["load_topology"]

_SHAPE_KEYS = {
    "cells",
    "cores_per_cell",
    "threads_per_core",
    "memory_mb_per_cell",
    "dedicated_cores_per_cell",
}
_HOST_KEYS = _SHAPE_KEYS | {
    "name",
    "count",
    "availability_zone",
    "labels",
    "disk_gb",
    "cpu_dedicated_set",
    "cpu_shared_set",
}


def load_topology(path: Path) -> list[HostSpec]:
    """Hosts from a YAML file; errors name the host and the key."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidSpec(f"{path}: cannot read the topology: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("hosts"), list):
        raise InvalidSpec(f"{path}: expected a mapping with a list under 'hosts'")
    defaults = document.get("defaults") or {}
    unknown = set(defaults) - _HOST_KEYS
    if unknown:
        raise InvalidSpec(f"{path}: defaults: unknown key {sorted(unknown)[0]!r}")
    specs: list[HostSpec] = []
    for index, raw in enumerate(document["hosts"]):
        if not isinstance(raw, dict) or not raw.get("name"):
            raise InvalidSpec(f"{path}: hosts[{index}]: every host needs a name")
        entry = {**defaults, **raw}
        unknown = set(entry) - _HOST_KEYS
        if unknown:
            raise InvalidSpec(f"{path}: host {raw['name']}: unknown key {sorted(unknown)[0]!r}")
        count = int(entry.get("count", 1))
        names = [raw["name"]] if count == 1 else [f"{raw['name']}-{i + 1}" for i in range(count)]
        specs.extend(_host(name, entry) for name in names)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InvalidSpec(f"{path}: host {spec.name} is named twice")
        seen.add(spec.name)
    return specs


def _host(name: str, entry: dict[str, Any]) -> HostSpec:
    try:
        topology = HostTopology.uniform(**{k: int(v) for k, v in entry.items() if k in _SHAPE_KEYS})
    except (TypeError, ValueError) as exc:
        raise InvalidSpec(f"host {name}: {exc}") from None
    if "cpu_dedicated_set" in entry or "cpu_shared_set" in entry:
        dedicated = (
            parse_cpu_set(
                str(entry.get("cpu_dedicated_set", "")), what=f"host {name}: cpu_dedicated_set"
            )
            if entry.get("cpu_dedicated_set")
            else frozenset()
        )
        shared = (
            parse_cpu_set(str(entry.get("cpu_shared_set", "")), what=f"host {name}: cpu_shared_set")
            if entry.get("cpu_shared_set")
            else frozenset()
        )
        topology = HostTopology(topology.cells, topology.siblings, dedicated, shared)
    labels = entry.get("labels") or {}
    if not isinstance(labels, dict):
        raise InvalidSpec(f"host {name}: labels must be a mapping")
    return HostSpec(
        name=name,
        topology=topology,
        disk_gb=int(entry.get("disk_gb", 1000)),
        availability_zone=str(entry.get("availability_zone", "nova")),
        labels={str(k): str(v) for k, v in labels.items()},
    )

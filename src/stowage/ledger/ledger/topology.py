"""A host's topology as the JSON the hosts table keeps."""

from __future__ import annotations

import json

from stowage.domain.topology import (
    Cell,
    HostTopology,
)


def topology_to_json(topo: HostTopology) -> str:
    return json.dumps(
        {
            "cells": [
                {"id": c.id, "cpus": sorted(c.cpus), "memory_mb": c.memory_mb} for c in topo.cells
            ],
            "siblings": {str(k): sorted(v) for k, v in sorted(topo.siblings.items())},
            "dedicated": sorted(topo.cpu_dedicated_set),
            "shared": sorted(topo.cpu_shared_set),
        },
        sort_keys=True,
    )


def topology_from_json(text: str) -> HostTopology:
    data = json.loads(text)
    return HostTopology(
        cells=tuple(Cell(c["id"], frozenset(c["cpus"]), c["memory_mb"]) for c in data["cells"]),
        siblings={int(k): frozenset(v) for k, v in data["siblings"].items()},
        cpu_dedicated_set=frozenset(data["dedicated"]),
        cpu_shared_set=frozenset(data["shared"]),
    )

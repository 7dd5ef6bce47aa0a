"""The pure domain: topology, NUMA fitting, server groups, errors. No I/O."""

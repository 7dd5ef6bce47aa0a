"""A deterministic simulation of the whole control plane (issue 9), in the manner of
FoundationDB's simulator and TigerBeetle's VOPR: one seed, one thread, virtual time, faults
chosen by the seed, invariants checked at the end. `stowage sim-test --seed N` replays a run.
"""

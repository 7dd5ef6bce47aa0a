#!/usr/bin/env bash
# The deterministic simulation over many seeds (issue 9): 10,000 by default, in parallel
# chunks, one process per core. Prints each failing seed with its faults and how to replay
# it, then the figures (seeds per second, faults injected per run).
#   scripts/sim.sh [FIRST-LAST] [FAULTS] [JOBS]      e.g. scripts/sim.sh 0-9999 default 2
set -euo pipefail
cd "$(dirname "$0")/.."
range="${1:-0-9999}"
faults="${2:-default}"
jobs="${3:-$(nproc)}"
stowage="${STOWAGE:-.venv/bin/stowage}"
first="${range%-*}"
last="${range#*-}"
total=$((last - first + 1))
chunk=$(((total + jobs - 1) / jobs))
logs="$(mktemp -d)"
start=$(date +%s)
pids=()
for ((i = 0; i < jobs; i++)); do
    a=$((first + i * chunk))
    b=$((a + chunk - 1))
    ((b > last)) && b=$last
    ((a > last)) && break
    "$stowage" sim-test --seeds "$a-$b" --faults "$faults" >"$logs/$i.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
end=$(date +%s)
cat "$logs"/*.log | grep -v '^[0-9]* seeds, ' | grep -v '^failed seeds:' || true
echo "per chunk:"
grep -h '^[0-9]* seeds, ' "$logs"/*.log
elapsed=$((end - start))
((elapsed == 0)) && elapsed=1
echo "$total seeds in ${elapsed} s with $jobs jobs: $(echo "scale=2; $total / $elapsed" | bc) seeds/s"
grep -h '^failed seeds:' "$logs"/*.log || echo "no seed failed"
rm -rf "$logs"
exit $status

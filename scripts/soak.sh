#!/usr/bin/env bash
# The soak over several seeds: 20 hosts, 50 concurrent moves with random injected failures per
# seed, the ledger audited after each. Usage: scripts/soak.sh [SEEDS]  (default 1,2,3,4,5)
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${1:-1,2,3,4,5}"
STOWAGE_SOAK_SEEDS="$seeds" .venv/bin/pytest -q -p no:cacheprovider tests/e2e/test_soak.py -v

#!/usr/bin/env bash
# Run Tempest's compute API tests against a fresh `stowage up` (validation off) and print the
# counts. Usage: scripts/tempest.sh [REGEX] (default '^tempest\.api\.compute').
#
# Environment: TEMPEST_VENV (where tempest is installed, created if missing), TEMPEST_WORKSPACE
# (the tempest workspace and the cloud's state, recreated each run), PORT (8899), HOSTS (4),
# CONCURRENCY (2), TEMPEST_VERSION (the tempest release to install).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
REGEX="${1:-^tempest\.api\.compute}"
TEMPEST_VENV="${TEMPEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/stowage/tempest-venv}"
TEMPEST_VERSION="${TEMPEST_VERSION:-47.0.0}"
WORKSPACE="${TEMPEST_WORKSPACE:-/tmp/stowage-tempest}"
PORT="${PORT:-8899}"
HOSTS="${HOSTS:-4}"
CONCURRENCY="${CONCURRENCY:-2}"
BASE_URL="http://127.0.0.1:${PORT}"

if [ ! -x "$TEMPEST_VENV/bin/tempest" ]; then
  python3 -m venv "$TEMPEST_VENV"
  "$TEMPEST_VENV/bin/pip" install -q "tempest==${TEMPEST_VERSION}"
fi
if [ ! -x "$ROOT/.venv/bin/stowage" ]; then
  echo "no $ROOT/.venv/bin/stowage: install the project first (see README.md)" >&2
  exit 1
fi

rm -rf "$WORKSPACE"
mkdir -p "$WORKSPACE"
"$ROOT/.venv/bin/stowage" up --state-dir "$WORKSPACE/cloud" --port "$PORT" --hosts "$HOSTS" \
  >"$WORKSPACE/cloud.log" 2>&1 &
CLOUD_PID=$!
stop_cloud() {
  kill -TERM "$CLOUD_PID" 2>/dev/null || true
  wait "$CLOUD_PID" 2>/dev/null || true
}
trap stop_cloud EXIT

for _ in $(seq 1 120); do
  [ -f "$WORKSPACE/cloud/clouds.yaml" ] && curl -sf "$BASE_URL/identity/v3" >/dev/null && break
  kill -0 "$CLOUD_PID" 2>/dev/null || { cat "$WORKSPACE/cloud.log" >&2; exit 1; }
  sleep 1
done

export OS_CLIENT_CONFIG_FILE="$WORKSPACE/cloud/clouds.yaml" OS_CLOUD=stowage-admin
IMAGE_REF="$("$ROOT/.venv/bin/openstack" image list --public -f value -c ID | head -n 1)"
PUBLIC_NETWORK_ID="$("$ROOT/.venv/bin/openstack" network show public -f value -c id)"
# devstack's flavor ids, which a fresh Stowage cloud has: m1.nano and m1.micro.
FLAVOR_REF=42
FLAVOR_REF_ALT=84

mkdir -p "$WORKSPACE/ws/etc"
sed -e "s|@BASE_URL@|$BASE_URL|g" -e "s|@IMAGE_REF@|$IMAGE_REF|g" \
  -e "s|@FLAVOR_REF@|$FLAVOR_REF|g" -e "s|@FLAVOR_REF_ALT@|$FLAVOR_REF_ALT|g" \
  -e "s|@HOSTS@|$HOSTS|g" -e "s|@PUBLIC_NETWORK_ID@|$PUBLIC_NETWORK_ID|g" -e "s|@WORKSPACE@|$WORKSPACE/ws|g" \
  "$ROOT/scripts/tempest.conf.in" >"$WORKSPACE/ws/etc/tempest.conf"

cd "$WORKSPACE/ws"
set +e
"$TEMPEST_VENV/bin/tempest" run --config-file etc/tempest.conf --regex "$REGEX" \
  --concurrency "$CONCURRENCY" >"$WORKSPACE/run.log" 2>&1
status=$?
set -e
tail -n 40 "$WORKSPACE/run.log"

# One line per test: name and status, for grouping the failures.
"$TEMPEST_VENV/bin/stestr" last --subunit | "$TEMPEST_VENV/bin/subunit2csv" \
  >"$WORKSPACE/results.csv" || true
"$TEMPEST_VENV/bin/python" - "$WORKSPACE/results.csv" <<'PY'
import csv
import sys

counts = {"success": 0, "fail": 0, "skip": 0}
alias = {"failure": "fail", "error": "fail", "xfail": "success", "uxsuccess": "fail"}
with open(sys.argv[1], newline="") as f:
    for row in csv.DictReader(f):
        # A class whose setUpClass failed shows as one failed "setUpClass (...)" row.
        status = alias.get(row["status"], row["status"])
        if status in counts:
            counts[status] += 1
ran = counts["success"] + counts["fail"]
pct = 100.0 * counts["success"] / ran if ran else 0.0
print(f"tempest: {counts['success']} passed, {counts['fail']} failed, {counts['skip']} skipped")
print(f"pass rate of the tests that ran: {pct:.1f}%")
PY
echo "details: $WORKSPACE/run.log, $WORKSPACE/results.csv, $WORKSPACE/ws/tempest.log"
exit "$status"

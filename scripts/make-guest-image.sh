#!/usr/bin/env bash
# A bootable guest disk from Debian packages alone (mtools, syslinux, busybox-static,
# linux-image-cloud-amd64; qemu-utils for --format qcow2): see src/stowage/virt/guest_image.py.
#   scripts/make-guest-image.sh guest.raw [--format qcow2]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m stowage.virt.guest_image "$@"

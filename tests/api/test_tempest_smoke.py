"""Tempest's own compute API tests, a small subset, against the session's cloud: the same
configuration as scripts/tempest.sh (which runs all of tempest.api.compute), so a change that
breaks what Tempest checks (response schemas, status codes) shows up in CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.api.cloudproc import IMAGE, RunningCloud

ROOT = Path(__file__).resolve().parents[2]
TEMPEST = Path(sys.executable).parent / "tempest"

# Quick classes that cover the core views and the compatibility endpoints beside them.
SMOKE = (
    r"^tempest\.api\.compute\.("
    r"test_versions|test_extensions|test_quotas|"
    r"flavors\.test_flavors\.|"
    r"servers\.test_server_metadata\.|servers\.test_server_tags\.|"
    r"servers\.test_server_addresses\.|"
    r"security_groups\.test_security_groups_negative\.|"
    r"images\.test_list_images\.)"
)


def _config(cloud: RunningCloud, workdir: Path) -> Path:
    image = cloud.osc_json("image", "show", IMAGE)["id"]
    hosts = len(cloud.osc_json("hypervisor", "list"))
    values = {
        "BASE_URL": cloud.base_url,
        "IMAGE_REF": image,
        "FLAVOR_REF": "42",
        "FLAVOR_REF_ALT": "84",
        "HOSTS": str(hosts),
        "WORKSPACE": str(workdir),
        "PUBLIC_NETWORK_ID": cloud.osc_json("network", "show", "public")["id"],
    }
    text = (ROOT / "scripts" / "tempest.conf.in").read_text()
    text = re.sub(r"@([A-Z_]+)@", lambda m: values[m.group(1)], text)
    path = workdir / "etc" / "tempest.conf"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_tempest_compute_smoke_subset_passes(cloud: RunningCloud, tmp_path: Path) -> None:
    config = _config(cloud, tmp_path)
    result = subprocess.run(
        [str(TEMPEST), "run", "--config-file", str(config), "--regex", SMOKE, "--concurrency", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = result.stdout + result.stderr
    passed = re.search(r"- Passed: (\d+)", output)
    failed = re.search(r"- Failed: (\d+)", output)
    assert passed is not None and failed is not None, output[-4000:]
    assert int(failed.group(1)) == 0, output[-8000:]
    assert int(passed.group(1)) >= 30, output[-4000:]
    assert result.returncode == 0, output[-4000:]

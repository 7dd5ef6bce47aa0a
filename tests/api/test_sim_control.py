"""The admin-only simulation controls of `stowage up` (`/os-stowage-sim`, `stowage sim`)."""

from __future__ import annotations

import subprocess

from tests.api.cloudproc import BIN, RunningCloud


def test_members_may_not_touch_the_simulated_hypervisors(cloud: RunningCloud) -> None:
    member = cloud.token("demo", "stowage-demo", "demo")
    assert cloud.compute("GET", "/os-stowage-sim", token=member).status_code == 403
    stop = cloud.compute("POST", "/os-stowage-sim/host1/action", token=member, json={"stop": {}})
    assert stop.status_code == 403


def test_bad_controls_are_refused_with_the_field_named(cloud: RunningCloud) -> None:
    unknown = cloud.compute("POST", "/os-stowage-sim/no-such-host/action", json={"stop": {}})
    assert unknown.status_code == 404
    assert "no-such-host" in unknown.json()["itemNotFound"]["message"]
    cases = [
        ({"explode": {}}, "explode"),
        ({"fault": {"operation": "spawn"}}, "step"),
        ({"fault": {"operation": "spawn", "step": "define", "action": "melt"}}, "action"),
        ({"slow-disk": {"seconds": -1}}, "seconds"),
        ({"fault": {"operation": "spawn", "step": "nope"}}, "nope"),
    ]
    for body, named in cases:
        response = cloud.compute("POST", "/os-stowage-sim/host1/action", json=body)
        assert response.status_code == 400, (body, response.text)
        assert named in response.json()["badRequest"]["message"], response.text


def test_show_lists_every_hypervisor_with_its_agent(cloud: RunningCloud) -> None:
    result = subprocess.run(
        [str(BIN / "stowage"), "sim", "show", "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for host in ("host1", "host2", "host3"):
        assert host in result.stdout
    shown = cloud.compute("GET", "/os-stowage-sim").json()["hosts"]
    assert [h["host"] for h in shown][:3] == ["host1", "host2", "host3"]
    assert all(h["running"] and h["service_up"] for h in shown)

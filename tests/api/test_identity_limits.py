"""Keystone's unified limits through the real CLI (registered limits and project limits, with
Keystone's default policies per persona), and a cloud whose compute quotas come from them
(`stowage up --quota-driver unified-limits`, Nova's UnifiedLimitsDriver)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.api.cloudproc import RunningCloud, boot_args, start_cloud, stop_cloud
from tests.api.personas import Personas, personas
from tests.api.test_identity import Admin, unique


def _json(result: object) -> object:
    assert getattr(result, "returncode", 1) == 0, getattr(result, "stderr", "")
    return json.loads(getattr(result, "stdout", ""))


def test_registered_and_project_limits_through_the_cli(cloud: RunningCloud) -> None:
    team = personas(cloud, "lim")
    other = personas(cloud, "lim-other")
    resource = unique("res")
    registered = cloud.osc_json(
        "registered", "limit", "create", "--service", "compute", "--default-limit", "10", resource
    )
    assert (registered["resource_name"], registered["default_limit"]) == (resource, 10)
    limit = cloud.osc_json(
        "limit", "create", "--service", "compute", "--project", team.project["id"],
        "--resource-limit", "2", resource,
    )  # fmt: skip
    assert (limit["project_id"], limit["resource_limit"]) == (team.project["id"], 2)
    admin = Admin(cloud)
    # Keystone: one registered limit per service, region and resource; a limit needs one.
    body = {"registered_limits": [{"service_id": registered["service_id"],
                                   "resource_name": resource, "default_limit": 1}]}  # fmt: skip
    assert admin("POST", "/registered_limits", body).status_code == 409
    orphan = {"limits": [{"service_id": registered["service_id"], "project_id":
                          team.project["id"], "resource_name": unique("none"),
                          "resource_limit": 1}]}  # fmt: skip
    assert admin("POST", "/limits", orphan).status_code == 403
    unknown = {"registered_limits": [{"service_id": "nope", "resource_name": "x",
                                      "default_limit": 1}]}  # fmt: skip
    assert admin("POST", "/registered_limits", unknown).status_code == 400
    # Any persona lists registered limits; a project's own limits are seen by its members.
    for role in ("admin", "member", "reader"):
        listed = _json(team.osc(role, "registered", "limit", "list", "-f", "json"))
        assert resource in {r["Resource Name"] for r in listed}  # type: ignore[attr-defined]
        mine = _json(team.osc(role, "limit", "list", "-f", "json"))
        assert limit["id"] in {r["ID"] for r in mine}  # type: ignore[attr-defined]
    others = Admin(cloud, other.token("member"))
    assert limit["id"] not in {r["id"] for r in others("GET", "/limits").json()["limits"]}
    assert others("GET", f"/limits/{limit['id']}").status_code == 403
    assert (
        admin("GET", "/limits", project_id=team.project["id"]).json()["limits"][0]["id"]
        == (limit["id"])
    )
    # Only an admin writes (the project's own admin persona holds the admin role).
    for role in ("member", "reader"):
        refused = team.osc(role, "limit", "set", "--resource-limit", "9", limit["id"])
        assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr
        token = Admin(cloud, team.token(role))
        assert token("DELETE", f"/registered_limits/{registered['id']}").status_code == 403
    changed = cloud.osc_json("limit", "set", "--resource-limit", "3", limit["id"])
    assert changed["resource_limit"] == 3
    model = admin("GET", "/limits/model").json()["model"]
    assert model["name"] == "flat"
    # A registered limit a project limit needs stays; then both go.
    assert admin("DELETE", f"/registered_limits/{registered['id']}").status_code == 403
    cloud.osc("limit", "delete", limit["id"])
    cloud.osc("registered", "limit", "delete", registered["id"])
    assert admin("GET", f"/registered_limits/{registered['id']}").status_code == 404


@pytest.fixture(scope="module")
def unified(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCloud]:
    state = Path(tmp_path_factory.mktemp("unified")) / "state"
    running = start_cloud(state, "--quota-driver", "unified-limits")
    try:
        yield running
    finally:
        stop_cloud(running)


def _boot(team: Personas, name: str) -> tuple[int, str]:
    result = team.osc("member", *boot_args(name), "-f", "json")
    return result.returncode, result.stderr


def test_compute_quotas_come_from_unified_limits(unified: RunningCloud) -> None:
    capped = personas(unified, "ul-capped")
    plain = personas(unified, "ul-plain")
    # As Nova's default strategy: `servers` without a registered limit is 0.
    code, err = _boot(plain, "before")
    assert code != 0 and "Quota exceeded" in err and "403" in err, err
    unified.osc(
        "registered", "limit", "create", "--service", "compute", "--default-limit", "1", "servers"
    )
    unified.osc(
        "limit", "create", "--service", "compute", "--project", capped.project["id"],
        "--resource-limit", "2", "servers",
    )  # fmt: skip
    # The project's own limit: two boot, the third is Nova's 403.
    assert _boot(capped, "one")[0] == 0
    assert _boot(capped, "two")[0] == 0
    code, err = _boot(capped, "three")
    assert code != 0 and "Quota exceeded for instances" in err and "403" in err, err
    # The registered default for a project without its own limit.
    assert _boot(plain, "first")[0] == 0
    code, err = _boot(plain, "second")
    assert code != 0 and "Quota exceeded" in err, err
    # os-quota-sets shows the unified limits; its update changes nothing (Nova's noop).
    path = f"/os-quota-sets/{capped.project['id']}"
    assert unified.compute("GET", path).json()["quota_set"]["instances"] == 2
    put = unified.compute("PUT", path, json={"quota_set": {"instances": 50}})
    assert put.status_code == 200 and put.json()["quota_set"]["instances"] == 2
    defaults = unified.compute("GET", f"{path}/defaults").json()["quota_set"]
    assert (defaults["instances"], defaults["cores"]) == (1, -1)

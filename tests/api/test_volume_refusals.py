"""What Cinder has and this cloud does not: refused with Cinder's 501 body naming the feature,
for every method, through the real `openstack` CLI, openstacksdk and raw calls; and the
refusals never shadow an implemented route."""

from __future__ import annotations

from typing import Any, cast

import pytest
from openstack import exceptions as sdk_exceptions
from tests.api.cloudproc import RunningCloud
from tests.api.personas import personas
from tests.api.test_volumes import SDK_WARNINGS, Volume, unique

from stowage.api.common import api_routes
from stowage.api.volume import create_volume_app, refusals

pytestmark = pytest.mark.filterwarnings(SDK_WARNINGS)

ANY_ID = "00000000-0000-0000-0000-000000000001"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def assert_refused(response: Any, feature: str) -> None:
    """Cinder's shape for a 501: {"notImplemented": {"code": 501, "message": ...}}."""
    assert response.status_code == 501, (response.request.method, response.url, response.text)
    body = response.json()
    assert list(body) == ["notImplemented"], body
    assert body["notImplemented"]["code"] == 501
    assert body["notImplemented"]["message"] == f"{feature} not supported by this cloud."


def test_every_method_on_every_refused_resource_is_a_501_naming_it(cloud: RunningCloud) -> None:
    api = Volume(cloud)
    assert len(refusals.NOT_HERE) >= 19
    for resource, feature in refusals.NOT_HERE.items():
        for suffix in ("", "/detail", f"/{ANY_ID}", f"/{ANY_ID}/action", f"/{ANY_ID}/metadata"):
            for method in METHODS:
                body = {"x": {}} if method in ("POST", "PUT", "PATCH") else None
                response = api.call(method, f"/{resource}{suffix}", json=body)
                assert_refused(response, feature)


def test_service_type_access_and_encryption_changes_are_refused(cloud: RunningCloud) -> None:
    api = Volume(cloud)
    for action, feature in refusals.SERVICE_ACTIONS.items():
        response = api.call("PUT", f"/os-services/{action}", json={"host": "stowage"})
        assert_refused(response, feature)
    assert api.call("PUT", "/os-services/no-such-action", json={}).status_code == 404
    made = api.call(
        "POST", "/types", json={"volume_type": {"name": unique("private"), "is_public": False}}
    )
    assert made.status_code == 200, made.text
    type_id = made.json()["volume_type"]["id"]
    for action in ("addProjectAccess", "removeProjectAccess"):
        response = api.call(
            "POST", f"/types/{type_id}/action", json={action: {"project": api.project_id}}
        )
        assert_refused(response, "Access lists of private volume types are")
    assert api.call("POST", f"/types/{type_id}/action", json={"nope": {}}).status_code == 400
    # No project was given access: the private type's list is empty; a public type has none.
    access = api.call("GET", f"/types/{type_id}/os-volume-type-access")
    assert access.status_code == 200, access.text
    assert access.json() == {"volume_type_access": []}
    public = api.call("GET", "/types/default").json()["volume_type"]["id"]
    assert api.call("GET", f"/types/{public}/os-volume-type-access").status_code == 404
    # No type is encrypted: Cinder's empty answer; making one encrypted is refused.
    encryption = api.call("GET", f"/types/{type_id}/encryption")
    assert (encryption.status_code, encryption.json()) == (200, {})
    assert api.call("GET", f"/types/{ANY_ID}/encryption").status_code == 404
    spec = {"encryption": {"provider": "luks", "control_location": "front-end"}}
    assert_refused(
        api.call("POST", f"/types/{type_id}/encryption", json=spec), "Encrypted volume types are"
    )
    assert_refused(
        api.call("PUT", f"/types/{type_id}/encryption/provider", json=spec),
        "Encrypted volume types are",
    )
    assert_refused(
        api.call("DELETE", f"/types/{type_id}/encryption/provider"), "Encrypted volume types are"
    )
    assert api.call("DELETE", f"/types/{type_id}").status_code == 202


def test_a_member_meets_cinders_admin_rule_before_the_refusal(cloud: RunningCloud) -> None:
    team = personas(cloud, "vref")
    member = Volume(cloud)
    member.token = team.token("member")
    member.project_id = team.project["id"]
    assert member.call("PUT", "/os-services/disable", json={}).status_code == 403
    assert member.call("POST", f"/types/{ANY_ID}/action", json={}).status_code == 403
    assert_refused(member.call("GET", "/backups/detail"), "Volume backups are")
    # Without a token, a refusal is not an answer either.
    anonymous = Volume(cloud)
    anonymous.token = ""
    assert anonymous.call("GET", "/backups").status_code == 401
    assert anonymous.call("GET", f"/backups/{ANY_ID}/metadata").status_code == 401


def test_the_refusals_shadow_no_implemented_route() -> None:
    """Every implemented route comes before the refusals' catch-all, and none of them lives
    under a refused resource."""
    app = create_volume_app(cast(Any, None))
    routes = list(api_routes(app.router))
    ours = [r for r in routes if r.endpoint.__module__ != refusals.__name__]
    refused = [r for r in routes if r.endpoint.__module__ == refusals.__name__]
    assert len(ours) > 40 and len(refused) >= 3
    assert max(routes.index(r) for r in ours) < min(routes.index(r) for r in refused)
    # The first segment under the project's prefix (the routes are the app's own, whole).
    firsts = {r.path.removeprefix("/v3/{project_id}").split("/")[1] for r in ours}
    assert {"volumes", "snapshots", "types", "attachments", "os-services"} <= firsts
    assert not firsts & set(refusals.NOT_HERE), firsts & set(refusals.NOT_HERE)


def test_implemented_routes_still_answer_beside_the_refusals(cloud: RunningCloud) -> None:
    api = Volume(cloud)
    for path in (
        "/volumes",
        "/volumes/detail",
        "/snapshots/detail",
        "/types",
        "/attachments",
        "/os-services",
        "/limits",
        "/os-availability-zone",
        "/extensions",
        "/scheduler-stats/get_pools",
        "/resource_filters",
    ):
        response = api.call("GET", path)
        assert response.status_code == 200, (path, response.text)
    assert api.call("GET", "/no-such-thing").status_code == 404
    assert api.call("DELETE", "/no-such-thing/x").status_code == 404


def test_resource_filters_name_the_filters_the_lists_take(cloud: RunningCloud, sdk: Any) -> None:
    api = Volume(cloud)
    rows = {r.resource: set(r.filters) for r in sdk.block_storage.resource_filters()}
    assert {"name", "status", "metadata", "bootable"} <= rows["volume"]
    assert rows["snapshot"] == {"name", "status", "volume_id"}
    # Each named filter is one the list reads (an unknown one is Cinder's 400).
    for name in rows["volume"]:
        value = "{}" if name == "metadata" else "x"
        assert api.call("GET", "/volumes", params={name: value}).status_code == 200, name
    assert api.call("GET", "/volumes", params={"no_such_filter": "x"}).status_code == 400
    assert api.call("GET", "/resource_filters", version="3.32").status_code == 404


# The `openstack` commands that reach a refused feature, and the feature their error names.
CLI = (
    (("volume", "backup", "list"), "Volume backups are"),
    (("volume", "backup", "show", ANY_ID), "Volume backups are"),
    (("volume", "qos", "list"), "QoS specs are"),
    (("volume", "qos", "create", "q"), "QoS specs are"),
    (("volume", "transfer", "request", "list"), "Volume transfers are"),
    (("volume", "group", "list"), "Volume groups are"),
    (("volume", "group", "type", "list"), "Volume group types are"),
    (("volume", "group", "snapshot", "list"), "Volume group snapshots are"),
    (("volume", "message", "list"), "User messages are"),
    (("consistency", "group", "list"), "Consistency groups are"),
    (("block", "storage", "cluster", "list"), "Clusters of volume services are"),
    (
        ("block", "storage", "volume", "manageable", "list", "stowage"),
        "Managing existing volumes is",
    ),
    (("block", "storage", "log", "level", "list"), "Volume services' log levels are"),
    (
        ("volume", "service", "set", "--disable", "stowage@local-file", "cinder-volume"),
        "Enabling and disabling volume services is",
    ),
    (("volume", "host", "set", "--disable", "stowage"), "Freezing and thawing volume hosts is"),
)


@pytest.mark.parametrize(("words", "feature"), CLI, ids=[" ".join(w[:4]) for w, _ in CLI])
def test_the_cli_fails_naming_the_refusal(
    cloud: RunningCloud, words: tuple[str, ...], feature: str
) -> None:
    result = cloud.osc("--os-volume-api-version", "3.70", *words, check=False)
    assert result.returncode != 0, result.stdout
    assert "501" in result.stderr, result.stderr
    assert f"{feature} not supported by this cloud." in result.stderr, result.stderr


def test_a_private_types_access_change_fails_in_the_cli_naming_it(cloud: RunningCloud) -> None:
    name = unique("private")
    cloud.osc("volume", "type", "create", "--private", name)
    result = cloud.osc("volume", "type", "set", "--project", "admin", name, check=False)
    assert result.returncode != 0
    assert "Access lists of private volume types are not supported" in result.stderr
    # Its (empty) access list shows without a warning.
    shown = cloud.osc("volume", "type", "show", name, check=False)
    assert shown.returncode == 0 and "Failed" not in shown.stderr, shown.stderr
    listed = cloud.osc("volume", "type", "list", "--encryption-type", check=False)
    assert listed.returncode == 0, listed.stderr
    cloud.osc("volume", "type", "delete", name)


@pytest.mark.parametrize(
    ("call", "feature"),
    (
        (lambda bs: list(bs.backups()), "Volume backups are"),
        (lambda bs: list(bs.groups()), "Volume groups are"),
        (lambda bs: list(bs.group_types()), "Volume group types are"),
        (lambda bs: list(bs.group_snapshots()), "Volume group snapshots are"),
        (lambda bs: list(bs.qos_specs()), "QoS specs are"),
        (lambda bs: list(bs.transfers()), "Volume transfers are"),
        (lambda bs: list(bs.messages()), "User messages are"),
        (lambda bs: list(bs.consistency_groups()), "Consistency groups are"),
        (lambda bs: list(bs.clusters()), "Clusters of volume services are"),
        (lambda bs: list(bs.default_types()), "Per-project default volume types are"),
        (
            lambda bs: bs.cleanup_service_workers(
                binary="cinder-volume", host="stowage", cluster_name=None
            ),
            "Cleaning up a volume service's resources is",
        ),
    ),
)
def test_openstacksdk_raises_the_refusal(sdk: Any, call: Any, feature: str) -> None:
    with pytest.raises(sdk_exceptions.HttpException) as raised:
        call(sdk.block_storage)
    assert raised.value.status_code == 501
    assert f"{feature} not supported by this cloud." in str(raised.value)

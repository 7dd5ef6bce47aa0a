"""Issue 10: nothing the compute API accepts is dropped, nothing is allowed that Nova forbids.

Each test names what it checks; the real `openstack` CLI is used where a client sends the
request, plain HTTP (the tests' helpers) otherwise.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import IMAGE, RunningCloud, start_cloud, stop_cloud

from stowage.api.compute.server_fields import (
    ACTION_FIELDS,
    CREATE_FIELDS,
    REBUILD_FIELDS,
    UPDATE_FIELDS,
    allowed_fields,
)

MEMBER = ("demo", "stowage-demo", "demo")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def image_id(cloud: RunningCloud) -> str:
    return str(cloud.osc_json("image", "show", IMAGE)["id"])


_IDS: dict[tuple[str, str], str] = {}


def private_net(cloud: RunningCloud) -> str:
    key = (cloud.base_url, "private")
    if key not in _IDS:
        _IDS[key] = str(cloud.osc_json("network", "show", "private")["id"])
    return _IDS[key]


def server_body(cloud: RunningCloud, version: str = "2.96", **fields: Any) -> dict[str, Any]:
    """A tiny server with no NIC (below 2.37, where "none" does not exist, on "private")."""
    minor = int(version.split(".")[1])
    body = {
        "name": unique("t"),
        "flavorRef": "1",
        "imageRef": image_id(cloud),
        "networks": "none" if minor >= 37 else [{"uuid": private_net(cloud)}],
    }
    body.update(fields)
    return {"server": body}


def refused_naming(response: Any, field: str) -> None:
    """A 400 whose message names the field (so it is refused for that field, not another)."""
    assert response.status_code == 400, (field, response.text)
    assert field in response.json()["badRequest"]["message"], (field, response.text)


def post_server(
    cloud: RunningCloud, body: dict[str, Any], *, token: str | None = None, version: str = "2.96"
) -> Any:
    return cloud.compute("POST", "/servers", token=token, version=version, json=body)


def wait_status(
    cloud: RunningCloud, server_id: str, statuses: set[str], token: str | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        shown = cloud.compute("GET", f"/servers/{server_id}", token=token).json()["server"]
        if shown["status"] in statuses or time.monotonic() > deadline:
            assert shown["status"] in statuses, shown
            return dict(shown)
        time.sleep(0.3)


def boot(
    cloud: RunningCloud, *, token: str | None = None, version: str = "2.96", **fields: Any
) -> dict[str, Any]:
    response = post_server(cloud, server_body(cloud, **fields), token=token, version=version)
    assert response.status_code == 202, response.text
    return wait_status(cloud, response.json()["server"]["id"], {"ACTIVE"}, token)


def delete(cloud: RunningCloud, *server_ids: str) -> None:
    for server_id in server_ids:
        cloud.compute("DELETE", f"/servers/{server_id}")
    deadline = time.monotonic() + 60
    for server_id in server_ids:
        while cloud.compute("GET", f"/servers/{server_id}").status_code != 404:
            assert time.monotonic() < deadline, f"{server_id} was not deleted"
            time.sleep(0.3)


def names_listed(cloud: RunningCloud, query: str, token: str | None = None) -> list[str]:
    response = cloud.compute("GET", f"/servers/detail?{query}", token=token)
    assert response.status_code == 200, response.text
    return [s["name"] for s in response.json()["servers"]]


# -- authorization ---------------------------------------------------------------------------


def test_a_member_asking_for_all_tenants_is_refused_as_nova_does(cloud: RunningCloud) -> None:
    listed = cloud.osc("server", "list", "--all-projects", cloud="stowage", check=False)
    assert listed.returncode != 0
    assert "403" in listed.stderr or "Policy" in listed.stderr, listed.stderr
    member = cloud.token(*MEMBER)
    assert cloud.compute("GET", "/servers?all_tenants=1", token=member).status_code == 403
    assert cloud.compute("GET", "/servers?all_tenants=0", token=member).status_code == 200
    assert cloud.compute("GET", "/servers?all_tenants=maybe").status_code == 400
    assert cloud.compute("GET", "/servers?all_tenants=1").status_code == 200


def test_the_owner_cannot_unlock_an_admins_lock_nor_resize_a_locked_server(
    cloud: RunningCloud,
) -> None:
    name = unique("locked")
    server = cloud.boot(name, cloud="stowage")
    cloud.osc("server", "lock", server["id"])  # the admin, from another project
    unlock = cloud.osc("server", "unlock", server["id"], cloud="stowage", check=False)
    assert unlock.returncode != 0
    assert "unlock_override" in unlock.stderr or "403" in unlock.stderr, unlock.stderr
    resize = cloud.osc(
        "server", "resize", "--flavor", "m1.small", server["id"], cloud="stowage", check=False
    )
    assert resize.returncode != 0
    assert "locked" in resize.stderr, resize.stderr
    member = cloud.token(*MEMBER)
    shown = cloud.compute("GET", f"/servers/{server['id']}", token=member).json()["server"]
    assert shown["locked"] is True
    assert shown["status"] == "ACTIVE"
    rebuild = cloud.compute(
        "POST",
        f"/servers/{server['id']}/action",
        token=member,
        json={"rebuild": {"imageRef": image_id(cloud)}},
    )
    assert rebuild.status_code == 409, rebuild.text
    cloud.osc("server", "unlock", server["id"])
    # The owner's own lock is the owner's to lift.
    cloud.osc("server", "lock", server["id"], cloud="stowage")
    cloud.osc("server", "unlock", server["id"], cloud="stowage")
    delete(cloud, server["id"])


def test_a_non_admin_naming_a_host_is_refused_and_an_admins_host_is_honoured(
    cloud: RunningCloud,
) -> None:
    member = cloud.token(*MEMBER)
    for field in ("host", "hypervisor_hostname"):
        refused = post_server(cloud, server_body(cloud, **{field: "host2"}), token=member)
        assert refused.status_code == 403, refused.text
    # Before 2.74 the fields do not exist.
    old = post_server(cloud, server_body(cloud, host="host2"), version="2.73")
    assert old.status_code == 400, old.text
    unknown = post_server(cloud, server_body(cloud, host="no-such-host"))
    assert unknown.status_code == 400, unknown.text
    created = cloud.osc_json(
        "--os-compute-api-version",
        "2.74",
        "server",
        "create",
        "--flavor",
        "m1.tiny",
        "--image",
        IMAGE,
        "--nic",
        "none",
        "--host",
        "host2",
        "--wait",
        unique("pinned"),
    )
    assert created["OS-EXT-SRV-ATTR:host"] == "host2"
    stem = unique("pinned")
    many = post_server(cloud, server_body(cloud, name=stem, host="host3", min_count=3, max_count=3))
    assert many.status_code == 202, many.text
    pinned = [
        wait_status(cloud, s["id"], {"ACTIVE"})
        for s in cloud.compute("GET", f"/servers/detail?name={stem}").json()["servers"]
    ]
    assert len(pinned) == 3
    assert {s["OS-EXT-SRV-ATTR:host"] for s in pinned} == {"host3"}
    # hypervisor_hostname alone restricts the same way.
    node = boot(cloud, hypervisor_hostname="host1")
    assert node["OS-EXT-SRV-ATTR:hypervisor_hostname"] == "host1"
    delete(cloud, created["id"], node["id"], *[s["id"] for s in pinned])


def test_another_projects_server_group_cannot_be_joined(cloud: RunningCloud) -> None:
    group = cloud.osc_json("server", "group", "create", "--policy", "anti-affinity", unique("g"))
    member = cloud.token(*MEMBER)
    body = server_body(cloud)
    body["os:scheduler_hints"] = {"group": group["id"]}
    refused = post_server(cloud, body, token=member)
    assert refused.status_code == 400, refused.text
    missing = dict(body, **{"os:scheduler_hints": {"group": str(uuid.uuid4())}})
    answer = post_server(cloud, missing, token=member)
    assert answer.status_code == 400
    # The same answer as for a group that does not exist: the id's existence is not told.
    assert refused.json()["badRequest"]["message"].replace(group["id"], "X") == answer.json()[
        "badRequest"
    ]["message"].replace(missing["os:scheduler_hints"]["group"], "X")
    assert cloud.osc_json("server", "group", "show", group["id"])["members"] in ([], "")


def test_booting_on_another_projects_network_or_port_is_refused_at_once(
    cloud: RunningCloud,
) -> None:
    net = cloud.osc_json("network", "create", unique("adm-net"))
    cloud.osc(
        "subnet", "create", "--network", net["id"], "--subnet-range", "10.66.0.0/24", unique("s")
    )
    port = cloud.osc_json("port", "create", "--network", net["id"], unique("adm-port"))
    member = cloud.token(*MEMBER)
    before = names_listed(cloud, "", member)
    answers = {}
    for key, value in (
        ("uuid", net["id"]),
        ("uuid", str(uuid.uuid4())),
        ("port", port["id"]),
        ("port", str(uuid.uuid4())),
    ):
        response = post_server(cloud, server_body(cloud, networks=[{key: value}]), token=member)
        assert response.status_code == 400, response.text
        answers[(key, value)] = response.json()["badRequest"]["message"].replace(value, "X")
    assert len({answers[k] for k in answers if k[0] == "uuid"}) == 1, answers
    assert len({answers[k] for k in answers if k[0] == "port"}) == 1, answers
    assert names_listed(cloud, "", member) == before
    assert cloud.osc_json("port", "show", port["id"])["device_id"] in ("", None)
    cloud.osc("port", "delete", port["id"])
    cloud.osc("network", "delete", net["id"])


# -- accepted, then dropped ------------------------------------------------------------------


def test_user_data_is_checked_kept_and_shown(cloud: RunningCloud, tmp_path: Path) -> None:
    bad = post_server(cloud, server_body(cloud, user_data="not base64 !"))
    assert bad.status_code == 400, bad.text
    big = base64.b64encode(b"x" * 60000).decode()
    assert len(big) > 65535
    too_big = post_server(cloud, server_body(cloud, user_data=big))
    assert too_big.status_code == 400, too_big.text
    script = tmp_path / "user-data"
    script.write_text("#!/bin/sh\necho hello\n")
    name = unique("ud")
    cloud.osc(
        "server",
        "create",
        "--flavor",
        "m1.tiny",
        "--image",
        IMAGE,
        "--nic",
        "none",
        "--user-data",
        str(script),
        "--wait",
        name,
    )
    shown = cloud.compute("GET", f"/servers?name={name}").json()["servers"][0]
    server = cloud.compute("GET", f"/servers/{shown['id']}").json()["server"]
    stored = server["OS-EXT-SRV-ATTR:user_data"]
    assert base64.b64decode(stored).decode() == script.read_text()
    old = cloud.compute("GET", f"/servers/{shown['id']}", version="2.2").json()["server"]
    assert "OS-EXT-SRV-ATTR:user_data" not in old
    delete(cloud, shown["id"])


def test_what_this_cloud_cannot_do_is_refused_not_dropped(cloud: RunningCloud) -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("2.96", {"config_drive": "sometimes"}),
        ("2.56", {"personality": [{"path": "/etc/motd", "contents": "aGk="}]}),
        ("2.57", {"personality": [{"path": "/etc/motd", "contents": "aGk="}]}),
        ("2.63", {"trusted_image_certificates": ["0b5d2c72-12cc-4ba6-a8d7-3ff5cc1d8cb8"]}),
        ("2.96", {"no_such_field": 1}),
        ("2.18", {"description": "too early"}),
        ("2.89", {"hostname": "too-early"}),
        ("2.51", {"tags": ["too-early"]}),
        ("2.36", {"networks": "auto"}),
        ("2.96", {"OS-DCF:diskConfig": "SOMETIMES"}),
    ]
    before = len(names_listed(cloud, ""))
    for version, fields in cases:
        response = post_server(cloud, server_body(cloud, version, **fields), version=version)
        refused_naming(response, next(iter(fields)))
    assert len(names_listed(cloud, "")) == before


def test_block_device_mappings_it_cannot_honour_are_refused(cloud: RunningCloud) -> None:
    image = image_id(cloud)
    for mapping in (
        {"boot_index": 0, "uuid": str(uuid.uuid4()), "source_type": "volume"},
        {"boot_index": 0, "uuid": str(uuid.uuid4()), "source_type": "snapshot"},
        {"source_type": "blank", "destination_type": "local", "volume_size": 1},
        {"source_type": "blank", "destination_type": "volume"},  # no size
    ):
        body = server_body(cloud, block_device_mapping_v2=[mapping])
        del body["server"]["imageRef"]
        response = post_server(cloud, body)
        assert response.status_code == 400, (mapping, response.text)
    legacy = post_server(
        cloud, server_body(cloud, block_device_mapping=[{"volume_id": str(uuid.uuid4())}])
    )
    assert legacy.status_code == 400, legacy.text
    local = server_body(
        cloud,
        block_device_mapping_v2=[
            {"boot_index": 0, "uuid": image, "source_type": "image", "destination_type": "local"}
        ],
    )
    del local["server"]["imageRef"]
    accepted = post_server(cloud, local)
    assert accepted.status_code == 202, accepted.text
    server_id = accepted.json()["server"]["id"]
    assert wait_status(cloud, server_id, {"ACTIVE"})["image"]["id"] == image
    delete(cloud, server_id)


def test_hostname_access_addresses_and_rebuild_fields_are_kept_and_shown(
    cloud: RunningCloud,
) -> None:
    keypair = unique("kp")
    cloud.osc("keypair", "create", keypair)
    server = boot(
        cloud,
        version="2.94",
        hostname="web.example.org",
        accessIPv4="192.0.2.7",
        accessIPv6="2001:db8::7",
        **{"OS-DCF:diskConfig": "AUTO"},
    )
    assert server["OS-EXT-SRV-ATTR:hostname"] == "web.example.org"
    assert server["accessIPv4"] == "192.0.2.7"
    assert server["accessIPv6"] == "2001:db8::7"
    assert server["OS-DCF:diskConfig"] == "AUTO"
    fqdn_early = post_server(cloud, server_body(cloud, hostname="a.b"), version="2.90")
    assert fqdn_early.status_code == 400, fqdn_early.text
    cloud.osc(
        "--os-compute-api-version", "2.90", "server", "set", "--hostname", "db1", server["id"]
    )
    updated = cloud.compute(
        "PUT", f"/servers/{server['id']}", json={"server": {"accessIPv4": "192.0.2.8"}}
    )
    assert updated.status_code == 200, updated.text
    shown = cloud.compute("GET", f"/servers/{server['id']}").json()["server"]
    assert shown["OS-EXT-SRV-ATTR:hostname"] == "db1"
    assert shown["accessIPv4"] == "192.0.2.8"
    user_data = base64.b64encode(b"#cloud-config\n").decode()
    rebuilt = cloud.compute(
        "POST",
        f"/servers/{server['id']}/action",
        json={
            "rebuild": {
                "imageRef": image_id(cloud),
                "key_name": keypair,
                "user_data": user_data,
                "hostname": "db2",
                "metadata": {"role": "db"},
                "description": "rebuilt",
            }
        },
    )
    assert rebuilt.status_code == 202, rebuilt.text
    assert rebuilt.json()["server"]["user_data"] == user_data
    shown = wait_status(cloud, server["id"], {"ACTIVE"})
    assert shown["key_name"] == keypair
    assert shown["OS-EXT-SRV-ATTR:user_data"] == user_data
    assert shown["OS-EXT-SRV-ATTR:hostname"] == "db2"
    assert shown["metadata"] == {"role": "db"}
    assert shown["description"] == "rebuilt"
    bad_key = cloud.compute(
        "POST",
        f"/servers/{server['id']}/action",
        json={"rebuild": {"imageRef": image_id(cloud), "key_name": "no-such-key"}},
    )
    assert bad_key.status_code == 400, bad_key.text
    early = cloud.compute(
        "POST",
        f"/servers/{server['id']}/action",
        version="2.53",
        json={"rebuild": {"imageRef": image_id(cloud), "key_name": keypair}},
    )
    assert early.status_code == 400, early.text
    delete(cloud, server["id"])
    cloud.osc("keypair", "delete", keypair)


def test_server_list_filters_and_sorting_are_applied(cloud: RunningCloud) -> None:
    keypair = unique("kp")
    cloud.osc("keypair", "create", keypair)
    stem = unique("flt")
    a = boot(cloud, name=f"{stem}-a", tags=["red", "big"], key_name=keypair, description="alpha")
    b = boot(cloud, name=f"{stem}-b", tags=["red"], description="beta")
    c = boot(cloud, name=f"{stem}-c", tags=["blue"])
    cloud.compute("POST", f"/servers/{b['id']}/action", json={"lock": None})
    mine = {a["name"], b["name"], c["name"]}

    def listed(query: str) -> set[str]:
        return set(names_listed(cloud, f"name={stem}&{query}")) & mine

    assert listed("tags=red,big") == {a["name"]}
    assert listed("tags-any=big,blue") == {a["name"], c["name"]}
    assert listed("not-tags=red,big") == {b["name"], c["name"]}
    assert listed("not-tags-any=red") == {c["name"]}
    assert listed(f"key_name={keypair}") == {a["name"]}
    assert listed("locked=true") == {b["name"]}
    assert listed("locked=false") == {a["name"], c["name"]}
    assert listed("description=alp") == {a["name"]}
    assert listed("availability_zone=no-such-zone") == set()
    assert listed("availability_zone=nova") == mine
    assert listed("config_drive=True") == set()
    launched = a["OS-SRV-USG:launched_at"]
    assert listed(f"launched_at={launched}") >= {a["name"]}
    assert listed("launched_at=1999-01-01") == set()
    assert listed("deleted=true") == set()
    assert listed("changes-before=2000-01-01T00:00:00Z") == set()
    assert listed("changes-before=2999-01-01T00:00:00Z") == mine
    ordered = names_listed(cloud, f"name={stem}&sort_key=display_name&sort_dir=asc")
    assert ordered == sorted(mine)
    ordered = names_listed(cloud, f"name={stem}&sort_key=display_name&sort_dir=desc")
    assert ordered == sorted(mine, reverse=True)
    assert cloud.compute("GET", "/servers?sort_key=__class__").status_code == 400
    assert cloud.compute("GET", "/servers?sort_dir=sideways").status_code == 400
    assert cloud.compute("GET", "/servers?locked=perhaps").status_code == 400
    member = cloud.token(*MEMBER)
    assert cloud.compute("GET", "/servers?sort_key=host", token=member).status_code == 403
    cloud.compute("POST", f"/servers/{b['id']}/action", json={"unlock": None})
    delete(cloud, a["id"], b["id"], c["id"])
    cloud.osc("keypair", "delete", keypair)


def test_resize_shows_the_destination_and_migrations_are_filtered_and_paged(
    cloud: RunningCloud,
) -> None:
    member = cloud.token(*MEMBER)
    mine = boot(cloud, token=member)
    resize = cloud.compute(
        "POST", f"/servers/{mine['id']}/action", token=member, json={"resize": {"flavorRef": "2"}}
    )
    assert resize.status_code == 202, resize.text
    wait_status(cloud, mine["id"], {"VERIFY_RESIZE"}, member)
    shown = cloud.compute("GET", f"/servers/{mine['id']}").json()["server"]
    migration = next(
        m
        for m in cloud.compute("GET", "/os-migrations").json()["migrations"]
        if m["instance_uuid"] == mine["id"]
    )
    assert migration["dest_compute"] != migration["source_compute"]
    assert shown["OS-EXT-SRV-ATTR:host"] == migration["dest_compute"]
    cloud.compute(
        "POST", f"/servers/{mine['id']}/action", token=member, json={"confirmResize": None}
    )
    theirs = boot(cloud)
    moved = cloud.compute("POST", f"/servers/{theirs['id']}/action", json={"migrate": None})
    assert moved.status_code == 202, moved.text
    wait_status(cloud, theirs["id"], {"VERIFY_RESIZE"})
    cloud.compute("POST", f"/servers/{theirs['id']}/action", json={"confirmResize": None})
    demo = cloud.osc_json("project", "show", "demo")["id"]
    by_project = cloud.compute("GET", f"/os-migrations?project_id={demo}", version="2.80")
    assert {m["project_id"] for m in by_project.json()["migrations"]} == {demo}
    assert mine["id"] in {m["instance_uuid"] for m in by_project.json()["migrations"]}
    user = mine["user_id"]
    by_user = cloud.compute("GET", f"/os-migrations?user_id={user}", version="2.80").json()
    assert {m["user_id"] for m in by_user["migrations"]} == {user}
    first = cloud.compute("GET", "/os-migrations?limit=1", version="2.80").json()
    assert len(first["migrations"]) == 1
    assert first["migrations_links"][0]["rel"] == "next"
    marker = first["migrations"][0]["uuid"]
    second = cloud.compute("GET", f"/os-migrations?limit=1&marker={marker}", version="2.80")
    assert second.json()["migrations"][0]["uuid"] != marker
    bad = cloud.compute("GET", f"/os-migrations?marker={uuid.uuid4()}", version="2.80")
    assert bad.status_code == 400
    usage = cloud.compute(
        "GET", "/os-simple-tenant-usage?detailed=1&limit=1", version="2.40"
    ).json()
    assert sum(len(u["server_usages"]) for u in usage["tenant_usages"]) == 1
    assert usage["tenant_usages_links"][0]["rel"] == "next"
    delete(cloud, mine["id"], theirs["id"])


def test_a_servers_security_groups_are_served_at_every_microversion(
    cloud: RunningCloud,
) -> None:
    server = boot(cloud)
    for version in ("2.1", "2.36", "2.96"):
        response = cloud.compute(
            "GET", f"/servers/{server['id']}/os-security-groups", version=version
        )
        assert response.status_code == 200, (version, response.text)
        assert [g["name"] for g in response.json()["security_groups"]] == ["default"]
    delete(cloud, server["id"])


def test_pause_and_suspend_are_done_by_the_hypervisor(cloud: RunningCloud) -> None:
    """Before the fix pause and suspend changed only the record: the guest ran on."""
    import json

    from tests.e2e.test_seed_stale_migration import sim

    server = boot(cloud)

    def guest_state() -> str:
        hosts = json.loads(sim(cloud, "show", "--json"))
        return next(
            str(h["instances"][server["id"]]["state"])
            for h in hosts
            if server["id"] in h["instances"]
        )

    for action, status in (("pause", "PAUSED"), ("unpause", "ACTIVE"),
                           ("suspend", "SUSPENDED"), ("resume", "ACTIVE")):  # fmt: skip
        response = cloud.compute("POST", f"/servers/{server['id']}/action", json={action: None})
        assert response.status_code == 202, (action, response.text)
        assert wait_status(cloud, server["id"], {status})["status"] == status
        assert guest_state() == {"PAUSED": "paused", "SUSPENDED": "suspended"}.get(
            status, "running"
        ), action
    delete(cloud, server["id"])


def test_networks_auto_uses_the_projects_one_network(cloud: RunningCloud) -> None:
    member = cloud.token(*MEMBER)
    server = boot(cloud, token=member, networks="auto")
    assert list(server["addresses"]) == ["private"], server["addresses"]
    # The admin's project sees two (its external one and the shared one): Nova's 409.
    ambiguous = post_server(cloud, server_body(cloud, networks="auto"))
    assert ambiguous.status_code == 409, ambiguous.text
    delete(cloud, server["id"])


def test_a_subnet_cidr_with_host_bits_is_accepted_and_normalized(cloud: RunningCloud) -> None:
    net = cloud.osc_json("network", "create", unique("hb"))
    subnet = cloud.osc_json(
        "subnet", "create", "--network", net["id"], "--subnet-range", "10.77.0.5/24", unique("s")
    )
    assert subnet["cidr"] == "10.77.0.0/24"
    cloud.osc("network", "delete", net["id"])


# -- the audit: every schema field is honoured or refused ------------------------------------

# For each create field: a value, and how a server built with it shows it (None: refused).
CREATE_PROBES: dict[str, tuple[Any, Any]] = {
    "name": ("probe", lambda s: s["name"] == "probe"),
    "config_drive": (True, lambda s: s["config_drive"] == "True"),
    "block_device_mapping_v2": (
        [
            {
                "source_type": "blank",
                "destination_type": "volume",
                "volume_size": 1,
                "delete_on_termination": True,
            }
        ],
        lambda s: (
            [v["delete_on_termination"] for v in s["os-extended-volumes:volumes_attached"]]
            == [True]
        ),
    ),
    "imageRef": (None, lambda s: bool(s["image"]["id"])),  # the body's own
    "flavorRef": ("1", lambda s: s["flavor"]["original_name"] == "m1.tiny"),
    "adminPass": ("s3cret", None),  # checked on the create answer
    "metadata": ({"k": "v"}, lambda s: s["metadata"] == {"k": "v"}),
    "networks": ("none", lambda s: s["addresses"] == {}),
    "OS-DCF:diskConfig": ("AUTO", lambda s: s["OS-DCF:diskConfig"] == "AUTO"),
    "accessIPv4": ("192.0.2.1", lambda s: s["accessIPv4"] == "192.0.2.1"),
    "accessIPv6": ("2001:db8::1", lambda s: s["accessIPv6"] == "2001:db8::1"),
    "availability_zone": ("nova", lambda s: s["OS-EXT-AZ:availability_zone"] == "nova"),
    "key_name": ("KEY", lambda s: str(s["key_name"]).startswith("kp-")),  # the test's key
    "min_count": (1, None),  # checked below, with a reservation of two
    "max_count": (1, None),
    "return_reservation_id": (False, None),
    "security_groups": (
        [{"name": "default"}],
        lambda s: s["security_groups"] == [{"name": "default"}],
    ),
    "user_data": ("aGk=", lambda s: s["OS-EXT-SRV-ATTR:user_data"] == "aGk="),
    "description": ("d", lambda s: s["description"] == "d"),
    "tags": (["t1"], lambda s: s["tags"] == ["t1"]),
    "host": ("host1", lambda s: s["OS-EXT-SRV-ATTR:host"] == "host1"),
    "hypervisor_hostname": ("host1", lambda s: s["OS-EXT-SRV-ATTR:hypervisor_hostname"] == "host1"),
    "hostname": ("probe-host", lambda s: s["OS-EXT-SRV-ATTR:hostname"] == "probe-host"),
}
# Fields this cloud refuses, with the value that would need what it does not have.
CREATE_REFUSED: dict[str, Any] = {
    "personality": [{"path": "/etc/motd", "contents": "aGk="}],
    "block_device_mapping": [{"volume_id": "0b5d2c72-12cc-4ba6-a8d7-3ff5cc1d8cb8"}],
    "trusted_image_certificates": ["0b5d2c72-12cc-4ba6-a8d7-3ff5cc1d8cb8"],
}


def test_every_create_field_is_honoured_or_refused(cloud: RunningCloud) -> None:
    assert set(CREATE_FIELDS) == set(CREATE_PROBES) | set(CREATE_REFUSED)
    for field, value in CREATE_REFUSED.items():
        _, last = CREATE_FIELDS[field]
        version = f"{last[0]}.{last[1]}" if last else "2.96"
        response = post_server(
            cloud, server_body(cloud, version, **{field: value}), version=version
        )
        refused_naming(response, field)
        if last is not None:  # after its last version the field is unknown
            after = f"{last[0]}.{last[1] + 1}"
            gone = post_server(cloud, server_body(cloud, after, **{field: value}), version=after)
            refused_naming(gone, field)
    keypair = unique("kp")
    cloud.osc("keypair", "create", keypair)
    fields = {
        k: (keypair if v == "KEY" else v) for k, (v, _) in CREATE_PROBES.items() if v is not None
    }
    response = post_server(cloud, server_body(cloud, **fields))
    assert response.status_code == 202, response.text
    assert response.json()["server"]["adminPass"] == "s3cret"
    shown = wait_status(cloud, response.json()["server"]["id"], {"ACTIVE"})
    for field, (_, check) in CREATE_PROBES.items():
        if check is not None:
            assert check(shown), (field, shown)
    # min_count, max_count and return_reservation_id: two servers, one reservation id.
    pair = post_server(
        cloud, server_body(cloud, min_count=2, max_count=2, return_reservation_id=True)
    )
    assert pair.status_code == 202, pair.text
    reservation = pair.json()["reservation_id"]
    both = cloud.compute("GET", f"/servers/detail?reservation_id={reservation}").json()
    assert len(both["servers"]) == 2
    # Each field is refused before the microversion that brought it.
    for field, (first, _) in CREATE_FIELDS.items():
        if first == (2, 1) or field not in fields:
            continue
        early = f"{first[0]}.{first[1] - 1}"
        body = server_body(cloud, early, **{field: fields[field]})
        refused_naming(post_server(cloud, body, version=early), field)
    delete(cloud, shown["id"], *[s["id"] for s in both["servers"]])
    cloud.osc("keypair", "delete", keypair)


def test_every_update_and_rebuild_field_is_honoured_or_refused(cloud: RunningCloud) -> None:
    server = boot(cloud)
    update = {
        "name": "renamed",
        "accessIPv4": "192.0.2.9",
        "accessIPv6": "2001:db8::9",
        "OS-DCF:diskConfig": "AUTO",
        "description": "changed",
        "hostname": "renamed-host",
    }
    assert set(update) == set(UPDATE_FIELDS)
    response = cloud.compute("PUT", f"/servers/{server['id']}", json={"server": update})
    assert response.status_code == 200, response.text
    shown = cloud.compute("GET", f"/servers/{server['id']}").json()["server"]
    assert shown["name"] == "renamed"
    assert shown["accessIPv4"] == "192.0.2.9"
    assert shown["accessIPv6"] == "2001:db8::9"
    assert shown["OS-DCF:diskConfig"] == "AUTO"
    assert shown["description"] == "changed"
    assert shown["OS-EXT-SRV-ATTR:hostname"] == "renamed-host"
    unknown = cloud.compute("PUT", f"/servers/{server['id']}", json={"server": {"tags": ["x"]}})
    assert unknown.status_code == 400
    rebuild_refused = {
        "personality": [{"path": "/etc/motd", "contents": "aGk="}],
        "preserve_ephemeral": True,
        "trusted_image_certificates": ["0b5d2c72-12cc-4ba6-a8d7-3ff5cc1d8cb8"],
    }
    rebuild_honoured = {
        "imageRef",
        "name",
        "adminPass",
        "metadata",
        "OS-DCF:diskConfig",
        "accessIPv4",
        "accessIPv6",
        "description",
        "key_name",
        "user_data",
        "hostname",
    }
    assert set(REBUILD_FIELDS) == rebuild_honoured | set(rebuild_refused)
    assert allowed_fields(REBUILD_FIELDS, (2, 96)) >= rebuild_honoured
    for field, value in rebuild_refused.items():
        version = "2.56" if field == "personality" else "2.96"
        response = cloud.compute(
            "POST",
            f"/servers/{server['id']}/action",
            version=version,
            json={"rebuild": {"imageRef": image_id(cloud), field: value}},
        )
        refused_naming(response, field)
    rebuilt = cloud.compute(
        "POST",
        f"/servers/{server['id']}/action",
        json={
            "rebuild": {
                "imageRef": image_id(cloud),
                "name": "rebuilt",
                "adminPass": "p4ss",
                "metadata": {"a": "b"},
                "OS-DCF:diskConfig": "MANUAL",
                "accessIPv4": "192.0.2.10",
                "accessIPv6": "2001:db8::10",
                "description": "again",
                "key_name": None,
                "user_data": "aGk=",
                "hostname": "rebuilt-host",
            }
        },
    )
    assert rebuilt.status_code == 202, rebuilt.text
    assert rebuilt.json()["server"]["adminPass"] == "p4ss"
    shown = wait_status(cloud, server["id"], {"ACTIVE"})
    assert shown["name"] == "rebuilt"
    assert shown["metadata"] == {"a": "b"}
    assert shown["OS-DCF:diskConfig"] == "MANUAL"
    assert shown["accessIPv4"] == "192.0.2.10"
    assert shown["accessIPv6"] == "2001:db8::10"
    assert shown["description"] == "again"
    assert shown["key_name"] is None
    assert shown["OS-EXT-SRV-ATTR:user_data"] == "aGk="
    assert shown["OS-EXT-SRV-ATTR:hostname"] == "rebuilt-host"
    delete(cloud, server["id"])


def test_every_action_argument_is_honoured_or_refused(cloud: RunningCloud) -> None:
    server = boot(cloud)
    path = f"/servers/{server['id']}/action"
    for action in ACTION_FIELDS:
        response = cloud.compute("POST", path, json={action: {"no_such_argument": 1}})
        refused_naming(response, "no_such_argument")
    for version, body, field in (
        ("2.72", {"lock": {"locked_reason": "early"}}, "locked_reason"),
        ("2.14", {"evacuate": {"onSharedStorage": False}}, "onSharedStorage"),
        (
            "2.68",
            {"os-migrateLive": {"host": None, "block_migration": "auto", "force": True}},
            "force",
        ),
        ("2.55", {"migrate": {"host": "host2"}}, "host"),
        ("2.96", {"reboot": {"type": "MEDIUM"}}, "type"),
    ):
        refused_naming(cloud.compute("POST", path, version=version, json=body), field)
    locked = cloud.compute("POST", path, version="2.73", json={"lock": {"locked_reason": "why"}})
    assert locked.status_code == 202, locked.text
    assert (
        cloud.compute("GET", f"/servers/{server['id']}").json()["server"]["locked_reason"] == "why"
    )
    cloud.compute("POST", path, json={"unlock": None})
    # A backup's metadata lands on its image (it was dropped).
    backup = cloud.compute(
        "POST",
        path,
        json={
            "createBackup": {
                "name": unique("bk"),
                "backup_type": "daily",
                "rotation": 1,
                "metadata": {"purpose": "audit"},
            }
        },
    )
    assert backup.status_code == 202, backup.text
    image = backup.json()["image_id"]
    shown = cloud.compute("GET", f"/images/{image}", version="2.35").json()["image"]
    assert shown["metadata"]["purpose"] == "audit", shown
    wait_status(cloud, server["id"], {"ACTIVE"})
    delete(cloud, server["id"])
    cloud.osc("image", "delete", image)


# -- evacuation at 2.95 (its own cloud: a host goes down) --------------------------------------


@pytest.fixture
def spare_cloud(tmp_path: Path) -> Iterator[RunningCloud]:
    running = start_cloud(tmp_path / "state")
    try:
        yield running
    finally:
        stop_cloud(running)


def test_an_evacuation_at_2_95_leaves_the_server_stopped(spare_cloud: RunningCloud) -> None:
    cloud = spare_cloud
    servers = [boot(cloud, host=f"host{i}") for i in (1, 1)]
    token = cloud.token()
    stopped = cloud.compute("POST", "/os-stowage-sim/host1/action", token=token, json={"stop": {}})
    assert stopped.status_code == 200, stopped.text
    down = cloud.compute(
        "PUT",
        "/os-services/force-down",
        version="2.11",
        json={"host": "host1", "binary": "nova-compute", "forced_down": True},
    )
    assert down.status_code == 200, down.text
    cloud.osc("--os-compute-api-version", "2.95", "server", "evacuate", servers[0]["id"])
    after = wait_status(cloud, servers[0]["id"], {"SHUTOFF", "ERROR"})
    assert after["status"] == "SHUTOFF", after
    assert after["OS-EXT-SRV-ATTR:host"] != "host1"
    older = cloud.compute(
        "POST", f"/servers/{servers[1]['id']}/action", version="2.94", json={"evacuate": {}}
    )
    assert older.status_code == 200, older.text
    assert wait_status(cloud, servers[1]["id"], {"ACTIVE", "ERROR"})["status"] == "ACTIVE"

"""Security: who may do what, authentication's guards and input limits (issue 10)."""

from __future__ import annotations

import stat
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from tests.api.cloudproc import BIN, IMAGE, RunningCloud, password_auth, start_cloud, stop_cloud


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _call(cloud: RunningCloud, token: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {"X-Auth-Token": token, **kwargs.pop("headers", {})}
    return httpx.request(method, f"{cloud.base_url}{path}", headers=headers, timeout=30, **kwargs)


def _reader_of_demo(cloud: RunningCloud) -> str:
    """A new user with only the reader role on project demo, and its token."""
    name = unique("reader")
    cloud.osc("user", "create", "--password", "read-only", "--project", "demo", name)
    cloud.osc("role", "add", "--project", "demo", "--user", name, "reader")
    return cloud.token(name, "read-only", "demo")


# -- a reader writes nothing through the compute proxies ---------------------------------------


def test_a_reader_cannot_write_through_the_compute_proxies(cloud: RunningCloud) -> None:
    member = cloud.token("demo", "stowage-demo", "demo")
    reader = _reader_of_demo(cloud)
    image = _call(
        cloud,
        member,
        "POST",
        "/image/v2/images",
        json={"name": unique("img"), "disk_format": "raw", "container_format": "bare"},
    )
    assert image.status_code == 201, image.text
    image_id = image.json()["id"]
    group = _call(
        cloud,
        member,
        "POST",
        "/networking/v2.0/security-groups",
        json={"security_group": {"name": unique("sg")}},
    )
    assert group.status_code == 201, group.text
    group_id = group.json()["security_group"]["id"]
    # Glance and Neutron themselves refuse the reader.
    assert _call(cloud, reader, "DELETE", f"/image/v2/images/{image_id}").status_code == 403
    rule = {"security_group_rule": {"security_group_id": group_id, "direction": "ingress"}}
    refused = _call(cloud, reader, "POST", "/networking/v2.0/security-group-rules", json=rule)
    assert refused.status_code == 403

    def proxy(method: str, path: str, **kwargs: Any) -> httpx.Response:
        return cloud.compute(method, path, version="2.35", token=reader, **kwargs)

    meta = {"metadata": {"k": "v"}}
    assert proxy("POST", f"/images/{image_id}/metadata", json=meta).status_code == 403
    assert proxy("PUT", f"/images/{image_id}/metadata", json=meta).status_code == 403
    item = {"meta": {"k": "v"}}
    assert proxy("PUT", f"/images/{image_id}/metadata/k", json=item).status_code == 403
    assert proxy("DELETE", f"/images/{image_id}/metadata/k").status_code == 403
    assert proxy("DELETE", f"/images/{image_id}").status_code == 403
    assert _call(cloud, member, "GET", f"/image/v2/images/{image_id}").status_code == 200
    assert "k" not in _call(cloud, member, "GET", f"/image/v2/images/{image_id}").json()

    opened = {
        "security_group_rule": {
            "parent_group_id": group_id,
            "ip_protocol": "tcp",
            "from_port": 22,
            "to_port": 22,
            "cidr": "0.0.0.0/0",
        }
    }
    assert proxy("POST", "/os-security-group-rules", json=opened).status_code == 403
    created = {"security_group": {"name": unique("sg"), "description": ""}}
    assert proxy("POST", "/os-security-groups", json=created).status_code == 403
    renamed = {"security_group": {"name": unique("sg"), "description": "x"}}
    assert proxy("PUT", f"/os-security-groups/{group_id}", json=renamed).status_code == 403
    assert proxy("DELETE", f"/os-security-groups/{group_id}").status_code == 403
    rules = _call(cloud, member, "GET", f"/networking/v2.0/security-groups/{group_id}").json()
    ingress = [
        r for r in rules["security_group"]["security_group_rules"] if r["direction"] == "ingress"
    ]
    assert ingress == []
    # The owner's member still may.
    assert cloud.compute(
        "POST", "/os-security-group-rules", version="2.35", token=member, json=opened
    ).is_success
    assert cloud.compute("DELETE", f"/images/{image_id}", version="2.35", token=member).is_success


def test_a_reader_cannot_clear_a_servers_password(cloud: RunningCloud) -> None:
    reader = _reader_of_demo(cloud)
    server = cloud.boot(unique("pw"), cloud="stowage")
    path = f"/servers/{server['id']}/os-server-password"
    assert cloud.compute("GET", path, token=reader).status_code == 200
    assert cloud.compute("DELETE", path, token=reader).status_code == 403
    member = cloud.token("demo", "stowage-demo", "demo")
    assert cloud.compute("DELETE", path, token=member).status_code == 204
    cloud.osc("server", "delete", "--wait", server["id"], cloud="stowage")


# -- tokens: who may look at one, and how long a rescoped one lives ------------------------------


def _login(cloud: RunningCloud, user: str, password: str, project: str = "demo") -> httpx.Response:
    body = password_auth(user, password, project)
    return httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body, timeout=30)


def _member(cloud: RunningCloud, password: str = "secret-pw", *options: str) -> str:
    name = unique("user")
    cloud.osc("user", "create", "--password", password, "--project", "demo", *options, name)
    cloud.osc("role", "add", "--project", "demo", "--user", name, "member")
    return name


def test_only_admin_service_or_its_own_user_validates_or_revokes_a_token(
    cloud: RunningCloud,
) -> None:
    demo = cloud.token("demo", "stowage-demo", "demo")
    other = cloud.token(_member(cloud), "secret-pw", "demo")

    def ask(method: str, caller: str, subject: str) -> httpx.Response:
        headers = {"X-Subject-Token": subject}
        return _call(cloud, caller, method, "/identity/v3/auth/tokens", headers=headers)

    assert ask("GET", other, demo).status_code == 403
    assert ask("HEAD", other, demo).status_code == 403
    assert ask("DELETE", other, demo).status_code == 403
    assert ask("GET", demo, demo).status_code == 200  # the token's own user
    assert ask("HEAD", demo, demo).status_code == 200
    assert ask("GET", cloud.token(), demo).status_code == 200  # an admin
    assert _call(cloud, demo, "GET", "/compute/v2.1/servers").status_code == 200
    assert ask("DELETE", demo, demo).status_code == 204
    assert _call(cloud, demo, "GET", "/compute/v2.1/servers").status_code == 401


def test_a_rescoped_token_keeps_its_parents_expiry_and_audit_chain(cloud: RunningCloud) -> None:
    first = _login(cloud, "admin", "stowage-admin", "admin")
    assert first.status_code == 201
    parent = first.json()["token"]
    body = {
        "auth": {
            "identity": {"methods": ["token"], "token": {"id": first.headers["x-subject-token"]}},
            "scope": {"project": {"name": "demo", "domain": {"name": "Default"}}},
        }
    }
    time.sleep(1.1)  # a fresh token would expire at least a second later
    second = httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body, timeout=30)
    assert second.status_code == 201, second.text
    child = second.json()["token"]
    assert child["expires_at"] == parent["expires_at"]
    assert child["audit_ids"][1:] == parent["audit_ids"]
    assert child["audit_ids"][0] != parent["audit_ids"][0]
    # Rescoping the rescoped token again stays on the same chain and expiry.
    body["auth"]["identity"]["token"]["id"] = second.headers["x-subject-token"]
    third = httpx.post(f"{cloud.base_url}/identity/v3/auth/tokens", json=body, timeout=30)
    assert third.json()["token"]["expires_at"] == parent["expires_at"]
    assert third.json()["token"]["audit_ids"][1:] == parent["audit_ids"]
    shown = _call(
        cloud,
        cloud.token(),
        "GET",
        "/identity/v3/auth/tokens",
        headers={"X-Subject-Token": third.headers["x-subject-token"]},
    )
    assert shown.json()["token"]["audit_ids"] == third.json()["token"]["audit_ids"]


# -- authentication ---------------------------------------------------------------------------


def test_login_time_does_not_tell_which_user_names_exist(cloud: RunningCloud) -> None:
    def median(user: str) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            assert _login(cloud, user, "wrong-password").status_code == 401
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    existing = median("demo")
    missing = median(unique("nobody"))
    assert missing > 0.5 * existing, (missing, existing)


def test_every_401_says_where_to_authenticate(cloud: RunningCloud) -> None:
    expected = f'Keystone uri="{cloud.base_url}/identity"'
    for path in (
        "/compute/v2.1/servers",
        "/image/v2/images",
        "/networking/v2.0/networks",
        "/placement/resource_providers",
        "/identity/v3/users",
    ):
        response = httpx.get(f"{cloud.base_url}{path}", timeout=30)
        assert response.status_code == 401, path
        assert response.headers.get("www-authenticate") == expected, path
    refused = _login(cloud, "demo", "wrong-password")
    assert refused.status_code == 401
    assert refused.headers.get("www-authenticate") == expected


def test_lockout_after_failed_logins_unless_the_user_ignores_it(tmp_path: Path) -> None:
    cloud = start_cloud(
        tmp_path / "state", "--lockout-failure-attempts", "3", "--lockout-duration", "3"
    )
    try:
        user = _member(cloud)
        immune = _member(cloud, "secret-pw", "--ignore-lockout-failure-attempts")
        for _ in range(3):
            assert _login(cloud, user, "wrong").status_code == 401
            assert _login(cloud, immune, "wrong").status_code == 401
        locked = _login(cloud, user, "secret-pw")
        assert locked.status_code == 401
        assert "locked" in locked.json()["error"]["message"]
        for _ in range(3):
            assert _login(cloud, immune, "wrong").status_code == 401
        assert _login(cloud, immune, "secret-pw").status_code == 201
        time.sleep(3.2)
        assert _login(cloud, user, "secret-pw").status_code == 201
        # A success starts the count again; enabling the user (an admin's unlock) clears it.
        for _ in range(3):
            assert _login(cloud, user, "wrong").status_code == 401
        assert _login(cloud, user, "secret-pw").status_code == 401
        user_id = cloud.osc_json("user", "show", user)["id"]
        enable = {"user": {"enabled": True}}
        unlocked = _call(
            cloud, cloud.token(), "PATCH", f"/identity/v3/users/{user_id}", json=enable
        )
        assert unlocked.status_code == 200
        assert _login(cloud, user, "secret-pw").status_code == 201
    finally:
        stop_cloud(cloud)


def test_without_lockout_options_failed_logins_lock_nobody(cloud: RunningCloud) -> None:
    user = _member(cloud)
    for _ in range(6):
        assert _login(cloud, user, "wrong").status_code == 401
    assert _login(cloud, user, "secret-pw").status_code == 201


def test_each_server_gets_its_own_random_admin_password(cloud: RunningCloud) -> None:
    image_id = cloud.osc_json("image", "show", IMAGE)["id"]
    passwords = []
    for _ in range(2):
        body = {
            "server": {
                "name": unique("pw"),
                "flavorRef": "1",
                "imageRef": image_id,
                "networks": "none",
            }
        }
        created = cloud.compute("POST", "/servers", json=body)
        assert created.status_code == 202, created.text
        server = created.json()["server"]
        passwords.append(server["adminPass"])
        cloud.osc("server", "delete", "--wait", server["id"])
    assert "stowage" not in passwords
    assert len(set(passwords)) == 2
    assert all(len(p) >= 12 for p in passwords)


# -- input: body sizes and media types ----------------------------------------------------------

LIMIT = 114688


def _padded(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    head = b'{"server": {"name": "x"}, "pad": "'
    return head + b"a" * (size - len(head) - 2) + b'"}'


def test_a_body_over_the_limit_is_a_413_before_anything_reads_it(cloud: RunningCloud) -> None:
    token = cloud.token()
    headers = {"Content-Type": "application/json"}
    over = _call(
        cloud, token, "POST", "/compute/v2.1/servers", content=_padded(LIMIT + 1), headers=headers
    )
    assert over.status_code == 413, over.text
    assert over.json()["overLimit"]["code"] == 413
    assert over.headers["x-openstack-request-id"]
    at = _call(
        cloud, token, "POST", "/compute/v2.1/servers", content=_padded(LIMIT), headers=headers
    )
    assert at.status_code == 400, at.text  # read and refused for what it says, not its size

    # Without a token, on the identity API: nobody may make it parse a large body.
    unauthenticated = httpx.post(
        f"{cloud.base_url}/identity/v3/auth/tokens",
        content=_padded(10 * LIMIT),
        headers=headers,
        timeout=30,
    )
    assert unauthenticated.status_code == 413
    assert unauthenticated.json()["error"]["code"] == 413

    # A chunked body says no Content-Length: it is counted as it comes.
    def chunks() -> Any:
        for _ in range(40):
            yield b" " * 8192

    chunked = httpx.post(
        f"{cloud.base_url}/networking/v2.0/networks",
        content=chunks(),
        headers={"X-Auth-Token": token, **headers},
        timeout=30,
    )
    assert chunked.status_code == 413
    assert chunked.json()["NeutronError"]["message"].startswith("Request is too large")


def test_image_data_is_not_limited_by_the_body_limit(cloud: RunningCloud) -> None:
    token = cloud.token()
    image = _call(
        cloud,
        token,
        "POST",
        "/image/v2/images",
        json={"name": unique("big"), "disk_format": "raw", "container_format": "bare"},
    )
    image_id = image.json()["id"]
    data = b"\0" * (4 * LIMIT)
    uploaded = _call(
        cloud,
        token,
        "PUT",
        f"/image/v2/images/{image_id}/file",
        content=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert uploaded.status_code == 204, uploaded.text
    assert _call(cloud, token, "GET", f"/image/v2/images/{image_id}").json()["size"] == len(data)
    assert _call(cloud, token, "DELETE", f"/image/v2/images/{image_id}").status_code == 204


def test_the_body_limit_is_an_option(tmp_path: Path) -> None:
    small = start_cloud(tmp_path / "state", "--max-request-body-size", "2000")
    try:
        token = small.token()
        headers = {"Content-Type": "application/json"}
        path = "/compute/v2.1/os-keypairs"
        refused = _call(small, token, "POST", path, content=_padded(2001), headers=headers)
        assert refused.status_code == 413
        body = {"keypair": {"name": "k" * 1500}}  # under the limit, refused for its name
        answer = _call(small, token, "POST", path, json=body)
        assert answer.status_code == 400, answer.text
        assert "name" in answer.json()["badRequest"]["message"]
    finally:
        stop_cloud(small)


def test_a_body_that_is_not_json_is_refused_as_each_service_does(cloud: RunningCloud) -> None:
    token = cloud.token()
    xml = {"Content-Type": "application/xml"}
    keypair = b'{"keypair": {"name": "%s"}}' % unique("xml").encode()
    cases = [
        ("/compute/v2.1/os-keypairs", keypair, 415),
        ("/networking/v2.0/networks", b'{"network": {"name": "xml"}}', 415),
        ("/image/v2/images", b'{"name": "xml"}', 415),
        ("/placement/traits/CUSTOM_XML", b"{}", 415),
        ("/identity/v3/projects", b'{"project": {"name": "xml"}}', 400),  # Keystone's answer
    ]
    for path, body, status in cases:
        method = "PUT" if path.startswith("/placement") else "POST"
        answer = _call(cloud, token, method, path, content=body, headers=xml)
        assert answer.status_code == status, (path, answer.text)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    answer = _call(cloud, token, "POST", "/compute/v2.1/os-keypairs", content=keypair, headers=form)
    assert answer.status_code == 415
    assert answer.json()["badMediaType"]["code"] == 415
    # JSON in its other names still goes through.
    vnd = {"Content-Type": "application/vnd.openstack.compute+json"}
    answer = _call(cloud, token, "POST", "/compute/v2.1/os-keypairs", content=keypair, headers=vnd)
    assert answer.status_code == 200, answer.text


# -- the state directory, the metrics and the admin's credentials -------------------------------


def test_the_state_directory_and_its_files_are_the_owners_only(cloud: RunningCloud) -> None:
    token = cloud.token()
    image = _call(
        cloud,
        token,
        "POST",
        "/image/v2/images",
        json={"name": unique("private"), "disk_format": "raw", "container_format": "bare"},
    ).json()
    uploaded = _call(
        cloud,
        token,
        "PUT",
        f"/image/v2/images/{image['id']}/file",
        content=b"x" * 1024,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert uploaded.status_code == 204
    assert stat.S_IMODE(cloud.state_dir.stat().st_mode) == 0o700
    seen = {p.relative_to(cloud.state_dir).as_posix() for p in cloud.state_dir.rglob("*")}
    assert {"ledger.db", "token.key", "clouds.yaml", f"images/{image['id']}"} <= seen
    exposed = {
        p.relative_to(cloud.state_dir).as_posix(): oct(stat.S_IMODE(p.stat().st_mode))
        for p in cloud.state_dir.rglob("*")
        if p.stat().st_mode & 0o077
    }
    assert exposed == {}
    assert _call(cloud, token, "DELETE", f"/image/v2/images/{image['id']}").status_code == 204


def test_the_metrics_are_for_an_admin_or_a_service(cloud: RunningCloud) -> None:
    anonymous = httpx.get(f"{cloud.base_url}/metrics", timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"].startswith("Keystone uri=")
    member = cloud.token("demo", "stowage-demo", "demo")
    assert _call(cloud, member, "GET", "/metrics").status_code == 403
    admin = _call(cloud, cloud.token(), "GET", "/metrics")
    assert admin.status_code == 200
    assert "stowage_agent" in admin.text
    bearer = httpx.get(
        f"{cloud.base_url}/metrics",
        headers={"Authorization": f"Bearer {cloud.token()}"},
        timeout=30,
    )
    assert bearer.status_code == 200


def _stowage(cloud: RunningCloud, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "stowage"), *args, "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _admin_auth(cloud: RunningCloud) -> dict[str, Any]:
    clouds = yaml.safe_load((cloud.state_dir / "clouds.yaml").read_text())
    auth: dict[str, Any] = clouds["clouds"]["stowage-admin"]["auth"]
    return auth


def test_the_bootstrap_password_and_an_operators_new_one_are_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_cloud(state, "--bootstrap-password", "boot-Secret-1")
    try:
        assert _admin_auth(first)["password"] == "boot-Secret-1"
        assert _login(first, "admin", "stowage-admin", "admin").status_code == 401
        assert _login(first, "admin", "boot-Secret-1", "admin").status_code == 201
        assert _stowage(first, "sim", "show").returncode == 0
        first.osc("user", "set", "--password", "operator-New-2", "admin")
        # clouds.yaml still says the old one: a clear refusal, not a traceback.
        stale = _stowage(first, "sim", "show")
        assert stale.returncode == 2
        assert "401" in stale.stderr and "clouds.yaml" in stale.stderr, stale.stderr
        assert "Traceback" not in stale.stderr
        # The operator writes the new password into clouds.yaml.
        clouds = yaml.safe_load((state / "clouds.yaml").read_text())
        clouds["clouds"]["stowage-admin"]["auth"]["password"] = "operator-New-2"
        (state / "clouds.yaml").write_text(yaml.safe_dump(clouds))
    finally:
        stop_cloud(first)
    again = start_cloud(state, "--bootstrap-password", "ignored-now")
    try:
        auth = _admin_auth(again)
        assert auth["password"] == "operator-New-2"  # a restart does not put the old one back
        assert auth["auth_url"] == f"{again.base_url}/identity/v3"  # the new port
        shown = _stowage(again, "sim", "show")
        assert shown.returncode == 0, shown.stderr
        assert stat.S_IMODE((state / "clouds.yaml").stat().st_mode) == 0o600
    finally:
        stop_cloud(again)


# -- input: what each service refuses ------------------------------------------------------------


def test_a_name_with_a_nul_character_is_refused_everywhere(cloud: RunningCloud) -> None:
    token = cloud.token()
    bad = "a\u0000b"
    image_id = cloud.osc_json("image", "show", IMAGE)["id"]
    cases = [
        ("POST", "/image/v2/images", {"name": bad}),
        ("POST", "/networking/v2.0/networks", {"network": {"name": bad}}),
        ("POST", "/networking/v2.0/security-groups", {"security_group": {"name": bad}}),
        ("POST", "/identity/v3/projects", {"project": {"name": bad}}),
        ("POST", "/identity/v3/users", {"user": {"name": bad}}),
        ("POST", "/identity/v3/roles", {"role": {"name": bad}}),
        ("POST", "/identity/v3/domains", {"domain": {"name": bad}}),
        ("POST", "/compute/v2.1/os-keypairs", {"keypair": {"name": bad}}),
        ("POST", "/compute/v2.1/flavors", {"flavor": {"name": bad, "ram": 64, "vcpus": 1}}),
        (
            "POST",
            "/compute/v2.1/servers",
            {"server": {"name": bad, "flavorRef": "1", "imageRef": image_id, "networks": "none"}},
        ),
        ("PUT", "/placement/resource_classes/CUSTOM_A%00B", None),
        ("PUT", "/placement/traits/CUSTOM_A%00B", None),
        ("PUT", "/identity/v3/projects/x/tags/a%00b", None),
    ]
    for method, path, body in cases:
        headers = {"OpenStack-API-Version": "placement latest"}
        answer = _call(cloud, token, method, path, json=body, headers=headers)
        assert answer.status_code == 400, (path, answer.status_code, answer.text)
    # Nothing was made on the way.
    names = [i["name"] for i in _call(cloud, token, "GET", "/image/v2/images").json()["images"]]
    assert bad not in names
    projects = _call(cloud, token, "GET", "/identity/v3/projects").json()["projects"]
    assert bad not in [p["name"] for p in projects]


def test_an_rxtx_factor_past_novas_bound_is_refused(cloud: RunningCloud) -> None:
    for factor in (1e308, 3.5e38, "1e308"):
        body = {"flavor": {"name": unique("rx"), "ram": 64, "vcpus": 1, "disk": 1}}
        body["flavor"]["rxtx_factor"] = factor
        answer = cloud.compute("POST", "/flavors", json=body)
        assert answer.status_code == 400, (factor, answer.text)
        assert "rxtx_factor" in answer.json()["badRequest"]["message"]
    body = {"flavor": {"name": unique("rx"), "ram": 64, "vcpus": 1, "disk": 1, "rxtx_factor": 2.5}}
    made = cloud.compute("POST", "/flavors", json=body)
    assert made.status_code == 200, made.text
    assert made.json()["flavor"]["rxtx_factor"] == 2.5
    assert cloud.compute("DELETE", f"/flavors/{made.json()['flavor']['id']}").status_code == 202


def test_a_quota_of_a_project_that_does_not_exist_is_refused(cloud: RunningCloud) -> None:
    body = {"quota_set": {"instances": 7}}
    missing = uuid.uuid4().hex
    answer = cloud.compute("PUT", f"/os-quota-sets/{missing}", json=body)
    assert answer.status_code == 400, answer.text
    assert "not a valid project" in answer.json()["badRequest"]["message"]
    demo = cloud.osc_json("project", "show", "demo")["id"]
    current = cloud.compute("GET", f"/os-quota-sets/{demo}").json()["quota_set"]["instances"]
    set_ = cloud.compute("PUT", f"/os-quota-sets/{demo}", json={"quota_set": {"instances": 7}})
    assert set_.status_code == 200
    assert set_.json()["quota_set"]["instances"] == 7
    restore = {"quota_set": {"instances": current}}
    assert cloud.compute("PUT", f"/os-quota-sets/{demo}", json=restore).status_code == 200

"""v3 credentials and EC2 credentials through the real CLI: the owner and an admin manage
them, others do not see them, and the database never holds a blob in the clear."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
from tests.api.cloudproc import RunningCloud
from tests.api.personas import personas
from tests.api.test_identity import Admin


def _stored_bytes(cloud: RunningCloud) -> bytes:
    return b"".join(
        path.read_bytes() for path in cloud.state_dir.glob("ledger.db*") if path.is_file()
    )


def test_credentials_belong_to_their_user_and_are_sealed_at_rest(cloud: RunningCloud) -> None:
    team = personas(cloud, "cred")
    member_id = team.users["member"]["id"]
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    blob = json.dumps({"access": f"a-{uuid.uuid4().hex}", "secret": secret})
    made = team.osc(
        "member",
        "credential",
        "create",
        "--type",
        "ec2",
        "--project",
        team.project["id"],
        member_id,
        blob,
        "-f",
        "json",
    )
    assert made.returncode == 0, made.stderr
    cred = json.loads(made.stdout)
    assert (cred["type"], cred["user_id"], json.loads(cred["blob"])["secret"]) == (
        "ec2",
        member_id,
        secret,
    )
    assert secret.encode() not in _stored_bytes(cloud)
    # The owner and an admin see it; the reader of the same project neither sees nor changes it.
    listed = json.loads(team.osc("member", "credential", "list", "-f", "json").stdout)
    assert [c["ID"] for c in listed] == [cred["id"]]
    assert cred["id"] in {c["ID"] for c in cloud.osc_json("credential", "list")}
    reader = Admin(cloud, team.token("reader"))
    assert reader("GET", "/credentials").json()["credentials"] == []
    assert reader("GET", f"/credentials/{cred['id']}").status_code == 404
    assert reader("DELETE", f"/credentials/{cred['id']}").status_code == 404
    forged = {"credential": {"user_id": member_id, "type": "totp", "blob": "x"}}
    refused = reader("POST", "/credentials", forged)
    assert refused.status_code == 403 and "identity:create_credential" in refused.text
    # Updated by its owner, shown changed, then deleted.
    new_blob = json.dumps({"access": "other", "secret": "new-secret"})
    member = Admin(cloud, team.token("member"))
    patched = member("PATCH", f"/credentials/{cred['id']}", {"credential": {"blob": new_blob}})
    assert patched.status_code == 200, patched.text
    shown = team.osc("member", "credential", "show", cred["id"], "-f", "json")
    assert json.loads(json.loads(shown.stdout)["blob"])["secret"] == "new-secret"
    assert team.osc("member", "credential", "delete", cred["id"]).returncode == 0
    assert member("GET", f"/credentials/{cred['id']}").status_code == 404
    # An ec2 credential's blob must name an access key, and it needs a project.
    bad = {"credential": {"user_id": member_id, "type": "ec2", "blob": "{}"}}
    assert member("POST", "/credentials", bad).status_code == 400


def test_ec2_credentials_of_a_user_on_its_project(cloud: RunningCloud) -> None:
    team = personas(cloud, "ec2")
    made = team.osc(
        "member", "ec2", "credentials", "create", "--project", team.project["id"], "-f", "json"
    )
    assert made.returncode == 0, made.stderr
    ec2 = json.loads(made.stdout)
    assert ec2["project_id"] == team.project["id"] and ec2["secret"]
    assert ec2["secret"].encode() not in _stored_bytes(cloud)
    listed = json.loads(team.osc("member", "ec2", "credentials", "list", "-f", "json").stdout)
    assert [c["Access"] for c in listed] == [ec2["access"]]
    shown = team.osc("member", "ec2", "credentials", "show", ec2["access"], "-f", "json")
    assert json.loads(shown.stdout)["secret"] == ec2["secret"]
    # It is a v3 credential too, of type ec2.
    admin = Admin(cloud)
    creds = admin("GET", "/credentials", user_id=team.users["member"]["id"]).json()
    assert [c["type"] for c in creds["credentials"]] == ["ec2"]
    # Another user may not read or make the member's.
    member_id = team.users["member"]["id"]
    url = f"{cloud.base_url}/identity/v3/users/{member_id}/credentials/OS-EC2"
    other = {"X-Auth-Token": team.token("reader")}
    assert httpx.get(url, headers=other).status_code == 403
    body = {"tenant_id": team.project["id"]}
    assert httpx.post(url, headers=other, json=body).status_code == 403
    # Not on a project the user holds no role on.
    elsewhere = admin.project(f"ec2-other-{uuid.uuid4().hex[:6]}")
    mine = {"X-Auth-Token": team.token("member")}
    refused = httpx.post(url, headers=mine, json={"tenant_id": elsewhere["id"]})
    assert refused.status_code == 404, refused.text
    deleted = team.osc("member", "ec2", "credentials", "delete", ec2["access"])
    assert deleted.returncode == 0, deleted.stderr
    assert httpx.get(f"{url}/{ec2['access']}", headers=mine).status_code == 404


def test_policy_blobs_are_stored_by_an_admin_and_read_by_readers_of_the_system(
    cloud: RunningCloud, tmp_path: Path
) -> None:
    """/v3/policies keeps blobs, as Keystone does (which never enforces them)."""
    team = personas(cloud, "pol")
    path = tmp_path / "policy.json"  # not in the cloud's state directory: that is the owner's
    path.write_text('{"compute:start": "role:admin"}')
    made = cloud.osc_json("policy", "create", "--type", "application/json", str(path))
    assert made["type"] == "application/json"
    assert json.loads(made["rules"]) == {"compute:start": "role:admin"}
    cloud.osc("policy", "set", "--type", "text/plain", made["id"])
    shown = cloud.osc_json("policy", "show", made["id"])
    assert shown["type"] == "text/plain"
    assert made["id"] in {p["ID"] for p in cloud.osc_json("policy", "list")}
    member = Admin(cloud, team.token("member"))
    assert member("GET", "/policies").status_code == 403
    refused = member("POST", "/policies", {"policy": {"type": "x", "blob": "y"}})
    assert refused.status_code == 403 and "identity:create_policy" in refused.text
    assert member("DELETE", f"/policies/{made['id']}").status_code == 403
    cloud.osc("policy", "delete", made["id"])
    assert Admin(cloud)("GET", f"/policies/{made['id']}").status_code == 404

"""The dashboard in headless Chromium (Debian's, driven by Playwright) against a real
`stowage up`: log in, a pinned server's pCPUs on its host, a live migration moving them while
the page stays loaded, the capacity what-if, and a member who sees only their project."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.api.cloudproc import BIN, RunningCloud, start_cloud, stop_cloud
from tests.e2e.test_seed_evacuation_anti_affinity import take_down

CHROMIUM = os.environ.get("STOWAGE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
WAIT_MS = 30_000  # a page that has not updated by then never will


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        problem = f"Chromium not found at {CHROMIUM} (Debian package chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard's browser tests are required in CI: {problem}")
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            yield launched
        finally:
            launched.close()


def _shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _log_in(browser: Any, cloud: RunningCloud, user: str, password: str, project: str) -> Any:
    context = browser.new_context(base_url=cloud.base_url)
    page = context.new_page()
    page.goto("/dashboard/servers")
    assert "/dashboard/login" in page.url  # no session: the login form
    page.get_by_label("User name").fill(user)
    page.get_by_label("Password").fill(password)
    page.get_by_label("Project").fill(project)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/dashboard/servers")
    return page


def _pins(cloud: RunningCloud, server_id: str) -> set[int]:
    nodes = cloud.compute("GET", f"/servers/{server_id}/topology").json()["nodes"]
    return {int(cpu) for node in nodes for cpu in node["cpu_pinning"].values()}


def _cpus_on(page: Any, host: str, server_id: str) -> set[int]:
    cells = page.locator(f'section[data-host="{host}"] li.cpu[data-instance="{server_id}"]')
    return {int(cells.nth(i).get_attribute("data-cpu")) for i in range(cells.count())}


def test_pinned_cpus_follow_a_live_migration_without_reload(
    cloud: RunningCloud, browser: Any
) -> None:
    name = f"dash-pin-{uuid.uuid4().hex[:6]}"
    server = cloud.boot(name, flavor="m1.pinned")
    source = server["OS-EXT-SRV-ATTR:host"]
    pinned = _pins(cloud, server["id"])
    assert pinned
    page = _log_in(browser, cloud, "admin", "stowage-admin", "admin")
    _shot(page, "servers")
    page.goto("/dashboard/hosts")
    assert _cpus_on(page, source, server["id"]) == pinned
    # Thread siblings sit side by side: each pinned pCPU is inside a core with its siblings.
    core = page.locator(f'section[data-host="{source}"] li.core').filter(
        has=page.locator(f'li.cpu[data-instance="{server["id"]}"]')
    )
    assert core.first.locator("li.cpu").count() == 2  # the default hosts: 2 threads a core
    _shot(page, "hosts")

    # A second tab on the server page starts the move; the hosts tab stays loaded and follows.
    page.evaluate("window.stillTheSamePage = true")
    dest = next(
        h["Host Name"]
        for h in cloud.osc_json("host", "list", "--zone", "nova")
        if h["Host Name"] != source
    )
    actions = page.context.new_page()
    actions.goto(f"/dashboard/servers/{server['id']}")
    _shot(actions, "server")
    actions.get_by_label("Destination").select_option(dest)
    actions.get_by_role("button", name="Live-migrate").click()
    page.locator(
        f'section[data-host="{dest}"] li.cpu[data-instance="{server["id"]}"]'
    ).first.wait_for(timeout=WAIT_MS)
    page.locator(
        f'section[data-host="{source}"] li.cpu[data-instance="{server["id"]}"]'
    ).first.wait_for(state="detached", timeout=WAIT_MS)
    assert page.evaluate("window.stillTheSamePage") is True  # updated in place, not reloaded
    assert _cpus_on(page, dest, server["id"]) == _pins(cloud, server["id"])
    _shot(page, "hosts-after-migration")
    actions.goto(f"/dashboard/servers/{server['id']}")
    assert actions.locator("#server-host").inner_text() == dest
    assert "live-migration" in actions.locator("table.migrations").inner_text()
    page.context.close()


def test_capacity_what_if_matches_the_api(cloud: RunningCloud, browser: Any) -> None:
    host = cloud.osc_json("host", "list", "--zone", "nova")[0]["Host Name"]
    page = _log_in(browser, cloud, "admin", "stowage-admin", "admin")
    page.goto("/dashboard/capacity")
    page.get_by_label("If this failed").select_option(host)
    page.get_by_role("button", name="Show").click()
    page.locator("#what-if").wait_for()
    shown = {
        row.locator("th").inner_text(): row.locator("td").first.inner_text()
        for row in page.locator("#what-if-flavors tbody tr").all()
    }
    answer = cloud.compute("GET", "/os-stowage-capacity", params={"fail_host": host}).json()
    expected = {
        f["name"]: f"{f['count']}+" if f["capped"] else str(f["count"])
        for f in answer["capacity"]["flavors"]
    }
    assert shown == expected
    assert "m1.pinned" in shown
    _shot(page, "capacity")
    page.context.close()


def test_a_member_sees_only_their_project(cloud: RunningCloud, browser: Any) -> None:
    theirs = cloud.boot(f"dash-admin-{uuid.uuid4().hex[:6]}")
    group_name = f"dash-spread-{uuid.uuid4().hex[:6]}"
    group = cloud.osc_json(
        "server", "group", "create", "--policy", "anti-affinity", group_name, cloud="stowage"
    )
    mine = cloud.boot(
        f"dash-demo-{uuid.uuid4().hex[:6]}", "--hint", f"group={group['id']}", cloud="stowage"
    )
    page = _log_in(browser, cloud, "demo", "stowage-demo", "demo")
    listed = set(page.locator("table.servers tbody tr[data-server]").evaluate_all(
        "rows => rows.map(r => r.dataset.server)"
    ))  # fmt: skip
    assert mine["id"] in listed
    assert theirs["id"] not in listed
    page.get_by_label("Name").fill(mine["name"])
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**name=*")
    rows = page.locator("table.servers tbody tr[data-server]")
    assert rows.count() == 1 and rows.first.get_attribute("data-server") == mine["id"]
    # Their group: its member on one host, every other host still free for one more.
    page.goto("/dashboard/groups")
    section = page.locator("section.group", has_text=group_name)
    assert "anti-affinity" in section.locator("h2").inner_text()
    member_row = section.locator("tbody tr", has=page.locator(f'a[href$="{mine["id"]}"]'))
    assert member_row.locator("td").last.inner_text() == "0"  # at most 1 per host: full
    assert section.locator("tbody tr").count() >= 2
    _shot(page, "groups")
    page.goto(f"/dashboard/servers/{theirs['id']}")
    assert page.locator("[role=alert]").inner_text() == (
        f"Instance {theirs['id']} could not be found."
    )
    response = page.goto("/dashboard/hosts")
    assert response is not None and response.status == 403
    page.goto(f"/dashboard/servers/{mine['id']}")
    assert page.locator("#server-host").count() == 0  # the host is an admin's to see
    _shot(page, "member-server")
    page.context.close()


def test_a_host_evacuation_started_from_its_plan(
    tmp_path: Path, browser: Any, request: pytest.FixtureRequest
) -> None:
    """The plan first (where each instance would go, all planned together), then the
    evacuation started from the page; a cloud of its own, as its host goes down."""
    topology = tmp_path / "racks.yaml"
    topology.write_text(
        "defaults: {cells: 1, cores_per_cell: 4, threads_per_core: 2}\n"
        "hosts:\n  - {name: host1, labels: {rack: r1}}\n  - {name: host2, labels: {rack: r2}}\n"
    )
    own = start_cloud(tmp_path / "state", "--topology", str(topology))
    request.addfinalizer(lambda: stop_cloud(own))
    server = own.boot("evac-me", "--availability-zone", "nova:host1", flavor="m1.pinned")
    page = _log_in(browser, own, "admin", "stowage-admin", "admin")
    # The what-if of its whole rack, before anything fails.
    page.goto("/dashboard/capacity")
    page.get_by_label("If this failed").select_option("rack=r1")
    page.get_by_role("button", name="Show").click()
    page.locator("#what-if").wait_for()
    assert page.locator("#wi-title").inner_text() == "If rack=r1 failed"
    row = page.locator("#what-if-instances tbody tr", has_text="evac-me")
    assert row.locator("td").nth(2).inner_text() == "host2"
    page.goto("/dashboard/hosts/host1/evacuate")
    assert page.get_by_role("button", name="Start the evacuation").is_disabled()  # host1 is up
    take_down(own, ["host1"])
    page.reload()
    plan = page.locator("#plan tbody tr")
    assert plan.count() == 1
    assert plan.first.locator("td").nth(2).inner_text() == "host2"
    _shot(page, "evacuation-plan")
    page.get_by_role("button", name="Start the evacuation").click()
    page.locator("#results").wait_for()
    assert server["id"] in page.locator("#results").inner_text()
    page.goto(f"/dashboard/servers/{server['id']}")
    page.locator("#server-host", has_text="host2").wait_for(timeout=WAIT_MS)  # live, no reload
    page.context.close()


def test_the_cloud_on_one_screen(cloud: RunningCloud) -> None:
    """`stowage status`, and the metrics the API process serves for it."""
    hosts = {h["Host Name"] for h in cloud.osc_json("host", "list", "--zone", "nova")}
    shown = subprocess.run(
        [str(BIN / "stowage"), "status", "--state-dir", str(cloud.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert all(host in shown.stdout for host in hosts)
    assert f"hosts: {len(hosts)} up, 0 down" in shown.stdout
    metrics = httpx.get(
        f"{cloud.base_url}/metrics", headers={"X-Auth-Token": cloud.token()}, timeout=30
    ).text
    assert 'stowage_http_requests_total{method="GET",route="/compute/v2.1/os-stowage-status"' in (
        metrics
    )
    assert "stowage_http_request_seconds_bucket" in metrics
    for host in hosts:
        assert f'stowage_host_heartbeat_age_seconds{{host="{host}"}}' in metrics


def _form_login(cloud: RunningCloud, client: httpx.Client, password: str, nxt: str) -> Any:
    form = client.get("/dashboard/login").text
    csrf = form.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    return client.post(
        "/dashboard/login",
        data={
            "csrf": csrf,
            "username": "admin",
            "password": password,
            "project": "admin",
            "next": nxt,
        },
    )


def test_the_session_cookie_and_csrf_are_enforced(cloud: RunningCloud) -> None:
    """No browser needed: the HTTP contract of the login and of the forms."""
    with httpx.Client(base_url=cloud.base_url, timeout=30) as client:
        refused = _form_login(cloud, client, "wrong", "/dashboard/hosts")
        assert refused.status_code == 401
        assert "stowage_dashboard=" not in refused.headers.get("set-cookie", "")
        # A login never redirects off the dashboard.
        done = _form_login(cloud, client, "stowage-admin", "//elsewhere.example/")
        assert (done.status_code, done.headers["location"]) == (303, "/dashboard/servers")
        cookie = next(
            c for c in done.headers.get_list("set-cookie") if c.startswith("stowage_dashboard=")
        )
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
        # The CSRF check comes before anything else (no server of that id need exist).
        anywhere = f"/dashboard/servers/{uuid.uuid4()}/live-migrate"
        for path in (anywhere, "/dashboard/hosts/host1/evacuate", "/dashboard/logout"):
            for fields in ({}, {"csrf": "forged"}):
                answer = client.post(path, data=fields)
                assert answer.status_code == 403, (path, fields)
                assert "CSRF" in answer.text
        page = client.get("/dashboard/servers")
        assert page.status_code == 200  # the session outlived the forged posts
        feed = client.get("/dashboard/feed").json()
        assert set(feed) == {"marker", "now"}
    # Without the cookie: the login page, and the feed tells nothing.
    anonymous = httpx.get(f"{cloud.base_url}/dashboard/feed", timeout=30)
    assert anonymous.status_code == 303 and "/dashboard/login" in anonymous.headers["location"]

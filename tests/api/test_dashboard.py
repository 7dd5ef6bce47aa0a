"""The dashboard in headless Chromium (Debian's, driven by Playwright) against a real
`stowage up`: log in, a pinned server's pCPUs on its host, a live migration moving them while
the page stays loaded, the capacity what-if, and a member who sees only their project."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.api.cloudproc import RunningCloud

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
    page.get_by_label("If this host failed").select_option(host)
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
    mine = cloud.boot(f"dash-demo-{uuid.uuid4().hex[:6]}", cloud="stowage")
    page = _log_in(browser, cloud, "demo", "stowage-demo", "demo")
    listed = set(page.locator("table.servers tbody tr[data-server]").evaluate_all(
        "rows => rows.map(r => r.dataset.server)"
    ))  # fmt: skip
    assert mine["id"] in listed
    assert theirs["id"] not in listed
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

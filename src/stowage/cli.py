"""The `stowage` command."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from stowage import __version__

if TYPE_CHECKING:
    from stowage.ledger import Ledger

app = typer.Typer(help="Stowage: a compute cloud control plane that speaks the OpenStack APIs.")
console = Console()
err = Console(stderr=True)

StateDir = Annotated[
    Path,
    typer.Option("--state-dir", help="State directory of a cloud started by `stowage up`."),
]
DbUrl = Annotated[
    str | None,
    typer.Option("--db", help="Ledger database URL (sqlite:///PATH or postgresql://...)."),
]


def _ledger_url(state_dir: Path, db: str | None) -> str:
    from stowage.ledger.db import sqlite_url

    if db:
        return db
    path = state_dir / "ledger.db"
    if not path.exists():
        err.print(f"[red]No ledger at {path}[/red]: give --state-dir of a cloud, or --db URL.")
        raise typer.Exit(2)
    return sqlite_url(path)


def _open_existing(url: str) -> Ledger:
    """Open a ledger that must already exist; exit 2 with a message when it does not."""
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from stowage.ledger import Ledger

    parsed = make_url(url)
    if parsed.drivername.startswith("sqlite") and not Path(parsed.database or "").exists():
        err.print(f"[red]No ledger database at {parsed.database}[/red]")
        raise typer.Exit(2)
    ledger = Ledger.open(url, upgrade=False)
    try:
        with ledger.engine.connect() as conn:
            present = inspect(conn).has_table("hosts")
    except SQLAlchemyError as exc:
        ledger.close()
        err.print(f"[red]Cannot read the ledger[/red]: {str(exc).splitlines()[0]}")
        raise typer.Exit(2) from None
    if not present:
        ledger.close()
        err.print("[red]That database holds no ledger[/red]: run `stowage db-upgrade` first.")
        raise typer.Exit(2)
    return ledger


@app.command()
def version() -> None:
    """Print the version."""
    console.print(__version__)


@app.command()
def audit(state_dir: StateDir = Path(".stowage"), db: DbUrl = None) -> None:
    """Check the ledger's invariants; exit 1 with a report when any fails."""
    from stowage.ledger import audit as run_audit

    ledger = _open_existing(_ledger_url(state_dir, db))
    try:
        violations = run_audit(ledger)
    finally:
        ledger.close()
    if not violations:
        console.print(
            "[green]ledger clean[/green]: no pCPU held twice, no group policy broken, "
            "usage equals the sum of claims, no claim without a consumer"
        )
        return
    console.print(f"[red]{len(violations)} invariant violation(s)[/red]")
    for v in violations:
        console.print(f"  {v}", markup=False, highlight=False)
    raise typer.Exit(1)


@app.command("db-upgrade")
def db_upgrade(state_dir: StateDir = Path(".stowage"), db: DbUrl = None) -> None:
    """Create or upgrade the ledger schema to the newest revision."""
    from stowage.ledger import make_engine, migrate
    from stowage.ledger.db import default_url

    if db is None:
        state_dir.mkdir(parents=True, exist_ok=True)
    url = db or default_url(state_dir)
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()
    console.print(f"ledger at revision head: {engine.url.render_as_string(hide_password=True)}")


def _server_class() -> type:
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """Stops on SIGINT or SIGTERM and exits 0, rather than re-raising the signal."""

        def handle_exit(self, sig: int, frame: object) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return Server


@app.command()
def up(
    state_dir: StateDir = Path(".stowage"),
    port: Annotated[int, typer.Option(help="Port for every API.")] = 8880,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    hosts: Annotated[int, typer.Option("--hosts", help="Simulated compute hosts.")] = 3,
    topology: Annotated[
        Path | None,
        typer.Option("--topology", help="YAML file describing the hosts (see README)."),
    ] = None,
    db: DbUrl = None,
) -> None:
    """Run a whole cloud in one process: every API on one port, SQLite, simulated hosts."""
    import uvicorn

    from stowage.api.app import create_app

    _Server = _server_class()
    from stowage.services.cloud import CloudConfig
    from stowage.services.runtime import open_cloud, port_is_free, write_clouds_yaml

    if not port_is_free(host, port):
        err.print(
            f"[red]Port {port} on {host} is already in use[/red]: is another cloud "
            "running? Stop it, or pass --port."
        )
        raise typer.Exit(1)
    config = CloudConfig(state_dir=state_dir.resolve(), host=host, port=port, hosts=hosts)
    if topology is not None:
        from stowage.domain.errors import InvalidSpec
        from stowage.services.topology_file import load_topology

        try:
            config.topology = load_topology(topology)
        except InvalidSpec as exc:
            err.print(f"[red]Bad topology[/red]: {exc}")
            raise typer.Exit(2) from None
    cloud = open_cloud(config, db_url=db)
    clouds = write_clouds_yaml(config)
    console.print(f"Stowage is up at {config.base_url} (state in {config.state_dir}).")
    console.print(
        f"Point the openstack CLI at it:  export OS_CLIENT_CONFIG_FILE={clouds} "
        "OS_CLOUD=stowage-admin   (or OS_CLOUD=stowage for the member)",
        soft_wrap=True,
    )
    server = _Server(uvicorn.Config(create_app(cloud), host=host, port=port, log_level="warning"))
    server.run()
    cloud.ledger.close()
    console.print("Stowage stopped.")


host_app = typer.Typer(help="Whole-host operations on a running cloud.")
app.add_typer(host_app, name="host")


def _admin_session(state_dir: Path) -> tuple[str, dict[str, str]]:
    """The running cloud's compute URL and an admin token, from its clouds.yaml."""
    import httpx
    import yaml

    path = state_dir / "clouds.yaml"
    if not path.exists():
        err.print(f"[red]No cloud at {state_dir}[/red]: start one with `stowage up`.")
        raise typer.Exit(2)
    auth = yaml.safe_load(path.read_text())["clouds"]["stowage-admin"]["auth"]
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {
                    "user": {
                        "name": auth["username"],
                        "domain": {"name": "Default"},
                        "password": auth["password"],
                    }
                },
            },
            "scope": {"project": {"name": auth["project_name"], "domain": {"name": "Default"}}},
        }
    }
    try:
        response = httpx.post(f"{auth['auth_url']}/auth/tokens", json=body, timeout=30)
    except httpx.HTTPError as exc:
        err.print(f"[red]The cloud at {auth['auth_url']} does not answer[/red]: {exc}")
        raise typer.Exit(2) from None
    response.raise_for_status()
    base = auth["auth_url"].rsplit("/identity", 1)[0]
    return f"{base}/compute/v2.1", {"X-Auth-Token": response.headers["x-subject-token"]}


@host_app.command("evacuate")
def host_evacuate(host: str, state_dir: StateDir = Path(".stowage")) -> None:
    """Re-plan every instance of a down HOST together; report where each went or why not."""
    import httpx

    compute, headers = _admin_session(state_dir)
    response = httpx.post(
        f"{compute}/os-stowage-hosts/{host}/evacuate", headers=headers, timeout=300
    )
    if response.status_code >= 400:
        fault: dict[str, object] = next(iter(response.json().values()), {})
        message = fault.get("message", response.text)
        err.print(f"[red]{response.status_code}[/red]: {message}")
        raise typer.Exit(1)
    failed = 0
    for item in response.json()["evacuations"]:
        if item["status"] == "failed":
            failed += 1
            console.print(f"{item['server_id']}: not moved: {item['reason']}", markup=False)
        else:
            console.print(f"{item['server_id']}: {item['status']} on {item['host']}", markup=False)
    if failed:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

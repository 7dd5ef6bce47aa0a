"""The `stowage` command."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from stowage import __version__
from stowage.domain.keystone import password_login

if TYPE_CHECKING:
    from stowage.ledger import Ledger

app = typer.Typer(help="Stowage: a compute cloud control plane that speaks the OpenStack APIs.")
console = Console()
err = Console(stderr=True, soft_wrap=True)  # paths in messages stay whole

StateDir = Annotated[
    Path,
    typer.Option("--state-dir", help="State directory of a cloud started by `stowage up`."),
]
DbUrl = Annotated[
    str | None,
    typer.Option("--db", help="Ledger database URL (sqlite:///PATH or postgresql://...)."),
]
LockoutAttempts = Annotated[
    int,
    typer.Option(
        "--lockout-failure-attempts",
        min=0,
        help="Keystone's [security_compliance]: failed logins in a row that lock a user (0: off).",
    ),
]
MaxBody = Annotated[
    int,
    typer.Option(
        "--max-request-body-size",
        min=1,
        help="Largest request body in bytes; larger ones get 413 (image data is not limited).",
    ),
]
BootstrapPassword = Annotated[
    str,
    typer.Option(
        "--bootstrap-password",
        envvar="STOWAGE_BOOTSTRAP_PASSWORD",
        help="The admin user's password when the cloud is first created (as keystone-manage "
        "bootstrap's); ignored after that. Prefer the environment variable to the command line.",
    ),
]
LogFormat = Annotated[
    str,
    typer.Option(
        "--log-format", help="Log lines as json or kv (key=value), on stderr.", show_default=True
    ),
]
LogLevel = Annotated[
    str, typer.Option("--log-level", help="debug, info, warning, error or critical.")
]
MetricsPort = Annotated[
    int,
    typer.Option(
        "--metrics-port", min=0, help="Serve Prometheus metrics on this port (0: not served)."
    ),
]
MetricsHost = Annotated[
    str, typer.Option("--metrics-host", help="Address the metrics port listens on.")
]


def _configure_logs(fmt: str, level: str, process: str) -> None:
    from stowage.telemetry import configure_logging

    try:
        configure_logging(fmt, level.lower(), process=process)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


LockoutDuration = Annotated[
    float,
    typer.Option(
        "--lockout-duration",
        min=0,
        help="Seconds a locked user stays locked (0: until an admin enables it again).",
    ),
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
def audit(
    state_dir: StateDir = Path(".stowage"),
    db: DbUrl = None,
    stale_after: Annotated[
        float,
        typer.Option(
            "--stale-after", help="Seconds an operation may wait with no conductor holding it."
        ),
    ] = 300.0,
) -> None:
    """Check the ledger's and the documents' invariants; exit 1 with a report when any fails."""
    from stowage.services.audit import audit_cloud

    ledger = _open_existing(_ledger_url(state_dir, db))
    try:
        violations = audit_cloud(ledger, stale_after_s=stale_after)
    finally:
        ledger.close()
    if not violations:
        console.print(
            "[green]ledger clean[/green]: no pCPU held twice, no group policy broken, "
            "usage equals the sum of claims, no claim without a consumer; every instance "
            "where its claims are, every move and operation owned, every quota kept"
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
    from stowage.ledger.db import NamedLock, default_url

    if db is None:
        import os

        from stowage.services.runtime import private_dir

        os.umask(0o077)  # the SQLite ledger is the owner's only
        private_dir(state_dir)
    url = db or default_url(state_dir)
    engine = make_engine(url)
    with NamedLock(engine, "bootstrap"):  # never two schema upgrades at once
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


VolumeDir = Annotated[
    Path | None,
    typer.Option(
        "--volume-dir",
        help="Block storage's files (default: <state-dir>/volumes). With several processes "
        "or hosts, a path on shared storage that each of them mounts at this same path.",
    ),
]
VolumeGb = Annotated[
    int, typer.Option("--volume-gb", min=1, help="Block storage pool capacity (GiB), when new.")
]


def _volume_dir(state_dir: Path, given: Path | None) -> Path:
    """`--volume-dir`, absolute; without it, the state directory's `volumes/` (as `up`)."""
    return (given if given is not None else state_dir / "volumes").resolve()


ConsoleTokenTtl = Annotated[
    float,
    typer.Option(
        "--console-token-ttl",
        min=0.1,
        help="Seconds a console URL's one-time token stays valid (Nova's [consoleauth] token_ttl).",
    ),
]
ApiWait = Annotated[
    float,
    typer.Option(
        "--api-wait-seconds",
        help="How long an action's answer waits for its operation to end (0, as Nova: "
        "answer as soon as the request is committed; clients poll).",
    ),
]


def _quota_driver(value: str) -> str:
    if value not in ("legacy", "unified-limits"):
        raise typer.BadParameter("legacy or unified-limits")
    return value


QuotaDriver = Annotated[
    str,
    typer.Option(
        "--quota-driver",
        callback=_quota_driver,
        help="Where compute quotas come from: legacy (os-quota-sets) or unified-limits "
        "(Keystone's registered and project limits, as Nova's UnifiedLimitsDriver).",
    ),
]
MaxPerRequest = Annotated[
    int,
    typer.Option("--max-instances-per-request", min=1, help="A create's max_count is cut to this."),
]


def _offload_time(value: float) -> float:
    if value < 0 and value != -1:
        raise typer.BadParameter("seconds >= 0, or -1 (never offload by itself)")
    return value


ShelvedOffloadTime = Annotated[
    float,
    typer.Option(
        "--shelved-offload-time",
        callback=_offload_time,
        help="Nova's shelved_offload_time: 0 offloads a shelved server at once (its claims "
        "go); otherwise it stays SHELVED, holding them, this many seconds (-1: until "
        "shelveOffload). The API and the conductors must be given the same value.",
    ),
]


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
    op_timeout: Annotated[
        float, typer.Option("--op-timeout", help="Seconds an agent has to answer one step.")
    ] = 10.0,
    live_migration_seconds: Annotated[
        float,
        typer.Option("--live-migration-seconds", help="Simulated memory copy of a live migration."),
    ] = 0.0,
    resize_confirm_window: Annotated[
        float,
        typer.Option(
            "--resize-confirm-window", help="Confirm resizes after this many seconds (0: never)."
        ),
    ] = 0.0,
    heartbeat_interval: Annotated[
        float, typer.Option("--heartbeat-interval", help="Seconds between agent heartbeats.")
    ] = 10.0,
    service_down_time: Annotated[
        float,
        typer.Option("--service-down-time", help="Seconds without a heartbeat: service down."),
    ] = 60.0,
    max_concurrent_disk_ops: Annotated[
        int,
        typer.Option("--max-concurrent-disk-ops", min=1, help="Disk-heavy work per agent."),
    ] = 2,
    api_wait_seconds: ApiWait = 0.0,
    max_instances_per_request: MaxPerRequest = 1000,
    quota_driver: QuotaDriver = "legacy",
    lockout_failure_attempts: LockoutAttempts = 0,
    lockout_duration: LockoutDuration = 1800.0,
    max_request_body_size: MaxBody = 114688,
    bootstrap_password: BootstrapPassword = "stowage-admin",
    lease_seconds: LeaseSeconds = 60.0,
    running_deleted_instance_action: ReapAction = "reap",
    driver: Annotated[
        str,
        typer.Option(
            "--driver", help="sim, or libvirt: each host a private libvirt daemon (real QEMU)."
        ),
    ] = "sim",
    virt_type: Annotated[
        str | None,
        typer.Option(
            "--virt-type", help="libvirt: kvm or qemu (TCG); default: kvm if a KVM guest runs."
        ),
    ] = None,
    host_ip: Annotated[
        str | None,
        typer.Option(
            "--host-ip",
            help="The compute hosts' address, shown by os-hypervisors (Nova's my_ip; "
            "default: this machine's address on its default route).",
        ),
    ] = None,
    resume_guests_state_on_host_boot: Annotated[
        bool,
        typer.Option(
            "--resume-guests-state-on-host-boot/--no-resume-guests-state-on-host-boot",
            help="At start, start the guests that were running when the cloud stopped "
            "(libvirt's daemons stop with it); without, they show SHUTOFF.",
        ),
    ] = True,
    log_format: LogFormat = "kv",
    log_level: LogLevel = "info",
    volume_dir: VolumeDir = None,
    volume_gb: VolumeGb = 1000,
    reclaim_instance_interval: Annotated[
        float,
        typer.Option(
            "--reclaim-instance-interval",
            min=0,
            help="Seconds a deleted server stays SOFT_DELETED (restorable); 0: deletes are final.",
        ),
    ] = 0.0,
    console_token_ttl: ConsoleTokenTtl = 600.0,
    shelved_offload_time: ShelvedOffloadTime = 0.0,
    compute_process: Annotated[
        bool | None,
        typer.Option(
            "--compute-process/--no-compute-process",
            help="Run the conductor and the agents in a second process beside the APIs' "
            "(both on the same ledger), so that each has a core [default: when this process "
            "may run on two or more cores].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a whole cloud on one machine: every API on one port, SQLite, simulated hosts."""
    import os

    _configure_logs(log_format, log_level, "up")

    os.umask(0o077)  # the ledger, images, disks and keys: the owner's only, from creation

    from stowage.services.cloud import CloudConfig
    from stowage.services.runtime import open_cloud, port_is_free
    from stowage.wiring import all_in_one
    from stowage.wiring import compute_process as separate_compute

    if not port_is_free(host, port):
        raise _port_in_use(host, port)
    config = CloudConfig(
        state_dir=state_dir.resolve(),
        host=host,
        port=port,
        hosts=hosts,
        op_timeout_s=op_timeout,
        live_migration_s=live_migration_seconds,
        resize_confirm_window_s=resize_confirm_window,
        heartbeat_interval_s=heartbeat_interval,
        service_down_time_s=service_down_time,
        max_concurrent_disk_ops=max_concurrent_disk_ops,
        api_wait_s=api_wait_seconds,
        max_instances_per_request=max_instances_per_request,
        quota_driver=quota_driver,
        lockout_failure_attempts=lockout_failure_attempts,
        lockout_duration_s=lockout_duration,
        max_request_body_size=max_request_body_size,
        admin_password=bootstrap_password,
        lease_s=lease_seconds,
        running_deleted_instance_action=running_deleted_instance_action,
        volume_dir=_volume_dir(state_dir, volume_dir),
        volume_pool_gb=volume_gb,
        reclaim_instance_interval_s=reclaim_instance_interval,
        shelved_offload_time_s=shelved_offload_time,
        console_token_ttl_s=console_token_ttl,
        host_ip=host_ip,
        resume_guests_state_on_host_boot=resume_guests_state_on_host_boot,
        scheduler_freeze_view=True,
        group_writes=True,
    )
    if topology is not None:
        from stowage.domain.errors import InvalidSpec
        from stowage.services.topology_file import load_topology

        try:
            config.topology = load_topology(topology)
        except InvalidSpec as exc:
            err.print(f"[red]Bad topology[/red]: {exc}")
            raise typer.Exit(2) from None
    libvirt_hosts = None
    if driver == "libvirt":
        libvirt_hosts = _start_libvirt_hosts(config, virt_type)
    elif driver != "sim":
        err.print(f"[red]Unknown driver {driver!r}[/red]: sim or libvirt")
        raise typer.Exit(2)
    cloud = open_cloud(config, db_url=db)
    if libvirt_hosts is not None:
        from stowage.agent.local import register_guest_image

        image_id = register_guest_image(cloud)
        console.print(
            f"libvirt hosts {', '.join(libvirt_hosts.uris)} ({libvirt_hosts.virt_type}); "
            f"guest image stowage-guest = {image_id}"
        )
    app_ = all_in_one(
        cloud,
        compute=(
            separate_compute(log_format=log_format, log_level=log_level)
            if _separate_compute(compute_process)
            else None
        ),
    )
    _serve(config, cloud, app_, libvirt_hosts)


def _serve(config: Any, cloud: Any, served_app: Any, libvirt_hosts: Any) -> None:
    """`stowage up`'s last part: bind the API's port, say where the cloud is, serve."""
    import uvicorn

    from stowage.services.runtime import write_clouds_yaml

    served = uvicorn.Config(
        served_app,
        host=config.host,
        port=config.port,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    # The API's port is bound now, before the app's start-up: uvicorn binds it only after,
    # and by then the compute side's console proxies have taken ports the system chose, one
    # of which could be this one (checked free before, not yet held).
    try:
        try:
            listening = served.bind_socket()
        except SystemExit:  # uvicorn's way to say the bind failed (it logged why)
            raise _port_in_use(config.host, config.port) from None
        clouds = write_clouds_yaml(config)
        console.print(f"Stowage is up at {config.base_url} (state in {config.state_dir}).")
        console.print(
            f"Point the openstack CLI at it:  export OS_CLIENT_CONFIG_FILE={clouds} "
            "OS_CLOUD=stowage-admin   (or OS_CLOUD=stowage for the member)",
            soft_wrap=True,
        )
        _server_class()(served).run(sockets=[listening])
    finally:
        if libvirt_hosts is not None:
            libvirt_hosts.stop()
        cloud.ledger.close()
    console.print("Stowage stopped.")


def _port_in_use(host: str, port: int) -> typer.Exit:
    """Say that `stowage up`'s port is taken; the exit to raise."""
    err.print(
        f"[red]Port {port} on {host} is already in use[/red]: is another cloud running? "
        "Stop it, or pass --port."
    )
    return typer.Exit(1)


def _separate_compute(asked: bool | None) -> bool:
    """`--compute-process`, or by default whether this process may use two cores or more:
    on one core the second process only adds the hand-over of the ledger's write lock."""
    import os

    return asked if asked is not None else len(os.sched_getaffinity(0)) >= 2


KEEP_ALIVE_S = 75
"""How long an idle client connection stays open. Longer than any client's pause between
polls (the openstack CLI's `--wait` polls every 5 s, uvicorn's default): a server closing
the connection as the next request arrives resets that request."""

LeaseSeconds = Annotated[
    float,
    typer.Option(
        "--lease-seconds",
        min=1.0,
        help="A conductor's lease on an operation: how long a dead conductor's operations "
        "wait for another conductor to take them over.",
    ),
]


def _reap_action(value: str) -> str:
    from stowage.services.reconcile import RUNNING_DELETED_ACTIONS

    if value not in RUNNING_DELETED_ACTIONS:
        raise typer.BadParameter(f"one of {', '.join(RUNNING_DELETED_ACTIONS)}")
    return value


ReapAction = Annotated[
    str,
    typer.Option(
        "--running-deleted-instance-action",
        callback=_reap_action,
        help="A guest running where the ledger places no instance of it (deleted, or "
        "elsewhere): reap (destroy it), log, or noop; as Nova's option of that name.",
    ),
]


def _start_libvirt_hosts(config: Any, virt_type: str | None) -> Any:
    """`stowage up --driver libvirt`: a private libvirt daemon per host, topology from it."""
    from stowage.virt.driver import DriverError
    from stowage.virt.hosts import start_libvirt_hosts

    if virt_type not in (None, "kvm", "qemu"):
        err.print(f"[red]Unknown virt type {virt_type!r}[/red]: kvm or qemu")
        raise typer.Exit(2)
    try:
        hosts = start_libvirt_hosts(config.state_dir, config.hosts, virt_type=virt_type)
    except (DriverError, ImportError) as exc:
        err.print(f"[red]Cannot start libvirt hosts[/red]: {exc}")
        raise typer.Exit(1) from None
    config.driver = "libvirt"
    config.virt_type = hosts.virt_type
    config.topology = hosts.specs
    config.libvirt_uris = dict(hosts.uris)
    return hosts


BusUrl = Annotated[
    str, typer.Option("--bus", help="RabbitMQ URL of the bus between services and agents.")
]
DEFAULT_BUS = "amqp://guest:guest@127.0.0.1:5672/"


def _production_cloud(state_dir: Path, db: str | None, **settings: Any) -> Any:
    """The shared cloud of the production processes: no simulated hosts of its own."""
    from stowage.services.cloud import CloudConfig
    from stowage.services.runtime import open_cloud

    if not db:
        err.print("[red]--db is required[/red]: the processes share one ledger (PostgreSQL).")
        raise typer.Exit(2)
    config = CloudConfig(state_dir=state_dir.resolve(), hosts=0, **settings)
    return open_cloud(config, db_url=db)


@app.command("api")
def api_process(
    state_dir: StateDir = Path(".stowage"),
    db: DbUrl = None,
    port: Annotated[int, typer.Option(help="Port for every API.")] = 8880,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    bus: BusUrl = DEFAULT_BUS,
    workers: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    api_wait_seconds: ApiWait = 0.0,
    max_instances_per_request: MaxPerRequest = 1000,
    quota_driver: QuotaDriver = "legacy",
    lockout_failure_attempts: LockoutAttempts = 0,
    lockout_duration: LockoutDuration = 1800.0,
    max_request_body_size: MaxBody = 114688,
    bootstrap_password: BootstrapPassword = "stowage-admin",
    console_token_ttl: ConsoleTokenTtl = 600.0,
    shelved_offload_time: ShelvedOffloadTime = 0.0,
    volume_dir: VolumeDir = None,
    volume_gb: VolumeGb = 1000,
    log_format: LogFormat = "kv",
    log_level: LogLevel = "info",
) -> None:
    """Production: the APIs only (conductor and agents run as their own processes). The API
    creates, extends and deletes the volumes' files in `--volume-dir`."""
    import os

    import uvicorn

    _configure_logs(log_format, log_level, "api")
    os.environ["STOWAGE_LOG_FORMAT"] = log_format
    os.environ["STOWAGE_LOG_LEVEL"] = log_level.lower()

    from stowage.services.runtime import write_clouds_yaml

    os.umask(0o077)
    volumes = _volume_dir(state_dir, volume_dir)
    cloud = _production_cloud(
        state_dir,
        db,
        host=host,
        port=port,
        admin_password=bootstrap_password,
        volume_dir=volumes,
        volume_pool_gb=volume_gb,
    )
    os.environ["STOWAGE_API_LOCKOUT_ATTEMPTS"] = str(lockout_failure_attempts)
    os.environ["STOWAGE_API_LOCKOUT_DURATION"] = str(lockout_duration)
    os.environ["STOWAGE_API_MAX_BODY"] = str(max_request_body_size)
    write_clouds_yaml(cloud.config)
    cloud.ledger.close()
    os.environ["STOWAGE_API_STATE_DIR"] = str(state_dir.resolve())
    os.environ["STOWAGE_API_DB"] = db or ""
    os.environ["STOWAGE_API_BUS"] = bus
    os.environ["STOWAGE_API_BASE"] = f"{host}:{port}"
    os.environ["STOWAGE_API_WAIT"] = str(api_wait_seconds)
    os.environ["STOWAGE_API_MAX_PER_REQUEST"] = str(max_instances_per_request)
    os.environ["STOWAGE_API_QUOTA_DRIVER"] = quota_driver
    os.environ["STOWAGE_API_CONSOLE_TOKEN_TTL"] = str(console_token_ttl)
    os.environ["STOWAGE_API_SHELVED_OFFLOAD_TIME"] = str(shelved_offload_time)
    os.environ["STOWAGE_API_VOLUME_DIR"] = str(volumes)
    os.environ["STOWAGE_API_VOLUME_GB"] = str(volume_gb)
    console.print(f"Stowage APIs at http://{host}:{port} ({workers} worker(s)).")
    uvicorn.run(
        "stowage.wiring:production_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
        log_config=None,  # each worker's lines go through configure_logging
    )


# How a conductor or an agent reaches the image API: as a user of the identity API (Nova's
# service user), sharing nothing with the API's host but the ledger and the bus.
ImageApi = Annotated[
    str,
    typer.Option(
        "--image-api",
        help="The image API: images fetched (libvirt; a conductor's volumes from images), "
        "snapshots sent.",
    ),
]
AuthUrl = Annotated[
    str | None,
    typer.Option("--auth-url", help="The identity API (default: beside --image-api, /identity)."),
]
AuthUser = Annotated[str, typer.Option("--auth-user", help="The service user.")]
AuthProject = Annotated[str, typer.Option("--auth-project", help="The service user's project.")]
AuthPassword = Annotated[
    str,
    typer.Option(
        "--auth-password", envvar="STOWAGE_AUTH_PASSWORD", help="The service user's password."
    ),
]


def _service_token(
    image_api: str, auth_url: str | None, user: str, password: str, project: str
) -> Any:
    """A renewed token of the service user, from `--auth-url` or the identity API beside the
    image API."""
    from stowage.virt.images import PasswordToken

    identity = auth_url or image_api.rstrip("/").removesuffix("/image") + "/identity"
    return PasswordToken(identity, user, password, project)


@app.command("conductor")
def conductor_process(
    state_dir: StateDir = Path(".stowage"),
    db: DbUrl = None,
    bus: BusUrl = DEFAULT_BUS,
    op_timeout: Annotated[float, typer.Option("--op-timeout")] = 10.0,
    lease_seconds: LeaseSeconds = 60.0,
    name: Annotated[
        str,
        typer.Option(
            "--name",
            help="This conductor's stable identity (default: the host name). A restarted "
            "conductor takes back the leases of its name at once; a second live conductor "
            "of the same name waits until the first ends.",
        ),
    ] = "",
    shelved_offload_time: ShelvedOffloadTime = 0.0,
    volume_dir: VolumeDir = None,
    image_api: ImageApi = "http://127.0.0.1:8880/image",
    auth_url: AuthUrl = None,
    auth_user: AuthUser = "admin",
    auth_project: AuthProject = "admin",
    auth_password: AuthPassword = "stowage-admin",
    log_format: LogFormat = "kv",
    log_level: LogLevel = "info",
    metrics_port: MetricsPort = 0,
    metrics_host: MetricsHost = "127.0.0.1",
) -> None:
    """Production: drive operations through the agents (run several for more throughput).
    A build makes its new volumes' files in `--volume-dir` and hands their paths there to the
    agent; a volume made from an image takes the image's data from the image API when this
    host has no copy of the API's image files (kept in `<state-dir>/image-cache`)."""
    import asyncio
    import functools

    from stowage.agent.processes import conductor_name, run_conductor, run_until_signal
    from stowage.services.dashboard import heartbeat_ages
    from stowage.telemetry import serve_metrics
    from stowage.telemetry.metrics import watch_heartbeats

    _configure_logs(log_format, log_level, "conductor")
    cloud = _production_cloud(
        state_dir,
        db,
        op_timeout_s=op_timeout,
        lease_s=lease_seconds,
        conductor_name=name,
        shelved_offload_time_s=shelved_offload_time,
        volume_dir=_volume_dir(state_dir, volume_dir),
        scheduler_freeze_view=True,
    )
    from stowage.virt.images import HttpImageFetcher, ImageCache

    token = _service_token(image_api, auth_url, auth_user, auth_password, auth_project)
    cloud.remote_images = ImageCache(
        state_dir.resolve() / "image-cache", HttpImageFetcher(image_api, token)
    )
    watch_heartbeats(functools.partial(heartbeat_ages, cloud))
    if metrics_port:
        serve_metrics(metrics_port, metrics_host)
    console.print(f"conductor {conductor_name(cloud)} running")
    asyncio.run(run_until_signal(lambda stop: run_conductor(cloud, bus, stop)))
    cloud.ledger.close()


@app.command("agent")
def agent_process(
    host_name: Annotated[str, typer.Option("--host", help="This compute host's name.")],
    driver: Annotated[str, typer.Option("--driver", help="sim or libvirt.")] = "sim",
    state_dir: StateDir = Path(".stowage"),
    db: DbUrl = None,
    bus: BusUrl = DEFAULT_BUS,
    libvirt_uri: Annotated[str, typer.Option("--libvirt-uri")] = "qemu:///system",
    topology: Annotated[
        Path | None, typer.Option("--topology", help="YAML with this host (see README).")
    ] = None,
    heartbeat_interval: Annotated[float, typer.Option("--heartbeat-interval")] = 10.0,
    max_concurrent_disk_ops: Annotated[
        int, typer.Option("--max-concurrent-disk-ops", min=1, help="Disk-heavy work at once.")
    ] = 2,
    running_deleted_instance_action: ReapAction = "reap",
    virt_type: Annotated[
        str | None, typer.Option("--virt-type", help="libvirt: kvm or qemu (default: detected).")
    ] = None,
    cpu_dedicated_set: Annotated[
        str | None, typer.Option("--cpu-dedicated-set", help="libvirt: pinnable CPUs, e.g. 2-7.")
    ] = None,
    cpu_shared_set: Annotated[
        str | None, typer.Option("--cpu-shared-set", help="libvirt: CPUs for shared vCPUs.")
    ] = None,
    image_api: ImageApi = "http://127.0.0.1:8880/image",
    auth_url: AuthUrl = None,
    auth_user: AuthUser = "admin",
    auth_project: AuthProject = "admin",
    auth_password: AuthPassword = "stowage-admin",
    host_ip: Annotated[
        str | None,
        typer.Option(
            "--host-ip",
            help="This host's address, shown by os-hypervisors (Nova's my_ip; "
            "default: this machine's address on its default route).",
        ),
    ] = None,
    console_listen: Annotated[
        str | None,
        typer.Option(
            "--console-listen",
            help="Where the serial console proxy listens for the API's connections "
            "(default: --host-ip, else this machine's address).",
        ),
    ] = None,
    console_port: Annotated[
        int,
        typer.Option("--console-port", help="The serial console proxy's port (0: any free one)."),
    ] = 0,
    volume_dir: VolumeDir = None,
    log_format: LogFormat = "kv",
    log_level: LogLevel = "info",
    metrics_port: MetricsPort = 0,
    metrics_host: MetricsHost = "127.0.0.1",
) -> None:
    """Production: one host's compute agent (registers the host, heartbeats, runs its work).
    Its guests' volumes are files in `--volume-dir` (a simulated host restarted gives its
    guests back their volumes from there).

    It talks to the image API as `--auth-user` (a token from the identity API, as Nova's
    service user): nothing is shared with the API's host but the ledger and the bus."""
    import asyncio
    import functools

    from stowage.agent.metrics import AgentMetrics
    from stowage.agent.processes import (
        http_image_sink,
        make_driver,
        my_ip,
        run_agent,
        run_until_signal,
    )
    from stowage.agent.server import ConsoleSettings
    from stowage.services.cloud import default_hosts
    from stowage.services.dashboard import heartbeat_ages
    from stowage.telemetry import serve_metrics
    from stowage.telemetry.metrics import watch_heartbeats

    _configure_logs(log_format, log_level, f"agent:{host_name}")

    cloud = _production_cloud(
        state_dir,
        db,
        heartbeat_interval_s=heartbeat_interval,
        max_concurrent_disk_ops=max_concurrent_disk_ops,
        running_deleted_instance_action=running_deleted_instance_action,
        volume_dir=_volume_dir(state_dir, volume_dir),
    )
    spec = default_hosts(1)[0]
    if topology is not None:
        from stowage.services.topology_file import load_topology

        named = [h for h in load_topology(topology) if h.name == host_name]
        if not named:
            err.print(f"[red]{topology} describes no host {host_name}[/red]")
            raise typer.Exit(2)
        spec = named[0]
    else:
        from dataclasses import replace

        spec = replace(spec, name=host_name)
    token = _service_token(image_api, auth_url, auth_user, auth_password, auth_project)
    if driver == "libvirt":
        the_driver = _libvirt_agent_driver(
            token,
            spec if topology is not None else None,
            state_dir.resolve() / "agents" / host_name,
            libvirt_uri,
            virt_type=virt_type,
            cpu_dedicated_set=cpu_dedicated_set,
            cpu_shared_set=cpu_shared_set,
            image_api=image_api,
        )
        from dataclasses import replace as _replace

        topo = getattr(the_driver, "topology", spec.topology)
        spec = _replace(spec, topology=topo, hypervisor_type="QEMU")
    else:
        the_driver = make_driver(
            driver, spec, state_dir.resolve() / "agents" / host_name, libvirt_uri=libvirt_uri
        )
    metrics = AgentMetrics.create()
    watch_heartbeats(functools.partial(heartbeat_ages, cloud, [host_name]))
    if metrics_port:
        serve_metrics(metrics_port, metrics_host, metrics.registry)
    console.print(f"agent of {host_name} ({driver}) running")
    sink = http_image_sink(image_api, token)
    asyncio.run(
        run_until_signal(
            lambda stop: run_agent(
                cloud,
                spec,
                the_driver,
                bus,
                stop,
                sink,
                host_ip,
                metrics=metrics,
                console=ConsoleSettings(
                    console_listen or host_ip or my_ip(), console_port, host_ip or None
                ),
            )
        )
    )
    cloud.ledger.close()


def _libvirt_agent_driver(
    token: Callable[[], str],
    spec: Any,
    disk_dir: Path,
    uri: str,
    *,
    virt_type: str | None,
    cpu_dedicated_set: str | None,
    cpu_shared_set: str | None,
    image_api: str,
) -> Any:
    """A production agent's libvirt driver: the host's topology from libvirt (unless the
    topology file gives it), images over HTTP with the agent user's token."""
    from stowage.agent.processes import make_driver
    from stowage.domain.topology import parse_cpu_set
    from stowage.virt.driver import DriverError
    from stowage.virt.hosts import kvm_makes_progress
    from stowage.virt.images import HttpImageFetcher

    def cpus(text: str | None, what: str) -> frozenset[int] | None:
        return None if text is None else parse_cpu_set(text, what=what)

    if virt_type is None and uri.startswith("qemu"):
        # Only QEMU offers kvm and qemu; another libvirt driver (test:///default, ...) offers
        # its own type, which the driver picks.
        virt_type = "kvm" if kvm_makes_progress() else "qemu"
    try:
        return make_driver(
            "libvirt",
            spec,
            disk_dir,
            libvirt_uri=uri,
            virt_type=virt_type,
            image_fetcher=HttpImageFetcher(image_api, token),
            cpu_dedicated_set=cpus(cpu_dedicated_set, "cpu_dedicated_set"),
            cpu_shared_set=cpus(cpu_shared_set, "cpu_shared_set"),
        )
    except DriverError as exc:
        err.print(f"[red]libvirt[/red]: {exc}")
        raise typer.Exit(1) from None


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
    body = password_login(auth["username"], auth["password"], auth["project_name"])
    try:
        response = httpx.post(f"{auth['auth_url']}/auth/tokens", json=body, timeout=30)
    except httpx.HTTPError as exc:
        err.print(f"[red]The cloud at {auth['auth_url']} does not answer[/red]: {exc}")
        raise typer.Exit(2) from None
    if response.status_code == 401:
        err.print(
            f"[red]The cloud refused the credentials of {auth['username']} in {path} (401)"
            "[/red]: if the password was changed (openstack user set --password), put the new "
            "one in the stowage-admin entry of that file."
        )
        raise typer.Exit(2)
    if response.status_code >= 400:
        err.print(f"[red]Login failed ({response.status_code})[/red]: {response.text[:300]}")
        raise typer.Exit(2)
    base = auth["auth_url"].rsplit("/identity", 1)[0]
    return f"{base}/compute/v2.1", {"X-Auth-Token": response.headers["x-subject-token"]}


sim_app = typer.Typer(help="Control the simulated hypervisors of a running `stowage up`.")
app.add_typer(sim_app, name="sim")


def _sim_action(state_dir: Path, host: str, action: str, args: dict[str, object]) -> None:
    import httpx

    compute, headers = _admin_session(state_dir)
    response = httpx.post(
        f"{compute}/os-stowage-sim/{host}/action", json={action: args}, headers=headers, timeout=60
    )
    _fail_on_error(response)
    agent = response.json()["host"]
    state = "running" if agent["running"] else "stopped"
    console.print(f"{host}: agent {state}, {len(agent['instances'])} instance(s)", markup=False)


def _fail_on_error(response: object) -> None:
    import httpx

    assert isinstance(response, httpx.Response)
    if response.status_code >= 400:
        fault: dict[str, object] = next(iter(response.json().values()), {})
        err.print(f"[red]{response.status_code}[/red]: {fault.get('message', response.text)}")
        raise typer.Exit(1)


@sim_app.command("stop")
def sim_stop(host: str, state_dir: StateDir = Path(".stowage")) -> None:
    """Stop HOST's agent: no heartbeats, no operations (like `systemctl stop nova-compute`)."""
    _sim_action(state_dir, host, "stop", {})


@sim_app.command("start")
def sim_start(host: str, state_dir: StateDir = Path(".stowage")) -> None:
    """Start HOST's agent again: it heartbeats and runs what waited for it."""
    _sim_action(state_dir, host, "start", {})


@sim_app.command("fault")
def sim_fault(
    host: str,
    operation: Annotated[str, typer.Argument(help="spawn, destroy, reboot, power_off, ...")],
    step: Annotated[str, typer.Argument(help="The step of OPERATION, e.g. define or start.")],
    action: Annotated[str, typer.Option("--action", help="fail, hang or crash.")] = "fail",
    times: Annotated[int, typer.Option("--times", help="How many runs it hits.")] = 1,
    state_dir: StateDir = Path(".stowage"),
) -> None:
    """Make STEP of OPERATION on HOST fail, hang or crash the agent."""
    args: dict[str, object] = {"operation": operation, "step": step, "action": action}
    args["times"] = times
    _sim_action(state_dir, host, "fault", args)


@sim_app.command("slow-disk")
def sim_slow_disk(
    host: str,
    seconds: Annotated[float, typer.Option("--seconds", help="Each disk read blocks this long.")],
    state_dir: StateDir = Path(".stowage"),
) -> None:
    """Make every read of HOST's disk block for SECONDS, like a saturated disk."""
    _sim_action(state_dir, host, "slow-disk", {"seconds": seconds})


@sim_app.command("latency")
def sim_latency(
    host: str,
    operation: Annotated[str, typer.Argument(help="spawn, attach_interface, ...")],
    step: Annotated[str, typer.Argument(help="The step of OPERATION, e.g. start or plug.")],
    seconds: Annotated[float, typer.Option("--seconds", help="How long the step takes.")],
    state_dir: StateDir = Path(".stowage"),
) -> None:
    """Make STEP of OPERATION on HOST take SECONDS (then go on), like a slow hypervisor."""
    args = {"operation": operation, "step": step, "seconds": seconds}
    _sim_action(state_dir, host, "latency", args)


@sim_app.command("clear")
def sim_clear(host: str, state_dir: StateDir = Path(".stowage")) -> None:
    """Remove HOST's faults, disk slowness and set latencies; hung steps return with an error."""
    _sim_action(state_dir, host, "clear", {})


@sim_app.command("repin")
def sim_repin(
    host: str,
    instance: str,
    pins: Annotated[list[str], typer.Argument(help="vCPU:pCPU pairs, e.g. 0:5 1:6")],
    state_dir: StateDir = Path(".stowage"),
) -> None:
    """Repin INSTANCE on HOST's hypervisor behind the ledger's back (for the reconciler)."""
    try:
        mapping = {int(v): int(c) for v, c in (p.split(":", 1) for p in pins)}
    except ValueError:
        err.print("[red]pins are vCPU:pCPU pairs[/red], e.g. 0:5")
        raise typer.Exit(2) from None
    _sim_action(state_dir, host, "repin", {"instance_id": instance, "pins": mapping})


@sim_app.command("show")
def sim_show(
    state_dir: StateDir = Path(".stowage"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What each simulated hypervisor runs, with pins, and whether its agent runs."""
    import json

    import httpx
    from rich.table import Table

    compute, headers = _admin_session(state_dir)
    response = httpx.get(f"{compute}/os-stowage-sim", headers=headers, timeout=60)
    _fail_on_error(response)
    hosts = response.json()["hosts"]
    if as_json:
        typer.echo(json.dumps(hosts, indent=2))
        return
    table = Table("host", "agent", "service", "instance", "state", "pins (vCPU:pCPU)")
    table.columns[3].overflow = "fold"
    for agent in hosts:
        state = "running" if agent["running"] else "stopped"
        service = "up" if agent.get("service_up") else "down"
        rows = agent["instances"] or {"-": {"state": "", "pins": {}}}
        for instance_id, inst in rows.items():
            pins = (
                " ".join(
                    f"{v}:{c}" for v, c in sorted(inst["pins"].items(), key=lambda x: int(x[0]))
                )
                if inst["pins"]
                else ""
            )
            table.add_row(agent["host"], state, service, instance_id, inst["state"], pins)
    console.print(table)


@host_app.command("reconcile")
def host_reconcile(host: str, state_dir: StateDir = Path(".stowage")) -> None:
    """Run HOST's reconciler now: what its hypervisor runs against what the ledger says."""
    import httpx

    compute, headers = _admin_session(state_dir)
    response = httpx.post(
        f"{compute}/os-stowage-hosts/{host}/reconcile", headers=headers, timeout=120
    )
    _fail_on_error(response)
    report = response.json()["reconcile"]
    console.print(
        f"{host}: {report['audited']} instance(s) audited, {report['skipped']} busy, "
        f"{len(report['divergences'])} divergence(s)",
        markup=False,
    )
    for divergence in report["divergences"]:
        console.print(f"  {divergence['kind']} {divergence['instance_id']}: "
                      f"{divergence['detail']}", markup=False)  # fmt: skip
    if report["divergences"] or report["error"]:
        raise typer.Exit(1)


@host_app.command("evacuate")
def host_evacuate(
    host: str,
    state_dir: StateDir = Path(".stowage"),
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to follow the evacuations.")
    ] = 240.0,
) -> None:
    """Re-plan every instance of a down HOST together; follow each instance's evacuation
    (status, destination, progress) to its end and report where each went or why not."""
    import time

    import httpx

    compute, headers = _admin_session(state_dir)
    response = httpx.post(
        f"{compute}/os-stowage-hosts/{host}/evacuate", headers=headers, timeout=60
    )
    if response.status_code >= 400:
        fault: dict[str, object] = next(iter(response.json().values()), {})
        message = fault.get("message", response.text)
        err.print(f"[red]{response.status_code}[/red]: {message}")
        raise typer.Exit(1)
    items: list[dict[str, Any]] = response.json()["evacuations"]
    headers = {**headers, "OpenStack-API-Version": "compute 2.80"}
    deadline = time.monotonic() + timeout

    def poll() -> bool:
        """Refresh each started evacuation from its migration record; True once all ended."""
        answer = httpx.get(
            f"{compute}/os-migrations",
            params={"source_compute": host, "migration_type": "evacuation"},
            headers=headers,
            timeout=30,
        )
        _fail_on_error(answer)
        records = {m["uuid"]: m for m in answer.json()["migrations"]}
        for item in items:
            record = records.get(item["migration_id"] or "")
            if record is not None:
                item["status"] = record["status"]
                item["host"] = record.get("dest_compute") or item["host"]
        return all(i["status"] in _EVACUATION_ENDED for i in items)

    if console.is_terminal:
        from rich.live import Live

        with Live(_evacuation_table(host, items), console=console, refresh_per_second=4) as live:
            while not poll() and time.monotonic() < deadline:
                live.update(_evacuation_table(host, items))
                time.sleep(0.5)
            live.update(_evacuation_table(host, items))
    else:
        seen: dict[str, str] = {}
        while True:
            ended = poll()
            for item in items:
                if seen.get(item["server_id"]) != item["status"]:
                    seen[item["server_id"]] = item["status"]
                    where = f" (destination {item['host']})" if item["host"] else ""
                    console.print(f"{item['server_id']}: {item['status']}{where}", markup=False)
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    if _report_evacuations(items, timeout):
        raise typer.Exit(1)


def _report_evacuations(items: list[dict[str, Any]], timeout: float) -> int:
    """One line per instance: where it went, or why not; returns how many did not move."""
    failed = 0
    for item in items:
        if item["status"] in ("failed", "refused", "error"):
            failed += 1
            console.print(f"{item['server_id']}: not moved: {item['reason']}", markup=False)
        elif item["status"] not in _EVACUATION_ENDED:
            failed += 1
            console.print(f"{item['server_id']}: still {item['status']} after {timeout:.0f} s")
        else:
            console.print(f"{item['server_id']}: {item['status']} on {item['host']}", markup=False)
    return failed


_EVACUATION_ENDED = frozenset({"done", "completed", "failed", "refused", "error", "cancelled"})


def _evacuation_table(host: str, items: list[dict[str, Any]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"Evacuation of {host}")
    for column in ("server", "migration", "status", "destination", "reason"):
        table.add_column(column)
    styles = {"done": "green", "completed": "green", "failed": "red", "refused": "red"}
    for item in items:
        table.add_row(
            Text(item["server_id"]),
            Text(item["migration_id"] or ""),
            Text(item["status"], styles.get(item["status"], "yellow")),
            Text(item["host"] or ""),
            Text(item["reason"] or ""),
        )
    return table


@app.command()
def status(state_dir: StateDir = Path(".stowage")) -> None:
    """The cloud on one screen: hosts up and down, free pCPUs, operations in flight, and the
    stuck and failed ones. Exit 1 when a host is down or an operation is stuck."""
    import httpx
    from rich.table import Table
    from rich.text import Text

    compute, headers = _admin_session(state_dir)
    response = httpx.get(f"{compute}/os-stowage-status", headers=headers, timeout=60)
    _fail_on_error(response)
    report = response.json()["status"]
    hosts = Table(title="Hosts")
    for column in ("host", "state", "heartbeat", "free pCPUs", "shared load", "instances"):
        hosts.add_column(column, justify="left" if column in ("host", "state") else "right")
    for item in report["hosts"]:
        state = item["state"] + (", disabled" if item["disabled"] else "")
        age = item["heartbeat_age_s"]
        hosts.add_row(
            Text(item["name"]),
            Text(state, "green" if item["state"] == "up" else "red"),
            "never" if age is None else f"{age:.0f} s ago",
            f"{item['pcpus_free']}/{item['pcpus_total']}",
            f"{item['shared_load']:.2f}",
            str(item["instances"]),
        )
    console.print(hosts)
    in_flight = report["operations_in_flight"]
    flying = ", ".join(f"{n} {kind}" for kind, n in in_flight.items()) or "none"
    console.print(
        f"hosts: {report['hosts_up']} up, {report['hosts_down']} down · "
        f"free pCPUs: {report['pcpus_free']} · operations in flight: {flying}",
        markup=False,
    )
    for title, ops in (("Stuck operations", report["stuck"]), ("Failed lately", report["failed"])):
        if not ops:
            continue
        table = Table(title=title)
        for column in ("operation", "kind", "instance", "host", "step", "attempts", "age", "why"):
            table.add_column(column)
        for op in ops:
            table.add_row(
                Text(op["id"]),
                op["kind"],
                Text(op["instance_id"]),
                Text(op["host"]),
                op["step"],
                str(op["attempts"]),
                f"{op['age_s']:.0f} s",
                Text(op["error"]),
            )
        console.print(table)
    if report["hosts_down"] or report["stuck"]:
        raise typer.Exit(1)


@app.command()
def capacity(
    fail_host: Annotated[
        str, typer.Option("--fail-host", help="The host to treat as failed.", show_default=False)
    ],
    state_dir: StateDir = Path(".stowage"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the answer as JSON.")] = False,
) -> None:
    """What if FAIL_HOST failed: where each of its instances would go, how many more of each
    flavor fit. Changes nothing; exit 1 when some instance would not find a place."""
    import json

    import httpx
    from rich.table import Table
    from rich.text import Text

    compute, headers = _admin_session(state_dir)
    response = httpx.get(
        f"{compute}/os-stowage-capacity",
        params={"fail_host": fail_host},
        headers=headers,
        timeout=300,
    )
    if response.status_code >= 400:
        fault: dict[str, object] = next(iter(response.json().values()), {})
        err.print(f"[red]{response.status_code}[/red]: {fault.get('message', response.text)}")
        raise typer.Exit(2)
    report = response.json()["capacity"]
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        placed = Table(title=f"Instances of {fail_host}, re-planned together")
        for column in ("server", "name", "flavor", "destination"):
            placed.add_column(column)
        for item in report["instances"]:
            where = (
                Text(item["host"]) if item["host"] else Text(f"nowhere: {item['reason']}", "red")
            )
            placed.add_row(Text(item["server_id"]), Text(item["name"]), Text(item["flavor"]), where)
        console.print(placed)
        room = Table(title=f"Room left without {fail_host}")
        room.add_column("flavor")
        room.add_column("more that fit", justify="right")
        for item in report["flavors"]:
            count = f"{item['count']}+" if item["capped"] else str(item["count"])
            room.add_row(Text(item["name"]), count)
        console.print(room)
        fits = report["fits"]
        console.print(
            "everything fits" if fits else "not everything fits", style="green" if fits else "red"
        )
    if not report["fits"]:
        raise typer.Exit(1)


@app.command("sim-test")
def sim_test(
    seed: Annotated[int | None, typer.Option("--seed", help="Run (replay) one seed.")] = None,
    seeds: Annotated[
        str | None, typer.Option("--seeds", help="A range of seeds, A-B (both included).")
    ] = None,
    faults: Annotated[
        str,
        typer.Option(
            "--faults",
            help="Fault classes: default, all, none or a list: default,-bus-loss,+api-crash.",
        ),
    ] = "default",
    db: Annotated[
        str | None,
        typer.Option("--db", help="A PostgreSQL URL: each run gets a schema of its own there."),
    ] = None,
    requests: Annotated[int, typer.Option("--requests", help="Client requests per run.")] = 12,
    trace: Annotated[bool, typer.Option("--trace", help="Print each run's trace.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Report passing runs too.")] = False,
) -> None:
    """Deterministic simulation of the whole control plane; exit 1 when a seed fails."""
    from stowage.simulation.faults import parse_faults
    from stowage.simulation.runner import parse_seeds, run_seeds
    from stowage.simulation.world import RunResult

    try:
        chosen = range(seed, seed + 1) if seed is not None else parse_seeds(seeds or "0-99")
        kinds = parse_faults(faults)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None

    import logging

    # The runs' own logs (injected crashes, retries) would drown the reports.
    logging.getLogger("stowage").setLevel(logging.CRITICAL)

    def report(result: RunResult) -> None:
        if trace:
            typer.echo("\n".join(result.trace))
        if verbose or trace or not result.ok or len(chosen) == 1:
            typer.echo(result.report())
            typer.echo(f"  trace hash {result.trace_hash}")

    summary = run_seeds(chosen, kinds, db_url=db, requests=requests, report=report)
    typer.echo(summary.figures())
    if summary.failed:
        typer.echo("failed seeds: " + " ".join(str(r.seed) for r in summary.failed))
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

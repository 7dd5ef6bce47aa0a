"""A whole cloud's state and the bootstrap that `stowage up` runs on a fresh state directory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stowage.bus.base import Calls
from stowage.domain.errors import NotFound
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger.ledger import Ledger
from stowage.ledger.objects import Document, ObjectStore
from stowage.ledger.operations import Operations
from stowage.services.images import bootstrap_images
from stowage.services.networks import bootstrap_networks
from stowage.services.scheduler import Scheduler
from stowage.services.tokens import Tokens, ValidationCache, hash_password
from stowage.virt.images import ImageCache

__all__ = ["Cloud", "CloudConfig", "bootstrap"]

DEFAULT_DOMAIN = "default"
# "service" as devstack adds it: the role services (and Tempest) call service-only APIs with.
ROLES = ("admin", "member", "reader", "manager", "service")

# devstack's flavors, plus a pinned one for the seed scenarios.
DEFAULT_FLAVORS: tuple[tuple[str, str, int, int, int, dict[str, str]], ...] = (
    ("1", "m1.tiny", 1, 512, 1, {}),
    ("2", "m1.small", 1, 2048, 20, {}),
    ("3", "m1.medium", 2, 4096, 40, {}),
    ("4", "m1.large", 4, 8192, 80, {}),
    ("5", "m1.xlarge", 8, 16384, 160, {}),
    ("42", "m1.nano", 1, 128, 1, {}),
    ("84", "m1.micro", 1, 192, 1, {}),
    ("c1", "m1.pinned", 1, 256, 1, {"hw:cpu_policy": "dedicated"}),
)


@dataclass(slots=True)
class CloudConfig:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 8880
    hosts: int = 3
    region: str = "RegionOne"
    admin_password: str = "stowage-admin"
    member_password: str = "stowage-demo"
    service_down_time_s: float = 60.0
    heartbeat_interval_s: float = 10.0
    topology: list[HostSpec] = field(default_factory=list)
    api_wait_s: float = 0.0  # how long an action's answer waits for its operation (0: Nova's)
    op_timeout_s: float = 10.0  # one agent call; past it the outcome is unknown
    live_migration_s: float = 0.0  # the simulated memory copy of a live migration
    resize_confirm_window_s: float = 0.0  # 0: resizes wait for an explicit confirm
    sim_step_s: float = 0.0  # latency of every simulated hypervisor step
    max_concurrent_disk_ops: int = 2  # per agent, like Nova's option of the same name
    max_instances_per_request: int = 1000  # a create's max_count is cut to this, like a quota
    # Keystone's [security_compliance]: failed password logins in a row that lock an account
    # (0: never), and for how many seconds (0: until an admin enables the user again).
    lockout_failure_attempts: int = 0
    lockout_duration_s: float = 1800.0
    # Nova's and Keystone's max_request_body_size: larger bodies get a 413 (image data aside).
    max_request_body_size: int = 114688
    # A guest running where the ledger places no instance of it: reap, log or noop (Nova's).
    running_deleted_instance_action: str = "reap"
    lease_s: float = 60.0  # a conductor's lease on an operation; renewed while it drives it
    conductor_name: str = ""  # a conductor's stable identity ("": the machine's host name)
    driver: str = "sim"  # the all-in-one cloud's hypervisors: sim, or libvirt (real QEMU)
    virt_type: str | None = None  # libvirt's domain type: kvm, qemu, or None (detected)
    libvirt_uris: dict[str, str] = field(default_factory=dict)  # host name -> libvirt URI
    host_ip: str | None = None  # the all-in-one hosts' address (Nova's my_ip); None: detected
    # Start, when the cloud starts, the guests that ran when it stopped (Nova's option of
    # that name): `stowage up` stops its libvirt daemons, and their guests, with it.
    resume_guests_state_on_host_boot: bool = True
    # Block storage: the local-file backend's directory (None: `<state_dir>/volumes`; a path on
    # shared storage lets every host reach the same files) and its pool's capacity in GiB.
    volume_dir: Path | None = None
    # Nova's reclaim_instance_interval: a delete soft-deletes for this long (0: immediate).
    reclaim_instance_interval_s: float = 0.0
    # Nova's shelved_offload_time: 0 offloads a shelved server at once; otherwise it stays
    # SHELVED, holding its claims, for this many seconds (-1: until shelveOffload).
    shelved_offload_time_s: float = 0.0
    volume_pool_gb: int = 1000
    # Where compute quotas take their limits: "legacy" (os-quota-sets, Nova's DbQuotaDriver)
    # or "unified-limits" (Keystone's registered and project limits, Nova's
    # UnifiedLimitsDriver): services/identity_limits.py.
    quota_driver: str = "legacy"
    # Nova's [consoleauth] token_ttl: how long a console URL's one-time token stays valid.
    console_token_ttl_s: float = 600.0
    # The scheduler's view out of the cyclic collector's reach after each full read
    # (Scheduler(freeze_view=True), gc.freeze of the whole process): on for the processes
    # that hold one cloud for their lifetime and schedule (`stowage up`, `stowage conductor`);
    # off where a process makes many clouds (tests, the simulation), whose frozen cycles
    # would never be collected.
    scheduler_freeze_view: bool = False
    # (ObjectStore(group_writes=True)): on a SQLite ledger, the write transactions that ask at
    # one moment (creates, finished spawns) commit as one, each in a savepoint; on for `stowage
    # up`, off where a test or the simulation needs each write on its own caller's thread.
    group_writes: bool = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Cloud:
    """The ledger, the document store, tokens and the scheduler of one running cloud."""

    def __init__(
        self, config: CloudConfig, ledger: Ledger, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.clock = clock
        self.objects = ObjectStore(
            ledger.engine,
            clock=clock,
            group_writes=config.group_writes and ledger.engine.dialect.name == "sqlite",
        )
        self.tokens = Tokens(_token_key(config.state_dir), clock=clock)
        # What validated tokens said, dropped on any change to what validation reads.
        self.validated_tokens = ValidationCache()
        self.objects.watch(("revoked_token", "user", "project"), self.validated_tokens.changed)
        self.scheduler = Scheduler(ledger, clock=clock, freeze_view=config.scheduler_freeze_view)
        # Where a process without the image API's files (a production conductor on a host of
        # its own) reads an image's data: a cache fetched from the image API.
        self.remote_images: ImageCache | None = None
        # One scheduling decision cycle at a time per process; several processes may still race.
        self.schedule_lock = threading.Lock()
        self.operations = Operations(ledger.engine, clock=clock)
        # Set by a running conductor: look for new work now rather than at the next poll.
        self.kick: Callable[[], None] = lambda: None
        # The bus to the agents, where this process has one.
        self.bus: Calls | None = None

    # -- identity lookups -------------------------------------------------------------

    def find_by_name(self, kind: str, name: str, *, domain_id: str | None = None) -> Document:
        for doc in self.objects.list(kind, name=name):
            if domain_id is None or doc.body.get("domain_id", DEFAULT_DOMAIN) == domain_id:
                return doc
        raise NotFound(f"Could not find {kind}: {name}.")

    def roles_of(self, user_id: str, project_id: str) -> tuple[str, ...]:
        from stowage.services.identity import implied_closure
        from stowage.services.identity_groups import group_role_ids
        from stowage.services.identity_inherit import inherited_role_ids

        role_ids = [
            doc.body["role_id"]
            for doc in self.objects.list("assignment", project_id=project_id)
            if doc.body.get("user_id") == user_id
        ]
        # The roles of the user's groups on the project count as its own (Keystone's).
        role_ids += group_role_ids(self, user_id, project_id)
        # And those inherited from the project's domain or its parents (OS-INHERIT).
        role_ids += inherited_role_ids(self, user_id, project_id)
        # With the roles they imply, by the cloud's inference rules.
        return tuple(sorted({role.name or "" for role in implied_closure(self, role_ids)}))


def _token_key(state_dir: Path) -> bytes:
    path = state_dir / "token.key"
    if path.exists():
        return path.read_bytes().strip()
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Processes that start at once on one state directory agree on one key: each writes its
    # own to a file of its own (mkstemp: 0600 from the start), and the first to link it in
    # place wins; the others read the winner's, whole.
    fd, temp = tempfile.mkstemp(dir=state_dir, prefix=".token.key.")
    try:
        os.write(fd, Tokens.new_key())
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    finally:
        os.unlink(temp)
    return path.read_bytes().strip()


def default_hosts(count: int) -> list[HostSpec]:
    """`count` simulated hosts: 2 NUMA cells x 8 cores x 2 threads, 64 GiB."""
    topology = HostTopology.uniform(
        cells=2, cores_per_cell=8, threads_per_core=2, memory_mb_per_cell=32768
    )
    return [
        HostSpec(f"host{i + 1}", topology, disk_gb=1000, labels={"rack": f"r{i % 2 + 1}"})
        for i in range(count)
    ]


def bootstrap(cloud: Cloud) -> None:
    """Create what a fresh cloud starts with; does nothing on a cloud that already has it.

    Every step creates only what is missing, with ids that a repeated run derives again, and
    the default domain comes last: a bootstrap that died half-way is finished by the next
    one. Processes that start at once on a fresh ledger serialize on a named lock around
    this (`services.runtime.open_cloud`), so one bootstraps and the others find it done.
    """
    objects = cloud.objects
    # metadefs change namespaces through services.documents, which needs this module.
    from stowage.services.metadefs import bootstrap_metadefs

    # Before the early return: a cloud bootstrapped before metadefs existed gets them too.
    bootstrap_metadefs(cloud)
    if objects.find("domain", DEFAULT_DOMAIN) is not None:
        return

    def ensure(kind: str, id: str, body: dict[str, Any], **meta: Any) -> None:
        if objects.find(kind, id) is None:
            objects.create(kind, id, body, **meta)

    role_ids = {}
    for role in ROLES:
        role_id = _bootstrap_id("role", role)
        role_ids[role] = role_id
        ensure("role", role_id, {"id": role_id, "name": role, "domain_id": None}, name=role)
    # Keystone's default inference rules, as data an admin may change (services/identity.py).
    from stowage.services.identity import IMPLIED_ROLES, INFERENCE, INFERENCES_STORED

    for prior, implies in IMPLIED_ROLES.items():
        for implied in implies:
            rule = {"prior_role_id": role_ids[prior], "implied_role_id": role_ids[implied]}
            ensure(INFERENCE, f"{role_ids[prior]}:{role_ids[implied]}", rule)
    ensure(INFERENCES_STORED, "all", {})
    projects = {}
    for name in ("admin", "demo", "service"):
        project_id = _bootstrap_id("project", name)
        projects[name] = project_id
        ensure(
            "project",
            project_id,
            {
                "id": project_id,
                "name": name,
                "domain_id": DEFAULT_DOMAIN,
                "enabled": True,
                "description": "",
                "is_domain": False,
                "parent_id": DEFAULT_DOMAIN,
                "tags": [],
            },
            project_id=project_id,
            name=name,
        )
    users = {
        "admin": (cloud.config.admin_password, [("admin", "admin"), ("demo", "admin")]),
        "demo": (cloud.config.member_password, [("demo", "member")]),
    }
    for name, (password, grants) in users.items():
        user_id = _bootstrap_id("user", name)
        if objects.find("user", user_id) is None:
            objects.create(
                "user",
                user_id,
                {
                    "id": user_id,
                    "name": name,
                    "domain_id": DEFAULT_DOMAIN,
                    "enabled": True,
                    "password_hash": hash_password(password),
                    "default_project_id": projects[grants[0][0]],
                },
                name=name,
            )
        for project, role in grants:
            scope = f"project:{projects[project]}"
            # The same id the identity service gives a grant (ids are at most 64 characters).
            grant_id = hashlib.sha256(f"{scope}\0{user_id}\0{role_ids[role]}".encode()).hexdigest()
            ensure(
                "assignment",
                grant_id,
                {"user_id": user_id, "project_id": projects[project], "role_id": role_ids[role]},
                project_id=projects[project],
            )
    for flavor_id, name, vcpus, ram, disk, specs in DEFAULT_FLAVORS:
        ensure(
            "flavor",
            flavor_id,
            {
                "id": flavor_id,
                "name": name,
                "vcpus": vcpus,
                "ram": ram,
                "disk": disk,
                "ephemeral": 0,
                "swap": 0,
                "rxtx_factor": 1.0,
                "is_public": True,
                "disabled": False,
                "description": None,
                "extra_specs": specs,
            },
            name=name,
        )
    hosts = cloud.config.topology or default_hosts(cloud.config.hosts)
    for spec in hosts:
        cloud.ledger.register_host(spec)
    bootstrap_images(cloud, projects["admin"])
    bootstrap_networks(cloud, projects)
    # Last: its presence says the bootstrap is complete.
    objects.create(
        "domain",
        DEFAULT_DOMAIN,
        {"id": DEFAULT_DOMAIN, "name": "Default", "enabled": True, "description": ""},
        name="Default",
    )


def _bootstrap_id(kind: str, name: str) -> str:
    """The id of a bootstrapped role, project or user: a repeated bootstrap finds it again."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"stowage-bootstrap:{kind}:{name}").hex

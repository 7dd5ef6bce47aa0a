"""One simulated run of the whole control plane, from one seed.

The API process (its use cases called directly, each request in a greenlet of its own), the
conductor, one agent per host with the simulated hypervisor, and the bus between them run in
one process, on one thread, on a `VirtualLoop`. The ledger is a SQLite file (a copy of a
bootstrapped template) or a PostgreSQL schema of its own. Each process has its own engine,
so a commit can be told apart by who made it, and a crash drops that process's engine and
memory only.

API requests interleave at transaction boundaries: before each transaction a request opens
(when it holds no other open), it yields, and the seed decides which request, or the rest of the
system, goes next. That is where two real API workers race.

After the workload and its faults, the run settles: faults stop, every agent runs, a fresh
conductor drives everything to an end, the settling client confirms resizes waiting for it,
and then `checks.CHECKS` must all pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import itertools
import logging
import random
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import greenlet
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.util import LRUCache

from stowage.agent.local import make_reconciler, make_upload_sink, restore_guests
from stowage.agent.metrics import AgentMetrics
from stowage.agent.reconciler import Reconciler
from stowage.agent.runtime import AgentConfig
from stowage.agent.server import AgentServer
from stowage.domain.errors import StowageError
from stowage.domain.groups import parse_group
from stowage.domain.topology import HostSpec, HostTopology
from stowage.ledger.audit import Violation
from stowage.ledger.db import make_engine, migrate, sqlite_url
from stowage.ledger.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap
from stowage.services.conductor import Conductor, ConductorConfig
from stowage.services.networks import addresses
from stowage.simulation import adapter
from stowage.simulation.bus import Endpoint, FaultyBus
from stowage.simulation.checks import Subject, check_all
from stowage.simulation.faults import DEFAULT_FAULTS, Crash, Fault, FaultKind, Schedule
from stowage.simulation.loop import EPOCH, VirtualClock, VirtualLoop, deterministic
from stowage.virt.sim import STEPS, SimConfig, SimDriver
from stowage.virt.sim import FaultKind as DriverFault

__all__ = ["RunConfig", "RunResult", "run"]

log = logging.getLogger(__name__)

QUOTA_INSTANCES = 8
SERVICE_DOWN_S = 40.0
# Each agent's reconciler, on the virtual clock: more often than production's 60 s, so that a
# one-minute workload sees its decisions taken under faults.
RECONCILE_INTERVAL_S = 20.0
FLAVORS = ("1", "2", "c1")  # m1.tiny, m1.small, m1.pinned


@dataclass(frozen=True, slots=True)
class RunConfig:
    seed: int
    faults: frozenset[FaultKind] = DEFAULT_FAULTS
    db_url: str | None = None  # None: SQLite in a temporary directory; else a PostgreSQL URL
    hosts: int = 3
    requests: int = 12
    workload_s: float = 60.0
    settle_s: float = 1800.0


@dataclass(slots=True)
class RunResult:
    seed: int
    faults: frozenset[FaultKind]
    trace_hash: str
    violations: list[Violation]
    injected: list[Fault]
    requests: int
    virtual_s: float
    wall_s: float
    trace: list[str] = field(repr=False, default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        """What a failing run prints: its seed, its faults, what broke, how to replay it."""
        kinds = ",".join(sorted(k.value for k in self.faults)) or "none"
        lines = [
            f"seed {self.seed}: {'ok' if self.ok else 'FAILED'} (trace {self.trace_hash[:16]}, "
            f"{self.requests} requests, {len(self.injected)} faults, "
            f"{self.virtual_s:.0f} virtual s, {self.wall_s:.2f} s)",
            f"  faults enabled: {kinds}",
        ]
        lines += [f"  injected: {f}" for f in self.injected]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        if not self.ok:
            lines.append(f"  replay: stowage sim-test --seed {self.seed} --faults {kinds}")
        return "\n".join(lines)


# -- the database --------------------------------------------------------------------------


def _topology() -> HostTopology:
    return HostTopology.uniform(
        cells=2, cores_per_cell=2, threads_per_core=2, memory_mb_per_cell=4096
    )


def _config(state_dir: Path, hosts: int) -> CloudConfig:
    specs = [HostSpec(f"host{i + 1}", _topology(), disk_gb=200) for i in range(hosts)]
    return CloudConfig(
        state_dir=state_dir,
        hosts=hosts,
        topology=specs,
        service_down_time_s=SERVICE_DOWN_S,
        heartbeat_interval_s=5.0,
        op_timeout_s=5.0,
    )


# Every run opens several engines; one statement cache for all of them saves compiling the
# same statements again in each.
_STATEMENTS: Any = LRUCache(2000)


def _engine(url: str) -> Engine:
    engine = make_engine(url, pool_size=4)
    engine.update_execution_options(compiled_cache=_STATEMENTS)
    if url.startswith("sqlite"):
        # One thread: a writer waiting for another's lock would wait for ever. Fail at once.
        @event.listens_for(engine, "connect")
        def _no_wait(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA busy_timeout=0")
            cursor.close()

    return engine


def _open(url: str, config: CloudConfig, clock: VirtualClock) -> Cloud:
    return Cloud(config, Ledger(_engine(url), clock=clock), clock=clock)


@dataclass(frozen=True, slots=True)
class _Fixture:
    demo: str
    admin_user: str
    demo_user: str
    image_id: str
    network_id: str
    groups: tuple[str, ...]


def _populate(url: str, config: CloudConfig) -> _Fixture:
    """Schema, bootstrap, two strict groups and the demo project's quota; the same every time."""
    clock = VirtualClock()
    with deterministic(random.Random(0)):
        engine = _engine(url)
        try:
            migrate(engine)
            cloud = Cloud(config, Ledger(engine, clock=clock), clock=clock)
            bootstrap(cloud)
            demo = cloud.find_by_name("project", "demo").id
            groups = []
            for policy in ("anti-affinity", "affinity"):
                group = parse_group(str(uuid.uuid4()), policy, policy, project_id=demo)
                cloud.ledger.create_group(group)
                groups.append(group.id)
            cloud.objects.create(
                "quota",
                demo,
                {"instances": QUOTA_INSTANCES, "cores": 4 * QUOTA_INSTANCES, "ram": -1},
                project_id=demo,
            )
            fixture = _Fixture(
                demo=demo,
                admin_user=cloud.find_by_name("user", "admin").id,
                demo_user=cloud.find_by_name("user", "demo").id,
                image_id=next(d.id for d in cloud.objects.list("image")),
                network_id=cloud.find_by_name("network", "private").id,
                groups=tuple(groups),
            )
        finally:
            engine.dispose()
    return fixture


_TEMPLATES: dict[int, tuple[Path, _Fixture]] = {}


def _scratch() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="stowage-sim-", dir=shm if shm.is_dir() else None))


def _sqlite_state(hosts: int) -> tuple[Path, _Fixture]:
    """A copy of this process's bootstrapped template (made once: migrations are slow)."""
    if hosts not in _TEMPLATES:
        template = _scratch() / "state"
        template.mkdir()
        fixture = _populate(sqlite_url(template / "ledger.db"), _config(template, hosts))
        _TEMPLATES[hosts] = (template, fixture)
    template, fixture = _TEMPLATES[hosts]
    state = _scratch() / "state"
    shutil.copytree(template, state, dirs_exist_ok=True)
    return state, fixture


@contextlib.contextmanager
def _pg_schema(base_url: str, seed: int) -> Any:
    schema = f"sim_{seed}_{uuid.UUID(bytes=random.randbytes(16)).hex[:8]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in base_url else "?"
    try:
        yield f"{base_url}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


# -- processes -----------------------------------------------------------------------------


class _Commits:
    """Counts one process's commits and makes it die before the chosen ones."""

    def __init__(
        self, schedule: Schedule, kind: FaultKind, at: list[int], on_crash: Callable[[], None]
    ) -> None:
        self.schedule = schedule
        self.kind = kind
        self.at = set(at)
        self.n = 0
        self.armed = True
        self.dead = False
        self.on_crash = on_crash

    def attach(self, engine: Engine) -> None:
        self.dead = False
        event.listen(engine, "commit", self._commit)

    def _commit(self, _conn: Any) -> None:
        if self.dead:
            raise Crash(f"{self.kind.value}: the process is dead")
        if not self.armed:
            return
        self.n += 1
        if self.n in self.at:
            self.dead = True
            self.schedule.note(self.kind, f"dies before its commit #{self.n}")
            self.on_crash()
            raise Crash(f"{self.kind.value} before commit #{self.n}")


class _RequestLock:
    """A process-local lock (the scheduler's, IPAM's) as the API's requests share it: a
    request that finds it held yields until it is free. The main greenlet (the conductor and
    the agents) is another process and never waits for an API request's lock."""

    def __init__(self, requests: Mapping[greenlet.greenlet, Any]) -> None:
        self._requests = requests
        self._holder: greenlet.greenlet | None = None

    def __enter__(self) -> None:
        me = greenlet.getcurrent()
        if me not in self._requests:
            return
        while self._holder is not None and self._holder is not me and not self._holder.dead:
            assert me.parent is not None
            me.parent.switch()
        self._holder = me

    def __exit__(self, *exc: object) -> None:
        if self._holder is greenlet.getcurrent():
            self._holder = None


@dataclass(slots=True)
class _Request:
    number: int
    what: str
    call: Callable[[Cloud], str]
    target: str = ""
    glet: greenlet.greenlet | None = None
    conns: list[Any] = field(default_factory=list)
    outcome: str = ""


class _Api:
    """The API process: requests in greenlets that yield before each transaction."""

    def __init__(self, world: _World) -> None:
        self.world = world
        self.commits = _Commits(
            world.schedule, FaultKind.API_CRASH, world.schedule.api_crash_at, lambda: None
        )
        self.inflight: list[_Request] = []
        self._by_glet: dict[greenlet.greenlet, _Request] = {}
        self.cloud = self._start()
        self.crashes = 0
        self.ipam_lock = _RequestLock(self._by_glet)

    def _start(self) -> Cloud:
        w = self.world
        cloud = _open(w.url, w.config, w.clock)
        self.commits.attach(cloud.ledger.engine)
        # Before each connection (so before its transaction): the BEGIN of a write
        # transaction takes SQLite's lock, and a request must never yield holding it.
        event.listen(cloud.ledger.engine, "engine_connect", self._begin)
        cloud.kick = w.kick
        cloud.schedule_lock = _RequestLock(self._by_glet)  # type: ignore[assignment]
        return cloud

    def _begin(self, conn: Any) -> None:
        req = self._by_glet.get(greenlet.getcurrent())
        if req is None:
            return
        req.conns = [c for c in req.conns if not c.closed and c is not conn]
        if not any(c.in_transaction() for c in req.conns):
            parent = greenlet.getcurrent().parent
            assert parent is not None
            parent.switch()
        req.conns.append(conn)

    def submit(self, req: _Request) -> None:
        cloud = self.cloud

        def body() -> None:
            try:
                req.outcome = "ok " + req.call(cloud)
            except StowageError as exc:
                req.outcome = f"refused {type(exc).__name__}: {exc}"
            except Exception as exc:
                from stowage.api.common import ApiError

                if isinstance(exc, ApiError):
                    req.outcome = f"refused {exc.status}: {exc}"
                else:
                    req.outcome = f"error {type(exc).__name__}: {exc}"
                    self.world.errors.append(f"request #{req.number} {req.what}: {req.outcome}")

        req.glet = greenlet.greenlet(body)
        self._by_glet[req.glet] = req
        self.inflight.append(req)
        self.world.trace(f"request #{req.number} {req.what}")

    def step(self) -> None:
        """Run one request up to its next transaction (or its end)."""
        w = self.world
        req = w.rng.choice(self.inflight)
        assert req.glet is not None
        try:
            req.glet.switch()
        except Crash:
            self._crash(req)
            return
        if req.glet.dead:
            self._done(req)

    def _done(self, req: _Request) -> None:
        self.inflight.remove(req)
        if req.glet is not None:
            self._by_glet.pop(req.glet, None)
        self.world.trace(f"request #{req.number} {req.outcome[:160]}")

    def _crash(self, first: _Request) -> None:
        """The process died: every request in it dies, and a new process starts."""
        self.crashes += 1
        first.outcome = "died with the api process"
        self._done(first)
        for req in list(self.inflight):
            if req.glet is not None and req.glet:
                with contextlib.suppress(Crash):
                    req.glet.throw(Crash("the api process died"))
            req.outcome = "died with the api process"
            self._done(req)
        self.cloud.ledger.engine.dispose()
        self.cloud = self._start()
        self.world.trace("api restarted")

    def quiet(self) -> None:
        self.commits.armed = False


class _Conductor:
    def __init__(self, world: _World) -> None:
        self.world = world
        self.generation = 0
        self.commits = _Commits(
            world.schedule,
            FaultKind.CONDUCTOR_CRASH,
            world.schedule.conductor_crash_at,
            self._died,
        )
        self.conductor: Conductor | None = None
        self.cloud: Cloud | None = None
        self.task: asyncio.Task[None] | None = None
        self.restart: asyncio.TimerHandle | None = None

    def start(self) -> None:
        w = self.world
        self.generation += 1
        self.cloud = _open(w.url, w.config, w.clock)
        self.commits.attach(self.cloud.ledger.engine)
        config = ConductorConfig(
            call_timeout_s=5.0, poll_s=6.0, lease_s=30.0, retry_s=0.5, retry_max_s=8.0
        )
        self.conductor = Conductor(self.cloud, w.bus, config, owner=f"conductor-{self.generation}")
        # As in production: a new process never voids another's leases; they run out.
        self.task = asyncio.get_running_loop().create_task(
            self.conductor.run(take_over=False), name=f"conductor-{self.generation}"
        )
        w.trace(f"conductor-{self.generation} started")

    def kick(self) -> None:
        if self.conductor is not None:
            self.conductor.kick()

    def _died(self) -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(
            lambda: loop.create_task(self.kill(restart_in=self.world.rng.choice((1, 5, 20))))
        )

    async def kill(self, *, restart_in: float | None) -> None:
        task, cloud = self.task, self.cloud
        self.task = self.cloud = self.conductor = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if cloud is not None:
            cloud.ledger.engine.dispose()
        self.world.trace(f"conductor killed, restart in {restart_in}")
        if restart_in is not None:
            self.restart = asyncio.get_running_loop().call_later(restart_in, self._restart)

    def _restart(self) -> None:
        self.restart = None
        if self.task is None:
            self.start()

    async def ensure_running(self) -> None:
        self.commits.armed = False
        if self.restart is not None:
            self.restart.cancel()
            self.restart = None
        if self.task is None or self.task.done():
            if self.task is not None:
                await self.kill(restart_in=None)
            self.start()


class _Agent:
    """One host's agent process over its (persistent) simulated hypervisor."""

    def __init__(self, world: _World, host: str, driver: SimDriver) -> None:
        self.world = world
        self.host = host
        self.driver = driver
        self.server: AgentServer | None = None
        self.endpoint: Endpoint | None = None
        self.restart: asyncio.TimerHandle | None = None
        self.uploads: list[Any] = []
        self.reconciler: Reconciler | None = None
        self.reconciling: asyncio.Task[None] | None = None
        self.forgot = False  # the hypervisor view is new and empty: restore before serving
        self.restore_fails = 0  # how many guests the restore fails to bring back

    async def start(self) -> None:
        w = self.world
        cloud = w.agents_cloud
        host = self.host
        if self.forgot:
            # As `stowage agent --driver sim` does on start: what the ledger places here runs
            # again before the agent serves (agent/processes.py run_agent). The seed may make
            # some of it fail to come back: the reconciler then puts those servers into
            # Nova's state for a vanished guest.
            self.forgot = False
            if self.restore_fails:
                self.driver.inject("spawn", "create_disk", DriverFault.FAIL, self.restore_fails)
            restored = await asyncio.to_thread(restore_guests, cloud, host, self.driver)
            if self.restore_fails:
                self.driver.clear_faults()
            w.trace(f"agent {host} restored {sorted(restored)}")
        self.endpoint = w.bus.endpoint()

        def beat() -> None:
            cloud.ledger.heartbeat([host])

        self.server = AgentServer(
            host,
            self.driver,
            self.endpoint,
            beat,
            config=AgentConfig(
                heartbeat_interval_s=10.0,
                heartbeat_timeout_s=5.0,
                lag_interval_s=60.0,
                chunk_bytes=4096,
            ),
            image_sink=self._sink(cloud),
            crash_restart_s=2.0,
            clock=w.clock,
        )
        await self.server.serve()
        self.reconciler = make_reconciler(cloud, host, self.server, AgentMetrics.create())
        self.reconciling = asyncio.get_running_loop().create_task(
            self._reconcile_forever(self.server, self.reconciler), name=f"reconcile-{host}"
        )
        w.trace(f"agent {host} started")

    async def _reconcile_forever(self, server: AgentServer, reconciler: Reconciler) -> None:
        """The agent's periodic audit (production's `run_forever`), paused while the agent is
        stopped (a stopped service runs no periodic task)."""
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            if server.running:
                await self.reconcile(reconciler)

    async def reconcile(self, reconciler: Reconciler | None = None) -> None:
        reconciler = reconciler or self.reconciler
        if reconciler is None:
            return
        try:
            report = await reconciler.run_once()
        except Crash:
            return
        for d in report.divergences:
            self.world.trace(f"reconcile {self.host} {d.kind.value} {d.instance_id}")
        if report.error:
            self.world.trace(f"reconcile {self.host} error {report.error[:120]}")

    def _sink(self, cloud: Cloud) -> Any:
        base = make_upload_sink(cloud)

        async def sink(image_id: str, payload: dict[str, Any]) -> Any:
            upload = await base(image_id, payload)
            self.uploads.append(upload)
            return upload

        return sink

    def _close_files(self) -> None:
        """The files a dead process had open are closed by the OS, not by the process."""
        for upload in self.uploads:
            file = getattr(getattr(upload, "_upload", None), "_file", None)
            if file is not None:
                file.close()
        self.uploads.clear()

    def _forget(self, restore_fails: int = 0) -> None:
        """The simulated hypervisor lived in the dead process: a new one starts empty, on the
        same disk directory and with the same (slow) disk."""
        old = self.driver
        old.release_hangs()
        self.driver = SimDriver(
            SimConfig(
                disk_bytes=old.config.disk_bytes,
                seed=old.config.seed,
                slow_disk_s=old.config.slow_disk_s,
                step_latency_s=dict(old.config.step_latency_s),
            ),
            disk_dir=old.disk_dir,
            sleep=self.world.clock.sleep,
        )
        self.world.drivers[self.host] = self.driver
        self.forgot = True
        self.restore_fails = restore_fails

    async def crash(
        self, restart_in: float | None, *, forget: bool = False, restore_fails: int = 0
    ) -> None:
        server, endpoint = self.server, self.endpoint
        self.server = self.endpoint = None
        reconciling, self.reconciling, self.reconciler = self.reconciling, None, None
        if reconciling is not None:
            reconciling.cancel()
            with contextlib.suppress(BaseException):
                await reconciling
        if endpoint is not None:
            await endpoint.close()
        if server is not None:
            await server.agent.stop(grace_s=0.0)
        self._close_files()
        if forget:
            self._forget(restore_fails)
        if restart_in is not None:
            loop = asyncio.get_running_loop()
            self.restart = loop.call_later(restart_in, lambda: loop.create_task(self._back()))

    async def _back(self) -> None:
        self.restart = None
        if self.server is None:
            await self.start()

    async def ensure_running(self) -> None:
        if self.restart is not None:
            self.restart.cancel()
            self.restart = None
        if self.server is None:
            await self.start()
        assert self.server is not None
        self.server.start()


class _World:
    def __init__(self, cfg: RunConfig, url: str, state: Path, fixture: _Fixture) -> None:
        self.cfg = cfg
        self.url = url
        self.state = state
        self.fixture = fixture
        self.clock = VirtualClock()
        self.rng = random.Random(f"workload:{cfg.seed}")
        self.schedule = Schedule.draw(cfg.faults, random.Random(f"faults:{cfg.seed}"))
        self.events: list[str] = []
        self.errors: list[str] = []
        self.loop_errors: list[dict[str, Any]] = []
        self.config = _config(state, cfg.hosts)
        self.bus = FaultyBus(self.schedule, self.trace)
        self.agents_cloud = _open(url, self.config, self.clock)
        self.agents_cloud.kick = self.kick  # the reconciler's reaping hands the conductor work
        self.drivers = {
            spec.name: SimDriver(
                SimConfig(disk_bytes=8192, seed=cfg.seed),
                disk_dir=state / "sim" / spec.name,
                sleep=self.clock.sleep,
            )
            for spec in self.config.topology
        }
        self.conductor = _Conductor(self)
        self.api = _Api(self)
        self.agents = {h: _Agent(self, h, d) for h, d in self.drivers.items()}
        self.numbers = 0
        self.down: dict[str, float] = {}  # host -> when its agent stopped

    def trace(self, line: str) -> None:
        self.events.append(f"{self.clock.now - EPOCH:10.3f} {line}")

    def kick(self) -> None:
        self.conductor.kick()

    # -- the run ----------------------------------------------------------------------

    async def main(self) -> None:
        for agent in self.agents.values():
            await agent.start()
        self.conductor.start()
        chaos = asyncio.get_running_loop().create_task(self._chaos())
        await self._clients()
        with contextlib.suppress(asyncio.CancelledError):
            await chaos
        await self._settle()

    async def _clients(self) -> None:
        cfg = self.cfg
        arrivals = sorted(
            round(self.rng.uniform(0, cfg.workload_s), 3) for _ in range(cfg.requests)
        )
        while arrivals or self.api.inflight:
            # A timer within the loop's resolution (1 us) of now may fire a little early.
            now = self.clock.now - EPOCH + 1e-5
            while arrivals and arrivals[0] <= now:
                arrivals.pop(0)
                for req in self._next_requests():
                    self.api.submit(req)
            if self.api.inflight:
                self.api.step()
                await asyncio.sleep(self.rng.choice((0.0, 0.0, 0.0, 0.01, 0.1, 0.5)))
            elif arrivals:
                await asyncio.sleep(max(arrivals[0] - now, 1e-3))

    async def _chaos(self) -> None:
        s, rng, cfg = self.schedule, self.schedule.rng, self.cfg
        events: list[tuple[float, FaultKind]] = []
        for kind, count in (
            (FaultKind.AGENT_CRASH, rng.choice((0, 1, 2))),
            (FaultKind.HOST_DOWN, rng.choice((0, 1))),
            (FaultKind.DRIVER_FAULT, rng.choice((0, 1, 3))),
            (FaultKind.SLOW_DISK, rng.choice((0, 1))),
            # Drawn only when enabled, so that other fault sets keep their schedules.
            (
                FaultKind.AGENT_FORGETS,
                rng.choice((0, 1, 1)) if s.on(FaultKind.AGENT_FORGETS) else 0,
            ),
        ):
            # With evacuations on, a host goes down early enough for clients to evacuate it
            # (past service_down_time) while the workload still runs.
            early = kind is FaultKind.HOST_DOWN and s.on(FaultKind.EVACUATE)
            span = cfg.workload_s / 4 if early else cfg.workload_s
            if s.on(kind):
                events += [(rng.uniform(0, span), kind) for _ in range(count)]
        for at, kind in sorted(events):
            await asyncio.sleep(max(0.0, at - (self.clock.now - EPOCH)))
            host = rng.choice(sorted(self.agents))
            agent, driver = self.agents[host], self.drivers[host]
            if kind is FaultKind.AGENT_CRASH and agent.server is not None:
                back = rng.choice((1.0, 5.0, 15.0))
                s.note(kind, f"agent {host} dies at {at:.1f} s, back {back} s later")
                await agent.crash(back)
            elif kind is FaultKind.AGENT_FORGETS and agent.server is not None:
                back = rng.choice((1.0, 5.0, 15.0))
                fails = rng.choice((0, 0, 1, 2))
                s.note(
                    kind,
                    f"agent {host} restarts at {at:.1f} s with no guests, back {back} s later, "
                    f"{fails} of them failing to come back",
                )
                await agent.crash(back, forget=True, restore_fails=fails)
            elif kind is FaultKind.HOST_DOWN and agent.server is not None and not self.down:
                span = rng.choice((60.0, 120.0))
                s.note(kind, f"agent {host} stops at {at:.1f} s for {span} s")
                agent.server.stop()
                self.down[host] = self.clock.now
                asyncio.get_running_loop().call_later(span, self._host_back, host)
            elif kind is FaultKind.DRIVER_FAULT:
                operation = rng.choice(sorted(STEPS))
                step = rng.choice(STEPS[operation])
                action = rng.choice((DriverFault.FAIL, DriverFault.CRASH))
                s.note(kind, f"{host} {operation}.{step} {action.value} at {at:.1f} s")
                driver.inject(operation, step, action, rng.choice((1, 2)))
            elif kind is FaultKind.SLOW_DISK:
                slow = rng.choice((1.0, 4.0, 12.0))
                s.note(kind, f"{host} disk {slow} s per step at {at:.1f} s")
                driver.config.slow_disk_s = slow
                driver.config.step_latency_s = {"create_disk": slow, "delete_disk": slow / 2}
            self.trace(f"chaos {kind.value} {host}")

    def _host_back(self, host: str) -> None:
        self.down.pop(host, None)
        server = self.agents[host].server
        if server is not None:
            server.start()
        self.trace(f"agent {host} back")

    async def _settle(self) -> None:
        """Faults stop, everything runs; the conductor and the settling client finish all."""
        self.trace("settle")
        self.bus.faults = False
        self.api.quiet()
        self.down.clear()
        for driver in self.drivers.values():
            driver.clear_faults()
            driver.config.slow_disk_s = 0.0
            driver.config.step_latency_s = {}
        for agent in self.agents.values():
            await agent.ensure_running()
        await self.conductor.ensure_running()
        deadline = self.clock.now + self.cfg.settle_s
        await self._quiesce(deadline)
        # Then each agent's reconciler has its periodic pass, on a quiet system: what it finds
        # (a guest the ledger does not place, a guest that vanished) it settles, and the
        # conductor drives the clean-ups it asks for to their end.
        for host in sorted(self.agents):
            await self.agents[host].reconcile()
        await self._quiesce(deadline)
        self.trace("settled")

    async def _quiesce(self, deadline: float) -> None:
        cloud = self.api.cloud
        while self.clock.now < deadline:
            await asyncio.sleep(5.0)
            waiting = [
                d.id
                for d in cloud.objects.list("instance")
                if d.body.get("status") == "VERIFY_RESIZE"
            ]
            for instance_id in waiting:
                with contextlib.suppress(StowageError):
                    adapter.confirm_resize(cloud, instance_id)
            self.kick()
            if not waiting and not cloud.operations.active():
                break

    # -- the workload -----------------------------------------------------------------

    def _request(self, what: str, call: Callable[[Cloud], Any]) -> _Request:
        self.numbers += 1

        def run(cloud: Cloud) -> str:
            result = call(cloud)
            return "" if result is None else str(result)

        return _Request(self.numbers, what, run)

    def _next_requests(self) -> list[_Request]:
        """The next client request (or burst of them), drawn from the state as it is."""
        s, rng = self.schedule, self.rng
        docs = self.api.cloud.objects.list("instance")
        if not s.on(FaultKind.DELETE_MOVING):
            deleting = {r.target for r in self.api.inflight if r.what.startswith("delete")}
            docs = [d for d in docs if d.id not in deleting]
        roll = rng.random()
        if s.on(FaultKind.QUOTA_RACE) and roll < 0.12:
            return [self._create(rng.choice((1, 1, 4))) for _ in range(rng.randint(3, 6))]
        if s.on(FaultKind.CONCURRENT) and docs and roll < 0.3:
            target = rng.choice(docs)
            return [self._action(target, conflicting=True) for _ in range(rng.randint(2, 3))]
        if not docs or roll < 0.45:
            return [self._create(1)]
        if s.on(FaultKind.EVACUATE) and self.down and rng.random() < 0.5:
            host = sorted(self.down)[0]
            if self.clock.now - self.down[host] > SERVICE_DOWN_S + 5:
                return [self._evacuate(host)]
        return [self._action(rng.choice(docs), conflicting=False)]

    def _create(self, max_count: int) -> _Request:
        f, rng = self.fixture, self.rng
        flavor = self.api.cloud.objects.get("flavor", rng.choice(FLAVORS)).body
        group = rng.choice((None, None, None, f.groups[0], f.groups[1]))
        nets: Any = [{"uuid": f.network_id}] if rng.random() < 0.3 else "none"
        name = f"vm{self.numbers + 1}"
        request_id = f"req-{self.numbers + 1}"

        def call(cloud: Cloud) -> list[str]:
            return adapter.create(
                cloud,
                name=name,
                flavor=flavor,
                image_id=f.image_id,
                project_id=f.demo,
                user_id=f.demo_user,
                min_count=1,
                max_count=max_count,
                group_id=group,
                networks=nets,
                request_id=request_id,
            )

        return self._request(
            f"create {name} flavor {flavor['name']} x{max_count} group {group} nets {nets}", call
        )

    def _evacuate(self, host: str) -> _Request:
        f = self.fixture
        return self._request(
            f"evacuate {host}",
            lambda cloud: adapter.evacuate(cloud, host, user_id=f.admin_user, project_id=f.demo),
        )

    def _action(self, doc: Any, *, conflicting: bool) -> _Request:
        req = self._action_on(doc, conflicting=conflicting)
        req.target = doc.id
        return req

    def _action_on(self, doc: Any, *, conflicting: bool) -> _Request:
        f, rng = self.fixture, self.rng
        iid = doc.id
        status = doc.body.get("status")
        # BUILD too: the create may still be in flight (its ports not yet allocated).
        moving = status in ("BUILD", "MIGRATING", "RESIZE", "VERIFY_RESIZE", "REBUILD")
        choices = [
            "stop",
            "start",
            "reboot",
            "rebuild",
            "snapshot",
            "live-migration",
            "migration",
            "resize",
            "confirm",
            "revert",
            "abort",
        ]
        busy = {r.target for r in self.api.inflight} | {
            op.instance_id for op in self.api.cloud.operations.active()
        }
        if self.schedule.on(FaultKind.DELETE_MOVING) or not (moving or conflicting or iid in busy):
            choices += ["delete", "delete"]
        if self.schedule.on(FaultKind.EVACUATE):
            # A paused server cannot be evacuated: an evacuation must report it and go on.
            choices += ["pause", "pause", "unpause"]
        kind = rng.choice(choices)
        request_id = f"req-{self.numbers + 1}"
        what = f"{kind} {iid[-8:]} ({status})"
        if kind == "delete":
            return self._request(what, lambda cloud: adapter.delete(cloud, iid))
        if kind in ("stop", "start", "reboot", "pause", "unpause"):
            action = {"stop": "os-stop", "start": "os-start"}.get(kind, kind)
            return self._request(what, lambda cloud: adapter.power(cloud, iid, action, request_id))
        if kind == "rebuild":
            return self._request(what, lambda cloud: adapter.rebuild(cloud, iid, f.image_id))
        if kind == "snapshot":
            return self._request(
                what,
                lambda cloud: adapter.snapshot(cloud, iid, f.demo, f"snap-{iid[-8:]}", request_id),
            )
        if kind in ("live-migration", "migration", "resize"):
            new_flavor = None
            if kind == "resize":
                current = str((doc.body.get("flavor") or {}).get("id"))
                other = rng.choice([x for x in FLAVORS if x != current])
                new_flavor = self.api.cloud.objects.get("flavor", other).body
                what += f" to {new_flavor['name']}"
            migration_type = kind
            return self._request(
                what,
                lambda cloud: adapter.move(
                    cloud,
                    iid,
                    migration_type,
                    user_id=f.demo_user,
                    project_id=f.demo,
                    new_flavor=new_flavor,
                    request_id=request_id,
                ),
            )
        if kind == "confirm":
            return self._request(what, lambda cloud: adapter.confirm_resize(cloud, iid))
        if kind == "revert":
            return self._request(what, lambda cloud: adapter.revert_resize(cloud, iid))
        migration = next(
            (
                m.id
                for m in self.api.cloud.objects.list("migration")
                if m.body.get("instance_uuid") == iid
                and m.body.get("migration_type") == "live-migration"
            ),
            "none",
        )
        return self._request(
            what + f" migration {migration[:8]}",
            lambda cloud: adapter.abort_live_migration(cloud, iid, migration),
        )

    # -- the end ------------------------------------------------------------------------

    def summary(self) -> None:
        """The settled state, in the trace, so that the hash covers where things ended."""
        cloud = self.api.cloud
        for doc in cloud.objects.list("instance"):
            b = doc.body
            self.trace(f"end {doc.id} {b.get('status')} {b.get('task_state')} {b.get('host')}")
        for doc in cloud.objects.list("migration"):
            self.trace(f"end migration {doc.id} {doc.body.get('status')}")
        for host, driver in sorted(self.drivers.items()):
            self.trace(f"end {host} runs {sorted(driver.running())}")

    def subject(self) -> Subject:
        f = self.fixture
        return Subject(
            _open(self.url, self.config, self.clock),
            self.drivers,
            quotas={f.demo: {"instances": QUOTA_INSTANCES, "cores": 4 * QUOTA_INSTANCES}},
            errors=list(self.errors),
        )

    async def close(self) -> None:
        await self.conductor.kill(restart_in=None)
        for agent in self.agents.values():
            await agent.crash(None)
        await self.bus.close()
        current = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not current]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        self.api.cloud.ledger.engine.dispose()
        self.agents_cloud.ledger.engine.dispose()
        for driver in self.drivers.values():
            driver.close()


_WARM = ("stowage.services", "stowage.agent", "stowage.ledger", "stowage.bus", "stowage.virt")
_warmed: list[str] = []


def _warm() -> None:
    """Import now what the run would import lazily: some imports draw a uuid4 (OpenTelemetry's
    context keys), and a first run would then draw differently from its replays."""
    if _warmed:
        return
    import importlib
    import pkgutil

    for name in _WARM:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if ".migrations." in info.name or info.name.endswith("libvirt_driver"):
                continue
            importlib.import_module(info.name)
            _warmed.append(info.name)
    importlib.import_module("stowage.api.compute.servers")


class _ConductorErrors(logging.Handler):
    """An operation the conductor fails on with an unexpected exception is a finding."""

    def __init__(self, world: _World) -> None:
        super().__init__(logging.ERROR)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, Crash):
            return  # the conductor was killed in the middle of it
        what = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        self.world.errors.append(f"conductor: {record.getMessage()} {what}".strip())
        self.world.trace(f"conductor error: {record.getMessage()} {what}")


@contextlib.contextmanager
def _errors_logged(world: _World) -> Any:
    handler = _ConductorErrors(world)
    logger = logging.getLogger("stowage.services.conductor")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Any:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _sabotage(cloud: Cloud, world: _World) -> None:
    """The checkers' own test: a migration record written behind every use case's back,
    resting in a status that holds the destination with no operation to end it."""
    cloud.objects.create(
        "migration", "sabotaged", {"instance_uuid": "none", "status": "pre-migrating"}
    )
    world.trace("sabotage: a migration with no operation")


_COLLECT_EVERY = 16
"""Runs between full garbage collections: one took 0.1-0.3 s (the live heap, not the run's
garbage, is most of it), a quarter of a seed's time when made after every run."""

_runs = itertools.count(1)


def run(cfg: RunConfig) -> RunResult:
    """One run from its seed; the same seed and faults give the same trace, every time."""
    # What a run's dead processes leave open (a snapshot upload cut off by an agent crash
    # keeps its file open) is closed by the garbage collector, in this run or a later one:
    # its ResourceWarning is expected, not a finding.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return _run(cfg)
        finally:
            if next(_runs) % _COLLECT_EVERY == 0:
                gc.collect()


def _run(cfg: RunConfig) -> RunResult:
    started = time.perf_counter()
    _warm()
    scratch: list[Path] = []
    with contextlib.ExitStack() as stack:
        if cfg.db_url is None:
            state, fixture = _sqlite_state(cfg.hosts)
            scratch.append(state.parent)
            url = sqlite_url(state / "ledger.db")
        else:
            state = _scratch() / "state"
            state.mkdir()
            scratch.append(state.parent)
            url = stack.enter_context(_pg_schema(cfg.db_url, cfg.seed))
            fixture = _populate(url, _config(state, cfg.hosts))
        stack.enter_context(deterministic(random.Random(f"uuid:{cfg.seed}")))
        world = _World(cfg, url, state, fixture)
        stack.enter_context(_patched(addresses, "_ipam_lock", world.api.ipam_lock))
        stack.enter_context(_errors_logged(world))
        loop = VirtualLoop(world.clock)
        # Not in the trace: "never retrieved" reports come when the garbage collector runs.
        loop.set_exception_handler(lambda _loop, context: world.loop_errors.append(context))
        violations: list[Violation]
        try:

            async def main() -> list[Violation]:
                try:
                    await world.main()
                    world.summary()
                    subject = world.subject()
                    if FaultKind.SABOTAGE in cfg.faults:
                        _sabotage(subject.cloud, world)
                    try:
                        return check_all(subject)
                    finally:
                        subject.cloud.ledger.engine.dispose()
                finally:
                    await world.close()

            violations = loop.run_until_complete(main())
        finally:
            loop.close()
            for path in scratch:
                shutil.rmtree(path, ignore_errors=True)
    digest = hashlib.sha256("\n".join(world.events).encode()).hexdigest()
    return RunResult(
        seed=cfg.seed,
        faults=cfg.faults,
        trace_hash=digest,
        violations=violations,
        injected=list(world.schedule.injected),
        requests=world.numbers,
        virtual_s=world.clock.now - EPOCH,
        wall_s=time.perf_counter() - started,
        trace=world.events,
    )

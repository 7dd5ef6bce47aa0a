"""The composition root: which parts each process runs, wired together in this one place.

- `all_in_one(cloud)`: `stowage up`. Every API on one port and, beside them in the same process,
  one simulated (or libvirt) agent per host, the conductor and the reconciler, on an
  in-process bus (`agent.local.LocalCompute`).
- `all_in_one(cloud, compute=...)`: `stowage up --compute-process`. The same cloud, with its
  compute side in a second process on the same ledger (`agent.compute_process`), so the APIs
  and the conductor each have a core; a watchdog here starts that process again if it dies.
- `production_app()`: `stowage api`'s app in each uvicorn worker. The APIs alone over the shared
  ledger; conductors and agents are processes of their own, reached over RabbitMQ.

The API package builds the apps and knows nothing of agents or transports: what runs beside
it is handed to `create_app` as a runtime, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp

from stowage.api.app import create_app
from stowage.api.limits import DEFAULT_MAX_BODY
from stowage.services.cloud import Cloud, CloudConfig

__all__ = ["all_in_one", "compute_process", "local_compute", "production_app", "rabbit_bus"]

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def local_compute(cloud: Cloud) -> AsyncIterator[Any]:
    """Agents, conductor and reconciler in this process, on an in-process bus; yields the
    agents' metrics for the API's /metrics."""
    from stowage.agent.local import LocalCompute

    local = LocalCompute(cloud)
    cloud.bus = await asyncio.to_thread(local.start_thread)
    try:
        yield local.metrics
    finally:
        await asyncio.to_thread(local.stop_thread)
        cloud.bus = None


WATCH_S = 1.0
"""How often the API's watchdog looks whether the compute process is alive."""


def compute_process(*, log_format: str, log_level: str) -> Any:
    """The runtime of `stowage up --compute-process`: the compute side in a child process."""

    @contextlib.asynccontextmanager
    async def run(cloud: Cloud) -> AsyncIterator[Any]:
        from stowage.agent.compute_process import ComputeProcess

        url = cloud.ledger.engine.url.render_as_string(hide_password=False)
        child = ComputeProcess(cloud.config, url, log_format=log_format, log_level=log_level)
        try:
            await asyncio.to_thread(child.start)
            cloud.bus, cloud.kick = child, child.kick
            watchdog = asyncio.create_task(_watch(child), name="compute-process-watchdog")
            try:
                yield child
            finally:
                watchdog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
                cloud.bus, cloud.kick = None, lambda: None
        finally:
            await asyncio.to_thread(child.close)

    return run


async def _watch(child: Any) -> None:
    """Start the compute process again whenever it has died (killed, crashed): until it is
    back, creates and moves wait in the ledger, and its conductor takes them over."""
    while True:
        await asyncio.sleep(WATCH_S)
        if child.alive():
            continue
        log.error(
            "the compute process (pid %s) exited with code %s: starting it again",
            child.pid,
            child.exitcode,
        )
        try:
            await asyncio.to_thread(child.stop)
            await asyncio.to_thread(child.start)
        except Exception:
            log.exception("the compute process did not start again; trying again")
        else:
            log.info("the compute process is back (pid %s)", child.pid)


def rabbit_bus(url: str) -> Any:
    """The runtime of a production API worker: a RabbitMQ connection to the agents."""

    @contextlib.asynccontextmanager
    async def run(cloud: Cloud) -> AsyncIterator[None]:
        from stowage.bus.base import LoopBridge
        from stowage.bus.rabbit import RabbitTransport

        rabbit = await RabbitTransport.connect(url)
        # Handlers run off this loop (`run_off_loop`): their calls cross back into it.
        cloud.bus = LoopBridge(asyncio.get_running_loop(), rabbit)
        try:
            yield None
        finally:
            await rabbit.close()
            cloud.bus = None

    return run


def all_in_one(cloud: Cloud, *, compute: Any = None) -> ASGIApp:
    """`stowage up`: every API, and the whole compute side beside it: in this process, or
    run by `compute` (`compute_process(...)`: in a process of its own)."""
    return create_app(cloud, runtime=compute or local_compute)


def production_app() -> ASGIApp:
    """`stowage api`'s app in each worker process: the shared ledger, no local compute."""
    from stowage.services.runtime import freeze_started_process, open_cloud
    from stowage.telemetry import configure_logging

    configure_logging(
        os.environ.get("STOWAGE_LOG_FORMAT", "kv"),
        os.environ.get("STOWAGE_LOG_LEVEL", "info"),
        process=f"api:{os.getpid()}",
    )
    address, port = os.environ["STOWAGE_API_BASE"].rsplit(":", 1)
    config = CloudConfig(
        state_dir=Path(os.environ["STOWAGE_API_STATE_DIR"]),
        hosts=0,
        host=address,
        port=int(port),
        api_wait_s=float(os.environ.get("STOWAGE_API_WAIT", "0")),
        max_instances_per_request=int(os.environ.get("STOWAGE_API_MAX_PER_REQUEST", "1000")),
        quota_driver=os.environ.get("STOWAGE_API_QUOTA_DRIVER", "legacy"),
        lockout_failure_attempts=int(os.environ.get("STOWAGE_API_LOCKOUT_ATTEMPTS", "0")),
        lockout_duration_s=float(os.environ.get("STOWAGE_API_LOCKOUT_DURATION", "1800")),
        max_request_body_size=int(os.environ.get("STOWAGE_API_MAX_BODY", DEFAULT_MAX_BODY)),
        console_token_ttl_s=float(os.environ.get("STOWAGE_API_CONSOLE_TOKEN_TTL", "600")),
        shelved_offload_time_s=float(os.environ.get("STOWAGE_API_SHELVED_OFFLOAD_TIME", "0")),
        volume_dir=Path(os.environ["STOWAGE_API_VOLUME_DIR"]),
        volume_pool_gb=int(os.environ.get("STOWAGE_API_VOLUME_GB", "1000")),
    )
    cloud = open_cloud(config, db_url=os.environ["STOWAGE_API_DB"])
    bus_url = os.environ.get("STOWAGE_API_BUS")
    app = create_app(cloud, runtime=rabbit_bus(bus_url) if bus_url else None)
    freeze_started_process(f"api worker {os.getpid()}")
    return app

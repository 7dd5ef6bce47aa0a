"""An agent whose serial console proxy cannot listen keeps serving its host (found by CI: a
production agent told a `--host-ip` this machine does not have died at start)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stowage.agent.server import AgentServer, ConsoleSettings
from stowage.bus.base import compute_topic
from stowage.bus.inproc import InProcTransport
from stowage.virt.sim import SimConfig, SimDriver

UNBINDABLE = "198.51.100.7"  # TEST-NET-2: no interface of this machine has it


def test_an_agent_whose_console_cannot_listen_serves_without_consoles(tmp_path: Path) -> None:
    async def scenario() -> None:
        bus = InProcTransport()
        driver = SimDriver(SimConfig(disk_bytes=4096), disk_dir=tmp_path / "h")
        server = AgentServer(
            "h", driver, bus, lambda: None, console=ConsoleSettings(listen=UNBINDABLE)
        )
        await server.serve()  # raised OSError (errno 99) before
        try:
            assert server.console is None
            reply = await bus.call(
                compute_topic("h"),
                "serial_console",
                {"instance_id": "vm-1", "ticket": True},
                op_id="op-console",
                timeout_s=10,
            )
            assert reply["ok"] is False
            assert reply["code"] == "agent.console.unavailable"
        finally:
            await server.close()
            await bus.close()

    asyncio.run(scenario())

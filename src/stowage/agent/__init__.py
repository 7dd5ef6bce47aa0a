"""The compute agent: one per hypervisor host, on asyncio, never blocking its loop."""

from __future__ import annotations

from stowage.agent.runtime import Agent, AgentConfig, LagWatchdog, OpResult, percentile

__all__ = ["Agent", "AgentConfig", "LagWatchdog", "OpResult", "percentile"]

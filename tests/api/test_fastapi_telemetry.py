"""FastAPI's own OpenTelemetry instrumentation (FastAPI 0.142 and later, on by default) in
Stowage's APIs: off where no tracer provider is configured, on where one is."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from stowage.api.common import api_app


def _served(calls: int) -> None:
    app = api_app()

    @app.get("/thing")
    def thing() -> dict[str, str]:
        return {"ok": "yes"}

    async def requests() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            for _ in range(calls):
                assert (await client.get("/thing")).json() == {"ok": "yes"}

    asyncio.run(requests())


def test_with_no_tracer_provider_a_request_asks_opentelemetry_for_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left on with no provider, FastAPI asked OpenTelemetry for its providers on every
    request, each ask a read of the environment, to do nothing (docs/performance.md,
    2026-12-07). Asked once now, as the app is built."""
    asked: list[str] = []
    real = trace.get_tracer_provider

    def counted() -> Any:
        asked.append("tracer")
        return real()

    monkeypatch.setattr(trace, "get_tracer_provider", counted)
    _served(5)
    assert asked == ["tracer"], asked


def test_with_a_tracer_provider_requests_are_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator who runs the API under an OpenTelemetry provider (`opentelemetry-instrument`)
    still gets FastAPI's spans of each request."""

    spans: list[str] = []

    class Recording(trace.NoOpTracer):
        def start_span(self, name: str, *args: Any, **kwargs: Any) -> trace.Span:
            spans.append(name)
            return super().start_span(name, *args, **kwargs)

        def start_as_current_span(self, name: str, *args: Any, **kwargs: Any) -> Any:
            spans.append(name)
            return super().start_as_current_span(name, *args, **kwargs)

    class Provider(trace.TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
            return Recording()

    provider = Provider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    _served(3)
    assert len(spans) >= 3, spans

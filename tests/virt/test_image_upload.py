"""A snapshot streamed to the image API over HTTP (`HttpImageUpload`), against a real local
HTTP server: the data arrives whole, in order, as one PUT; a refusal is an error, never a hang,
however much data is still to come."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stowage.virt.driver import DriverError
from stowage.virt.images import HttpImageUpload


class _Server:
    def __init__(self, status: int) -> None:
        self.received: list[tuple[str, str, bytes]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_PUT(self) -> None:
                if status != 204:  # refuse at once, without reading the body
                    self.send_response(status)
                    self.send_header("Content-Length", "7")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(b"refused")
                    return
                body = b""
                while True:  # chunked transfer: size line, data, CRLF; 0 ends
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
                outer.received.append((self.path, self.headers["X-Auth-Token"], body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/image"


@pytest.fixture
def accepting() -> Iterator[_Server]:
    server = _Server(204)
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
def refusing() -> Iterator[_Server]:
    server = _Server(403)
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def test_the_data_arrives_whole_as_one_put(accepting: _Server) -> None:
    chunks = [bytes([i]) * 65536 for i in range(20)]

    async def send() -> None:
        upload = HttpImageUpload(accepting.endpoint, "img-1", lambda: "tok")
        for chunk in chunks:
            await upload.write(chunk)
        await upload.commit()

    asyncio.run(send())
    assert accepting.received == [("/image/v2/images/img-1/file", "tok", b"".join(chunks))]


def test_a_refusal_is_an_error_not_a_hang(refusing: _Server) -> None:
    async def send() -> None:
        upload = HttpImageUpload(refusing.endpoint, "img-2", lambda: "tok")
        async with asyncio.timeout(60):  # a hang fails here instead of stalling the suite
            for _ in range(200):  # far more than the queue and the socket take
                await upload.write(b"x" * 65536)
            await upload.commit()

    with pytest.raises(DriverError) as caught:
        asyncio.run(send())
    assert caught.value.code == "virt.image.upload_failed"
    assert "img-2" in str(caught.value)

"""A per-host image cache: bases fetched from the image API over HTTP, checksummed, kept by id.

Every method blocks (HTTP, disk, `qemu-img`): the driver calls them from the agent's executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from stowage.domain.keystone import password_login
from stowage.virt.driver import DriverError, ImageSpec

__all__ = [
    "HttpImageFetcher",
    "HttpImageUpload",
    "ImageCache",
    "ImageFetcher",
    "PasswordToken",
    "qemu_img",
    "virtual_size",
]

CHUNK_BYTES = 1024 * 1024

# (image, chunks written so far) -> the image's data, chunk by chunk.
ImageFetcher = Callable[[ImageSpec], Iterator[bytes]]


class HttpImageFetcher:
    """`GET {endpoint}/v2/images/{id}/file`, streamed, with a token from `token()`."""

    def __init__(self, endpoint: str, token: Callable[[], str], *, timeout_s: float = 60.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s

    def __call__(self, image: ImageSpec) -> Iterator[bytes]:
        url = f"{self.endpoint}/v2/images/{image.id}/file"
        with (
            httpx.Client(timeout=self._timeout_s) as client,
            client.stream("GET", url, headers={"X-Auth-Token": self._token()}) as response,
        ):
            if response.status_code != 200:
                response.read()
                raise DriverError(
                    f"image {image.id}: GET {url} answered {response.status_code}: "
                    f"{response.text[:200]}",
                    code="virt.image.fetch_failed",
                )
            yield from response.iter_bytes(CHUNK_BYTES)


class PasswordToken:
    """A project-scoped token from the identity API by password, as Nova's service user gets
    one: an agent on a host of its own shares no signing key with the API. Renewed a minute
    before it expires; thread-safe."""

    def __init__(
        self,
        auth_url: str,
        username: str,
        password: str,
        project: str,
        *,
        domain: str = "Default",
        timeout_s: float = 30.0,
    ) -> None:
        self.auth_url = auth_url.rstrip("/")
        self._body = password_login(username, password, project, domain)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires_at = 0.0

    def __call__(self) -> str:
        with self._lock:
            if self._token is not None and time.time() < self._expires_at - 60.0:
                return self._token
            url = f"{self.auth_url}/v3/auth/tokens"
            try:
                response = httpx.post(url, json=self._body, timeout=self._timeout_s)
            except httpx.HTTPError as exc:
                raise DriverError(f"POST {url}: {exc}", code="virt.image.auth_failed") from None
            if response.status_code != 201:
                raise DriverError(
                    f"POST {url} answered {response.status_code}: {response.text[:200]}",
                    code="virt.image.auth_failed",
                )
            self._token = response.headers["x-subject-token"]
            expires = str(response.json()["token"]["expires_at"])
            self._expires_at = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
            return self._token


class HttpImageUpload:
    """One snapshot's data streamed to `PUT {endpoint}/v2/images/{id}/file` as it is read:
    the image API keeps it, wherever that runs (no directory shared with the agent)."""

    def __init__(
        self, endpoint: str, image_id: str, token: Callable[[], str], *, timeout_s: float = 600.0
    ) -> None:
        self.url = f"{endpoint.rstrip('/')}/v2/images/{image_id}/file"
        self._token = token
        self._timeout_s = timeout_s
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        self._task: asyncio.Task[httpx.Response] | None = None

    async def write(self, chunk: bytes) -> None:
        await self._send(chunk)

    async def commit(self) -> None:
        await self._send(None)
        await self._finish()

    async def _send(self, item: bytes | None) -> None:
        """Hand `item` to the request (the end of the data: None), unless it ended first."""
        if self._task is None:
            self._task = asyncio.create_task(self._put())
        put = asyncio.create_task(self._chunks.put(item))
        await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():  # the request ended before taking the data: its error says why
            put.cancel()
            await self._finish()
            raise DriverError(f"PUT {self.url} ended early", code="virt.image.upload_failed")

    async def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _finish(self) -> None:
        assert self._task is not None
        try:
            response = await self._task
        except httpx.HTTPError as exc:
            raise DriverError(
                f"PUT {self.url}: {type(exc).__name__} {exc}", code="virt.image.upload_failed"
            ) from None
        if response.status_code != 204:
            raise DriverError(
                f"PUT {self.url} answered {response.status_code}: {response.text[:200]}",
                code="virt.image.upload_failed",
            )

    async def _put(self) -> httpx.Response:
        token = await asyncio.to_thread(self._token)
        headers = {"X-Auth-Token": token, "Content-Type": "application/octet-stream"}
        async with httpx.AsyncClient(timeout=self._timeout_s) as client:
            return await client.put(self.url, content=self._body(), headers=headers)

    async def _body(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk


class ImageCache:
    """Images by id in `directory`, each fetched once and checked against its checksums."""

    def __init__(self, directory: Path, fetch: ImageFetcher | None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fetch = fetch
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def path(self, image: ImageSpec) -> Path:
        """The cached base of `image`, fetched (once, whatever the concurrency) if missing."""
        if not image.id or "/" in image.id or image.id.startswith("."):
            raise DriverError(f"bad image id {image.id!r}", code="virt.image.bad_id")
        target = self.directory / image.id
        with self._lock:
            lock = self._locks.setdefault(image.id, threading.Lock())
        with lock:
            if target.exists():
                return target
            if self._fetch is None:
                raise DriverError(
                    f"image {image.id} is not cached and this host has no image API",
                    code="virt.image.no_source",
                )
            part = target.with_name(target.name + ".part")
            md5 = hashlib.md5(usedforsecurity=False)
            other = _hasher(image)
            size = 0
            try:
                with part.open("wb") as f:
                    for chunk in self._fetch(image):
                        f.write(chunk)
                        md5.update(chunk)
                        if other is not None:
                            other.update(chunk)
                        size += len(chunk)
                _verify(image, size, md5.hexdigest(), other)
                _check_format(part, image.disk_format)
                part.replace(target)
            except httpx.HTTPError as exc:
                raise DriverError(
                    f"image {image.id}: {exc}", code="virt.image.fetch_failed"
                ) from None
            finally:
                part.unlink(missing_ok=True)
            (self.directory / f"{image.id}.json").write_text(
                json.dumps({"disk_format": image.disk_format, "size": size})
            )
            return target

    def evict(self, image_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / image_id).unlink()
        (self.directory / f"{image_id}.json").unlink(missing_ok=True)


def _hasher(image: ImageSpec) -> Any:
    if image.hash_algo and image.hash_value:
        try:
            return hashlib.new(image.hash_algo)
        except ValueError:
            return None
    return None


def _verify(image: ImageSpec, size: int, md5: str, other: Any) -> None:
    if image.size and size != image.size:
        raise DriverError(
            f"image {image.id}: got {size} bytes, the image API says {image.size}",
            code="virt.image.size_mismatch",
        )
    if image.checksum and md5 != image.checksum:
        raise DriverError(
            f"image {image.id}: md5 {md5} != checksum {image.checksum}",
            code="virt.image.checksum_mismatch",
        )
    if other is not None and other.hexdigest() != image.hash_value:
        raise DriverError(
            f"image {image.id}: {image.hash_algo} does not match os_hash_value",
            code="virt.image.checksum_mismatch",
        )


def _check_format(path: Path, disk_format: str) -> None:
    """The data must be what the image claims to be (a qcow2 labelled raw would be a hole)."""
    if disk_format not in ("raw", "qcow2"):
        raise DriverError(
            f"disk_format {disk_format!r} is not bootable here (raw or qcow2)",
            code="virt.image.unsupported_format",
        )
    with path.open("rb") as f:
        magic = f.read(4)
    is_qcow2 = magic == b"QFI\xfb"
    if (disk_format == "qcow2") != is_qcow2:
        raise DriverError(
            f"the image's data is {'qcow2' if is_qcow2 else 'not qcow2'}, "
            f"but its disk_format is {disk_format}",
            code="virt.image.format_mismatch",
        )


def qemu_img(*args: str, timeout_s: float = 600.0) -> str:
    """Run `qemu-img` in a subprocess; its stdout, or a DriverError with its stderr."""
    try:
        done = subprocess.run(
            ["qemu-img", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        raise DriverError(
            "qemu-img is not installed (Debian: qemu-utils)", code="virt.qemu_img.missing"
        ) from None
    except subprocess.TimeoutExpired:
        raise DriverError(
            f"qemu-img {args[0]} took over {timeout_s} s", code="virt.qemu_img.timeout"
        ) from None
    if done.returncode != 0:
        raise DriverError(
            f"qemu-img {' '.join(args)}: {done.stderr.strip()}", code="virt.qemu_img.failed"
        )
    return done.stdout


def virtual_size(path: Path, disk_format: str) -> int:
    info = json.loads(qemu_img("info", "--output=json", "-f", disk_format, str(path)))
    return int(info["virtual-size"])

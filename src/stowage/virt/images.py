"""A per-host image cache: bases fetched from the image API over HTTP, checksummed, kept by id.

Every method blocks (HTTP, disk, `qemu-img`): the driver calls them from the agent's executor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from stowage.virt.driver import DriverError, ImageSpec

__all__ = ["HttpImageFetcher", "ImageCache", "ImageFetcher", "qemu_img", "virtual_size"]

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

"""Volume backends: where a volume's bytes live. One port, a local-file implementation.

A backend is told what to make (a blank volume, one from an image, from a snapshot, a clone)
and answers how a hypervisor reaches it (`connection_info`, os-brick's shape). Every method is
idempotent and leaves either the finished file or nothing (written to a temporary name, then
renamed), so a volume service that died half-way simply runs the step again. Capacity is not
the backend's business: the ledger's storage claims account it before the backend is asked.
An LVM backend would `lvcreate`/`lvextend`/`lvremove` and answer `{"driver_volume_type":
"local", "data": {"device_path": "/dev/vg/..."}}`; an RBD one would answer `rbd` with a
pool and image name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Protocol

__all__ = ["BackendError", "LocalFileBackend", "VolumeBackend"]

GIB = 1024**3


class BackendError(Exception):
    """The backend could not do what it was asked (the volume goes to an error status)."""


class VolumeBackend(Protocol):
    kind: str

    def create_blank(self, volume_id: str, size_gb: int) -> None: ...

    def create_from_image(
        self, volume_id: str, size_gb: int, image: Path, disk_format: str
    ) -> None: ...

    def create_from_snapshot(self, volume_id: str, size_gb: int, snapshot_id: str) -> None: ...

    def clone(self, volume_id: str, size_gb: int, source_id: str) -> None: ...

    def extend(self, volume_id: str, size_gb: int) -> None: ...

    def delete(self, volume_id: str) -> None: ...

    def snapshot(self, snapshot_id: str, volume_id: str) -> None: ...

    def delete_snapshot(self, snapshot_id: str) -> None: ...

    def exists(self, volume_id: str) -> bool: ...

    def connection_info(self, volume_id: str) -> dict[str, Any]: ...


class LocalFileBackend:
    """Raw sparse files in one directory: the state directory's `volumes/`, or a path on
    shared storage that several hosts mount (then every host reaches the same file)."""

    kind = "local-file"

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.root

    def volume_path(self, volume_id: str) -> Path:
        return self._dir() / f"volume-{volume_id}"

    def snapshot_path(self, snapshot_id: str) -> Path:
        return self._dir() / f"snapshot-{snapshot_id}"

    def exists(self, volume_id: str) -> bool:
        return self.volume_path(volume_id).exists()

    def create_blank(self, volume_id: str, size_gb: int) -> None:
        with self._writing(self.volume_path(volume_id)) as tmp:
            tmp.touch(mode=0o600)
            os.truncate(tmp, size_gb * GIB)

    def create_from_image(
        self, volume_id: str, size_gb: int, image: Path, disk_format: str
    ) -> None:
        """The image's disk, converted to raw (qemu-img) when it is not raw already."""
        with self._writing(self.volume_path(volume_id)) as tmp:
            if disk_format in ("raw", "iso") or not shutil.which("qemu-img"):
                _sparse_copy(image, tmp)
            else:
                _convert(image, disk_format, tmp)
            if tmp.stat().st_size > size_gb * GIB:
                raise BackendError(f"Image virtual size is larger than the volume's {size_gb} GB")
            os.truncate(tmp, size_gb * GIB)

    def create_from_snapshot(self, volume_id: str, size_gb: int, snapshot_id: str) -> None:
        self._copy_grown(self.snapshot_path(snapshot_id), self.volume_path(volume_id), size_gb)

    def clone(self, volume_id: str, size_gb: int, source_id: str) -> None:
        self._copy_grown(self.volume_path(source_id), self.volume_path(volume_id), size_gb)

    def extend(self, volume_id: str, size_gb: int) -> None:
        path = self.volume_path(volume_id)
        if path.stat().st_size < size_gb * GIB:
            os.truncate(path, size_gb * GIB)

    def delete(self, volume_id: str) -> None:
        self.volume_path(volume_id).unlink(missing_ok=True)

    def snapshot(self, snapshot_id: str, volume_id: str) -> None:
        target = self.snapshot_path(snapshot_id)
        if target.exists():
            return
        with self._writing(target) as tmp:
            _sparse_copy(self.volume_path(volume_id), tmp)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.snapshot_path(snapshot_id).unlink(missing_ok=True)

    def connection_info(self, volume_id: str) -> dict[str, Any]:
        """os-brick's LOCAL connector: the hypervisor opens the file itself."""
        return {
            "driver_volume_type": "local",
            "data": {
                "device_path": str(self.volume_path(volume_id)),
                "volume_id": volume_id,
                "access_mode": "rw",
                "encrypted": False,
            },
        }

    def _copy_grown(self, source: Path, target: Path, size_gb: int) -> None:
        if target.exists():
            return
        if not source.exists():
            raise BackendError(f"{source.name} does not exist")
        with self._writing(target) as tmp:
            _sparse_copy(source, tmp)
            if tmp.stat().st_size < size_gb * GIB:
                os.truncate(tmp, size_gb * GIB)

    @contextlib.contextmanager
    def _writing(self, target: Path) -> Any:
        """A temporary file beside `target`, renamed onto it only when the body succeeds."""
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        try:
            yield tmp
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _sparse_copy(source: Path, target: Path) -> None:
    """Copy only the data extents (SEEK_DATA/SEEK_HOLE): a 10 GB blank volume copies in no time."""
    size = source.stat().st_size
    with source.open("rb") as src, target.open("wb") as dst:
        os.chmod(target, 0o600)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            src.seek(start)
            dst.seek(start)
            remaining = end - start
            while remaining:
                chunk = src.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                dst.write(chunk)
                remaining -= len(chunk)
            offset = end
        dst.truncate(size)


def _convert(image: Path, disk_format: str, target: Path) -> None:
    result = subprocess.run(
        ["qemu-img", "convert", "-f", disk_format, "-O", "raw", str(image), str(target)],
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
    )
    if result.returncode != 0:
        raise BackendError(f"qemu-img convert failed: {result.stderr.strip()[:200]}")
    os.chmod(target, 0o600)

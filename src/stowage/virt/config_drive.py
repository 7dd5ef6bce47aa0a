"""The config drive image: ISO 9660 (Joliet and Rock Ridge), volume label `config-2`, as
Nova writes it; cloud-init finds a config drive by that label.

Built where the guest is defined (the hypervisor driver), from the files the control plane
computed (`services/guest_metadata.config_drive_files`), so an agent on another machine
needs nothing but the guest description.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

__all__ = ["LABEL", "build_config_drive"]

LABEL = "config-2"


def build_config_drive(files: dict[str, bytes], out: Path) -> None:
    """An ISO 9660 image of `files` (path -> content) written to `out` (via a temporary
    file beside it, renamed into place)."""
    from pycdlib.pycdlib import PyCdlib

    iso = PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident=LABEL)
    made: set[str] = set()
    for index, (path, data) in enumerate(sorted(files.items())):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            if directory not in made:
                made.add(directory)
                iso.add_directory(
                    _iso9660(directory, len(made), is_dir=True),
                    rr_name=parts[depth - 1],
                    joliet_path="/" + directory,
                )
        iso.add_fp(
            io.BytesIO(data),
            len(data),
            _iso9660(path, index, is_dir=False),
            rr_name=parts[-1],
            joliet_path="/" + path,
        )
    tmp = out.with_name(out.name + ".tmp")
    try:
        iso.write(str(tmp))
        iso.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _iso9660(path: str, index: int, *, is_dir: bool) -> str:
    """A level-3 ISO 9660 name for `path` (Rock Ridge and Joliet carry the real names): the
    parent directories' names as `_iso9660` made them, then a short unique name."""
    parts = path.split("/")
    parents = ["/".join(parts[: d + 1]) for d in range(len(parts) - 1)]
    names = [_short(p) for p in parents]
    leaf = _short(path) if is_dir else f"F{index:04d}.;1"
    return "/" + "/".join([*names, leaf])


def _short(path: str) -> str:
    return "D" + hashlib.sha256(path.encode()).hexdigest()[:7].upper()

"""The config drive image: ISO 9660 labelled config-2, every file readable back by its path."""

from __future__ import annotations

import io
from pathlib import Path

from pycdlib.pycdlib import PyCdlib

from stowage.services.guest_metadata import build_config_drive


def test_a_config_drive_holds_every_file_under_its_real_path(tmp_path: Path) -> None:
    files = {
        "openstack/latest/meta_data.json": b'{"uuid": "u-1"}',
        "openstack/latest/user_data": b"#!/bin/sh\necho hi\n",
        "openstack/2020-10-14/network_data.json": b'{"links": []}',
        "ec2/latest/meta-data.json": b"{}",
    }
    out = tmp_path / "disk.config"
    build_config_drive(files, out)
    iso = PyCdlib()
    iso.open(str(out))
    try:
        assert iso.pvd.volume_identifier.decode().strip() == "config-2"
        for path, data in files.items():
            for key in ("rr_path", "joliet_path"):
                read = io.BytesIO()
                iso.get_file_from_iso_fp(read, **{key: "/" + path})
                assert read.getvalue() == data
    finally:
        iso.close()

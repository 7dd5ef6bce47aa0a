"""Running a cloud: open the ledger in the state directory, bootstrap, write clouds.yaml."""

from __future__ import annotations

import socket
from pathlib import Path

import yaml

from stowage.ledger.db import NamedLock, migrate, sqlite_url
from stowage.ledger.ledger import Ledger
from stowage.services.cloud import Cloud, CloudConfig, bootstrap

__all__ = ["open_cloud", "port_is_free", "write_clouds_yaml"]


def open_cloud(config: CloudConfig, *, db_url: str | None = None) -> Cloud:
    """The cloud in `config.state_dir`, created on first use and brought back after that."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(db_url or sqlite_url(config.state_dir / "ledger.db"), upgrade=False)
    # Processes started at the same moment on a fresh ledger (as an init system starts
    # them) take turns: the first creates the schema and the cloud, the others find both.
    with NamedLock(ledger.engine, "bootstrap"):
        migrate(ledger.engine)
        cloud = Cloud(config, ledger)
        bootstrap(cloud)
    return cloud


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def write_clouds_yaml(config: CloudConfig) -> Path:
    def cloud(user: str, password: str, project: str) -> dict[str, object]:
        return {
            "auth": {
                "auth_url": f"{config.base_url}/identity/v3",
                "username": user,
                "password": password,
                "project_name": project,
                "user_domain_name": "Default",
                "project_domain_name": "Default",
            },
            "region_name": config.region,
            "identity_api_version": 3,
            "interface": "public",
        }

    path = config.state_dir / "clouds.yaml"
    document = {
        "clouds": {
            "stowage": cloud("demo", config.member_password, "demo"),
            "stowage-admin": cloud("admin", config.admin_password, "admin"),
        }
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path

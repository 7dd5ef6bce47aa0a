"""Network v2.0: networks, subnets, ports, security groups (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

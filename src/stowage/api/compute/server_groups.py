"""Compute v2.1: server groups (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

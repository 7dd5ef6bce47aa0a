"""Compute v2.1: migrations (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

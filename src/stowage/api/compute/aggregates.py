"""Compute v2.1: aggregates (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

"""Compute v2.1: os services (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

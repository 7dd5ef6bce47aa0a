"""Compute v2.1: instance actions (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()

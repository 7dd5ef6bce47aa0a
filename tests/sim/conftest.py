"""The nesting guard is on for every test here (tests/conftest.py `guard_nesting`)."""

import pytest


@pytest.fixture(autouse=True)
def _nesting_guarded(guard_nesting: None) -> None:
    return None

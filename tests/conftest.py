"""Shared by every test: async tests (`async def`, marked `pytest.mark.anyio`) run under anyio's
pytest plugin, each in a fresh event loop (as `asyncio.run` would), on asyncio only."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """asyncio only: anyio's own default would also run every async test on trio where trio is installed."""
    return "asyncio"

"""A node's holder record (what its disk and host pool hold, read by peers that fetch from it):
one etcd did not take is put again, and the failure is said once a streak."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from gpu_manager.daemon import _holder_put
from gpufaas.store import StoreError


class Storage:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.puts = 0

    async def put_holder(self, lease: int) -> None:
        self.puts += 1
        if self.failures:
            self.failures -= 1
            raise StoreError("etcd unreachable")


def test_a_holder_record_etcd_did_not_take_is_put_again(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        storage, again = Storage(failures=2), asyncio.Event()
        failing, asked_again = False, []
        for _ in range(3):
            again.clear()
            failing = not await _holder_put(cast(Any, storage), 7, again, failing=failing)
            asked_again.append(again.is_set())
        assert storage.puts == 3 and not failing and asked_again == [True, True, False]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "retrying" in warnings[0].getMessage()

    asyncio.run(main())

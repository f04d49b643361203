"""A node's holdings (what its disk and host pool hold): told to the scheduler when they change,
and put in etcd as its holder record (read by peers that fetch from it); one etcd did not take is
put again on its own, and the failure is said once a streak; a pre-staging that cannot read etcd
is given up with a warning."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, cast

import pytest

from gpu_manager.daemon import HOLDINGS_RETRY_S, _holder_put, report_holdings
from gpu_manager.storage import NodeStorage, StorageOptions
from gpufaas.keys import Keys
from gpufaas.store import StoreError
from tests.fakes import MemoryStore


class Storage:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.puts = 0

    async def put_holder(self, lease: int) -> None:
        self.puts += 1
        if self.failures:
            self.failures -= 1
            raise StoreError("etcd unreachable")


def test_a_holder_record_etcd_did_not_take_is_put_again_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        storage = Storage(failures=2)
        failing, taken = False, []
        for _ in range(3):
            failing = not await _holder_put(cast(Any, storage), 7, failing=failing)
            taken.append(not failing)
        assert storage.puts == 3 and taken == [False, False, True]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "retrying" in warnings[0].getMessage()

    asyncio.run(main())


def test_while_etcd_refuses_the_record_changes_still_reach_the_scheduler_at_once_and_only_changes() -> None:
    # etcd refuses the first three puts. The record is put again every HOLDINGS_RETRY_S; the
    # scheduler hears each change within the coalescing time (not the retry's), and hears
    # nothing from the retries of a record that did not change.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        changed, told, puts = asyncio.Event(), [], []
        refusals = 3

        async def put_holder(failing: bool) -> bool:
            nonlocal refusals
            puts.append(loop.time())
            refusals -= 1
            return refusals < 0

        task = asyncio.create_task(report_holdings(changed, lambda: told.append(loop.time()), put_holder))
        started = loop.time()
        changed.set()
        await asyncio.sleep(0.2)
        assert len(told) == 1 and len(puts) == 1  # told, put, refused
        changed.set()  # a change while etcd refuses
        await asyncio.sleep(0.2)
        assert len(told) == 2 and told[1] - started < 0.5, told  # at once, not a retry later
        await asyncio.sleep(HOLDINGS_RETRY_S * 2 + 0.3)
        assert len(told) == 2, "the scheduler was told holdings again that did not change"
        assert len(puts) == 4  # the retries went on until etcd took it ...
        await asyncio.sleep(HOLDINGS_RETRY_S + 0.2)
        assert len(puts) == 4  # ... and stopped
        task.cancel()

    asyncio.run(main())


def test_a_pre_staging_while_etcd_is_unreachable_is_logged_and_given_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The package's record could not be read: StoreError escaped NodeStorage.stage, and the
    # daemon's task for the scheduler's Stage died with it ('Task exception was never retrieved').
    async def main() -> None:
        store = MemoryStore()
        storage = NodeStorage(
            store,
            Keys(),
            node="n1",
            state_dir=tmp_path,
            in_use=set,
            on_change=lambda: None,
            options=StorageOptions(pool_mb=0),
        )
        store.set_reachable(False)
        with caplog.at_level(logging.WARNING, logger="gpufaas.gpu_manager.storage"):
            await storage.stage("sha256:" + "0" * 64)
        assert "could not stage package" in caplog.text and "unreachable" in caplog.text

    asyncio.run(main())

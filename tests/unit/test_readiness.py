"""The gateway's readiness probe: however many probes come (GET /healthz is open to anyone), the
scheduler and etcd are asked at most once per max_age_s, and probes waiting meanwhile share it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.readiness import Readiness, ReadinessProbe


class Finder:
    """Finds readiness when the test says (`answer`), counting how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0
        self.pending: asyncio.Future[Readiness] | None = None

    async def __call__(self) -> Readiness:
        self.asked += 1
        self.pending = asyncio.get_running_loop().create_future()
        return await self.pending

    async def answer(self, readiness: Readiness) -> None:
        while self.pending is None or self.pending.done():  # until the probe has asked
            await asyncio.sleep(0)
        self.pending.set_result(readiness)


def test_probes_share_one_finding_and_its_answer_for_max_age() -> None:
    async def main() -> None:
        now = [100.0]
        finder = Finder()
        probe = ReadinessProbe(finder, max_age_s=0.5, clock=lambda: now[0])
        probes = [asyncio.ensure_future(probe.check()) for _ in range(200)]
        await asyncio.sleep(0)
        probes[0].cancel()  # one client gone: the others still get their answer
        await finder.answer(Readiness(scheduler=True, etcd=True))
        answers = await asyncio.gather(*probes[1:])
        assert finder.asked == 1 and all(a.ready for a in answers)
        now[0] += 0.4
        assert (await probe.check()).ready and finder.asked == 1  # young enough: no one asked
        now[0] += 0.2
        later = asyncio.ensure_future(probe.check())
        await finder.answer(Readiness(scheduler=False, etcd=True))
        assert not (await later).ready and finder.asked == 2

    asyncio.run(main())


def test_a_finding_that_fails_is_not_kept() -> None:
    async def main() -> None:
        calls = 0

        async def broken() -> Readiness:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("boom")
            return Readiness(scheduler=True, etcd=False)

        probe = ReadinessProbe(broken)
        with pytest.raises(RuntimeError):
            await probe.check()
        assert not (await probe.check()).ready and calls == 2

    asyncio.run(main())

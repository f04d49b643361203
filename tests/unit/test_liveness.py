"""gpufaas.liveness: the watchdog's verdicts and the loop-lag readings (manual clock)."""

from __future__ import annotations

from gpufaas.liveness import LoopLag, Watchdog, WatchdogPolicy

POLICY = WatchdogPolicy(every_s=0.5, timeout_s=1.0, failures=2, start_grace_s=10.0)


def probe(watchdog: Watchdog, name: str, answered: bool, now: float) -> bool:
    assert name in watchdog.due(now)
    return watchdog.probed(name, answered, now)


def test_a_component_that_stops_answering_is_killed_after_the_failures_in_a_row() -> None:
    watchdog = Watchdog(POLICY)
    watchdog.started("scheduler", 0.0)
    assert not probe(watchdog, "scheduler", True, 0.0)
    assert watchdog.due(0.4) == []  # probed every 0.5 s
    assert not probe(watchdog, "scheduler", False, 1.5)  # one probe unanswered: not yet
    assert not probe(watchdog, "scheduler", True, 2.0)  # it answered again: the count starts over
    assert not probe(watchdog, "scheduler", False, 3.0)
    assert probe(watchdog, "scheduler", False, 4.0)  # the second in a row: kill
    assert watchdog.kills == {"scheduler": 1}
    assert watchdog.due(100.0) == []  # not probed again until it is restarted
    watchdog.started("scheduler", 100.0)
    assert watchdog.due(100.0) == ["scheduler"] and watchdog.failing["scheduler"] == 0


def test_a_starting_component_is_not_judged_until_it_answered_or_its_grace_ran_out() -> None:
    watchdog = Watchdog(POLICY)
    watchdog.started("node0", 0.0)
    for now in (1.0, 2.0, 3.0):  # still importing: no answer yet, no kill
        assert not probe(watchdog, "node0", False, now)
    assert probe(watchdog, "node0", False, 10.0)  # past the grace, still silent: kill
    watchdog.started("node0", 20.0)
    assert not probe(watchdog, "node0", True, 21.0)  # it answered once: judged from now on
    assert not probe(watchdog, "node0", False, 22.0)
    assert probe(watchdog, "node0", False, 23.0)


def test_a_probe_of_the_previous_process_does_not_count_and_one_probe_is_out_at_a_time() -> None:
    watchdog = Watchdog(POLICY)
    watchdog.started("gateway", 0.0)
    assert watchdog.due(0.0) == ["gateway"]
    assert watchdog.due(5.0) == []  # the first probe is still out
    watchdog.started("gateway", 6.0)  # restarted (it exited) while the probe was out
    assert not watchdog.probed("gateway", False, 7.0)  # that late answer is ignored
    assert watchdog.failing["gateway"] == 0 and watchdog.due(7.0) == ["gateway"]


def test_loop_lag_keeps_the_latest_reading_and_the_worst_of_its_window() -> None:
    lag = LoopLag(window_s=60.0)
    assert lag.report(0.0) == {"loop_lag_s": 0.0, "loop_lag_max_s": 0.0}
    lag.measured(5.0, 10.0)  # a 5 s stall (SIGSTOP): reported once the loop runs again
    lag.measured(0.001, 10.5)
    assert lag.report(11.0) == {"loop_lag_s": 0.001, "loop_lag_max_s": 5.0}
    assert lag.max_s(69.0) == 5.0 and lag.max_s(70.4) == 0.001  # the stall left the window
    lag.measured(-0.001, 71.0)  # a timer that fired early is no lag
    assert lag.latest_s == 0.0


def test_a_daemons_metrics_listener_answers_healthz_without_the_token_with_its_loop_lag() -> None:
    import asyncio
    import json

    from prometheus_client import CollectorRegistry

    from gpufaas.metrics import MetricsServer

    async def ask(address: str, path: str) -> bytes:
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # Connection: close, so the answer ends with the connection (not at the keep-alive timeout).
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = await reader.read()
        writer.close()
        return answer

    async def main() -> tuple[bytes, bytes]:
        server = MetricsServer(CollectorRegistry(), token="secret")
        address = await server.start("127.0.0.1:0")
        await asyncio.sleep(0.3)  # a reading or so
        try:
            return await ask(address, "/healthz"), await ask(address, "/metrics")
        finally:
            await server.close()

    health, metrics = asyncio.run(main())
    head, _, body = health.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and set(json.loads(body)) == {"status", "loop_lag_s", "loop_lag_max_s"}
    assert metrics.startswith(b"HTTP/1.1 401")  # the metrics still ask for the token

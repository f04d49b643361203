"""Steady calls through the balancer while deploy/compose-e2e.sh kills a daemon, and the verdict on them.

Run by compose-e2e.sh with the host's python3 (standard library only):

    python3 deploy/compose_load.py leader URL TOKEN_FILE ADMIN_PASSWORD_FILE SERVICE=CONTAINER...
    python3 deploy/compose_load.py gateway URL TOKEN_FILE PID

`leader` asks the overview which scheduler leads, maps it to its compose service (the host of the
address it registered, `--advertise scheduler-N:50051`), kills that container with
`docker kill -s KILL` under CLIENTS clients, and passes when no call failed, a call sent after its
death succeeded within RECOVERY_BOUND_S of the kill, and the overview then names the other
scheduler with a higher epoch. `gateway` SIGKILLs the gateway's pid 1 (a crash, which its restart
policy undoes) and passes when only calls in flight at its death failed. Exit status 0: passed.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CLIENTS = 8
STEADY_S = 5.0  # calls before the kill, and again after it
CALL_TIMEOUT_S = 60.0
RECOVERY_BOUND_S = 2.0  # issue 21: calls succeed again within 2 s of the leader's death
NEW_LEADER_TIMEOUT_S = 30.0
MAX_FAILED_SHOWN = 12
FUNCTION = "hello"
BODY = b'{"inputs": [[1, 2, 3, 4]]}'


@dataclass(frozen=True)
class Call:
    """One call: when it was sent and answered (monotonic seconds) and how."""

    sent_s: float
    done_s: float
    status: int | None  # None: no HTTP answer (`error` says why)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def outcome(self) -> str:
        """The status, or the exception's class where there was no answer."""
        return str(self.status) if self.status is not None else self.error.split("(", 1)[0]


class Load:
    """CLIENTS threads, each calling FUNCTION through the balancer in a loop while in the `with`."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.calls: list[Call] = []  # appended by the clients (list.append is atomic)
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join()

    def _client(self) -> None:
        while not self._stopping.is_set():
            request = urllib.request.Request(
                f"{self.url}/function/{FUNCTION}",
                data=BODY,
                headers={"authorization": f"Bearer {self.token}", "content-type": "application/json"},
            )
            sent_s, status, error = time.monotonic(), None, ""
            try:
                with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status, error = exc.code, repr(exc.read()[:200])
            except OSError as exc:
                error = repr(exc)
            self.calls.append(Call(sent_s, time.monotonic(), status, error))


def kill_and_wait(pid: int, kill: Callable[[], object]) -> tuple[float, float]:
    """Run `kill` against the process `pid`; (when it was run, when the process was gone), monotonic
    seconds. Gone means reaped: its threads, and the sockets they held, are gone too (a zombie
    leader's threads may still hold them), so no call sent later can reach it."""
    killed_s = time.monotonic()
    kill()
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.001)
    return killed_s, time.monotonic()


def recovery_s(calls: list[Call], killed_s: float, dead_s: float) -> float | None:
    """Seconds from the kill to the first success of a call sent after the death (None: none)."""
    done = [c.done_s for c in calls if c.sent_s > dead_s and c.ok]
    return min(done) - killed_s if done else None


def longest_gap_s(calls: list[Call], killed_s: float) -> float:
    """The longest spell without a success that ended after the kill."""
    ok = sorted(c.done_s for c in calls if c.ok)
    return max((b - a for a, b in itertools.pairwise(ok) if b > killed_s), default=0.0)


def overview_leader(url: str, admin_password: str) -> dict[str, Any]:
    """GET /system/overview as admin: its `scheduler_leader` ({name, address, epoch})."""
    credentials = base64.b64encode(f"admin:{admin_password}".encode()).decode()
    request = urllib.request.Request(f"{url}/system/overview", headers={"authorization": f"Basic {credentials}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        leader: dict[str, Any] = json.load(response)["scheduler_leader"]
    return leader


def wait_for_leader(url: str, admin_password: str, not_named: str) -> dict[str, Any]:
    """The overview's leader once it names a scheduler other than `not_named`."""
    deadline_s = time.monotonic() + NEW_LEADER_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline_s:
        try:
            found = overview_leader(url, admin_password)
            if found.get("name") and found["name"] != not_named:
                return found
            last = found
        except (OSError, KeyError, ValueError) as exc:  # no leader yet: the gateway cannot answer
            last = exc
        time.sleep(0.1)
    raise SystemExit(f"FAILED: no leader other than {not_named} in {NEW_LEADER_TIMEOUT_S:.0f} s (last: {last})")


def service_of(leader: dict[str, Any], containers: dict[str, str]) -> str:
    """The compose service of the scheduler `leader` names: its registered address's host."""
    host = str(leader.get("address") or leader.get("name") or "").rsplit(":", 1)[0]
    if host not in containers:
        raise SystemExit(f"FAILED: the leader {leader} is none of the services {sorted(containers)}")
    return host


def print_calls(calls: list[Call], killed_s: float, dead_s: float) -> None:
    by_outcome = dict(sorted(Counter(c.outcome for c in calls).items()))
    in_flight = sum(1 for c in calls if c.sent_s < dead_s and c.done_s > killed_s)
    after = [c for c in calls if c.sent_s > dead_s]
    print(
        f"  {len(calls)} calls, by status {by_outcome}; {in_flight} in flight at the kill, "
        f"{len(after)} sent after the death ({sum(c.ok for c in after)} succeeded)"
    )
    failed = [c for c in calls if not c.ok]
    if len(failed) > MAX_FAILED_SHOWN:
        print(f"  the first {MAX_FAILED_SHOWN} of {len(failed)} failed calls:")
    for c in failed[:MAX_FAILED_SHOWN]:
        print(
            f"  failed: sent {1000 * (c.sent_s - dead_s):+.0f} ms from the death, "
            f"done {1000 * (c.done_s - dead_s):+.0f}: {c.status} {c.error}"
        )


def kill_leader(url: str, token: str, admin_password: str, containers: dict[str, str]) -> bool:
    """The leading scheduler's container SIGKILLed under load; True when the run passed."""
    first = overview_leader(url, admin_password)
    service = service_of(first, containers)
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", containers[service]))
    with Load(url, token) as load:
        time.sleep(STEADY_S)
        print(f"  killing the leader {service} ({first['address']}, epoch {first['epoch']})", flush=True)
        killed_s, dead_s = kill_and_wait(pid, lambda: docker("kill", "-s", "KILL", containers[service]))
        time.sleep(STEADY_S)
    calls = list(load.calls)
    print(f"  {service} gone {1000 * (dead_s - killed_s):.0f} ms after `docker kill` began")
    print_calls(calls, killed_s, dead_s)
    recovered_s = recovery_s(calls, killed_s, dead_s)
    print(
        f"  first success of a call sent after the death: {recovered_s:.2f} s after the kill"
        if recovered_s is not None
        else "  no call sent after the death succeeded"
    )
    print(f"  longest spell without a success: {longest_gap_s(calls, killed_s):.2f} s")
    second = wait_for_leader(url, admin_password, not_named=first["name"])
    print(f"  the overview names {second['name']} ({second['address']}), epoch {second['epoch']}")
    return (
        bool(calls)
        and all(c.ok for c in calls)
        and recovered_s is not None
        and recovered_s <= RECOVERY_BOUND_S
        and service_of(second, containers) != service
        and int(second["epoch"]) > int(first["epoch"])
    )


def kill_gateway(url: str, token: str, pid: int) -> bool:
    """The gateway's pid 1 SIGKILLed under load; True when only calls in flight at its death failed
    and every call sent after it succeeded."""
    with Load(url, token) as load:
        time.sleep(STEADY_S)
        killed_s, dead_s = kill_and_wait(pid, lambda: os.kill(pid, signal.SIGKILL))
        time.sleep(STEADY_S)
    calls = list(load.calls)
    print_calls(calls, killed_s, dead_s)
    in_flight = [c for c in calls if c.sent_s < dead_s and c.done_s > killed_s]
    after = [c for c in calls if c.sent_s > dead_s]
    return all(c in in_flight for c in calls if not c.ok) and bool(after) and all(c.ok for c in after)


def docker(*argv: str) -> str:
    return subprocess.run(["docker", *argv], check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    leader = commands.add_parser("leader", help="kill the leading scheduler's container")
    gateway = commands.add_parser("gateway", help="SIGKILL a gateway's pid 1")
    for sub in (leader, gateway):
        sub.add_argument("url")
        sub.add_argument("token_file")
    leader.add_argument("admin_password_file")
    leader.add_argument("containers", nargs="+", metavar="SERVICE=CONTAINER")
    gateway.add_argument("pid", type=int)
    args = parser.parse_args(argv)
    with open(args.token_file) as file:
        token = file.read().strip()
    if args.command == "leader":
        with open(args.admin_password_file) as file:
            admin_password = file.read().strip()
        containers = dict(pair.split("=", 1) for pair in args.containers)
        passed = kill_leader(args.url, token, admin_password, containers)
    else:
        passed = kill_gateway(args.url, token, args.pid)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""The worker pool over real processes: a zygote and the workers it forks, the cpu backend where
the handler matters and the emulated one where it does not. Misses through warm spares, hits,
pipelined calls, dynamic batching, every call outcome, timeouts, deaths, eviction, redeploys,
spares and the zygote. Every test checks on the way out that no process it started is left running.

Tests that only load and call models of their own share one cpu pool (`cpu_node`: its zygote
imports torch, a second or two); their models are evicted after each of them, and what remains
checked. The others each start their own pool (`open_pool`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpu_manager.backends import UnknownBackend
from gpu_manager.metrics import NodeMetrics
from gpu_manager.pool import STOP_GRACE_S, ModelRun, RunResult, WorkerPool
from gpu_manager.staging import LocalPackages
from gpufaas.functions import WorkerSettings
from gpufaas.proto import gpufaas_pb2 as pb
from tests.fixtures.make_packages import build_package

TIMEOUT_S = 30.0  # the deadline of a call that is not about deadlines: a busy machine is slow
SHUTDOWN_S = 8.0  # a shutdown takes milliseconds; past this it is stuck
MAX_BODY_BYTES = 4096  # the shared pool's result limit (what the tests return is smaller)
JSON = "application/json"
OCTETS = "application/octet-stream"


# --- processes, from /proc -----------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (the state first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class Proc:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_ticks: int
    ppid: int = field(compare=False)

    @classmethod
    def of(cls, pid: int) -> Proc:
        stat = _stat(pid)
        assert stat is not None, f"no process {pid}"
        return cls(pid, int(stat[19]), int(stat[1]))

    @property
    def running(self) -> bool:
        """It exists and has not exited (a zombie has exited: it only waits to be reaped)."""
        stat = _stat(self.pid)
        return stat is not None and int(stat[19]) == self.start_ticks and stat[0] not in ("Z", "X")

    @property
    def cmdline(self) -> str:
        with suppress(OSError):
            return Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return ""

    def kill(self) -> None:
        if self.running:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def descendants(pid: int) -> set[Proc]:
    """Every running process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found: set[Proc] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with suppress(AssertionError):  # it exited meanwhile
                found.add(Proc.of(child))
            todo.append(child)
    return {proc for proc in found if proc.running}


async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.01)


# --- packages --------------------------------------------------------------------------------------


class Shelf:
    """The function packages a test's pool can fetch (built from tests/fixtures), by digest, from
    real blobs and links (gpu_manager.staging.LocalPackages). `fetched` lists every download
    (concurrent fetches of one package share one); each takes `fetch_delay_s`."""

    def __init__(self, tmp_path: Path, *, fetch_delay_s: float = 0.0) -> None:
        self.tmp_path = tmp_path
        self.local = LocalPackages(tmp_path / "store")
        self.fetch_delay_s = fetch_delay_s
        self.fetched: list[str] = []
        self._known: set[str] = set()
        self._ready: dict[str, Path] = {}
        self._pending: dict[str, asyncio.Task[Path]] = {}

    def digest(self, fixture: str) -> str:
        """Build `fixture` (e.g. "echo_function") into a package, once; its digest."""
        archive = self.tmp_path / f"{fixture}.tar.gz"
        if not archive.exists():
            build_package(fixture, self.tmp_path)
        digest = self.local.add_archive(archive.read_bytes())
        self._known.add(digest)
        return digest

    def directory(self, digest: str) -> str:
        path = self._ready.get(digest)
        assert path is not None, f"package {digest} is not installed"
        return str(path)

    async def _download(self, digest: str) -> Path:
        self.fetched.append(digest)
        await asyncio.sleep(self.fetch_delay_s)
        if digest not in self._known:
            raise LookupError(f"no package {digest} in the registry")
        path = await self.local.ensure(digest)
        self._ready[digest] = path
        return path

    async def fetch(self, digest: str) -> tuple[Path, float]:
        """The pool's `fetch_package`."""
        if digest in self._ready:
            return self._ready[digest], 0.0
        started = time.perf_counter()
        task = self._pending.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._download(digest))
            self._pending[digest] = task
            task.add_done_callback(lambda _: self._pending.pop(digest, None))
        return await asyncio.shield(task), time.perf_counter() - started


# --- the pool --------------------------------------------------------------------------------------

_call_ids = itertools.count()


@dataclass
class Node:
    """A started WorkerPool, its packages, and every process it was seen to start (`watch()`)."""

    pool: WorkerPool
    shelf: Shelf
    hellos: list[pb.WorkerHello] = field(default_factory=list)  # the first spares'
    started: set[Proc] = field(default_factory=set)
    before: set[Proc] = field(default_factory=set)  # what ran below this process before the pool
    shutdown_ok: bool | None = None  # None until `shutdown()`, then whether it finished in time
    runner: asyncio.Runner | None = None  # the shared pool's event loop

    def watch(self) -> None:
        """Note the processes running below this test process now, to check on the way out."""
        self.started |= descendants(os.getpid()) - self.before

    def zygotes(self) -> list[Proc]:
        """This pool's running zygote (it starts it as a child process of this one)."""
        return [
            p
            for p in descendants(os.getpid()) - self.before
            if p.ppid == os.getpid() and "gpu_manager.zygote" in p.cmdline
        ]

    def forked_workers(self) -> list[Proc]:
        """The running worker processes (spares included) of this pool's zygote."""
        parents = {z.pid for z in self.zygotes()}
        return [p for p in descendants(os.getpid()) if p.ppid in parents]

    async def call(
        self,
        run: ModelRun,
        inputs: object = None,
        *,
        gpu: str = "gpu0",
        content_type: str = JSON,
        timeout_s: float = TIMEOUT_S,
        evict: tuple[str, ...] = (),
        seq: int = 0,
    ) -> RunResult:
        """One call: `inputs` as JSON, or as they are when bytes."""
        payload = inputs if isinstance(inputs, bytes) else json.dumps(inputs).encode()
        return await self.pool.run(
            run,
            gpu,
            f"call-{next(_call_ids)}",
            payload,
            content_type=content_type,
            timeout_s=timeout_s,
            evict=evict,
            seq=seq,
        )

    async def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Shut the pool down, once (on the way out if the test did not); AssertionError if it
        takes over `timeout_s`."""
        self.watch()
        self.shutdown_ok = False
        try:
            async with asyncio.timeout(timeout_s):
                await self.pool.shutdown()
        except TimeoutError:
            raise AssertionError(f"the pool's shutdown took over {timeout_s:g} s") from None
        self.shutdown_ok = True

    def pid_of(self, model: str, gpu: str = "gpu0") -> int:
        [pid] = [pid for m, g, pid, _ in self.pool.workers() if (m, g) == (model, gpu)]
        return pid

    def models(self, gpu: str = "gpu0") -> list[str]:
        return sorted(m for m, g, _, _ in self.pool.workers() if g == gpu)


@asynccontextmanager
async def open_pool(
    backend: str,
    shelf: Shelf,
    *,
    gpus: tuple[str, ...] = ("gpu0",),
    spares_per_gpu: int = 1,
    warm: bool = True,
    **options: Any,
) -> AsyncIterator[Node]:
    """A started pool (its first spares warm, unless not `warm`). On the way out, whatever
    happened: shut it down, check that every process it started is gone, and kill (by pid) any
    that is not."""
    node = Node(
        WorkerPool(
            backend,
            gpus={gpu: index for index, gpu in enumerate(gpus)},
            fetch_package=shelf.fetch,
            spares_per_gpu=spares_per_gpu,
            **options,
        ),
        shelf,
        before=descendants(os.getpid()),
    )
    try:
        node.pool.start()
        if warm:
            node.hellos = await node.pool.spares_ready(TIMEOUT_S)
            assert len(node.hellos) == spares_per_gpu * len(gpus), "the first spares did not all start"
            node.watch()
        yield node
    finally:
        node.watch()
        leftovers: list[Proc] = []
        try:
            if node.shutdown_ok is None:
                await node.shutdown()
            if node.shutdown_ok:  # the zygote reaps its children: give it a moment
                with suppress(AssertionError):
                    await eventually(lambda: not any(p.running for p in node.started), "processes exit", 5.0)
        finally:
            node.watch()  # anything started late
            leftovers = sorted((p for p in node.started if p.running), key=lambda p: p.pid)
            for proc in leftovers:
                proc.kill()
        assert not leftovers, f"left running after shutdown: {[(p.pid, p.cmdline) for p in leftovers]}"
        assert node.pool.workers() == []


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def on_own_pool(
    tmp_path: Path, backend: str, scenario: Callable[[Node], Coroutine[Any, Any, None]], **options: Any
) -> None:
    """Run `scenario(node)` on a pool of its own, `open_pool(backend, ..., **options)`; the packages
    it can fetch are `node.shelf`'s."""
    shelf = Shelf(tmp_path)

    async def main() -> None:
        async with open_pool(backend, shelf, **options) as node:
            await scenario(node)

    run(main)


def on_own_emulated_pool(tmp_path: Path, scenario: Callable[[Node, str], Coroutine[Any, Any, None]]) -> None:
    """Run `scenario(node, digest)` on an emulated pool of its own; `digest` is echo_function's
    package, built before the pool starts."""
    shelf = Shelf(tmp_path)

    async def main() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("emulated", shelf) as node:
            await scenario(node, digest)

    run(main)


def on_two_gpus_and_a_host_tier(
    tmp_path: Path, scenario: Callable[[Node, str], Coroutine[Any, Any, None]], *, host_cache_mb: int, parked_mb: int
) -> None:
    """Run `scenario(node, probe)` on a cpu pool of its own with gpu0 and gpu1 and a host tier of
    `host_cache_mb`, where each parked worker measures `parked_mb`; `probe` is probe_function's
    package, built before the pool starts."""
    shelf = Shelf(tmp_path)

    async def main() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool(
            "cpu", shelf, gpus=("gpu0", "gpu1"), host_cache_mb=host_cache_mb, measure_host_mb=lambda pid: parked_mb
        ) as node:
            await scenario(node, probe)

    run(main)


@pytest.fixture(scope="module")
def cpu_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One cpu pool for the tests of this module that only use models of their own (`on_shared`)."""
    shelf = Shelf(tmp_path_factory.mktemp("cpu-node"))
    with asyncio.Runner() as runner:
        pool = open_pool("cpu", shelf, max_body_bytes=MAX_BODY_BYTES)
        node = runner.run(pool.__aenter__())
        node.runner = runner
        try:
            yield node
        finally:
            runner.run(pool.__aexit__(None, None, None))


def on_shared(node: Node, scenario: Callable[[Node], Coroutine[Any, Any, None]]) -> None:
    """Run `scenario` on the shared pool; then evict every model and check that only the spares
    are left running (any other worker process is killed, by pid, so the next test starts clean)."""

    async def scenario_then_clean_up() -> None:
        try:
            await scenario(node)
        finally:
            node.watch()
            for model, gpu, _, _ in node.pool.workers():
                await node.pool.evict(model, gpu)
            deadline = time.monotonic() + 5.0
            while True:
                spares = {hello.pid for hello in await node.pool.spares_ready(TIMEOUT_S)}
                strays = [p for p in node.forked_workers() if p.pid not in spares]
                if not strays or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            for proc in strays:
                proc.kill()
            assert not strays, f"worker processes that are neither a model's nor a spare: {strays}"

    assert node.runner is not None
    node.runner.run(scenario_then_clean_up())


def emulated(model: str, digest: str, *, load_s: float = 0.001, inference_s: float = 0.001) -> ModelRun:
    """An emulated model with its own profile (a profile of 0 would mean Table I's)."""
    return ModelRun(model, digest, memory_mb=100, load_time_s=load_s, inference_time_s=inference_s)


def on_cpu(model: str, digest: str, memory_mb: int = 300, **settings: Any) -> ModelRun:
    """A run of `digest`'s package; `settings` are the function's WorkerSettings fields."""
    return ModelRun(model, digest, memory_mb, worker=WorkerSettings(**settings).to_wire())


def ok(result: RunResult) -> dict[str, Any]:
    """The JSON output of a call that must have succeeded."""
    assert result.outcome == pb.OK, f"{pb.Outcome.Name(result.outcome)}: {result.message}"
    assert result.content_type == JSON
    output: dict[str, Any] = json.loads(result.output)
    return output


# --- misses and hits -------------------------------------------------------------------------------


def test_a_miss_loads_through_the_warm_spare_and_a_new_spare_replaces_it(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path, fetch_delay_s=0.2)

    async def scenario() -> None:
        echo = shelf.digest("echo_function")
        async with open_pool("cpu", shelf) as node:
            [spare] = node.hellos
            model = on_cpu("echo", echo)

            miss = await node.call(model, {"x": 1})

            assert ok(miss)["pid"] == spare.pid  # the warm spare took the model
            assert miss.loaded
            stages = miss.stages
            assert stages is not None
            assert stages.start_s == 0 and stages.context_s == 0  # nothing to wait for: it was warm
            assert stages.fetch_s >= 0.2  # downloaded on this miss
            assert stages.load_s > 0
            assert miss.load_time_s == pytest.approx(stages.fetch_s + stages.load_s)
            assert node.pool.workers() == [("echo", "gpu0", spare.pid, 300)]

            [new_spare] = await node.pool.spares_ready(TIMEOUT_S)
            assert new_spare.pid != spare.pid
            assert node.pool.spare_count("gpu0") == 1

            hit = await node.call(model, {"x": 2})

            assert ok(hit)["echo"] == {"x": 2}
            assert ok(hit)["pid"] == spare.pid
            assert not hit.loaded and hit.stages is None and hit.load_time_s == 0
            assert hit.peak_memory_mb == 300  # declared: there is no device memory to measure on the cpu

            # Another model from the same package: through the new spare, and no second download.
            other = await node.call(on_cpu("echo-2", echo), {"x": 3})

            assert ok(other)["pid"] == new_spare.pid
            assert other.loaded and other.stages is not None
            assert other.stages.fetch_s < 0.2
            assert shelf.fetched == [echo]

    run(scenario)


def test_without_a_warm_spare_a_miss_waits_for_a_worker_process(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("emulated", shelf, gpus=("gpu0", "gpu1"), spares_per_gpu=0) as node:
            assert node.zygotes() == []  # nothing to fork yet

            miss = await node.call(emulated("m", digest), {"x": 1}, gpu="gpu1")

            assert ok(miss) == {"model": "m", "backend": "emulated", "device": "emulated:1", "echo": {"x": 1}}
            assert miss.loaded and miss.stages is not None
            assert miss.stages.start_s > 0
            assert node.pool.spare_count("gpu1") == 0
            assert [w.pid for w in node.forked_workers()] == [node.pid_of("m", "gpu1")]

    run(scenario)


def test_concurrent_first_calls_of_a_model_load_it_once(tmp_path: Path) -> None:
    async def scenario(node: Node, digest: str) -> None:
        model = emulated("m", digest, load_s=0.3)

        results = await asyncio.gather(*(node.call(model, {"i": i}) for i in range(4)))

        assert [ok(r)["echo"] for r in results] == [{"i": i} for i in range(4)]
        assert [r.loaded for r in results].count(True) == 1
        assert len(node.pool.workers()) == 1
        await node.pool.spares_ready(TIMEOUT_S)
        assert len(node.forked_workers()) == 2  # the model's worker and the new spare
        assert node.shelf.fetched == [digest]

    on_own_emulated_pool(tmp_path, scenario)


def test_calls_pipelined_to_one_worker_all_answer_in_order_and_beat_one_at_a_time(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("pipelined", node.shelf.digest("probe_function"))
        ok(await node.call(model, {}))
        sequential_s: list[float] = []
        pipelined_s: list[float] = []
        served: list[int] = []
        for _ in range(2):  # the best of two rounds each: the machine is shared
            started = time.perf_counter()
            for _ in range(100):
                served.append(ok(await node.call(model, {}))["calls"])
            sequential_s.append(time.perf_counter() - started)

            started = time.perf_counter()
            results = await asyncio.gather(*(node.call(model, {}) for _ in range(100)))
            pipelined_s.append(time.perf_counter() - started)
            served += [ok(r)["calls"] for r in results]

        # The worker counts the calls it serves: it served every one, in the order sent.
        assert served == list(range(2, 402))
        assert min(pipelined_s) < min(sequential_s)

    on_shared(cpu_node, scenario)


def test_two_models_on_one_gpu_run_in_separate_processes_at_once(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        sleepy = node.shelf.digest("sleepy_function")
        a, b = on_cpu("side-a", sleepy), on_cpu("side-b", sleepy)
        first = await asyncio.gather(node.call(a, {"sleep_s": 0}), node.call(b, {"sleep_s": 0}))
        assert ok(first[0])["pid"] != ok(first[1])["pid"]
        assert node.models() == ["side-a", "side-b"]

        started = time.perf_counter()
        both = await asyncio.gather(node.call(a, {"sleep_s": 1.0}), node.call(b, {"sleep_s": 1.0}))
        elapsed_s = time.perf_counter() - started

        assert [ok(r)["pid"] for r in both] == [ok(r)["pid"] for r in first]
        assert elapsed_s < 1.8  # side by side, not one after the other (2 s)

    on_shared(cpu_node, scenario)


# --- what the handler sees, and what its output becomes ---------------------------------------------


def test_the_handler_sees_its_environment_package_directory_and_working_directory(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        echo, probe = node.shelf.digest("echo_function"), node.shelf.digest("probe_function")
        names = ["GPUFAAS_TEST_GREETING", "OMP_NUM_THREADS"]

        seen = ok(await node.call(on_cpu("env-echo", echo), {"x": 1}))
        greeted = ok(
            await node.call(on_cpu("env-probe", probe, environment={"GPUFAAS_TEST_GREETING": "hello"}), {"env": names})
        )
        other = ok(await node.call(on_cpu("env-probe-2", probe), {"env": names}))

        assert seen["package_dir_real"] == seen["cwd"] == node.shelf.directory(echo)
        if os.geteuid() == 0:  # the worker runs as the package's user: a handle, opened before it dropped root
            assert re.fullmatch(r"/proc/self/fd/\d+", seen["package_dir"]), seen["package_dir"]
            assert seen["uid"] == node.pool.isolation.package_users.get(echo)
        else:
            assert seen["package_dir"] == node.shelf.directory(echo)
        assert seen["helper"] == "from helper.py"  # a module beside handler.py
        assert seen["device"] == "cpu"
        expected = {"GPUFAAS_TEST_GREETING": "hello"}
        expected["OMP_NUM_THREADS"] = "1"  # the cpu backend: one thread per worker
        assert greeted == {"env": expected, "env_at_load": expected}
        assert other["env"]["GPUFAAS_TEST_GREETING"] is None  # each model's worker has its own
        assert "GPUFAAS_TEST_GREETING" not in os.environ

    on_shared(cpu_node, scenario)


def test_payloads_reach_the_handler_as_declared_and_outputs_carry_their_content_type(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("payloads", node.shelf.digest("echo_function"))

        as_json = await node.call(model, {"a": [1, 2]})
        with_charset = await node.call(model, b'{"a": 3}', content_type="application/json; charset=utf-8")
        undeclared = await node.call(model, b'{"a": 4}', content_type="")
        raw = await node.call(model, b"\xff\x00raw", content_type=OCTETS)
        declared_text = await node.call(model, b'{"a": 5}', content_type="text/plain")
        text = await node.call(model, {"text": True})
        invalid = await node.call(model, b"{not json", content_type=JSON)
        after = await node.call(model, {"a": 6})

        assert ok(as_json)["echo"] == {"a": [1, 2]}
        assert ok(with_charset)["echo"] == {"a": 3}
        assert ok(undeclared)["echo"] == {"a": 4}  # no content type: parsed when it is JSON
        for result, sent in ((raw, b"\xff\x00raw"), (declared_text, b'{"a": 5}')):
            # Given to the handler as bytes (never parsed), so echoed back as bytes.
            assert (result.outcome, result.output, result.content_type) == (pb.OK, sent, OCTETS)
        assert (text.outcome, text.output, text.content_type) == (pb.OK, b"plain text", "text/plain; charset=utf-8")
        assert invalid.outcome == pb.INVALID_INPUT
        assert "declared application/json but is not valid JSON" in invalid.message
        assert invalid.output == b""
        assert ok(after)["pid"] == ok(as_json)["pid"]  # the caller's mistake: the worker stays

    on_shared(cpu_node, scenario)


def test_an_output_over_the_limit_or_not_encodable_fails_that_call_and_the_worker_stays(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("limits", node.shelf.digest("probe_function"))
        pid = ok(await node.call(model, {}))["pid"]

        at_limit = await node.call(model, {"text_bytes": MAX_BODY_BYTES})
        too_large = await node.call(model, {"text_bytes": MAX_BODY_BYTES + 1})
        unencodable = await node.call(model, {"unencodable": True})
        after = await node.call(model, {})

        assert (at_limit.outcome, len(at_limit.output)) == (pb.OK, MAX_BODY_BYTES)
        assert too_large.outcome == pb.OUTPUT_TOO_LARGE
        assert f"{MAX_BODY_BYTES + 1} bytes, over the node's limit of {MAX_BODY_BYTES} bytes" in too_large.message
        assert "--max-payload-mb on the nodes and the gateways" in too_large.message  # both bound a result
        assert too_large.output == b""
        assert unencodable.outcome == pb.OUTPUT_INVALID
        assert "set is not bytes, str or JSON-serializable" in unencodable.message
        assert ok(after) == {"calls": 5, "pid": pid}

    on_shared(cpu_node, scenario)


def test_an_output_holding_nan_or_infinity_is_output_invalid_and_the_worker_stays(cpu_node: Node) -> None:
    # Once answered OK as bare NaN / Infinity under application/json, which strict clients cannot parse.
    pytest.importorskip("torch")

    async def scenario(node: Node) -> None:
        model = on_cpu("not-finite", node.shelf.digest("probe_function"))
        pid = ok(await node.call(model, {}))["pid"]

        nan = await node.call(model, {"not_finite": "float"})
        inf = await node.call(model, {"not_finite": "tensor"})
        after = await node.call(model, {})

        for result in (nan, inf):
            assert (result.outcome, result.output) == (pb.OUTPUT_INVALID, b"")
            assert result.message.startswith("ValueError: the output holds NaN or Infinity, which JSON cannot carry")
            assert "return None (JSON null) or a string" in result.message
        assert ok(after) == {"calls": 4, "pid": pid}

    on_shared(cpu_node, scenario)


def test_the_linear_function_loads_its_safetensors_weights_and_computes_with_torch(cpu_node: Node) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    async def scenario(node: Node) -> None:
        model = on_cpu("linear", node.shelf.digest("linear_function"))
        inputs = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]]

        first = await node.call(model, {"inputs": inputs})
        second = await node.call(model, {"inputs": inputs})

        weights = load_file(str(node.shelf.tmp_path / "linear_function-src" / "weights.safetensors"))
        expected = (torch.tensor(inputs) @ weights["weight"].T + weights["bias"]).tolist()
        outputs = ok(first)["outputs"]  # a tensor, returned as nested lists
        assert len(outputs) == 2
        for got, want in zip(outputs, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-6)
        assert second.output == first.output
        assert first.loaded and not second.loaded

    on_shared(cpu_node, scenario)


# --- handler failures ------------------------------------------------------------------------------


def test_a_predict_error_is_a_handler_error_and_the_worker_keeps_serving(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("flaky", node.shelf.digest("failing_function"))

        failed = await node.call(model, {"fail": True})
        pid = node.pid_of("flaky")
        after = await node.call(model, {"fail": False})

        assert failed.outcome == pb.HANDLER_ERROR
        assert failed.message == "predict raised RuntimeError: bad input"
        assert failed.loaded  # the model loaded fine; its predict failed
        assert (after.outcome, after.output, after.loaded) == (pb.OK, b"ok", False)
        assert node.pid_of("flaky") == pid

    on_shared(cpu_node, scenario)


def test_a_load_error_fails_every_waiting_call_and_leaves_no_worker(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        [hello] = await node.pool.spares_ready(TIMEOUT_S)
        spare = Proc.of(hello.pid)  # the miss takes it
        model = on_cpu("broken", node.shelf.digest("failing_load_function"))
        metrics = NodeMetrics(node.pool, node="n0")
        lost_before = metrics.registry.get_sample_value("gpufaas_node_workers_lost_total") or 0.0

        def lost() -> float:
            return (metrics.registry.get_sample_value("gpufaas_node_workers_lost_total") or 0.0) - lost_before

        results = await asyncio.gather(node.call(model, {}), node.call(model, {}))

        for result in results:
            assert result.outcome == pb.LOAD_FAILED
            assert "load failed: RuntimeError: weights are missing" in result.message
            metrics.ran(model.model, result)  # (as the node does with each call's answer)
        assert [r.loaded for r in results] == [True, False]
        assert "broken" not in node.models()
        await eventually(lambda: not spare.running, "the worker that failed to load exits")
        await eventually(lambda: lost() == 1, "one worker lost, not one per call that waited on it")
        again = await node.call(model, {})  # not remembered: the next call tries again
        assert (again.outcome, again.loaded) == (pb.LOAD_FAILED, True)

    on_shared(cpu_node, scenario)


def test_a_package_that_cannot_be_had_fails_the_load(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        async with open_pool("emulated", shelf) as node:
            missing = "sha256:" + "0" * 64

            result = await node.call(emulated("m", missing), {})

            assert (result.outcome, result.loaded) == (pb.LOAD_FAILED, True)
            assert "function package unavailable" in result.message
            assert node.pool.workers() == []
            assert ok(await node.call(emulated("m", shelf.digest("echo_function")), {}))["echo"] == {}

    run(scenario)


# --- timeouts and deaths ---------------------------------------------------------------------------


def test_a_call_stuck_past_its_timeout_kills_its_worker_and_the_next_call_loads_afresh(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("stuck", node.shelf.digest("sleepy_function"))
        worker = Proc.of(ok(await node.call(model, {"sleep_s": 0}))["pid"])

        stuck = asyncio.create_task(node.call(model, {"sleep_s": 60}, timeout_s=0.5))
        await asyncio.sleep(0)  # sent first
        behind = asyncio.create_task(node.call(model, {"sleep_s": 0}))
        timed_out, queued = await stuck, await behind

        assert (timed_out.outcome, timed_out.worker_killed) == (pb.TIMEOUT, True)
        assert "no result within the 0.5 s timeout; worker killed" in timed_out.message
        assert queued.outcome == pb.WORKER_DIED  # it was waiting on the killed worker
        assert "stuck" not in node.models()
        await eventually(lambda: not worker.running, "the stuck worker is killed")

        fresh = await node.call(model, {"sleep_s": 0})
        assert fresh.loaded
        assert ok(fresh)["pid"] != worker.pid

    on_shared(cpu_node, scenario)


def test_a_call_queued_behind_a_slow_call_times_out_without_killing_the_worker(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("queued", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(model, {"sleep_s": 0}))["pid"]

        slow = asyncio.create_task(node.call(model, {"sleep_s": 1.0}))
        await asyncio.sleep(0.2)  # the worker is in the slow call
        queued = await node.call(model, {"sleep_s": 0}, timeout_s=0.3)

        assert (queued.outcome, queued.worker_killed) == (pb.TIMEOUT, False)
        assert "still queued at the worker" in queued.message
        assert ok(await slow)["pid"] == pid
        assert ok(await node.call(model, {"sleep_s": 0}))["pid"] == pid

    on_shared(cpu_node, scenario)


def test_a_result_written_before_a_deadline_kill_still_answers_its_call(cpu_node: Node) -> None:
    """A batch of two answered as the first one's deadline came, the node not yet having read
    them (its reading paused here, as a busy event loop's timers run before its reads): the first
    times out and its worker is killed, and the second still gets the result its worker wrote."""

    async def scenario(node: Node) -> None:
        model = on_cpu("written", node.shelf.digest("batch_function"), max_batch_size=2, max_batch_wait_ms=500)
        pid = ok(await node.call(model, {"i": 0}))["pid"]
        worker = node.pool._workers.get("written", "gpu0")
        assert worker is not None and worker.conn is not None and worker.conn.transport is not None
        worker.conn.transport.pause_reading()

        first = asyncio.create_task(node.call(model, {"i": 1}, timeout_s=1.0))
        mate = asyncio.create_task(node.call(model, {"i": 2}))
        timed_out, answered = await first, await mate

        assert (timed_out.outcome, timed_out.worker_killed) == (pb.TIMEOUT, True)
        assert (ok(answered)["echo"], ok(answered)["pid"], answered.batch_calls) == ({"i": 2}, pid, 2)
        assert "written" not in node.models()

    on_shared(cpu_node, scenario)


def test_a_load_past_the_timeout_kills_the_loading_worker(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        async with open_pool("emulated", shelf) as node:
            spare = Proc.of(node.hellos[0].pid)

            result = await node.call(emulated("slow", shelf.digest("echo_function"), load_s=60), timeout_s=0.5)

            assert (result.outcome, result.loaded, result.worker_killed) == (pb.TIMEOUT, True, True)
            assert "not loaded within the 0.5 s timeout" in result.message
            assert node.pool.workers() == []
            await eventually(lambda: not spare.running, "the loading worker is killed")

    run(scenario)


def test_a_worker_killed_under_a_call_is_worker_died_and_the_next_call_loads_afresh(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("killed", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(model, {"sleep_s": 0}))["pid"]

        under = asyncio.create_task(node.call(model, {"sleep_s": 30}))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        died = await under

        assert died.outcome == pb.WORKER_DIED
        assert f"pid {pid}" in died.message
        fresh = await node.call(model, {"sleep_s": 0})
        assert fresh.loaded
        fresh_pid = ok(fresh)["pid"]
        assert fresh_pid != pid

        # Killed while idle: once the pool has seen it go, the next call loads afresh too.
        os.kill(fresh_pid, signal.SIGKILL)
        await eventually(lambda: "killed" not in node.models(), "the pool notices the idle worker's death")
        again = await node.call(model, {"sleep_s": 0})
        assert again.loaded
        assert ok(again)["pid"] not in (pid, fresh_pid)

    on_shared(cpu_node, scenario)


# --- eviction and redeploys ------------------------------------------------------------------------


def test_evict_stops_the_process_and_answers_false_for_a_model_it_does_not_run(tmp_path: Path) -> None:
    async def scenario(node: Node, digest: str) -> None:
        ok(await node.call(emulated("a", digest)))
        # Every call of b takes 30 s: its first is still running when b is evicted.
        in_flight = asyncio.create_task(node.call(emulated("b", digest, inference_s=30)))
        await eventually(lambda: node.models() == ["a", "b"], "b is loaded")
        await asyncio.sleep(0.1)
        pid_a, pid_b = Proc.of(node.pid_of("a")), Proc.of(node.pid_of("b"))

        assert await node.pool.evict("a", "gpu0") is True
        assert not pid_a.running  # evict returns once the process is gone
        assert node.models() == ["b"]
        assert await node.pool.evict("a", "gpu0") is False
        assert await node.pool.evict("never-loaded", "gpu0") is False
        assert await node.pool.evict("b", "gpu1") is False  # no such GPU, no such worker

        assert await node.pool.evict("b", "gpu0") is True
        assert not pid_b.running
        assert (await in_flight).outcome == pb.WORKER_DIED
        assert (await node.call(emulated("a", digest))).loaded

    on_own_emulated_pool(tmp_path, scenario)


def test_a_victim_is_stopped_on_a_miss_unless_a_later_grant_used_it_or_it_has_calls_in_flight(
    tmp_path: Path,
) -> None:
    async def scenario(node: Node, digest: str) -> None:
        victim = emulated("victim", digest, inference_s=0.5)
        ok(await node.call(victim, seq=1))
        first = Proc.of(node.pid_of("victim"))

        ok(await node.call(emulated("b", digest), evict=("victim",), seq=2))
        assert node.models() == ["b"]
        await eventually(lambda: not first.running, "the victim exits")

        ok(await node.call(victim, seq=5))
        second = Proc.of(node.pid_of("victim"))
        ok(await node.call(emulated("c", digest), evict=("victim",), seq=3))  # an older grant
        assert node.models() == ["b", "c", "victim"]

        in_flight = asyncio.create_task(node.call(victim, seq=6))
        await asyncio.sleep(0.1)
        ok(await node.call(emulated("d", digest), evict=("victim",), seq=10))
        assert ok(await in_flight)["model"] == "victim"
        assert node.models() == ["b", "c", "d", "victim"]
        assert second.running

        # A hit may name victims too (the grant expected a miss).
        ok(await node.call(emulated("b", digest), evict=("victim",), seq=11))
        assert node.models() == ["b", "c", "d"]
        await eventually(lambda: not second.running, "the victim exits")

    on_own_emulated_pool(tmp_path, scenario)


def test_the_host_tier_keeps_an_evicted_worker_and_a_miss_takes_it_back(tmp_path: Path) -> None:
    async def scenario(node: Node, probe: str) -> None:
        # Each parked worker measures 100 MB here (the real measure is the next test's).
        first = ok(await node.call(on_cpu("a", probe, memory_mb=100), {}))
        ok(await node.call(on_cpu("b", probe, memory_mb=100), {}, evict=("a",), seq=1))
        assert node.models() == ["b"]  # "a" left the GPU...
        parked = Proc.of(first["pid"])
        assert parked.running  # ... but its process stays, its model in host memory

        # A miss for "a", even on the other GPU, takes it back: no load, the same process.
        back = await node.call(on_cpu("a", probe, memory_mb=100), {}, gpu="gpu1", seq=2)
        assert ok(back)["pid"] == parked.pid
        assert back.loaded and back.stages is not None
        assert back.stages.from_host and back.stages.load_s == 0.0
        assert node.models("gpu1") == ["a"]

        # The tier holds 250 MB of models: parking a third 100 MB one pushes the oldest out.
        ok(await node.call(on_cpu("c", probe, memory_mb=100), {}, seq=3))
        b_proc, c_proc = Proc.of(node.pid_of("b")), Proc.of(node.pid_of("c"))
        for victim, seq in (("b", 4), ("c", 5)):
            ok(await node.call(on_cpu(f"new-{victim}", probe, memory_mb=100), {}, evict=(victim,), seq=seq))
        ok(await node.call(on_cpu("d", probe, memory_mb=100), {}, gpu="gpu1", evict=("a",), seq=6))
        await eventually(lambda: not b_proc.running, "the oldest parked worker is stopped")
        assert c_proc.running and parked.running
        b_back = await node.call(on_cpu("b", probe, memory_mb=100), {}, seq=7)
        assert b_back.loaded and b_back.stages is not None and not b_back.stages.from_host, "b was pushed out"

    on_two_gpus_and_a_host_tier(tmp_path, scenario, host_cache_mb=250, parked_mb=100)


def test_misses_faster_than_spares_are_made_raise_the_spares_kept_up_to_the_extra(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool("cpu", shelf, extra_spares=1, cpu_busy=lambda: False) as node:
            assert node.pool.spare_count("gpu0") == 1
            for seq, model in enumerate("abcdefgh", start=1):  # loads as fast as spares are made
                ok(await node.call(on_cpu(model, probe, memory_mb=100), {}, seq=seq))
            await eventually(lambda: node.pool.spare_count("gpu0") == 2, "the floor and 1 extra spare warm")
            await asyncio.sleep(0.3)
            assert len(node.forked_workers()) == 8 + 2  # never more than floor + extra

        async with open_pool("cpu", shelf, extra_spares=1, cpu_busy=lambda: True) as busy:
            for seq, model in enumerate("abcdefgh", start=1):
                ok(await busy.call(on_cpu(model, probe, memory_mb=100), {}, seq=seq))
            await asyncio.sleep(0.5)
            assert busy.pool.spare_count("gpu0") == 1  # busy CPUs: the floor only

    run(scenario)


def test_a_worker_taken_back_onto_another_gpu_follows_that_gpus_grant_order(tmp_path: Path) -> None:
    async def scenario(node: Node, probe: str) -> None:
        # "a" serves on gpu0 at grant 500 of gpu0's order, then is parked.
        ok(await node.call(on_cpu("a", probe, memory_mb=100), {}, gpu="gpu0", seq=500))
        ok(await node.call(on_cpu("b", probe, memory_mb=100), {}, gpu="gpu0", evict=("a",), seq=501))
        # gpu1's order is at 3: "a" comes back there, and grant 4 of gpu1 evicts it.
        back = await node.call(on_cpu("a", probe, memory_mb=100), {}, gpu="gpu1", seq=3)
        assert back.stages is not None and back.stages.from_host
        ok(await node.call(on_cpu("c", probe, memory_mb=100), {}, gpu="gpu1", evict=("a",), seq=4))
        assert node.models("gpu1") == ["c"]  # gpu0's grant 500 did not make it look newer
        assert [m for m, _ in node.pool.parked()] == ["a"]

    on_two_gpus_and_a_host_tier(tmp_path, scenario, host_cache_mb=1000, parked_mb=20)


def test_parked_workers_are_charged_their_measured_host_memory_not_their_declared_gpu_memory(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        # 1,500 MB of tier and models declared at 1,000 MB: by declared memory one would fit.
        async with open_pool("cpu", shelf, host_cache_mb=1500) as node:
            procs = [Proc.of(ok(await node.call(on_cpu("a", probe, memory_mb=1000), {}, seq=1))["pid"])]
            for seq, (model, victim) in enumerate(zip("bcd", "abc", strict=True), start=2):
                call = await node.call(on_cpu(model, probe, memory_mb=1000), {}, evict=(victim,), seq=seq)
                procs.append(Proc.of(ok(call)["pid"]))
                # Measured once parked (until then a worker is charged its declared 1,000 MB).
                await eventually(lambda: all(mb < 1000 for _, mb in node.pool.parked()), f"{victim} charged its PSS")
            assert [m for m, _ in node.pool.parked()] == ["a", "b", "c"]
            procs.pop()  # d's, on the GPU
            assert all(p.running for p in procs)
            for _, host_mb in node.pool.parked():
                assert 0 < host_mb < 500  # a worker forked from the zygote shares most of its pages

    run(scenario)


def test_staged_exit_parks_an_idle_worker_then_stops_it_and_leaves_a_busy_or_regranted_one(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool("cpu", shelf, host_cache_mb=1000, measure_host_mb=lambda pid: 100) as node:
            proc = Proc.of(ok(await node.call(on_cpu("a", probe, memory_mb=100), {}, seq=1))["pid"])
            # Released to the host tier: off the GPU, its process kept, reported as parked.
            assert await node.pool.release("a", "gpu0", to_host=True, seq=1) is True
            assert node.models() == [] and node.pool.parked() == [("a", 100)] and proc.running
            assert await node.pool.release("a", "gpu0", to_host=True, seq=1) is False  # not on the GPU now
            # Second stage: the host copy goes, and its process with it.
            assert await node.pool.release_from_host("a") is True
            assert node.pool.parked() == [] and not proc.running
            assert await node.pool.release_from_host("a") is False

            # A worker a later grant used, or one with a call in flight, stays.
            ok(await node.call(on_cpu("b", probe, memory_mb=100), {}, seq=5))
            assert await node.pool.release("b", "gpu0", to_host=True, seq=4) is False
            slow = on_cpu("slow", shelf.digest("sleepy_function"), memory_mb=100)
            in_flight = asyncio.create_task(node.call(slow, {"sleep_s": 1.0}, seq=6))
            await eventually(lambda: "slow" in node.models(), "slow is loaded")
            await asyncio.sleep(0.1)
            assert await node.pool.release("slow", "gpu0", to_host=False, seq=6) is False
            ok(await in_flight)
            # Without to_host (or without a tier) a release stops the worker.
            b_proc = Proc.of(node.pid_of("b"))
            assert await node.pool.release("b", "gpu0", to_host=False, seq=6) is True
            assert not b_proc.running and node.pool.parked() == []

    run(scenario)


def test_a_miss_after_a_deadline_kill_waits_for_the_killed_workers_exit(tmp_path: Path) -> None:
    """A worker killed at a call's deadline holds its device memory until it exits, as a stopped
    one does: the next miss on its GPU (whose grant names no victims: the scheduler dropped the
    model) loaded beside it without waiting, on cuda into an out-of-memory."""
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        sleepy, probe = shelf.digest("sleepy_function"), shelf.digest("probe_function")
        async with open_pool("cpu", shelf, wait_for_victims=True) as node:
            ok(await node.call(on_cpu("slow", sleepy), {"sleep_s": 0}, seq=1))
            killed = node.pool._workers.get("slow", "gpu0")
            assert killed is not None
            waited: list[bool] = []
            load = node.pool._loader.load

            async def watched(worker: Any, run_: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]]) -> Any:
                waited.append(killed.exited in victims)
                return await load(worker, run_, gpu_id, victims)

            node.pool._loader.load = watched  # type: ignore[method-assign]
            timed_out = await node.call(on_cpu("slow", sleepy), {"sleep_s": 5}, timeout_s=0.3, seq=2)
            assert timed_out.outcome == pb.TIMEOUT and timed_out.worker_killed
            exited_then = killed.exited.done()
            ok(await node.call(on_cpu("b", probe), {}, seq=3))
            assert exited_then or waited == [True], waited

    run(scenario)


def test_a_take_back_that_names_a_victim_is_not_pushed_out_of_the_tier_by_it(tmp_path: Path) -> None:
    """The scheduler books a take-back from the host tier as the model leaving the tier, then its
    victims entering it; the node parked the victims first, so with the tier near full the model
    itself was pushed out, and the call loaded it afresh."""
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool("cpu", shelf, host_cache_mb=150, measure_host_mb=lambda pid: 100) as node:
            ok(await node.call(on_cpu("a", probe, memory_mb=100), {}, seq=1))
            ok(await node.call(on_cpu("b", probe, memory_mb=100), {}, evict=("a",), seq=2))
            await eventually(lambda: node.pool.parked() == [("a", 100)], "a parked and measured")
            back = await node.call(on_cpu("a", probe, memory_mb=100), {}, evict=("b",), seq=3)
            assert back.stages is not None and back.stages.from_host, back.stages
            await eventually(lambda: node.pool.parked() == [("b", 100)], "b parked in its place")

    run(scenario)


def test_a_miss_waits_for_a_released_worker_still_exiting_on_its_gpu(tmp_path: Path) -> None:
    """A release frees the scheduler's memory at once, so the next grant for that GPU names no
    victims; where device memory matters (`wait_for_victims`, the cuda default) its load must
    still wait until the released process is gone."""
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool("cpu", shelf, wait_for_victims=True) as node:
            # It ignores SIGTERM, so it exits only when it gets SIGKILL, STOP_GRACE_S later.
            released = Proc.of(ok(await node.call(on_cpu("a", probe), {"ignore_sigterm": True}, seq=1))["pid"])
            release = asyncio.create_task(node.pool.release("a", "gpu0", to_host=False, seq=1))
            await asyncio.sleep(0.1)
            started = time.perf_counter()
            ok(await node.call(on_cpu("b", probe), {}, seq=2))  # a miss that names no victims
            assert not released.running
            assert time.perf_counter() - started >= STOP_GRACE_S - 0.3
            assert await release is True

    run(scenario)


def test_a_parked_worker_of_an_older_package_or_a_dead_one_is_not_taken_back(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe, echo = shelf.digest("probe_function"), shelf.digest("echo_function")
        async with open_pool("cpu", shelf, host_cache_mb=1000) as node:
            old = Proc.of(ok(await node.call(on_cpu("a", probe), {}))["pid"])
            ok(await node.call(on_cpu("b", probe), {}, evict=("a",), seq=1))
            assert old.running
            # Redeployed meanwhile: the parked worker runs stale code; it is stopped, the new loads.
            fresh = await node.call(on_cpu("a", echo), {"x": 1}, seq=2)
            assert ok(fresh)["echo"] == {"x": 1}
            assert fresh.stages is not None and not fresh.stages.from_host
            await eventually(lambda: not old.running, "the stale parked worker exits")

            ok(await node.call(on_cpu("c", echo), {}, evict=("b",), seq=3))
            parked = Proc.of(node.pid_of("c"))
            ok(await node.call(on_cpu("d", echo), {}, evict=("c",), seq=4))
            parked.kill()
            await eventually(lambda: not parked.running, "the parked worker dies")
            await asyncio.sleep(0.1)
            again = await node.call(on_cpu("c", echo), {"y": 2}, seq=5)
            assert ok(again)["echo"] == {"y": 2} and again.stages is not None and not again.stages.from_host

    run(scenario)


def test_the_host_tier_is_the_cpu_backends(tmp_path: Path) -> None:
    for backend in ("emulated", "cuda"):
        with pytest.raises(ValueError, match="cpu"):
            WorkerPool(backend, gpus={"gpu0": 0}, fetch_package=Shelf(tmp_path).fetch, host_cache_mb=100)


@pytest.mark.parametrize("wait_for_victims", [False, True])
def test_a_miss_waits_for_its_victims_to_exit_only_when_asked(tmp_path: Path, wait_for_victims: bool) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        probe = shelf.digest("probe_function")
        async with open_pool("cpu", shelf, wait_for_victims=wait_for_victims) as node:
            # A victim that ignores SIGTERM exits only when it gets SIGKILL, STOP_GRACE_S later.
            victim = Proc.of(ok(await node.call(on_cpu("victim", probe), {"ignore_sigterm": True}))["pid"])

            started = time.perf_counter()
            miss = await node.call(on_cpu("newcomer", probe), {}, evict=("victim",), seq=1)
            elapsed_s = time.perf_counter() - started

            ok(miss)
            if wait_for_victims:  # its device memory must be free before the load
                assert not victim.running
                assert elapsed_s >= STOP_GRACE_S
            else:
                assert elapsed_s < STOP_GRACE_S / 2
            await eventually(lambda: not victim.running, "the victim is killed")
            assert node.models() == ["newcomer"]

    run(scenario)


def test_a_redeployed_package_replaces_the_worker(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        old = ok(await node.call(on_cpu("fn", node.shelf.digest("echo_function")), {"x": 1}))
        assert old["echo"] == {"x": 1}
        old_worker = Proc.of(old["pid"])

        redeployed = await node.call(on_cpu("fn", node.shelf.digest("sleepy_function")), {"sleep_s": 0})

        assert redeployed.loaded
        new = ok(redeployed)
        assert new["slept_s"] == 0  # the new package's code
        assert new["pid"] != old["pid"]
        assert node.pool.workers() == [("fn", "gpu0", new["pid"], 300)]
        assert not old_worker.running

    on_shared(cpu_node, scenario)


def test_concurrent_calls_after_a_redeploy_load_one_new_worker(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        v1, v2 = shelf.digest("echo_function"), shelf.digest("sleepy_function")
        async with open_pool("emulated", shelf) as node:
            ok(await node.call(emulated("fn", v1)))
            old = Proc.of(node.pid_of("fn"))

            results = await asyncio.gather(*(node.call(emulated("fn", v2), {"i": i}) for i in range(3)))

            assert [ok(r)["echo"] for r in results] == [{"i": i} for i in range(3)]
            assert not old.running
            spares = {h.pid for h in await node.pool.spares_ready(TIMEOUT_S)}
            assert {p.pid for p in node.forked_workers()} == {node.pid_of("fn")} | spares  # nothing else runs
            assert [r.loaded for r in results].count(True) == 1

    run(scenario)


# --- dynamic batching ------------------------------------------------------------------------------


def test_calls_waiting_at_a_batching_worker_are_merged_into_one_predict(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        model = on_cpu("batcher", node.shelf.digest("batch_function"), max_batch_size=4)
        alone = await node.call(model, {"i": 0})
        assert (ok(alone)["batch_size"], alone.batch_calls) == (1, 1)

        holder = asyncio.create_task(node.call(model, {"i": 1, "sleep_s": 0.8}))
        await asyncio.sleep(0.4)  # the worker is busy with it: the next calls wait in its socket
        inputs: list[dict[str, Any]] = [{"i": 2}, {"i": 3, "unencodable": True}, {"i": 4}, {"i": 5}, {"i": 6}]
        merged = await asyncio.gather(*(node.call(model, one) for one in inputs))

        assert (await holder).batch_calls == 1
        assert [r.outcome for r in merged] == [pb.OK, pb.OUTPUT_INVALID, pb.OK, pb.OK, pb.OK]
        assert [merged[i].batch_calls for i in (0, 2, 3)] == [4, 4, 4]  # up to max_batch_size
        assert merged[4].batch_calls == 1  # the fifth call: the next batch
        for result, sent in zip(merged, inputs, strict=True):
            if result.outcome == pb.OK:
                assert ok(result)["echo"] == sent  # each call gets its own output
        assert ok(merged[4])["batch_sizes"] == [1, 1, 4, 1]  # as predict saw them

    on_shared(cpu_node, scenario)


def test_a_batch_whose_predict_returns_the_wrong_number_of_outputs_is_run_again_call_by_call(cpu_node: Node) -> None:
    # Which call's input made the count wrong is not known: each is run alone, and only its own fails.
    async def scenario(node: Node) -> None:
        model = on_cpu("miscounting", node.shelf.digest("batch_function"), max_batch_size=4)
        pid = ok(await node.call(model, {"i": 0}))["pid"]

        holder = asyncio.create_task(node.call(model, {"sleep_s": 0.8}))
        await asyncio.sleep(0.4)
        batch = await asyncio.gather(*(node.call(model, one) for one in ({"i": 1}, {"drop_one": True}, {"i": 2})))

        ok(await holder)
        assert [result.outcome for result in batch] == [pb.OK, pb.HANDLER_ERROR, pb.OK]
        assert "predict was given a batch of 1 inputs and returned 0 outputs" in batch[1].message
        assert ok(await node.call(model, {"i": 3}))["pid"] == pid

    on_shared(cpu_node, scenario)


def test_max_batch_wait_lets_a_lone_call_wait_for_company_but_no_longer(cpu_node: Node) -> None:
    async def scenario(node: Node) -> None:
        batch = node.shelf.digest("batch_function")
        model = on_cpu("waiting", batch, max_batch_size=4, max_batch_wait_ms=400.0)
        ok(await node.call(model, {"i": 0}))

        started = time.perf_counter()
        lone = await node.call(model, {"i": 1})
        lone_s = time.perf_counter() - started
        first = asyncio.create_task(node.call(model, {"i": 2}))
        await asyncio.sleep(0.1)
        second = await node.call(model, {"i": 3})

        assert lone.batch_calls == 1
        assert 0.4 <= lone_s < 2.0
        assert [(await first).batch_calls, second.batch_calls] == [2, 2]

        # A batch that fills up does not wait.
        await node.pool.spares_ready(TIMEOUT_S)
        patient = on_cpu("patient", batch, max_batch_size=2, max_batch_wait_ms=5000.0)
        started = time.perf_counter()
        full = await asyncio.gather(node.call(patient, {"i": 4}), node.call(patient, {"i": 5}))
        assert [r.batch_calls for r in full] == [2, 2]
        assert time.perf_counter() - started < 3.0

    on_shared(cpu_node, scenario)


# --- spares, the zygote, shutdown ------------------------------------------------------------------


def test_a_spare_that_dies_is_replaced(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        async with open_pool("emulated", shelf) as node:
            [spare] = node.hellos
            os.kill(spare.pid, signal.SIGKILL)

            async with asyncio.timeout(TIMEOUT_S):
                while not (fresh := [h.pid for h in await node.pool.spares_ready() if h.pid != spare.pid]):
                    await asyncio.sleep(0.01)
            assert node.pool.spare_count("gpu0") == 1
            node.watch()
            miss = await node.call(emulated("m", shelf.digest("echo_function")))

            ok(miss)
            assert miss.stages is not None and miss.stages.start_s == 0  # a warm spare took it
            assert node.pid_of("m") == fresh[0]

    run(scenario)


def test_a_zygote_that_dies_is_restarted_and_misses_still_work(tmp_path: Path) -> None:
    async def scenario(node: Node, digest: str) -> None:
        [spare] = node.hellos
        [zygote] = node.zygotes()
        zygote.kill()
        await eventually(lambda: not zygote.running, "the zygote dies")

        # The spare it forked before it died still serves (it speaks to the pool, not the zygote).
        assert ok(await node.call(emulated("a", digest)))["model"] == "a"
        assert node.pid_of("a") == spare.pid
        # A worker forked after: by a new zygote.
        assert ok(await node.call(emulated("b", digest)))["model"] == "b"
        [restarted] = node.zygotes()
        assert restarted != zygote
        node.watch()

        # The dead zygote's workers are orphans now; stopping one is as prompt as any other.
        async with asyncio.timeout(5):
            assert await node.pool.evict("a", "gpu0")

    on_own_emulated_pool(tmp_path, scenario)


def _open_sockets() -> set[str]:
    """The sockets this process has open now ("socket:[inode]", from /proc/self/fd)."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        with suppress(OSError):
            if (target := os.readlink(entry)).startswith("socket:"):
                found.add(target)
    return found


def test_a_dead_zygotes_control_socket_is_closed_when_it_is_replaced(tmp_path: Path) -> None:
    async def scenario(node: Node, digest: str) -> None:
        [zygote] = node.zygotes()
        runtime = node.pool._processes.runtime
        control = runtime._zygote.control  # type: ignore[attr-defined]
        dead_control = f"socket:[{os.fstat(control.fileno()).st_ino}]"
        zygote.kill()
        await eventually(lambda: not zygote.running, "the zygote dies")

        assert ok(await node.call(emulated("a", digest)))["model"] == "a"  # the spare forked before
        assert ok(await node.call(emulated("b", digest)))["model"] == "b"  # forked by a new zygote
        node.watch()

        # Each restart (a zygote the OOM killer took, say) kept one more descriptor for good.
        assert dead_control not in _open_sockets()

    on_own_emulated_pool(tmp_path, scenario)


def test_a_zygote_that_cannot_be_started_leaves_no_socket_open(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("emulated", shelf, spares_per_gpu=0, warm=False, python=str(tmp_path / "gone")) as node:
            before = _open_sockets()
            for _ in range(3):  # (an interpreter removed under the node, or a fork refused for memory)
                failed = await node.call(emulated("a", digest))
                assert failed.outcome == pb.WORKER_DIED, failed.message
            assert _open_sockets() <= before  # each attempt kept its end of the control socket

    run(scenario)


def test_shutdown_stops_every_worker_and_the_zygote_and_refuses_later_calls(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("emulated", shelf, gpus=("gpu0", "gpu1")) as node:
            await asyncio.gather(node.call(emulated("a", digest)), node.call(emulated("a", digest), gpu="gpu1"))
            loading = asyncio.create_task(node.call(emulated("b", digest, load_s=60)))
            await asyncio.sleep(0.3)
            running = descendants(os.getpid()) - node.before
            assert len(running) >= 4  # the zygote, two ready workers, one loading

            await node.shutdown()

            await eventually(lambda: not any(p.running for p in running), "every process exits", 5.0)
            assert node.pool.workers() == []
            later = await node.call(emulated("a", digest))
            assert later.outcome == pb.WORKER_DIED
            assert "shutting down" in later.message
            try:
                interrupted = await loading
            except asyncio.CancelledError:
                pytest.fail("a call loading during shutdown raised CancelledError instead of answering")
            assert interrupted.outcome == pb.WORKER_DIED

    run(scenario)


def test_shutdown_while_the_zygote_is_starting_is_prompt_and_leaves_nothing_running(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)
    # An interpreter that takes 3 s to start, as the cuda backend's zygote can (torch, CUDA).
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "import os, sys, time; time.sleep(3); '
        f'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])" "$@"\n'
    )
    slow_python.chmod(0o755)

    async def scenario() -> None:
        async with open_pool("emulated", shelf, warm=False, python=str(slow_python)) as node:
            await asyncio.sleep(0.2)  # the first spare is waiting for the zygote
            assert node.pool.spare_count("gpu0") == 0

            await node.shutdown(timeout_s=5.0)  # nothing to wait for: no worker exists yet

            await asyncio.sleep(0.5)  # a zygote or worker still on its way would show up by now
            node.watch()
            assert not any(p.running for p in node.started)

    run(scenario)


def test_a_pool_refuses_an_unknown_backend_an_unknown_gpu_and_a_negative_spare_count(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def scenario() -> None:
        with pytest.raises(UnknownBackend, match="unknown backend 'tpu'"):
            WorkerPool("tpu", gpus={"gpu0": 0}, fetch_package=shelf.fetch)
        with pytest.raises(ValueError, match="spares_per_gpu must be >= 0"):
            WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=shelf.fetch, spares_per_gpu=-1)
        before = descendants(os.getpid())
        pool = WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=shelf.fetch)
        result = await pool.run(
            emulated("m", shelf.digest("echo_function")), "gpu7", "c", b"{}", content_type=JSON, timeout_s=1
        )
        assert (result.outcome, result.message) == (pb.REFUSED, "this node has no GPU 'gpu7'")
        assert descendants(os.getpid()) == before  # refused before anything started
        assert shelf.fetched == []
        await pool.shutdown()

    run(scenario)


def test_the_emulated_zygote_and_workers_never_load_torch_or_numpy(tmp_path: Path, cpu_node: Node) -> None:
    shelf = Shelf(tmp_path)

    def libraries(proc: Proc) -> str:
        return Path(f"/proc/{proc.pid}/maps").read_text()

    async def scenario() -> None:
        async with open_pool("emulated", shelf) as node:
            ok(await node.call(emulated("m", shelf.digest("echo_function")), {"x": [1.5]}))
            processes = [*node.zygotes(), *node.forked_workers()]
            assert len(processes) == 3  # the zygote, the model's worker, a spare
            for proc in processes:
                maps = libraries(proc)
                assert "torch" not in maps and "numpy" not in maps, f"pid {proc.pid} loaded torch or numpy"
        [cpu_zygote] = cpu_node.zygotes()  # the check does see torch where it is loaded
        assert "libtorch" in libraries(cpu_zygote)

    run(scenario)


def test_two_calls_sharing_a_call_id_on_one_worker_each_get_their_own_output(tmp_path: Path) -> None:
    # A client's X-Call-Id is its own choice: the same id can reach one worker twice (a retry
    # through another gateway, placed beside a call run under a lease). Each call gets its output.
    async def scenario(node: Node) -> None:
        model = on_cpu("shared-id", node.shelf.digest("echo_function"))

        def call(who: str) -> Coroutine[Any, Any, RunResult]:
            payload = json.dumps({"who": who}).encode()
            return node.pool.run(model, "gpu0", "abc", payload, content_type="application/json", timeout_s=30.0)

        await call("warm-up")  # loaded: both below are hits on the one worker
        alice, bob = await asyncio.gather(call("alice"), call("bob"))
        assert ok(alice)["echo"] == {"who": "alice"} and ok(bob)["echo"] == {"who": "bob"}

    on_own_pool(tmp_path, "cpu", scenario)


def test_a_load_granted_by_a_former_scheduler_does_not_outrank_the_new_ones_grants(tmp_path: Path) -> None:
    """A grant of a former leader (its per-GPU number high) loads a model while a new leader
    attaches (its grants count from 1): the worker must not keep that number, or every eviction
    of the model by the new leader is ignored until it has granted as many."""

    async def scenario(node: Node, digest: str) -> None:
        loading = asyncio.create_task(node.call(emulated("m", digest, load_s=1.0), seq=5000))
        await asyncio.sleep(0.3)
        node.pool.forget_grant_order()  # the new leader attached (the daemon's attach)
        ok(await loading)
        ok(await node.call(emulated("b", digest), evict=("m",), seq=3))  # its grant 3 evicts m
        assert node.models() == ["b"]

    on_own_emulated_pool(tmp_path, scenario)

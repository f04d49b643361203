"""Function packages on a node: content-addressed `.tar.gz` archives, verified and safely extracted
(the format and its checks: gpufaas.packages)."""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpufaas.packages import (
    DEFAULT_MAX_UNPACKED_MB,
    HANDLER_FILE,
    InvalidPackage,
    PackageTooLarge,
    check_member,
    package_digest,
)

if not hasattr(tarfile, "data_filter"):  # before Python 3.11.4 (Debian bookworm: 3.11.2): PEP 706's filters
    from backports import tarfile  # type: ignore[no-redef,import-not-found,unused-ignore]

__all__ = ["InvalidPackage", "PackageCache", "package_digest"]

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_TMP_PREFIX = ".tmp-"


def _hex_of(digest: str) -> str:
    match = _DIGEST.fullmatch(digest)
    if match is None:
        raise InvalidPackage(f"package digest {digest!r} is not of the form 'sha256:<64 lowercase hex digits>'")
    return match.group(1)


class PackageCache:
    """Extracted packages under `root`, one directory per digest (`root/<hex>`).

    A directory under `root` named by a digest exists only once its package is fully extracted:
    extraction happens in a sibling temporary directory that is renamed into place, so a crash
    leaves at worst a `.tmp-*` directory (removed when the next cache opens on this root) and never a
    half-written package. `root` belongs to one cache (one gpu_manager) at a time.
    """

    def __init__(
        self, root: Path, *, max_unpacked_mb: int = DEFAULT_MAX_UNPACKED_MB, clock: Callable[[], float] = time.time
    ) -> None:
        self.root = root
        self._clock = clock
        self.max_unpacked_bytes = max_unpacked_mb * 1024 * 1024
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        # Downloads in flight, by digest: concurrent `ensure`s of one digest await the same task.
        # An entry lives from the first `ensure` that finds the package absent until that task ends.
        self._pending: dict[str, asyncio.Task[Path]] = {}
        self._used_at: dict[str, float] = {}  # digest -> when a worker last asked for it (wall clock)

    def path_for(self, digest: str) -> Path | None:
        """The extracted directory of `digest`, or None if it is not installed."""
        path = self.root / _hex_of(digest)
        return path if path.is_dir() else None

    async def install(self, digest: str, data: bytes) -> Path:
        """Verify `data` against `digest` and extract it (idempotent); returns the package directory.

        Raises InvalidPackage if the bytes do not match, are not a tar.gz, lack `handler.py` or hold
        an unsafe member. Hashing and extraction run in a thread: packages carry weights (large).
        """
        hex_digest = _hex_of(digest)
        return await asyncio.to_thread(self._install_blocking, digest, hex_digest, data)

    async def ensure(self, digest: str, fetch: Callable[[str], Awaitable[bytes]]) -> Path:
        """The package directory of `digest`, downloading it with `fetch(digest)` only if absent.

        Concurrent calls for one digest share one download; a failed download is not remembered, so
        the next call tries again.
        """
        self._used_at[digest] = self._clock()
        path = self.path_for(digest)
        if path is not None:
            return path
        task = self._pending.get(digest)
        if task is None:
            task = asyncio.create_task(self._download(digest, fetch), name=f"package {digest}")
            self._pending[digest] = task
            task.add_done_callback(lambda _: self._pending.pop(digest, None))
        # Shielded: one caller giving up must not cancel the download the others are waiting for.
        return await asyncio.shield(task)

    def collect(self, in_use: set[str], now_unix_s: float, grace_s: float) -> list[str]:
        """Delete the extracted packages not `in_use` that nobody asked for in `grace_s` (or, if
        none has since this cache opened, whose directory is that old); the digests deleted."""
        removed = []
        for path in self.root.iterdir():
            if path.name.startswith(_TMP_PREFIX) or not _DIGEST.fullmatch(f"sha256:{path.name}"):
                continue
            digest = f"sha256:{path.name}"
            try:
                last = self._used_at.get(digest, path.stat().st_mtime)
            except FileNotFoundError:
                continue
            if digest not in in_use and digest not in self._pending and now_unix_s - last > grace_s:
                shutil.rmtree(path, ignore_errors=True)
                self._used_at.pop(digest, None)
                removed.append(digest)
        return removed

    async def _download(self, digest: str, fetch: Callable[[str], Awaitable[bytes]]) -> Path:
        data = await fetch(digest)
        return await self.install(digest, data)

    def _install_blocking(self, digest: str, hex_digest: str, data: bytes) -> Path:
        actual = package_digest(data)
        if actual != digest:
            raise InvalidPackage(f"package bytes hash to {actual}, not {digest}: corrupt or wrong package")
        target = self.root / hex_digest
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{hex_digest[:12]}-", dir=self.root))
        try:
            _extract(data, tmp, digest, self.max_unpacked_bytes)
            try:
                os.rename(tmp, target)  # atomic on one filesystem: the package appears whole or not at all
            except OSError:
                if not target.is_dir():  # lost a race to an identical install, which is fine; else real
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _extract(data: bytes, dest: Path, digest: str, max_unpacked_bytes: int) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            unpacked = 0
            for member in members:
                try:
                    check_member(member)
                except InvalidPackage as exc:
                    raise InvalidPackage(f"package {digest}: {exc}") from None
                unpacked += member.size if member.isfile() else 0
                if unpacked > max_unpacked_bytes:
                    raise PackageTooLarge(f"package {digest} unpacks to more than {max_unpacked_bytes} bytes")
            # The "data" filter re-checks what check_member did and also strips setuid bits and
            # other special permissions: defence in depth against a crafted archive.
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidPackage(f"package {digest} is not a valid .tar.gz: {exc}") from exc
    if not (dest / HANDLER_FILE).is_file():
        raise InvalidPackage(f"package {digest} has no top-level {HANDLER_FILE}")

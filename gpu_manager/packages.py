"""Function packages on a node: content-addressed `.tar.gz` archives, verified and safely extracted."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpufaas.errors import GpufaasError

HANDLER_FILE = "handler.py"
"""Every package holds this file at its top level, defining `load(device)` and `predict(model, inputs)`."""

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_TMP_PREFIX = ".tmp-"


class InvalidPackage(GpufaasError):
    """A package whose bytes do not match its digest, that is not a gzip'd tar, that lacks
    `handler.py`, or that holds a member which could escape its directory (absolute path, `..`,
    link, device)."""


def package_digest(data: bytes) -> str:
    """The content address of a package: "sha256:<hex>" of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


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

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        # Downloads in flight, by digest: concurrent `ensure`s of one digest await the same task.
        # An entry lives from the first `ensure` that finds the package absent until that task ends.
        self._pending: dict[str, asyncio.Task[Path]] = {}

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
            _extract(data, tmp, digest)
            try:
                os.rename(tmp, target)  # atomic on one filesystem: the package appears whole or not at all
            except OSError:
                if not target.is_dir():  # lost a race to an identical install, which is fine; else real
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _extract(data: bytes, dest: Path, digest: str) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member, digest)
            # The "data" filter re-checks what _check_member did and also strips setuid bits and
            # other special permissions: defence in depth against a crafted archive.
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidPackage(f"package {digest} is not a valid .tar.gz: {exc}") from exc
    if not (dest / HANDLER_FILE).is_file():
        raise InvalidPackage(f"package {digest} has no top-level {HANDLER_FILE}")


def _check_member(member: tarfile.TarInfo, digest: str) -> None:
    name = member.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or Path(name).is_absolute():
        raise InvalidPackage(f"package {digest}: member {name!r} has an absolute path")
    if ".." in parts:
        raise InvalidPackage(f"package {digest}: member {name!r} climbs out of the package with '..'")
    if not (member.isfile() or member.isdir()):
        raise InvalidPackage(f"package {digest}: member {name!r} is a link or device; only files and directories")

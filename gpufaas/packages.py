"""Function packages: the format (a gzip'd tar with `handler.py` at its top), its checks, its
content address, and a deterministic builder.

Checked where a package enters (the gateway's upload, refusing it with 400 or 413) and again where
it is unpacked (the GPU manager): only regular files and directories, relative paths that stay
inside the package, a `handler.py` at the top, and at most `max_unpacked_bytes` unpacked.

The builder gives the same bytes (and so the same digest) for the same directory: entries sorted,
modification times, owners and gzip's timestamp fixed, modes reduced to 0644 / 0755.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from gpufaas.errors import GpufaasError

HANDLER_FILE = "handler.py"
"""Every package holds this file at its top level, defining `load(device)` and `predict(model, inputs)`."""
DEFAULT_MAX_UNPACKED_MB = 4096
SKIPPED_PARTS = frozenset({"__pycache__", ".git", ".venv", ".mypy_cache", ".pytest_cache"})


class InvalidPackage(GpufaasError):
    """A package that is not a gzip'd tar, lacks `handler.py`, holds a member that could escape
    its directory (absolute path, `..`, link, device), or whose bytes do not match its digest."""


class PackageTooLarge(InvalidPackage):
    """A package that unpacks to more than the limit."""


@dataclass(frozen=True, slots=True)
class PackageSummary:
    files: int
    unpacked_bytes: int


def package_digest(data: bytes) -> str:
    """The content address of a package: "sha256:<hex>" of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_archive(source: str | os.PathLike[str] | IO[bytes], *, max_unpacked_bytes: int) -> PackageSummary:
    """Read the whole archive (streaming, nothing extracted) and check every member; raises
    InvalidPackage (PackageTooLarge past `max_unpacked_bytes`) naming what is wrong."""
    files = unpacked = 0
    has_handler = False
    try:
        with _open(source) as tar:
            for member in tar:
                check_member(member)
                if member.isfile():
                    files += 1
                    unpacked += member.size
                    if unpacked > max_unpacked_bytes:
                        raise PackageTooLarge(
                            f"the package unpacks to more than {max_unpacked_bytes} bytes (the limit); "
                            "leave data out of it or raise the limit"
                        )
                    has_handler = has_handler or PurePosixPath(member.name) == PurePosixPath(HANDLER_FILE)
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, ValueError) as exc:
        raise InvalidPackage(f"the package is not a valid .tar.gz: {exc}") from None
    if not has_handler:
        raise InvalidPackage(f"the package has no {HANDLER_FILE} at its top; put the handler's directory in it")
    return PackageSummary(files, unpacked)


def check_member(member: tarfile.TarInfo) -> None:
    """Raise InvalidPackage for a member that could escape the package or is not a file or directory."""
    name = member.name
    if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute():
        raise InvalidPackage(f"member {name!r} has an absolute path; paths must be relative to the package")
    if ".." in PurePosixPath(name).parts:
        raise InvalidPackage(f"member {name!r} climbs out of the package with '..'")
    if not (member.isfile() or member.isdir()):
        raise InvalidPackage(f"member {name!r} is a link or device; a package holds only files and directories")


def build_package(directory: Path, *, skip: Iterable[str] = SKIPPED_PARTS) -> bytes:
    """`directory` as a package, the same bytes every time for the same files (see the module)."""
    skipped = frozenset(skip)
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in sorted(directory.rglob("*")):
            relative = path.relative_to(directory)
            if not path.is_file() or path.is_symlink() or skipped & set(relative.parts):
                continue
            info = tar.gettarinfo(str(path), arcname=relative.as_posix())
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if info.mode & 0o111 else 0o644
            with path.open("rb") as data:
                tar.addfile(info, data)
    return buffer.getvalue()


def _open(source: str | os.PathLike[str] | IO[bytes]) -> tarfile.TarFile:
    if isinstance(source, str | os.PathLike):
        return tarfile.open(source, mode="r|gz")
    return tarfile.open(fileobj=source, mode="r|gz")

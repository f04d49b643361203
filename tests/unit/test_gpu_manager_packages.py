"""Function packages: digest check, safe extraction, idempotent install, one download per digest."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import pytest

from gpu_manager.packages import InvalidPackage, PackageCache, package_digest
from tests.fixtures.make_packages import build_package


def make_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, content in members:
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return buffer.getvalue()


def file_member(name: str, content: bytes = b"x = 1\n") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(content)
    return info, content


def special_member(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


HANDLER = file_member(
    "handler.py", b"def load(device):\n    return None\n\n\ndef predict(model, inputs):\n    return 1\n"
)


def install(cache: PackageCache, data: bytes) -> Path:
    return asyncio.run(cache.install(package_digest(data), data))


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_digest_is_sha256_of_the_bytes() -> None:
    assert package_digest(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_install_extracts_into_a_directory_named_by_digest(tmp_path: Path) -> None:
    data = build_package("echo_function", tmp_path).read_bytes()
    cache = PackageCache(tmp_path / "packages")
    digest = package_digest(data)
    assert cache.path_for(digest) is None

    path = install(cache, data)

    assert path == tmp_path / "packages" / digest.removeprefix("sha256:")
    assert cache.path_for(digest) == path
    assert sorted(p.name for p in path.iterdir()) == ["handler.py", "helper.py"]
    assert install(cache, data) == path  # idempotent
    assert leftovers(tmp_path / "packages") == [path.name]  # no temporary directory left behind


def test_install_rejects_bytes_that_do_not_match_the_digest(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path)
    data = make_tar([HANDLER])
    with pytest.raises(InvalidPackage, match="hash to"):
        asyncio.run(cache.install(package_digest(b"other"), data))
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("digest", ["sha256:abc", "md5:" + "0" * 32, "sha256:" + "G" * 64, "../../etc"])
def test_malformed_digests_are_refused(tmp_path: Path, digest: str) -> None:
    with pytest.raises(InvalidPackage, match="not of the form"):
        PackageCache(tmp_path).path_for(digest)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a tarball", "not a valid .tar.gz"),
        (make_tar([file_member("model.py")]), "no top-level handler.py"),
        (make_tar([file_member("sub/handler.py")]), "no top-level handler.py"),
    ],
)
def test_install_rejects_archives_that_are_not_packages(tmp_path: Path, data: bytes, message: str) -> None:
    cache = PackageCache(tmp_path / "packages")
    with pytest.raises(InvalidPackage, match=message):
        install(cache, data)
    assert leftovers(tmp_path / "packages") == []


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (file_member("/tmp/evil.py"), "absolute path"),
        (file_member("../evil.py"), r"'\.\.'"),
        (file_member("weights/../../evil.py"), r"'\.\.'"),
        (special_member("link", tarfile.SYMTYPE, "/etc/passwd"), "link or device"),
        (special_member("inside-link", tarfile.SYMTYPE, "handler.py"), "link or device"),
        (special_member("hard", tarfile.LNKTYPE, "handler.py"), "link or device"),
        (special_member("tty", tarfile.CHRTYPE), "link or device"),
        (special_member("fifo", tarfile.FIFOTYPE), "link or device"),
    ],
)
def test_install_refuses_members_that_could_escape(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None], message: str
) -> None:
    cache = PackageCache(tmp_path / "packages")
    with pytest.raises(InvalidPackage, match=message):
        install(cache, make_tar([HANDLER, member]))
    assert leftovers(tmp_path / "packages") == []
    assert not (tmp_path / "evil.py").exists()


def test_a_new_cache_removes_temporary_directories_of_a_crashed_one(tmp_path: Path) -> None:
    (tmp_path / ".tmp-abc-123").mkdir()
    (tmp_path / ".tmp-abc-123" / "handler.py").write_text("")
    PackageCache(tmp_path)
    assert leftovers(tmp_path) == []


def test_concurrent_ensures_of_one_digest_download_once(tmp_path: Path) -> None:
    data = make_tar([HANDLER])
    digest = package_digest(data)
    cache = PackageCache(tmp_path)
    fetched: list[str] = []

    async def fetch(wanted: str) -> bytes:
        fetched.append(wanted)
        await asyncio.sleep(0.05)  # long enough for every caller to arrive while it downloads
        return data

    async def scenario() -> list[Path]:
        return await asyncio.gather(*(cache.ensure(digest, fetch) for _ in range(5)))

    paths = asyncio.run(scenario())
    assert fetched == [digest]
    assert set(paths) == {cache.path_for(digest)}


def test_ensure_does_not_fetch_an_installed_package(tmp_path: Path) -> None:
    data = make_tar([HANDLER])
    cache = PackageCache(tmp_path)
    path = install(cache, data)

    async def fetch(digest: str) -> bytes:
        raise AssertionError("fetch must not be called for an installed package")

    assert asyncio.run(cache.ensure(package_digest(data), fetch)) == path


def test_a_failed_download_is_retried_by_the_next_ensure(tmp_path: Path) -> None:
    data = make_tar([HANDLER])
    digest = package_digest(data)
    cache = PackageCache(tmp_path)
    answers: list[bytes | Exception] = [ConnectionError("gateway down"), b"corrupt", data]

    async def fetch(wanted: str) -> bytes:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def scenario() -> Path:
        with pytest.raises(ConnectionError):
            await cache.ensure(digest, fetch)
        with pytest.raises(InvalidPackage, match="hash to"):
            await cache.ensure(digest, fetch)
        return await cache.ensure(digest, fetch)

    assert asyncio.run(scenario()) == cache.path_for(digest)
    assert answers == []


def test_a_caller_giving_up_does_not_cancel_the_download_of_the_others(tmp_path: Path) -> None:
    data = make_tar([HANDLER])
    digest = package_digest(data)
    cache = PackageCache(tmp_path)

    async def fetch(wanted: str) -> bytes:
        await asyncio.sleep(0.1)
        return data

    async def scenario() -> Path:
        impatient = asyncio.create_task(cache.ensure(digest, fetch))
        patient = asyncio.create_task(cache.ensure(digest, fetch))
        await asyncio.sleep(0.02)
        impatient.cancel()
        return await patient

    assert asyncio.run(scenario()) == cache.path_for(digest)


def test_an_archive_that_unpacks_past_the_limit_is_refused(tmp_path: Path) -> None:
    cache = PackageCache(tmp_path / "packages", max_unpacked_mb=1)
    data = make_tar([HANDLER, file_member("zeros.bin", bytes(2 * 1024 * 1024))])
    with pytest.raises(InvalidPackage, match="unpacks to more than 1048576 bytes"):
        asyncio.run(cache.install(package_digest(data), data))
    assert list((tmp_path / "packages").iterdir()) == []


def test_collect_deletes_the_packages_no_worker_used_for_the_grace(tmp_path: Path) -> None:
    async def scenario() -> None:
        now = [1000.0]
        cache = PackageCache(tmp_path / "packages", clock=lambda: now[0])
        kept, idle, busy = (make_tar([HANDLER, file_member(f"v{i}.txt")]) for i in range(3))
        digests = [package_digest(data) for data in (kept, idle, busy)]
        for data, digest in zip((kept, idle, busy), digests, strict=True):
            await cache.install(digest, data)

        async def fetch(_: str) -> bytes:
            raise AssertionError("installed already")

        for digest in digests:
            await cache.ensure(digest, fetch)
        assert cache.collect({digests[2]}, 1030, grace_s=60) == []  # all used within the grace
        now[0] = 1100
        await cache.ensure(digests[0], fetch)  # used again later than the others
        assert cache.collect({digests[2]}, 1120, grace_s=60) == [digests[1]]
        assert cache.path_for(digests[1]) is None
        assert cache.path_for(digests[0]) is not None and cache.path_for(digests[2]) is not None

    asyncio.run(scenario())

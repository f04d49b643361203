"""Package manifests: the canonical form and digest, every check, building one from a directory,
and reading the .tar.gz form into blobs."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from gpufaas.packages import (
    EMPTY_DIGEST,
    MAX_FILES,
    MAX_HEADER_BYTES,
    DigestCache,
    InvalidPackage,
    Manifest,
    PackageFile,
    PackageTooLarge,
    build_package,
    read_archive,
    scan_directory,
    sha256_digest,
)

HANDLER = PackageFile("handler.py", sha256_digest(b"x"), 1)


def entry(path: str, data: bytes = b"x", mode: int = 0o644) -> PackageFile:
    return PackageFile(path, sha256_digest(data), len(data), mode)


def test_the_digest_is_of_the_canonical_form_whatever_the_order() -> None:
    a = Manifest.of([entry("handler.py"), entry("b/w.bin", b"ww")])
    b = Manifest.of([entry("b/w.bin", b"ww"), entry("handler.py")])
    assert a == b and a.digest == b.digest
    document = json.loads(a.to_json())
    assert [f["path"] for f in document["files"]] == ["b/w.bin", "handler.py"]
    shuffled = json.dumps({"version": 1, "files": list(reversed(document["files"]))}, indent=2)
    assert Manifest.from_json(shuffled).digest == a.digest
    assert a.to_json() == json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/etc/passwd", "relative"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("a\\b", "backslash"),
        ("a\nb", "control"),
        ("", "relative"),
        ("d/" + "n" * 256, "longer than 255"),  # accepted once, then no node could stage it
    ],
)
def test_paths_that_could_escape_are_refused(path: str, why: str) -> None:
    with pytest.raises(InvalidPackage, match=why):
        Manifest.of([HANDLER, entry(path)])


def test_other_rules() -> None:
    with pytest.raises(InvalidPackage, match=r"no handler\.py"):
        Manifest.of([entry("model.py")])
    with pytest.raises(InvalidPackage, match="twice"):
        Manifest.of([HANDLER, HANDLER])
    with pytest.raises(InvalidPackage, match="both a file and a directory"):
        Manifest.of([HANDLER, entry("a"), entry("a/b")])
    with pytest.raises(InvalidPackage, match="one blob has one size"):  # (a pool copy would end short)
        Manifest.of([HANDLER, PackageFile("a", sha256_digest(b"x"), 1), PackageFile("b", sha256_digest(b"x"), 2)])
    with pytest.raises(InvalidPackage, match="mode 777"):
        Manifest.of([HANDLER, entry("x", mode=0o777)])
    with pytest.raises(InvalidPackage, match="empty file"):
        Manifest.of([HANDLER, PackageFile("e", sha256_digest(b"x"), 0)])
    with pytest.raises(InvalidPackage, match="not a digest"):
        Manifest.of([HANDLER, PackageFile("x", "sha256:XYZ", 1)])
    with pytest.raises(PackageTooLarge, match="more than 10 bytes"):
        Manifest.of([HANDLER, entry("w", b"0123456789a")], max_unpacked_bytes=10)
    assert Manifest.of([HANDLER, PackageFile("e", EMPTY_DIGEST, 0)]).unpacked_bytes == 1


@pytest.mark.parametrize(
    "document",
    [
        "not json",
        "[]",
        '{"version": 2, "files": []}',
        '{"version": 1, "files": {}}',
        '{"version": 1, "files": [], "extra": 1}',
        '{"version": 1, "files": [{"path": "handler.py"}]}',
        '{"version": 1, "files": [{"path": "handler.py", "digest": "sha256:0", "size": "1", "mode": 420}]}',
        '{"version": true, "files": []}',
    ],
)
def test_malformed_manifests_are_refused_with_a_reason(document: str) -> None:
    with pytest.raises(InvalidPackage) as info:
        Manifest.from_json(document)
    assert str(info.value)


def test_too_many_files() -> None:
    files = [{"path": f"f{i}", "digest": EMPTY_DIGEST, "size": 0, "mode": 420} for i in range(MAX_FILES + 1)]
    with pytest.raises(PackageTooLarge, match="files"):
        Manifest.from_json(json.dumps({"version": 1, "files": files}))


def make_dir(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "handler.py").write_text("def load(d): ...\ndef predict(m, i): ...\n")
    (root / "sub" / "weights.bin").write_bytes(os.urandom(3 << 20))
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o775)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"junk")
    (root / "link").symlink_to(root / "handler.py")
    return root


def test_scan_directory_hashes_files_and_leaves_out_caches_and_links(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "fn")
    manifest, paths = scan_directory(root)
    assert [f.path for f in manifest.files] == ["handler.py", "run.sh", "sub/weights.bin"]
    weights = manifest.file("sub/weights.bin")
    assert weights is not None and weights.digest == sha256_digest((root / "sub" / "weights.bin").read_bytes())
    assert manifest.file("run.sh") == PackageFile("run.sh", sha256_digest(b"#!/bin/sh\n"), 10, 0o755)
    assert paths[weights.digest] == root / "sub" / "weights.bin"
    assert manifest.large_files(1 << 20) == [weights]


def test_the_digest_cache_skips_unchanged_files_and_notices_changes(tmp_path: Path, monkeypatch) -> None:
    root = make_dir(tmp_path / "fn")
    cache_file = tmp_path / "digests.json"
    first, _ = scan_directory(root, cache=DigestCache(cache_file))
    DigestCache(cache_file)  # nothing saved yet
    cache = DigestCache(cache_file)
    first, _ = scan_directory(root, cache=cache)
    cache.save()
    hashed: list[Path] = []
    from gpufaas import packages

    real = packages.file_sha256
    monkeypatch.setattr(packages, "file_sha256", lambda p: hashed.append(p) or real(p))
    again, _ = scan_directory(root, cache=DigestCache(cache_file))
    assert again == first and hashed == []
    (root / "handler.py").write_text("def load(d): return 1\ndef predict(m, i): ...\n")
    changed, _ = scan_directory(root, cache=DigestCache(cache_file))
    assert hashed == [root / "handler.py"]
    assert changed.digest != first.digest


def test_read_archive_stores_each_file_and_gives_the_same_manifest_as_a_scan(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "fn")
    stored: dict[str, bytes] = {}

    def store(path: str, size: int, reader: io.BufferedIOBase) -> str:
        data = reader.read()
        assert len(data) == size
        stored[sha256_digest(data)] = data
        return sha256_digest(data)

    manifest = read_archive(io.BytesIO(build_package(root)), store, max_unpacked_bytes=1 << 30)
    assert manifest == scan_directory(root)[0]
    assert set(stored) == set(manifest.blobs())


def test_read_archive_refuses_links_and_escapes(tmp_path: Path) -> None:
    def archive(member: tarfile.TarInfo, data: bytes = b"") -> io.BytesIO:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.addfile(member, io.BytesIO(data) if data else None)
        buffer.seek(0)
        return buffer

    link = tarfile.TarInfo("handler.py")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    with pytest.raises(InvalidPackage, match="link"):
        read_archive(archive(link), lambda *_: EMPTY_DIGEST, max_unpacked_bytes=100)
    escape = tarfile.TarInfo("../x")
    escape.size = 1
    with pytest.raises(InvalidPackage, match=r"\.\."):
        read_archive(archive(escape, b"x"), lambda *_: EMPTY_DIGEST, max_unpacked_bytes=100)
    with pytest.raises(InvalidPackage, match=r"valid \.tar\.gz"):
        read_archive(io.BytesIO(b"not a tarball"), lambda *_: EMPTY_DIGEST, max_unpacked_bytes=100)
    big = tarfile.TarInfo("handler.py")
    big.size = 101
    with pytest.raises(PackageTooLarge):
        read_archive(archive(big, b"x" * 101), lambda *_: EMPTY_DIGEST, max_unpacked_bytes=100)


def _gnu_header(name: str, size: int, kind: bytes) -> bytes:
    member = tarfile.TarInfo(name)
    member.size, member.type = size, kind
    return member.tobuf(tarfile.GNU_FORMAT)


def test_read_archive_refuses_extended_headers_it_would_read_whole_or_follow_without_end() -> None:
    # A pax header is read whole into memory (one declaring 256 MiB of zeros, 255 KB gzipped,
    # took 542 MiB), and each one in a row is followed recursively (2,000: RecursionError).
    def store(path: str, size: int, reader: io.BufferedIOBase) -> str:
        return sha256_digest(reader.read())

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo("handler.py")
        member.size = 1
        member.pax_headers = {"comment": "x" * MAX_HEADER_BYTES}
        tar.addfile(member, io.BytesIO(b"x"))
    with pytest.raises(PackageTooLarge, match="extended header"):
        read_archive(io.BytesIO(buffer.getvalue()), store, max_unpacked_bytes=100)
    long_name = b"handler.py\0".ljust(tarfile.BLOCKSIZE, b"\0")
    chain = (_gnu_header("././@LongLink", 11, tarfile.GNUTYPE_LONGNAME) + long_name) * 2000
    handler = _gnu_header("handler.py", 1, tarfile.REGTYPE) + b"x".ljust(tarfile.BLOCKSIZE, b"\0")
    with pytest.raises(PackageTooLarge, match="extended headers"):
        read_archive(io.BytesIO(chain + handler + bytes(1024)), store, max_unpacked_bytes=100, compressed=False)
    # what tarfile writes for a long path (one GNU long-name header, or one pax header) still reads
    name = "d/" * 200 + "handler.py"
    for form in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=form) as tar:
            member = tarfile.TarInfo(name)
            member.size = 1
            tar.addfile(member, io.BytesIO(b"x"))
            member.name = "handler.py"
            tar.addfile(member, io.BytesIO(b"x"))
        read = read_archive(io.BytesIO(buffer.getvalue()), store, max_unpacked_bytes=100, compressed=False)
        assert [f.path for f in read.files] == [name, "handler.py"]


def test_read_archive_refuses_sparse_members_whose_map_it_would_read_whole() -> None:
    # An old GNU sparse member's map continues in extension blocks, a pax 1.0 one's in its data,
    # each read whole into memory: 200,000 extension blocks (357 KB gzipped) took 800 MiB.
    def store(path: str, size: int, reader: io.BufferedIOBase) -> str:
        return sha256_digest(reader.read())

    old_gnu = _gnu_header("handler.py", 1, tarfile.GNUTYPE_SPARSE) + b"x".ljust(tarfile.BLOCKSIZE, b"\0")
    with pytest.raises(InvalidPackage, match="sparse"):
        read_archive(io.BytesIO(old_gnu + bytes(1024)), store, max_unpacked_bytes=100, compressed=False)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        member = tarfile.TarInfo("handler.py")
        member.size = 4
        member.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "1"}
        tar.addfile(member, io.BytesIO(b"0\n\n\n"))
    with pytest.raises(InvalidPackage, match="sparse"):
        read_archive(io.BytesIO(buffer.getvalue()), store, max_unpacked_bytes=100, compressed=False)

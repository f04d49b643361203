"""Package and holder records, the order in which a node asks holders for a package's blobs, and a
gateway's commit gathering blobs from other gateways and leaving a copy on one."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from gateway.artifacts import Artifacts, MissingBlobs, PeerAccess
from gpufaas.blobnet import TransferError, fetch_blob
from gpufaas.blobs import BlobStore
from gpufaas.holders import HolderRecord, PackageRecord, read_holders, sources_for
from gpufaas.keys import Keys
from gpufaas.packages import InvalidPackage, Manifest, PackageFile, sha256_digest
from gpufaas.requirements import Layer
from tests.fakes import MemoryStore

MANIFEST = Manifest.of([PackageFile("handler.py", sha256_digest(b"h"), 1)])


def test_records_round_trip_and_refuse_garbage() -> None:
    record = PackageRecord(MANIFEST, "gateway-a", Layer(("tabulate==0.9.0",), "cp311-x86_64"), 12.5)
    assert PackageRecord.from_json(record.to_json()) == record and record.digest == MANIFEST.digest
    assert PackageRecord.from_json(PackageRecord(MANIFEST, "g").to_json()).requirements is None
    with pytest.raises(InvalidPackage):
        PackageRecord.from_json(b'{"manifest": {"version": 1, "files": []}, "gateway": "g"}')
    holder = HolderRecord(
        "node-n1", "node", "http://10.0.0.2:7000", frozenset({MANIFEST.digest}), {"torch": "2.13.0"}, frozenset({"x"})
    )
    assert HolderRecord.from_json(holder.to_json()) == holder and holder.host == "10.0.0.2"


def test_nearest_holders_first() -> None:
    digest = MANIFEST.digest
    package = PackageRecord(MANIFEST, "gw-took-it")
    holders = [
        HolderRecord("gw-other", "gateway", "http://10.0.0.9:1"),
        HolderRecord("gw-took-it", "gateway", "http://10.0.0.8:1"),
        HolderRecord("node-far", "node", "http://10.0.0.3:1", frozenset({digest})),
        HolderRecord("node-near", "node", "http://10.0.0.1:1", frozenset({digest})),
        HolderRecord("node-without", "node", "http://10.0.0.1:2"),
        HolderRecord("node-me", "node", "http://10.0.0.1:3", frozenset({digest})),
    ]
    for seed in range(20):
        order = [
            h.name for h in sources_for(package, holders, me="node-me", my_host="10.0.0.1", rng=random.Random(seed))
        ]
        assert order == ["node-near", "node-far", "gw-took-it", "gw-other"]
    # Unknown package (no record): any gateway, no peer.
    assert {h.name for h in sources_for(None, holders, me="node-me")} == {"gw-other", "gw-took-it"}


def test_a_holder_with_a_malformed_url_is_passed_over(tmp_path: Path) -> None:
    """A holder record's URL (a node's --blob-advertise, as etcd keeps it) that urllib cannot
    parse raised ValueError in sources_for (its host) and in fetch_blob (its port), out of
    everything that passes over a failing holder: one misconfigured node stopped every other
    node's staging of the packages it holds."""
    digest = MANIFEST.digest
    package = PackageRecord(MANIFEST, "gw")
    bad_urls = ("http://[::1", "http://10.0.0.2:notaport", "http://10.0.0.2:99999")
    holders = [HolderRecord(f"node-{i}", "node", url, frozenset({digest})) for i, url in enumerate(bad_urls)]
    holders.append(HolderRecord("gw", "gateway", "http://10.0.0.8:1"))
    order = [h.name for h in sources_for(package, holders, me="node-me", my_host="10.0.0.1")]
    assert sorted(order[:3]) == ["node-0", "node-1", "node-2"] and order[3] == "gw"
    for url in bad_urls:
        with pytest.raises(TransferError, match="not an http://HOST:PORT"):
            fetch_blob(url, sha256_digest(b"h"), 1, BlobStore(tmp_path / "mine"), tls=False)


@pytest.mark.anyio
async def test_an_unreadable_holder_record_is_left_out_not_raised() -> None:
    """read_holders leaves out records it cannot read; one whose base_environment is not an
    object raised AttributeError instead, and every staging and gather of the cluster with it."""
    store, keys = MemoryStore(), Keys()
    good = HolderRecord("gw", "gateway", "http://10.0.0.8:1")
    await store.put(keys.holder("gw"), good.to_json())
    await store.put(keys.holder("odd"), b'{"name":"odd","kind":"node","url":"http://h:1","base_environment":[]}')
    assert await read_holders(store, keys) == [good]


def _gateway(store: MemoryStore, root: Path, name: str) -> Artifacts:
    """A gateway's artifact store serving its blobs on loopback (no credentials, plain links)."""
    artifacts = Artifacts(store, Keys(), root / name, name=name, max_unpacked_bytes=1 << 20)
    artifacts.serve("127.0.0.1:0", lambda method, authorization: None)
    return artifacts


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_commit_gathers_blobs_from_another_gateway_and_leaves_a_copy_there(tmp_path: Path) -> None:
    """Blobs uploaded to gateway a, the manifest committed through gateway b: b fetches them from
        a; committed through c with a copy pushed to one other gateway; a gateway's blob server asked
    for a blob it lacks fetches it first."""
    store = MemoryStore()
    a, b, c = (_gateway(store, tmp_path, name) for name in ("gw-a", "gw-b", "gw-c"))
    try:
        for artifacts in (a, b):
            await store.put(Keys().holder(artifacts.name), artifacts.holder("").to_json())
        handler, weights = b"def load(device): ...\n", bytes(range(256)) * 64
        manifest = Manifest.of(
            [
                PackageFile("handler.py", sha256_digest(handler), len(handler)),
                PackageFile("w.bin", sha256_digest(weights), len(weights)),
            ]
        )
        a.blobs.put(handler)
        a.blobs.put(weights)
        record = await b.register(manifest, PeerAccess())
        assert record.gateway == "gw-b" and all(b.blobs.has(d) for d in manifest.blobs())
        with pytest.raises(MissingBlobs):  # c is no holder others know; a blob none holds
            await c.register(Manifest.of([PackageFile("handler.py", sha256_digest(b"x"), 1)]), PeerAccess())
        await store.put(Keys().holder(c.name), c.holder("").to_json())
        await c.register(manifest, PeerAccess())
        copy, others = await c.replicate(manifest, PeerAccess())
        assert copy in ("gw-a", "gw-b") and others == 2
        assert await a.ensure_blob(sha256_digest(weights), PeerAccess()) is not None
        late = _gateway(store, tmp_path, "gw-late")  # a node asks its blob server for a blob it lacks
        try:
            target = BlobStore(tmp_path / "node")
            await asyncio.to_thread(fetch_blob, late.url, sha256_digest(weights), len(weights), target)
            assert target.has(sha256_digest(weights)) and late.blobs.has(sha256_digest(weights))
        finally:
            late.stop()
    finally:
        for artifacts in (a, b, c):
            artifacts.stop()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_gateway_alone_says_that_nobody_took_a_copy(tmp_path: Path) -> None:
    store = MemoryStore()
    alone = _gateway(store, tmp_path, "gw-alone")
    try:
        await store.put(Keys().holder(alone.name), alone.holder("").to_json())
        alone.blobs.put(b"h")
        assert await alone.replicate(MANIFEST, PeerAccess()) == (None, 0)
    finally:
        alone.stop()

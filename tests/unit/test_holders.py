"""Package and holder records, and the order in which a node asks holders for a package's blobs."""

from __future__ import annotations

import random

import pytest

from gpufaas.holders import HolderRecord, PackageRecord, sources_for
from gpufaas.packages import InvalidPackage, Manifest, PackageFile, sha256_digest
from gpufaas.requirements import Layer

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

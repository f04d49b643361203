"""Who holds which blobs: package records (a manifest and where its blobs were uploaded) and
holder records (a gateway's or node's blob address and the packages it holds whole), as kept in
etcd, and the order in which a node asks holders for a blob (nearest first)."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from gpufaas.keys import Keys
from gpufaas.packages import InvalidPackage, Manifest
from gpufaas.requirements import Layer, RequirementsError
from gpufaas.store import Store

log = logging.getLogger("gpufaas.holders")

HolderKind = Literal["gateway", "node"]


@dataclass(frozen=True, slots=True)
class PackageRecord:
    """A registered package (`{root}/packages/{hex}`): its manifest, the holder (a gateway) that
    took its blobs, and the layer of Python distributions its requirements.txt resolved to (None:
    it has none)."""

    manifest: Manifest
    gateway: str
    requirements: Layer | None = None
    created_unix_s: float = 0.0

    @property
    def digest(self) -> str:
        return self.manifest.digest

    def to_json(self) -> bytes:
        document: dict[str, Any] = {
            "manifest": json.loads(self.manifest.to_json()),
            "gateway": self.gateway,
            "requirements": None if self.requirements is None else json.loads(self.requirements.to_json()),
            "created_unix_s": self.created_unix_s,
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> PackageRecord:
        """InvalidPackage if it is not one (a record is checked like any manifest)."""
        try:
            raw = json.loads(data)
            manifest = Manifest.from_json(json.dumps(raw["manifest"]))
            requirements = raw.get("requirements")
            layer = None if requirements is None else Layer.from_json(json.dumps(requirements).encode())
            return cls(manifest, str(raw["gateway"]), layer, float(raw.get("created_unix_s", 0.0)))
        except (ValueError, KeyError, TypeError, RequirementsError) as exc:
            raise InvalidPackage(f"not a package record: {exc}") from None


@dataclass(frozen=True, slots=True)
class HolderRecord:
    """A blob holder (`{root}/holders/{name}`): where it serves blobs (`url`, http://HOST:PORT)
    and, for a node, the packages it holds whole on disk (`packages`) and those whose weights are
    in its host model pool (`pooled`); `base_environment` (a node's) is the Python distributions
    its workers run with (name -> version), which requirements resolve against."""

    name: str
    kind: HolderKind
    url: str
    packages: frozenset[str] = frozenset()
    base_environment: dict[str, str] = field(default_factory=dict)
    pooled: frozenset[str] = frozenset()

    def to_json(self) -> bytes:
        document = {
            "name": self.name,
            "kind": self.kind,
            "url": self.url,
            "packages": sorted(self.packages),
            "base_environment": self.base_environment,
            "pooled": sorted(self.pooled),
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> HolderRecord:
        """ValueError if `data` is not a holder record (of any shape)."""
        try:
            raw = json.loads(data)
            kind = raw["kind"]
            if kind not in ("gateway", "node"):
                raise ValueError(f"holder kind {kind!r}")
            return cls(
                str(raw["name"]),
                kind,
                str(raw["url"]),
                frozenset(raw.get("packages", ())),
                {str(k): str(v) for k, v in raw.get("base_environment", {}).items()},
                frozenset(raw.get("pooled", ())),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a holder record: {exc!r}") from None

    @property
    def host(self) -> str:
        """The host of `url` ("" where it has none, or is malformed: fetching from it fails then)."""
        try:
            return urllib.parse.urlsplit(self.url).hostname or ""
        except ValueError:
            return ""


def sources_for(
    package: PackageRecord | None,
    holders: Iterable[HolderRecord],
    *,
    me: str,
    my_host: str = "",
    rng: random.Random | None = None,
) -> list[HolderRecord]:
    """The holders to ask for a package's blobs, in order: nearest first. Peer nodes that hold the
    package whole (those on this host first), then the gateway that took its upload, then the
    other gateways (one may hold it too). Ties are shuffled so that many nodes fetching one
    package spread over its holders. Never `me`."""
    rng = rng if rng is not None else random.Random()
    others = [h for h in holders if h.name != me]
    digest = package.digest if package is not None else None
    peers = [h for h in others if h.kind == "node" and digest is not None and digest in h.packages]
    rng.shuffle(peers)
    peers.sort(key=lambda h: h.host != my_host or not my_host)  # stable: same host first, shuffled within
    gateways = [h for h in others if h.kind == "gateway"]
    rng.shuffle(gateways)
    if package is not None:
        gateways.sort(key=lambda h: h.name != package.gateway)
    return peers + gateways


async def read_package(store: Store, keys: Keys, digest: str) -> PackageRecord | None:
    """A package's record from etcd; None if it is not registered (or unreadable: logged)."""
    kv = await store.get(keys.package(digest))
    if kv is None:
        return None
    try:
        return PackageRecord.from_json(kv.value)
    except InvalidPackage as exc:
        log.warning("ignoring the unreadable package record %s: %s", kv.key, exc)
        return None


async def read_holders(store: Store, keys: Keys) -> list[HolderRecord]:
    """Every blob holder registered now (unreadable records left out)."""
    holders = []
    for kv in await store.get_prefix(keys.holders):
        with contextlib.suppress(ValueError):
            holders.append(HolderRecord.from_json(kv.value))
    return holders

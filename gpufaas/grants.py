"""Placement tokens: a Grant (what a placement allows) signed by the scheduler, checked by nodes.

token = the Grant's protobuf bytes + HMAC-SHA256 of them under the scheduler's token key (32
bytes, at the end). The gateway carries it opaque from the scheduler's Placement to the node's
Execute; the node runs a call only under a token that it can verify, that names it, that is
presented before its claim time and that it has not seen before (gpu_manager.ledger).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from google.protobuf.message import DecodeError

from gpufaas.proto import gpufaas_pb2 as pb

TAG_BYTES = hashlib.sha256().digest_size
KEY_BYTES = 32
MAX_CLAIM_S = 30.0  # the most a grant's claim time (and a lease) may run: nodes remember grants for 60 s
# How long past its claim time (a lease's: past its last call's end) a node remembers a grant it saw,
# and refuses it again (gpu_manager.ledger).
GRANT_KEEP_S = 60.0
# The outcomes of a call under a lease after which the lease goes on (docs/hit-leases.md): the node
# ends it on any other (its worker lost or timed out), and the gateway drops it then.
LEASE_KEEPING_OUTCOMES = frozenset({pb.OK, pb.HANDLER_ERROR, pb.INVALID_INPUT, pb.OUTPUT_TOO_LARGE, pb.OUTPUT_INVALID})


class BadToken(ValueError):
    """A token that is not one this key signed (forged, corrupted, or signed under another key)."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def sign(grant: pb.Grant, key: bytes, *, function_part: bytes = b"") -> bytes:
    """The token of `grant` merged with `function_part` (see `function_part`): a protobuf message
    parsed from concatenated encodings is their merge, so the node reads one Grant with both."""
    body = function_part + grant.SerializeToString()
    return body + _tag(key, body)


@functools.lru_cache(maxsize=4096)
def function_part(function: str, model: str, package_digest: str, memory_mb: int, worker: bytes) -> bytes:
    """The encoded Grant fields that are the function's own, the same in each of its grants:
    encoded once per function version, not once per call (`sign(..., function_part=)`)."""
    return pb.Grant(
        function=function, model=model, package_digest=package_digest, memory_mb=memory_mb, worker=worker
    ).SerializeToString()


def verify(token: bytes, key: bytes) -> pb.Grant:
    """The token's Grant if `key` signed it; BadToken otherwise."""
    if not key:
        raise BadToken("no token key: no scheduler has attached to this node yet")
    if len(token) <= TAG_BYTES:
        raise BadToken("the token is too short to be a signed grant")
    body, tag = token[:-TAG_BYTES], token[-TAG_BYTES:]
    if not hmac.compare_digest(_tag(key, body), tag):
        raise BadToken("the token's signature does not match: it was not issued by this cluster's scheduler")
    try:
        return pb.Grant.FromString(body)
    except DecodeError:
        raise BadToken("the signed token does not hold a grant") from None


@functools.lru_cache(maxsize=16)
def _keyed(key: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 under `key` with nothing fed yet: `_tag` copies it. (Keys are few: a term's.)"""
    return hmac.new(key, digestmod=hashlib.sha256)


def _tag(key: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of `body` under `key`. A copy of the keyed state, not `hmac.digest`, which looks
    the digest up in OpenSSL and sets the key afresh on every call: measured 2.3 -> 1.5 us in a
    loop; under cProfile it was 26-39 us of own time a call in the node and the scheduler."""
    mac = _keyed(key).copy()
    mac.update(body)
    return mac.digest()

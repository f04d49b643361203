"""User-facing error hierarchy of gpufaas; each boundary (CLI, HTTP) maps these to its own form.

GpufaasError
├── ModelTooLarge      a model cannot fit on any GPU (or on the GPU it was asked to use)
├── CacheFull          every byte that could be freed on a GPU is pinned by running work
├── UnknownPolicy      a scheduling or eviction policy name that is not registered
├── UnknownModel       a request names a model the scheduler was never told about
└── InvalidInput       malformed user input (trace files, flags, specs); says where and what
"""

from __future__ import annotations


class GpufaasError(Exception):
    """Base of every error that is the user's to fix; its message says what to do."""


class ModelTooLarge(GpufaasError):
    pass


class CacheFull(GpufaasError):
    pass


class UnknownPolicy(GpufaasError):
    pass


class UnknownModel(GpufaasError):
    pass


class InvalidInput(GpufaasError):
    pass


SHOWN_CHARS = 80  # of a refused value, quoted in its error: a 1 MB name is not echoed whole


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` (a refused value, or where it is) as an error message quotes it: at most `limit`
    characters, cut with '...'."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# How an X-Call-Id already in flight is refused, by a gateway (409) and by the scheduler (a Rejection
# INVALID: a Status of its own would be a 502 at gateways that predate it), which gateways tell by
# this ending and answer 409 too.
CALL_ID_IN_FLIGHT = "is already in flight; use a new X-Call-Id"


def call_id_in_flight(call_id: str) -> str:
    """The refusal of a call whose X-Call-Id `call_id` names a call in flight."""
    return f"call {call_id!r} {CALL_ID_IN_FLIGHT}"

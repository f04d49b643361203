"""The wire inside one process: two `Connection`s joined by memory instead of a socket.

A gateway that runs the scheduler or a node in its own process (`python -m gateway
--with-scheduler --with-node`) links to them with pairs from `local_pair`: the same frames, the
same `Connection` and handlers on both ends, so neither end can tell it from a TCP link, but a
frame crosses by a copy into the peer's read buffer: no system call, no TLS record, no event loop
wake-up of another process. Nothing on it is authenticated: both ends are this process.

A server that this process runs may be offered to its own dialers (`serve_here`): a dial of its
address from here (`link_here`, which the gateway's router and the scheduler's node links try
before a TCP dial) then gets an in-memory link, served by the server as one it accepted.

Order and timing are a socket's: what one end writes in one pass of the event loop reaches the
other in a later callback (its `_flush`), in order; an end that pauses its reading gets nothing
until it resumes; `close()` on either end closes both, the other one (as on a FIN) once it has
read what was sent before the close, and each end's handler hears `on_close` once.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

from gpufaas.wire import DEFAULT_MAX_FRAME_BYTES, Connection, Handler, Server, Unauthenticated

PEER_NAME = "in-process"  # what `Connection.peer` (and its log lines) name the other end as


class _MemoryTransport(asyncio.Transport):
    """One end's transport: `write` hands the bytes to the other end, which delivers them to its
    protocol while its protocol reads (a protocol may pause its reading, as on a socket)."""

    def __init__(self, own: Connection) -> None:
        super().__init__()
        self._own = own
        self.peer: _MemoryTransport | None = None
        self._closing = False
        self._in: collections.deque[memoryview] = collections.deque()  # arrived, not yet delivered
        self._reading = True
        self._delivery_due = False
        self._eof = False  # the other end closed: once what it sent is delivered, this end closes

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self.peer is None:
            return
        self.peer._arrive(data if isinstance(data, bytes) else bytes(data))

    def _arrive(self, data: bytes) -> None:
        if self._closing:
            return
        self._in.append(memoryview(data))
        self._deliver_soon()

    def _deliver_soon(self) -> None:
        # Delivered from a callback of its own, never from inside the writer's call: a handler
        # then never runs under the code that sent to it (as over a socket).
        if self._reading and not self._delivery_due:
            self._delivery_due = True
            asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        """One read, as from a socket: what is waiting, up to the reader's buffer, in one
        `buffer_updated`; the rest on a later turn (so the reader's cap on frames per turn holds here
        too)."""
        self._delivery_due = False
        own, pending = self._own, self._in
        if pending and self._reading and not self._closing:
            buffer = own.get_buffer(-1)
            filled = 0
            while pending and filled < len(buffer):
                view = pending[0]
                n = min(len(buffer) - filled, len(view))
                buffer[filled : filled + n] = view[:n]
                filled += n
                if n == len(view):
                    pending.popleft()
                else:
                    pending[0] = view[n:]
            own.buffer_updated(filled)
            if pending:
                self._deliver_soon()
        if self._eof and not pending and self._reading and not self._closing:
            self._closing = True
            own.connection_lost(None)

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        if self._in or self._eof:
            self._deliver_soon()

    def is_reading(self) -> bool:
        return self._reading

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        loop.call_soon(self._own.connection_lost, None)
        peer = self.peer
        if peer is not None and not peer._closing:
            peer._eof = True  # as a FIN: the other end closes once it has read what came before
            peer._deliver_soon()

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return PEER_NAME if name == "peername" else default

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


def local_pair(
    client: Handler | None,
    server: Handler | None,
    *,
    server_role: str | None = None,
    client_role: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    server_max_frame_bytes: int | None = None,
) -> tuple[Connection, Connection]:
    """Two connected ends: (the client's, the server's), with `client` and `server` as their
    handlers. `server_role` is what the client end's `peer_role` says (the role a TLS link would
    have shown it), `client_role` the server end's. Each end refuses frames over its limit, as over
    a socket: `max_frame_bytes` the client's (and the server's, unless `server_max_frame_bytes`
    says). Call on the event loop."""
    server_limit = max_frame_bytes if server_max_frame_bytes is None else server_max_frame_bytes
    ends = (
        Connection(client, max_frame_bytes=max_frame_bytes, dead_after_s=None),
        Connection(server, max_frame_bytes=server_limit, dead_after_s=None, server=True),
    )
    transports = (_MemoryTransport(ends[0]), _MemoryTransport(ends[1]))
    transports[0].peer, transports[1].peer = transports[1], transports[0]
    for end, transport in zip(ends, transports, strict=True):
        end.connection_made(transport)
    ends[0].peer_role, ends[1].peer_role = server_role, client_role
    return ends


@dataclass(frozen=True, slots=True)
class _Served:
    server: Server
    role: str  # the role its TLS certificate names: what a dialer asking for a role is checked against


# The servers of this process its own dialers reach in memory, by the address they are dialled at.
_SERVED: dict[str, _Served] = {}


def serve_here(address: str, server: Server, *, role: str) -> None:
    """Dials of `address` from this process (`link_here`) reach `server` in memory until
    `withdraw(address)`. `role`: the role `server` serves as (its certificate's, under TLS)."""
    _SERVED[address] = _Served(server, role)


def withdraw(address: str) -> None:
    """`address` is dialled over the network again (its server stops, or moves)."""
    _SERVED.pop(address, None)


def link_here(
    address: str,
    handler: Handler | None,
    *,
    client_role: str,
    peer_role: str | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Connection | None:
    """The dialling end of an in-memory link to the server this process serves at `address`
    (`serve_here`), with `handler` as its handler; None where this process serves nothing there
    (dial it). `client_role`: the dialer's role (what the server end's `peer_role` says);
    `peer_role`: the role the server must have, as `gpufaas.wire.connect` checks it (Unauthenticated
    otherwise). `max_frame_bytes`: the dialer's limit on what it receives (the server keeps its own)."""
    served = _SERVED.get(address)
    if served is None:
        return None
    if peer_role is not None and peer_role != served.role:
        raise Unauthenticated(f"{address} is this process's {served.role}, not a {peer_role}")
    server = served.server
    dialled, accepted = local_pair(
        handler,
        server.handler(),
        server_role=served.role,
        client_role=client_role,
        max_frame_bytes=max_frame_bytes,
        server_max_frame_bytes=server.max_frame_bytes,
    )
    server.adopt(accepted)
    return dialled

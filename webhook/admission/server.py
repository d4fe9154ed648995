"""The admission app under uvicorn over TLS, with the settings the API server's client calls for and the
bounds a server every pod creation depends on needs against clients that are not the API server.

uvicorn reads headers without a deadline or a size limit and, on SIGTERM, closes idle keep-alive
connections at once, when a request may already be on its way on one. `GuardedProtocol` adds what is
missing at the connection: a deadline for a request's headers (from the connection's start, or from the
request's first byte), bounds on their size and number, a cap on open connections, and a drain: on
SIGTERM the listener closes, but open connections are still answered for DRAIN_SECONDS, each answer
with `Connection: close`, so the client reconnects elsewhere instead of meeting a closed socket. The
body's own deadline and the memory bodies may hold are the app's (webhook.admission.app).
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The API server keeps idle webhook connections for 90 s; closing ours sooner makes it reconnect
# (a fresh TLS handshake) on the next admission. uvicorn's default is 5 s.
KEEP_ALIVE_SECONDS = 95
# A request's headers must be complete this long after its first byte (after the connection opened,
# for its first request). The API server sends a few hundred bytes at once; its whole call is bounded by
# timeoutSeconds (at most 30 s), so a client slower than this is not it.
HEADER_READ_SECONDS = 10.0
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
# Open connections at once. The API server needs a handful per replica; the bench drives 200. An idle
# one costs about 30 KB; one whose client pushes a body gpuguard is not reading yet holds up to about
# 0.6 MB of TLS buffers (asyncio's 256 KiB read buffer, the decrypted bytes below, uvicorn's 64 KiB):
# 256 of them stay well inside the Deployment's 512 Mi limit, next to the app's body budget.
MAX_CONNECTIONS = 256
# Decrypted bytes asyncio may buffer for a connection whose reading is paused (its default: 256 KiB).
TLS_READ_BUFFER_BYTES = 64 * 1024
# The most one read of a TLS connection asks for: what a TLS record holds at most. uvloop asks for 256 KiB
# every time and shrinks the buffer to what came: above the 128 KiB `gpuguard serve` has glibc map on their
# own (webhook.processes.serve), each request paid an mmap, an mremap, a munmap and four page faults. (Reads
# of 64 KiB, made on the heap, left it fragmented: 38 MiB more after test_server_bounds' slow bodies.)
TLS_READ_BYTES = 16 * 1024
# After SIGTERM: how long open connections are still answered (with Connection: close) before the
# server stops reading them; then requests in flight get GRACEFUL_SHUTDOWN_SECONDS to finish.
DRAIN_SECONDS = 10.0
GRACEFUL_SHUTDOWN_SECONDS = 30

log = logging.getLogger("gpuguard.server")


class BoundedReadSSLObject(ssl.SSLObject):
    """The TLS connection object of the listener's context: reads ask for TLS_READ_BYTES at most."""

    # SSLObject's own parameter names; Any, as it answers a count when it reads into `buffer`.
    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        return super().read(min(len, TLS_READ_BYTES), buffer)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the reason is in GuardedProtocol._refusal."""


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _OneWriteResponse:
    """The transport as one response writes to it: its head (status line and headers) is held until the
    next write, so that the head and the body leave together. uvicorn writes them apart, and each write
    is a TLS record, a system call and a TCP segment of its own: one of each more per answer than needed.

    Made only for a request that is not HEAD: every other response writes its body, even an empty one,
    after its head. A "100 Continue" goes out at once (the client waits for it before sending the body),
    and closing writes a head still held first.
    """

    __slots__ = ("_head", "_started", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""
        self._started = False

    def write(self, data: bytes) -> None:
        if self._started:
            if self._head:
                data, self._head = self._head + data, b""
            self._transport.write(data)
        elif data == _CONTINUE:
            self._transport.write(data)
        else:
            self._started = True
            self._head = data

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        if self._head:
            self._transport.write(self._head)
            self._head = b""
        self._transport.close()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header deadlines and bounds, a connection cap and a drain."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # The header deadline: when reading the current request's headers began (None: not reading
        # them), and one timer per connection that checks it. The timer is left running when headers
        # complete and, when it fires, re-arms itself for the request being read then, if any: a timer
        # made and cancelled for every request cost more than the bounds it keeps.
        self._headers_since: float | None = None
        self._header_deadline: asyncio.TimerHandle | None = None
        self._reading_headers = True
        self._header_bytes = 0  # received while the current request's headers are incomplete
        self._header_count = 0
        self._header_size = 0  # of the url, names and values parsed so far
        self._refusal: tuple[int, str] | None = None
        self._over_capacity = False
        self.draining = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= MAX_CONNECTIONS:
            # Refused before anything is read: no memory beyond the handshake is spent on it.
            self._over_capacity = True
            self.transport = transport
            transport.abort()
            return
        super().connection_made(transport)
        # A TLS transport's own read buffer (asyncio's is the only one with this knob).
        set_limits = getattr(transport, "set_read_buffer_limits", None)
        if set_limits is not None:
            set_limits(high=TLS_READ_BUFFER_BYTES)
        self._start_header_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_since = None
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        if not self._over_capacity:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._reading_headers
            and self._header_bytes > MAX_HEADER_BYTES
            and not self.transport.is_closing()
        ):
            self._refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")

    # --- parser callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_count = self._header_size = 0
        self._start_header_clock()

    def on_url(self, url: bytes) -> None:
        self._count(len(url), headers=0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), headers=1)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_since = None
        self._reading_headers = False
        self._header_bytes = 0
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is previous:  # no request cycle was made (an upgrade)
            return
        if self.scope["method"] != "HEAD":
            self.cycle.transport = _OneWriteResponse(self.transport)  # type: ignore[assignment]
        if self.draining:
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_headers = True

    # --- bounds -------------------------------------------------------------------------------------

    def _count(self, size: int, *, headers: int) -> None:
        self._header_size += size
        self._header_count += headers
        if self._header_size > MAX_HEADER_BYTES:
            self._refusal = (431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
            raise _Refused
        if self._header_count > MAX_HEADERS:
            self._refusal = (431, f"more than {MAX_HEADERS} request headers")
            raise _Refused

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers any parser error 400; a refused request says why (llhttp has a header size
        # limit of its own, and then fails the parse before gpuguard's count does).
        if self._refusal is None and self._reading_headers and self._header_bytes > MAX_HEADER_BYTES:
            self._refusal = (431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
        status, reason = self._refusal or (400, msg)
        self._refuse(status, reason)

    def _refuse(self, status: int, reason: str) -> None:
        log.warning("refused a request: %s", reason, extra={"fields": {"client": str(self.client)}})
        body = reason.encode()
        head = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def _start_header_clock(self) -> None:
        # A connection's first request is timed from the connection's start, later ones from their first byte.
        if self._headers_since is None:
            self._headers_since = self.loop.time()
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_at(
                self._headers_since + HEADER_READ_SECONDS, self._check_header_deadline
            )

    def _check_header_deadline(self) -> None:
        self._header_deadline = None
        since = self._headers_since
        if since is None or self.transport.is_closing():
            return  # no headers being read: the next request's first byte starts the clock again
        due = since + HEADER_READ_SECONDS
        if self.loop.time() < due:  # a later request's headers, begun after this timer was set
            self._header_deadline = self.loop.call_at(due, self._check_header_deadline)
            return
        self._refuse(408, f"request headers not complete within {HEADER_READ_SECONDS:.0f} s")

    # --- shutdown -----------------------------------------------------------------------------------

    def drain(self) -> None:
        """From now on every answer closes its connection; an idle one stays open for a last request."""
        self.draining = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False


class _Config(uvicorn.Config):
    """uvicorn's settings, whose TLS context makes its connections with BoundedReadSSLObject."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.sslobject_class = BoundedReadSSLObject


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains open connections (GuardedProtocol.drain)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("Shutting down: no new connections; open ones answered for %.0f s", DRAIN_SECONDS)
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            if isinstance(connection, GuardedProtocol):
                connection.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        while self.server_state.connections and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def https_server(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    cert_file: Path,
    key_file: Path,
    adopt_context: Callable[[ssl.SSLContext], None] | None = None,
) -> uvicorn.Server:
    """`adopt_context` receives the listener's SSLContext before it opens, for a caller that switches
    the certificate it presents while serving."""
    config = _Config(
        app,
        host=host,
        port=port,
        http=GuardedProtocol,
        ws="none",
        ssl_certfile=str(cert_file),
        ssl_keyfile=str(key_file),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        access_log=False,
        log_config=None,
        server_header=False,
        # The API server calls gpuguard directly: no proxy in between whose X-Forwarded-For to trust.
        # uvicorn's default trusts it from loopback, which only lets a local client choose the address
        # gpuguard logs, and costs a middleware call per request.
        proxy_headers=False,
    )
    if adopt_context is not None:
        # Made now rather than by uvicorn at startup, so the caller can switch what it presents.
        config.load()
        assert config.ssl is not None
        adopt_context(config.ssl)
    return DrainingServer(config)

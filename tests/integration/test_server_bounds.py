"""The real server against clients that are not the API server: slow or silent ones, oversized headers
and bodies, too many connections, and SIGTERM under load. Each reproduces an attack that used to hold
memory or connections forever, or lose requests; the bounds asserted are behaviour (answered, closed,
nothing lost, memory back), with deadlines far above the server's own."""

from __future__ import annotations

import contextlib
import http.client
import re
import select
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness.manifests import admission_review, defaulted_gpu_pod, well_formed
from tests.integration.test_http import STOP_SECONDS, Server, _read_until, start_server
from webhook.admission.app import BODY_READ_SECONDS, MAX_BODY_BYTES
from webhook.admission.server import HEADER_READ_SECONDS, MAX_CONNECTIONS, MAX_HEADER_BYTES, MAX_HEADERS

# How long a test waits for the server to act on a deadline of its own: generous, for a loaded machine.
PATIENCE = max(HEADER_READ_SECONDS, BODY_READ_SECONDS) + 50.0
DEPLOYMENT_MEMORY_LIMIT_MIB = 512
CHURN_ROUNDS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("bounds"))
    try:
        yield running
    finally:
        running.stop()


def port_of(server: Server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def connect(server: Server, timeout: float = PATIENCE) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))
    raw = socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def read_to_eof(stream: ssl.SSLSocket) -> bytes:
    """Everything the server sends until it closes the connection (the socket timeout bounds the wait)."""
    received = b""
    try:
        while chunk := stream.recv(65536):
            received += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return received


def post_head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n".encode()
        + extra
        + b"\r\n"
    )


def status_and_body(reply: bytes) -> tuple[int, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1.1 (\d{3})", head)
    assert match, reply[:200]
    if b"connection: close" not in head.lower():
        raise AssertionError(f"no Connection: close in {head!r}")
    return int(match.group(1)), body


def rss_mib(server: Server) -> float:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match, status
    return int(match.group(1)) / 1024


# --- deadlines --------------------------------------------------------------------------------------


def drip(stream: ssl.SSLSocket, data: bytes, *, pace: float = 0.5) -> bytes:
    """Sends `data` a byte at a time, `pace` apart, until the server answers; returns its answer."""
    for byte in data:
        readable, _, _ = select.select([stream], [], [], pace)  # the attacker's pace; stops on a reply
        if readable:
            break
        stream.sendall(bytes([byte]))
    return read_to_eof(stream)


def test_silent_and_slow_clients_are_answered_and_closed(server: Server) -> None:
    silent = connect(server)  # connects, never sends
    partial = connect(server)  # half a request line
    partial.sendall(b"POST /mutate HTTP/1.1\r\nHost: 127")
    body_prefix = admission_review(defaulted_gpu_pod(), uid="slow-body")[:2000]
    slow_body = connect(server)  # declares a body just under the limit, sends 2 KB of it
    slow_body.sendall(post_head("/mutate", MAX_BODY_BYTES - 1) + body_prefix)
    trickle = connect(server)  # headers a byte at a time: the deadline runs from the first one
    trickled = b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"y" * 1000
    # The same on a kept-alive connection, after an answered request: its deadline is the second request's.
    again = connect(server)
    again.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head, _, body = _read_until(again, b"\r\n\r\n").partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: (\d+)", head)
    assert head.startswith(b"HTTP/1.1 200") and length is not None, head
    while len(body) < int(length.group(1)):  # all of it: drip stops at the first byte it can read
        body += again.recv(65536)

    started = time.monotonic()
    replies: dict[str, bytes] = {}
    readers = [
        threading.Thread(target=lambda: replies.update(trickle=drip(trickle, trickled))),
        threading.Thread(target=lambda: replies.update(again=drip(again, trickled))),
        *(
            threading.Thread(target=lambda n=name, s=stream: replies.update({n: read_to_eof(s)}))
            for name, stream in (("silent", silent), ("partial", partial), ("slow-body", slow_body))
        ),
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=PATIENCE)
    elapsed = time.monotonic() - started

    for name in ("silent", "partial", "trickle"):
        assert status_and_body(replies[name])[0] == 408, (name, replies[name][:200])
    assert status_and_body(replies["again"])[0] == 408, replies["again"][:200]
    code, body = status_and_body(replies["slow-body"])
    response = well_formed(body)["response"]
    assert (code, response["uid"], response["status"]["code"]) == (200, "slow-body", 408)
    assert elapsed < PATIENCE
    for stream in (silent, partial, trickle, again, slow_body):
        stream.close()


# --- sizes ------------------------------------------------------------------------------------------


def test_a_body_declared_too_large_is_refused_at_once_with_its_uid_and_the_connection_closed(
    server: Server,
) -> None:
    with connect(server) as stream:
        stream.sendall(
            post_head("/mutate", 100 * 1024 * 1024) + admission_review(defaulted_gpu_pod(), uid="huge")[:2000]
        )
        code, body = status_and_body(read_to_eof(stream))  # the rest of the 100 MB is never sent
    response = well_formed(body)["response"]
    assert (code, response["uid"], response["allowed"], response["status"]["code"]) == (
        200,
        "huge",
        False,
        413,
    )


def test_a_body_over_the_limit_is_refused_with_its_uid_and_the_connection_closed(server: Server) -> None:
    review = admission_review(defaulted_gpu_pod(), uid="over")
    padded = review[:-2] + b',"padding":"' + b"x" * MAX_BODY_BYTES + b'"}}'
    with connect(server) as stream:
        # Chunked: no Content-Length to refuse it by, so it is read up to the limit.
        stream.sendall(
            b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(padded):x}\r\n".encode()
        )
        with contextlib.suppress(OSError):  # the server may close before the rest arrives
            stream.sendall(padded + b"\r\n0\r\n\r\n")
        code, body = status_and_body(read_to_eof(stream))
    response = well_formed(body)["response"]
    assert (code, response["uid"], response["status"]["code"]) == (200, "over", 413)


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(b"X-Big: " + b"a" * (2 * 1024 * 1024) + b"\r\n", id="one-2MB-header"),
        pytest.param(b"".join(b"X-H%d: v\r\n" % i for i in range(5000)), id="5000-headers"),
        pytest.param(b"X-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n", id="just-over"),
        pytest.param(b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 1)), id="one-too-many"),
    ],
)
def test_oversized_headers_are_refused(server: Server, headers: bytes) -> None:
    with connect(server) as stream:
        with contextlib.suppress(OSError):  # refused before everything was sent
            stream.sendall(post_head("/mutate", 2, headers) + b"{}")
        code, body = status_and_body(read_to_eof(stream))
    assert code == 431, body


def test_headers_within_the_bounds_are_served(server: Server) -> None:
    extra = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 200) for i in range(MAX_HEADERS - 10))
    body = admission_review(defaulted_gpu_pod(), uid="many-headers")
    with connect(server) as stream:
        stream.sendall(post_head("/mutate", len(body), extra + b"Connection: close\r\n") + body)
        reply = read_to_eof(stream)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert well_formed(reply.partition(b"\r\n\r\n")[2])["response"]["uid"] == "many-headers"


# --- connections ------------------------------------------------------------------------------------


def test_connections_past_the_cap_are_closed_and_the_server_keeps_serving(server: Server) -> None:
    held: list[ssl.SSLSocket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(connect(server))
        # One more is closed by the server as soon as it is made, before anything is read.
        try:
            with connect(server) as extra:
                extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_to_eof(extra) == b""
        except OSError:
            pass  # closed during the handshake already
        first = held[0]
        first.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_to_eof(first).startswith(b"HTTP/1.1 200")
    finally:
        for stream in held:
            stream.close()
    with server.client() as client:  # the slots come back once they close
        assert client.get("/healthz").status_code == 200


# --- memory -----------------------------------------------------------------------------------------


def test_slow_large_bodies_hold_bounded_memory_that_returns(
    tmp_path: Path, summary: Callable[[str, str], None]
) -> None:
    server = start_server(tmp_path)
    streams: list[ssl.SSLSocket] = []
    try:
        idle = rss_mib(server)
        size = MAX_BODY_BYTES - 1  # each declares 7 MiB and sends all but its last byte
        chunk = b" " * 65536

        def push() -> None:
            stream = connect(server)
            streams.append(stream)
            try:
                stream.sendall(post_head("/mutate", size))
                left = size - 1
                while left:
                    left -= stream.send(chunk[: min(left, len(chunk))])
            except OSError:
                return  # answered and closed before it was all sent

        pushers = [threading.Thread(target=push, daemon=True) for _ in range(80)]
        for pusher in pushers:
            pusher.start()
        peak = idle
        while any(p.is_alive() for p in pushers):
            peak = max(peak, rss_mib(server))
            for pusher in pushers:
                pusher.join(timeout=0.2)
        peak = max(peak, rss_mib(server))
        # Those over the budget wait; every one is answered 408 once its body deadline passes.
        answered = [status_and_body(read_to_eof(stream))[0] for stream in streams]
        for stream in streams:
            stream.close()
        assert answered == [200] * 80
        deadline = time.monotonic() + PATIENCE
        while rss_mib(server) > idle + 48 and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the condition, deadline-bounded
        after = rss_mib(server)
    finally:
        server.stop()
    summary(
        "slow_body_rss",
        f"server RSS with 80 clients each sending 7 MiB slowly: {idle:.0f} MiB idle, {peak:.0f} at the "
        f"peak, {after:.0f} after they were answered",
    )
    assert peak < DEPLOYMENT_MEMORY_LIMIT_MIB / 2, f"RSS {idle:.0f} -> {peak:.0f} MiB"
    assert after < idle + 48, f"RSS {idle:.0f} -> {peak:.0f} -> {after:.0f} MiB"


def test_rounds_of_connections_level_off_well_under_the_deployments_limit(
    tmp_path: Path, summary: Callable[[str, str], None]
) -> None:
    # Rounds of connections up to the cap, each posting a review and closing: what a burst of API server
    # connections does. Memory may grow over the first rounds (TLS buffers, allocator arenas), then levels off.
    server = start_server(tmp_path)
    body = admission_review(defaulted_gpu_pod(), uid="churn")
    request = post_head("/mutate", len(body), b"Connection: close\r\n") + body
    after_round: list[float] = []
    try:
        idle = rss_mib(server)
        for _ in range(CHURN_ROUNDS):
            streams = [connect(server) for _ in range(MAX_CONNECTIONS - 6)]  # a few slots to spare
            for stream in streams:
                stream.sendall(request)
            statuses = [status_and_body(read_to_eof(stream))[0] for stream in streams]
            for stream in streams:
                stream.close()
            assert statuses == [200] * len(streams)
            with server.client() as client:  # every slot is back once they close
                assert client.get("/healthz").status_code == 200
            after_round.append(rss_mib(server))
    finally:
        server.stop()
    figures = " -> ".join(f"{rss:.0f}" for rss in after_round)
    summary(
        "connection_churn_rss",
        f"server RSS over {CHURN_ROUNDS} rounds of {MAX_CONNECTIONS - 6} connections: {idle:.0f} MiB idle, "
        f"after each round {figures}",
    )
    assert max(after_round) < DEPLOYMENT_MEMORY_LIMIT_MIB / 4, f"RSS {idle:.0f} -> {figures} MiB"
    # Level: the later rounds add little to what the second one left (the first warms the allocator).
    assert after_round[-1] - after_round[1] < 32, f"RSS still growing: {idle:.0f} -> {figures} MiB"


# --- SIGTERM under load -----------------------------------------------------------------------------


@dataclass
class Client:
    """One keep-alive client posting reviews in a loop until the server stops taking connections."""

    server: Server
    answered: int = 0
    closed_by_server: int = 0
    lost: list[str] = field(default_factory=list)  # sent, and no reply came

    def run(self, stop: threading.Event) -> None:
        context = ssl.create_default_context(cafile=str(self.server.cert_dir / "ca.crt"))
        body = admission_review(defaulted_gpu_pod(), uid="load")
        while not stop.is_set():
            conn = http.client.HTTPSConnection("127.0.0.1", port_of(self.server), timeout=30, context=context)
            try:
                conn.connect()
            except OSError:
                return  # the listener is closed: nothing was sent
            try:
                while not stop.is_set():
                    try:
                        conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
                    except OSError:
                        break  # not sent: the connection was already closed
                    try:
                        response = conn.getresponse()
                        response.read()
                    except (OSError, http.client.HTTPException) as exc:
                        self.lost.append(f"{type(exc).__name__}: {exc}")
                        break
                    self.answered += 1
                    if response.getheader("connection", "").lower() == "close":
                        self.closed_by_server += 1
                        break
            finally:
                conn.close()


def test_sigterm_under_load_answers_every_request_on_open_connections(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    clients = [Client(server) for _ in range(8)]
    stop = threading.Event()
    threads = [threading.Thread(target=c.run, args=(stop,), daemon=True) for c in clients]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + PATIENCE
        while sum(c.answered for c in clients) < 200:  # under way on every connection
            assert time.monotonic() < deadline, "the load never got going"
            assert all(t.is_alive() for t in threads), [c.lost for c in clients]
            for thread in threads:
                thread.join(timeout=0.05)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=STOP_SECONDS) == 0, server.log_tail()
        stop.set()
        for thread in threads:
            thread.join(timeout=PATIENCE)
    finally:
        stop.set()
        server.stop()
    lost = [reason for c in clients for reason in c.lost]
    assert lost == [], f"{len(lost)} requests sent and never answered: {lost[:3]}"
    # Every connection open at the signal ended with an answer saying Connection: close.
    assert all(c.closed_by_server >= 1 for c in clients), [(c.answered, c.closed_by_server) for c in clients]

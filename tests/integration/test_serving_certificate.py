"""A serving certificate switched without a restart: a TLS server on loopback presents the new certificate
from the next handshake on, while a connection made before the switch keeps the one it started with."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.unit.certs.test_tls import SERVICE_NAMES, fresh
from webhook.certs import files
from webhook.certs.serving import ServingCertificate


class EchoServer:
    """A TLS server on loopback answering each line with itself, on uvicorn's kind of context."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(raw,), daemon=True).start()

    def _echo(self, raw: socket.socket) -> None:
        try:
            with self.context.wrap_socket(raw, server_side=True) as conn:
                while data := conn.recv(1024):
                    conn.sendall(data)
        except (OSError, ssl.SSLError):
            pass

    def connect(self, cafile: Path, server_name: str) -> ssl.SSLSocket:
        context = ssl.create_default_context(cafile=str(cafile))
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        return context.wrap_socket(raw, server_hostname=server_name)

    def close(self) -> None:
        self.listener.close()


def served(conn: ssl.SSLSocket) -> x509.Certificate:
    der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def echo(conn: ssl.SSLSocket, text: bytes) -> bytes:
    conn.sendall(text)
    return conn.recv(1024)


@pytest.fixture
def switchable(tmp_path: Path) -> Iterator[tuple[ServingCertificate, EchoServer]]:
    serving = ServingCertificate(tmp_path / "certs")
    files = serving.placeholder(SERVICE_NAMES)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert, files.key)
    serving.attach(context)
    server = EchoServer(context)
    yield serving, server
    server.close()


@pytest.mark.parametrize("server_name", ["127.0.0.1", "gpuguard.gpuguard.svc"], ids=["no-sni", "sni"])
def test_a_new_certificate_is_served_from_the_next_handshake_on(
    switchable: tuple[ServingCertificate, EchoServer], tmp_path: Path, server_name: str
) -> None:
    # An IP URL (as in the e2e suite) makes clients send no server name; a Service URL sends one.
    serving, server = switchable
    first, second = fresh(datetime.datetime.now(datetime.UTC)), fresh(datetime.datetime.now(datetime.UTC))
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(first.ca_bundle + second.ca_bundle)
    assert not serving.valid()  # the placeholder is not a certificate from the Secret

    assert serving.use(first)
    assert serving.valid()
    with server.connect(bundle, server_name) as before:
        assert served(before) == first.leaf
        assert not serving.use(first)  # the same certificate again changes nothing

        assert serving.use(second)

        with server.connect(bundle, server_name) as after:
            assert served(after) == second.leaf
            assert echo(after, b"new") == b"new"
        # The connection made before the switch keeps working with the certificate it started with.
        assert echo(before, b"in flight") == b"in flight"
        assert served(before) == first.leaf
    assert (serving.cert_dir / files.CERT_FILE).read_bytes() == second.cert
    assert (serving.cert_dir / files.CA_FILE).read_bytes() == second.ca_bundle

"""What the TLS listener presents, switchable while it runs: the certificate from the Secret replaces a
placeholder, and each rotation replaces the last, with no restart and no dropped connection."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

from cryptography import x509

from webhook.certs import tls
from webhook.certs.files import ServingFiles


class ServingCertificate:
    """What the TLS listener presents, switchable while it runs.

    uvicorn's SSLContext is made once, before the listener opens. Its SNI callback, called by OpenSSL
    for every handshake whether or not the client sent a server name, moves the connection to the
    context of the current certificate. Each certificate gets a new context, fully loaded before it is
    published by one reference assignment: a handshake sees the old or the new one, never half of
    either, and established connections (requests in flight) keep the certificate they started with.
    The switched-to context only supplies the certificate and key; protocol settings stay uvicorn's.
    """

    def __init__(self, cert_dir: Path) -> None:
        self.cert_dir = cert_dir
        self._context: ssl.SSLContext | None = None
        self._leaf: x509.Certificate | None = None

    def placeholder(self, names: tuple[str, ...]) -> ServingFiles:
        """A throwaway self-issued certificate for the listener to start with: /healthz answers while
        the real one is fetched, and /readyz says not ready until then."""
        ca = tls.new_ca("gpuguard-placeholder")
        return tls.write_serving_files(self.cert_dir, ca.cert_pem, tls.issue(ca, names[0], sans=names))

    def attach(self, context: ssl.SSLContext) -> None:
        context.sni_callback = self._select

    def _select(self, connection: ssl.SSLObject | ssl.SSLSocket, _: str | None, __: ssl.SSLContext) -> None:
        current = self._context
        if current is not None:
            connection.context = current

    def use(self, material: tls.Material) -> bool:
        """Serves `material`'s certificate from the next handshake on; False when it already is."""
        if self._leaf == material.leaf:
            return False
        files = tls.write_serving_files(self.cert_dir, material.ca_bundle, material.serving)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(files.cert, files.key)
        self._context, self._leaf = context, material.leaf
        return True

    def valid(self) -> bool:
        """A certificate from the Secret is served and within its validity (what /readyz requires)."""
        leaf = self._leaf
        return leaf is not None and tls.is_current(leaf, datetime.datetime.now(datetime.UTC))

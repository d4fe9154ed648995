"""The admission app under uvicorn over TLS, with the settings the API server's client calls for."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

# The API server keeps idle webhook connections for 90 s; closing ours sooner makes it reconnect
# (a fresh TLS handshake) on the next admission. uvicorn's default is 5 s.
KEEP_ALIVE_SECONDS = 95
# On SIGTERM, requests in flight finish; the API server's timeoutSeconds is far below this.
GRACEFUL_SHUTDOWN_SECONDS = 30


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
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_certfile=str(cert_file),
        ssl_keyfile=str(key_file),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        access_log=False,
        log_config=None,
        server_header=False,
    )
    if adopt_context is not None:
        # Made now rather than by uvicorn at startup, so the caller can switch what it presents.
        config.load()
        assert config.ssl is not None
        adopt_context(config.ssl)
    return uvicorn.Server(config)

"""Runs the app under uvicorn over TLS, with settings chosen for the API server as a client."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from webhook.app import State, create_app
from webhook.policy import Policy

# The API server keeps idle webhook connections for 90 s; closing ours sooner makes it reconnect
# (a fresh TLS handshake) on the next admission. uvicorn's default is 5 s.
KEEP_ALIVE_SECONDS = 95
# On SIGTERM, requests in flight finish; the API server's timeoutSeconds is far below this.
GRACEFUL_SHUTDOWN_SECONDS = 30


def build_server(*, host: str, port: int, cert_file: Path, key_file: Path, policy: Policy) -> uvicorn.Server:
    state = State(policy)
    state.use_policy(policy)
    config = uvicorn.Config(
        create_app(state),
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
    return uvicorn.Server(config)


def serve(*, host: str, port: int, cert_file: Path, key_file: Path, policy: Policy) -> None:
    build_server(host=host, port=port, cert_file=cert_file, key_file=key_file, policy=policy).run()

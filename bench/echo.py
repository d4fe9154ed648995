"""The physical baseline: a bare ASGI app under uvicorn, same TLS certificate and settings as gpuguard.

It reads the whole request body, as gpuguard must, and answers a fixed ~100 B AdmissionReview, so what it
costs is the kernel, TLS, HTTP parsing and ASGI dispatch: the floor under any Python webhook on this
machine. gpuguard's throughput is stated as a ratio to it, measured in the same run, so the figure does not
depend on how fast the machine is.

    python -m bench.echo --port 9443 --cert-dir DIR

`--work` adds one piece of gpuguard's work to the bare echo, to show by hand where the saturation floor
goes: `decode` parses the body with orjson and encodes an answer allowing it, with the review's
apiVersion and uid (the least a Python webhook that reads the review does; `bench/run hotpath`'s
reference); `review` answers through `webhook.admission.review.review` (engine, differ, answer) with the
embedded policy, without gpuguard's shell (FastAPI, metrics, the log line). `allow` is the least a
webhook the API server accepts can do: it finds the request's uid in the body's first bytes and allows,
changing nothing (`bench/run admission`'s scenario (e), the cost of calling any webhook at all).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import orjson
import uvicorn
from starlette.types import Message, Receive, Scope, Send

from webhook.admission.server import KEEP_ALIVE_SECONDS

ANSWER = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"","allowed":true}}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
START: Message = {"type": "http.response.start", "status": 200, "headers": HEADERS}
BODY: Message = {"type": "http.response.body", "body": ANSWER}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            break
    await send(START)
    await send(BODY)


def working_app(work: Callable[[bytes], bytes]) -> Callable[[Scope, Receive, Send], object]:
    """The echo that collects the body and answers what `work` makes of it."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                break
        # A GET (the bench's readiness poll) has no review to work on.
        answer = work(b"".join(chunks)) if scope["method"] == "POST" else ANSWER
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return serve


def _decode() -> Callable[[bytes], bytes]:
    def decode(body: bytes) -> bytes:
        review = orjson.loads(body)
        response = {"uid": review["request"]["uid"], "allowed": True}
        return orjson.dumps(
            {"apiVersion": review["apiVersion"], "kind": "AdmissionReview", "response": response}
        )

    return decode


def _review() -> Callable[[bytes], bytes]:
    # Imported here so that the plain echo, the bench's baseline, loads neither pydantic nor the engine.
    from webhook.admission.review import review
    from webhook.policy.model import default_policy

    policy = default_policy()
    return lambda body: review(body, endpoint="mutate", policy=policy).body


def _allow() -> Callable[[bytes], bytes]:
    from webhook.admission.review import uid_in

    def allow(body: bytes) -> bytes:
        # The API server refuses an answer whose uid is not its request's.
        response = {"uid": uid_in(body), "allowed": True}
        return orjson.dumps(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        )

    return allow


WORK: dict[str, Callable[[], Callable[[bytes], bytes]]] = {
    "allow": _allow,
    "decode": _decode,
    "review": _review,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert-dir", type=Path, required=True)
    parser.add_argument("--work", choices=sorted(WORK), help="add this piece of gpuguard's work")
    args = parser.parse_args()
    # The settings gpuguard's server.py uses (uvloop and httptools are uvicorn's "auto" choice when
    # installed), so that the two differ only in the application.
    uvicorn.run(
        working_app(WORK[args.work]()) if args.work else app,
        host=args.host,
        port=args.port,
        ssl_certfile=str(args.cert_dir / "tls.crt"),
        ssl_keyfile=str(args.cert_dir / "tls.key"),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        access_log=False,
        server_header=False,
        lifespan="off",
        log_level="warning",
    )


if __name__ == "__main__":
    main()

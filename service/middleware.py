"""ASGI middleware around the whole service: request bodies within a limit, JSON bodies
declared as such, and every error in one shape.

It runs outside BentoML's app and the mounted one (:mod:`service.http_api`), so
`/v1/predict`, whose body BentoML reads, gets the same treatment as the other endpoints.
See docs/sidecar.md (HTTP errors)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger.validation import MAX_MESSAGE_BYTES

# The largest request body any endpoint of the mounted app reads: one intake request may be
# as large as a Kafka message (1 MiB), the other endpoints take none.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES


async def _send_error(send: Send, status: int, error: str) -> None:
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a request body over its path's limit gets 413, unread.

    A Content-Length over the limit is refused before a byte of the body is read;
    a body without one (chunked) is counted as it streams in and refused at the
    chunk that goes over, so at most the limit plus one chunk is ever held. A body
    within the limit is read here and handed on to the app as one chunk. `limits`
    maps exact paths to their own limit; every other path gets `default`.
    """

    def __init__(self, app: ASGIApp, default: int = MAX_BODY_BYTES,
                 limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.default = default
        self.limits = dict(limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        limit = self.limits.get(path, self.default)
        declared = [v for k, v in scope["headers"] if k.lower() == b"content-length"]
        if declared:
            text = declared[0].decode("latin-1").strip()
            if len(declared) > 1 or not text.isdigit():
                await _send_error(send, 400, "Content-Length must be one non-negative integer")
                return
            if int(text) > limit:
                await _send_error(send, 413, f"request body of {text} bytes is over the "
                                             f"limit of {limit} bytes for {path}")
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(send, 413, f"request body is over the limit of {limit} "
                                             f"bytes for {path}")
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)

        async def replay() -> Message:
            nonlocal body
            if body is None:  # after the body: disconnects and the like
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)


class ErrorShape:
    """ASGI middleware: every error answer (status >= 400), on every path, in the one
    shape, ``{"error": "..."}`` with ``Content-Type: application/json``.

    BentoML answers an API's InvalidArgument with ``[{"error": ...}]`` and a pydantic
    validation error with ``{"error": ..., "detail": [...]}``; this folds the details
    into the message (``loc: msg``) and unwraps the list. Plain-text answers (Starlette's
    404 and 405, BentoML's ``/readyz`` 503) become a message that says what to do.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _one_shape(b"".join(chunks), start["status"], scope)
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() not in (b"content-length", b"content-type")]
            await send({**start, "headers": [*headers, (b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping)


class JsonBody:
    """ASGI middleware: a POST to `paths` whose body is not declared JSON gets 415 saying
    to send ``Content-Type: application/json`` (BentoML would read it as a form, and
    answer ``instances: Field required``)."""

    def __init__(self, app: ASGIApp, paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and \
                scope["path"] in self.paths:
            declared = dict(scope.get("headers") or ()).get(b"content-type", b"")
            if declared.split(b";")[0].strip().lower() != b"application/json":
                what = repr(declared.decode("latin-1")[:100]) if declared else "none"
                await _send_error(send, 415, "send the body as JSON with the header "
                                             "'Content-Type: application/json' (got "
                                             f"{what})")
                return
        await self.app(scope, receive, send)


def _one_shape(body: bytes, status: int, scope: Scope) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return json.dumps({"error": _plain_error(body, status, scope)}).encode()
    if isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict):
        doc = doc[0]
    if not isinstance(doc, dict) or "error" not in doc:
        return json.dumps({"error": _plain_error(body, status, scope)}).encode()
    if set(doc) - {"error", "detail"}:  # an intake rejection's status and reason: kept
        return body
    parts = [str(doc["error"])]
    for d in doc.get("detail") or ():
        if isinstance(d, dict):
            loc = ".".join(map(str, d.get("loc") or ()))
            parts.append(f"{loc}: {d.get('msg')}" if loc else str(d.get("msg")))
    return json.dumps({"error": "; ".join(parts)}).encode()


def _plain_error(body: bytes, status: int, scope: Scope) -> str:
    """What a non-JSON error answer says, in words a client can act on."""
    path, method = scope.get("path", ""), scope.get("method", "")
    if status == 404:
        return f"no endpoint at {path[:200]} (docs/sidecar.md lists them)"
    if status == 405:
        return f"{method} is not allowed on {path[:200]}"
    if status == 503 and path == "/readyz":
        return ("not ready: no model version is loaded yet (publish one with `obliviate "
                "model train` or `obliviate worker --train`)")
    text = body.decode("utf-8", "replace").strip()
    return text[:500] or HTTPStatus(status).phrase

"""The service's JSON endpoints besides /v1/predict, and the audit page.

Mounted into the BentoML service as an ASGI app. Intake and audit endpoints
need the admin bearer token: a deletion request and a request's history are
not for the public. The model manifest, the ledger's signed tree heads and
consistency proofs, and the page itself are public (the page asks for the
token and sends it with each call).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.orchestration.registry import ModelVersion, Registry
from ledger.chain import iso
from ledger.forgotten import forgotten, receipt
from ledger.store import Ledger
from ledger.transform import schema_document
from ledger.validation import MAX_ID_LENGTH, MAX_MESSAGE_BYTES, show_value, storable_id
from service.usage import GuardUsage

AUDIT_DIR = Path(__file__).parent / "audit"
# The largest request body any endpoint of this app reads: one intake request may be as
# large as a Kafka message (1 MiB), the other endpoints take none.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES
Handler = Callable[[Request], Awaitable[Response]]


# what the public may not see of a manifest: the seeds (private prediction mode rests on
# them staying secret) and where it was built
_PRIVATE_MANIFEST = ("seed", "built_by")
# In private prediction mode, what the public may see of a version's change and guard:
# nothing that depends on the shard seeds. Which shards an update retrained, from which
# slice, how many records they hold, how long they took and each shard's bound all tell
# which shard a deleted or added record was in (released outside the seeds' budget).
_SEEDLESS_CHANGE = ("op", "requests", "n_records", "reason", "to", "from")
_SEEDLESS_UPDATE = ("op", "n_records", "guarantee")
_SEEDLESS_GUARD = ("rule", "ready", "n_shards", "shard_bound")
_SEEDLESS_CHECK = ("guarantee", "exact")
_MAX_BIGINT = 2**63 - 1  # the largest tree size or sequence number a column holds
# ASCII digits only (int() also takes " 1_0" and other scripts' digits), 20 at most
_INTEGER = re.compile(r"-?[0-9]{1,20}")


def _public_manifest(m: dict[str, Any], private: bool) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in _PRIVATE_MANIFEST}
    out["params"] = {k: v for k, v in m.get("params", {}).items() if k != "random_state"}
    if private:
        out["guard"] = _pick(m.get("guard"), _SEEDLESS_GUARD)
        out["change"] = _seedless_change(m.get("change") or {})
    return out


def _seedless_change(change: dict[str, Any]) -> dict[str, Any]:
    out = _pick(change, _SEEDLESS_CHANGE)
    if "updates" in change:
        out["updates"] = [_pick(u, _SEEDLESS_UPDATE) for u in change["updates"]]
    if "guard" in change:
        out["guard"] = _pick(change["guard"], _SEEDLESS_GUARD)
    if "exactness" in change:
        out["exactness"] = _pick(change["exactness"], _SEEDLESS_CHECK)
    return out


def _pick(d: dict[str, Any] | None, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d[k] for k in keys if k in d} if isinstance(d, dict) else {}


def _version_dict(v: ModelVersion, full: bool = False, private: bool = False
                  ) -> dict[str, Any]:
    return {"version": v.version, "seq": v.seq, "parent": v.parent,
            "created_at": iso(v.created_at),
            "manifest": v.manifest if full else _public_manifest(v.manifest, private),
            "superseded_by_deletion": v.superseded_by_deletion,
            "destroyed_at": None if v.destroyed_at is None else iso(v.destroyed_at)}


def _int_param(request: Request, name: str, default: int | None, low: int, high: int) -> int:
    """Query parameter `name`, an integer in [low, high] (`default` when absent); 400
    otherwise: a limit of -1 reached PostgreSQL as LIMIT -1, a size past BIGINT overflowed."""
    text = request.query_params.get(name)
    if text is None and default is not None:
        return default
    if text is None or not _INTEGER.fullmatch(text) or not low <= int(text) <= high:
        raise HTTPException(400, f"{name} must be an integer from {low:,} to {high:,}, got "
                                 f"{'nothing' if text is None else show_value(text)}")
    return int(text)


def _path_id(request: Request, name: str) -> str:
    """Path parameter `name`, an id; 400 for one no id column can hold (NUL, over 128
    characters): it is in no row, and PostgreSQL would refuse it with an error."""
    value = request.path_params[name]
    if not storable_id(value):
        raise HTTPException(400, f"{name} must be 1-{MAX_ID_LENGTH} characters without NUL, "
                                 f"got {show_value(value)}")
    return value


@dataclass
class AppContext:
    """What the handlers use; filled in when the serving process starts.

    The app is built at import time (BentoML mounts it then), the ledger and the
    registry only exist once the process runs.
    """

    ledger: Ledger | None = None
    registry: Registry | None = None
    usage: GuardUsage | None = None
    admin_token: str = ""
    status: Callable[[], dict[str, Any]] = dict
    private: bool = False  # private prediction mode: no seed-dependent field to the public


def build_app(ctx: AppContext) -> Starlette:
    """The Starlette app over `ctx` (see the module docstring)."""

    def bearer(request: Request) -> str | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token if scheme.lower() == "bearer" and token else None

    def is_admin(request: Request) -> bool:
        token = bearer(request)
        return token is not None and secrets.compare_digest(token.encode(),
                                                            ctx.admin_token.encode())

    def admin(handler: Handler) -> Handler:
        async def checked(request: Request) -> Response:
            if bearer(request) is None:
                return JSONResponse({"error": "this endpoint needs 'Authorization: Bearer "
                                              "<admin token>'"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            if not is_admin(request):
                return JSONResponse({"error": "the admin token is not valid"}, status_code=403)
            return await handler(request)
        return checked

    async def submit(request: Request) -> Response:
        body = await request.body()
        if not body:
            return JSONResponse({"error": "empty body; send one request as JSON"},
                                status_code=400)
        result = await run_in_threadpool(ctx.ledger.receive, body, "http")
        answer = result.as_dict()
        if result.status == "rejected":  # every 4xx body has an "error"
            answer["error"] = result.reason
        if result.status == "accepted":  # for the subject: GET /v1/requests/{id}/receipt
            answer["receipt_token"] = ctx.ledger.events.receipt_token(result.request_id)
        return JSONResponse(answer, status_code=result.http_status)

    async def request_history(request: Request) -> Response:
        rid = _path_id(request, "request_id")
        try:
            history = await run_in_threadpool(ctx.ledger.history, rid)
        except KeyError:
            return JSONResponse({"error": f"no request {rid!r}"}, status_code=404)
        return JSONResponse(history)

    async def forgotten_report(request: Request) -> Response:
        rid = _path_id(request, "request_id")
        try:
            report = await run_in_threadpool(forgotten, ctx.ledger, rid)
        except KeyError:
            return JSONResponse({"error": f"no request {rid!r}"}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(report)

    async def subject_requests(request: Request) -> Response:
        sid = _path_id(request, "subject_id")
        rows = await run_in_threadpool(ctx.ledger.lifecycle.requests_of_subject, sid)
        return JSONResponse({"subject_id": sid, "requests": rows})

    async def models(request: Request) -> Response:
        cur = await run_in_threadpool(ctx.registry.current)
        if cur is None:
            return JSONResponse({"error": "no model version is published yet"},
                                status_code=503)
        full = is_admin(request)  # seeds and host names for the admin only
        serving = ctx.status()
        if not full:
            serving = {k: v for k, v in serving.items() if k != "process"}
        return JSONResponse({"current": _version_dict(cur, full, ctx.private),
                             "serving": serving})

    async def lineage(request: Request) -> Response:
        limit = _int_param(request, "limit", 100, 1, 1000)
        rows = await run_in_threadpool(ctx.registry.lineage, limit)
        full = is_admin(request)
        return JSONResponse({"versions": [_version_dict(v, full, ctx.private) for v in rows]})

    async def ledger_heads(request: Request) -> Response:
        """Public: signed tree heads are meant to be published (and saved by auditors)."""
        since = _int_param(request, "since", 0, 0, _MAX_BIGINT)
        limit = _int_param(request, "limit", 1000, 1, 10_000)
        return JSONResponse(await run_in_threadpool(ctx.ledger.heads.published, since, limit))

    async def ledger_consistency(request: Request) -> Response:
        """Public: an RFC 6962 consistency proof between two tree sizes (hashes only)."""
        old = _int_param(request, "old", None, 0, _MAX_BIGINT)
        new = _int_param(request, "new", None, 0, _MAX_BIGINT)
        try:
            proof = await run_in_threadpool(ctx.ledger.events.consistency, old, new)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(proof)

    async def guard_usage(request: Request) -> Response:
        bucket = _int_param(request, "bucket_s", 60, 1, 366 * 86_400)
        return JSONResponse(await run_in_threadpool(ctx.usage.summary, bucket))

    async def schema(request: Request) -> Response:
        """Public: what /v1/predict takes (feature names and ranges, scaling, classes)."""
        doc = await run_in_threadpool(ctx.ledger.records.schema)
        if doc is None:
            return JSONResponse({"error": "the ledger holds no records yet: run `obliviate "
                                          "ledger init`"}, status_code=503)
        return JSONResponse(schema_document(doc))

    async def audit_page(request: Request) -> Response:
        return FileResponse(AUDIT_DIR / "index.html")

    routes = [
        Route("/v1/requests", admin(submit), methods=["POST"]),
        Route("/v1/requests/{request_id:path}/receipt", _receipt_handler(ctx, bearer, is_admin),
              methods=["GET"]),
        Route("/v1/requests/{request_id:path}", admin(request_history), methods=["GET"]),
        Route("/v1/forgotten/{request_id:path}", admin(forgotten_report), methods=["GET"]),
        Route("/v1/subjects/{subject_id:path}/requests", admin(subject_requests),
              methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/lineage", lineage, methods=["GET"]),
        Route("/v1/ledger/heads", ledger_heads, methods=["GET"]),
        Route("/v1/ledger/consistency", ledger_consistency, methods=["GET"]),
        Route("/v1/guard/usage", admin(guard_usage), methods=["GET"]),
        Route("/v1/schema", schema, methods=["GET"]),
        Route("/audit", audit_page, methods=["GET"]),
    ]
    if AUDIT_DIR.is_dir():
        routes.append(Mount("/audit/static", StaticFiles(directory=AUDIT_DIR), name="audit"))
    return Starlette(routes=routes, middleware=[Middleware(BodyLimit)],
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


def _receipt_handler(ctx: AppContext, bearer: Callable[[Request], str | None],
                     is_admin: Callable[[Request], bool]) -> Handler:
    """GET /v1/requests/{id}/receipt: the deletion receipt (`ledger.receipt`), for the
    admin or the subject holding the request's receipt token (returned when the request
    was accepted)."""
    async def deletion_receipt(request: Request) -> Response:
        token = bearer(request)
        if token is None:
            return JSONResponse({"error": "this endpoint needs 'Authorization: Bearer <the "
                                          "request's receipt token, or the admin token>'"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        rid = _path_id(request, "request_id")
        if not (is_admin(request) or secrets.compare_digest(
                token.encode(), ctx.ledger.events.receipt_token(rid).encode())):
            return JSONResponse({"error": "neither this request's receipt token nor the "
                                          "admin token"}, status_code=403)
        try:
            doc = await run_in_threadpool(receipt, ctx.ledger, rid)
        except KeyError:
            return JSONResponse({"error": f"no request {rid!r}"}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(doc)
    return deletion_receipt


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "internal error; the service log has the details"},
                        status_code=500)


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
    """ASGI middleware: JSON error bodies of `paths` in the one shape, {"error": "..."}.

    BentoML answers an API's InvalidArgument with ``[{"error": ...}]`` and a pydantic
    validation error with ``{"error": ..., "detail": [...]}``; this folds the details
    into the message (``loc: msg``) and unwraps the list. Other bodies pass unchanged.
    """

    def __init__(self, app: ASGIApp, paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and \
                    any(k.lower() == b"content-type" and v.startswith(b"application/json")
                        for k, v in message.get("headers", [])):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _one_shape(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers,
                                              (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping)


def _one_shape(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict):
        doc = doc[0]
    if not isinstance(doc, dict) or set(doc) - {"error", "detail"} or "error" not in doc:
        return body
    parts = [str(doc["error"])]
    for d in doc.get("detail") or ():
        if isinstance(d, dict):
            loc = ".".join(map(str, d.get("loc") or ()))
            parts.append(f"{loc}: {d.get('msg')}" if loc else str(d.get("msg")))
    return json.dumps({"error": "; ".join(parts)}).encode()


# ---------------------------------------------------------------------------- ids in paths
# Paths of the service that are not this app's routes (BentoML's own, and the API).
_SERVICE_PATHS = frozenset({"/v1/predict", "/metrics", "/healthz", "/livez", "/readyz", "/",
                            "/docs.json", "/schema.json"})
_UNMATCHED = "{unmatched}"
_REAL_PATH = "obliviate.real_path"


def _route_patterns() -> tuple[frozenset[str], list[tuple[re.Pattern[str], str]]]:
    """This app's exact paths, and (regex, template) for those with parameters."""
    exact, templated = set(_SERVICE_PATHS), []
    for route in build_app(AppContext()).routes:
        template = re.sub(r":\w+}", "}", route.path)
        if isinstance(route, Mount):
            templated.append((re.compile("^" + re.escape(route.path) + "/.*$"),
                              route.path + "/{path}"))
        elif route.param_convertors:
            templated.append((route.path_regex, template))
        else:
            exact.add(route.path)
    return frozenset(exact), templated


def route_template(path: str) -> str:
    """The route a path matches, with its parameters as names (`/v1/requests/{request_id}`);
    `{unmatched}` for a path of no route. What metrics and access logs may show: never a
    request, subject or record id, and a bounded number of values."""
    global _PATTERNS
    if _PATTERNS is None:
        _PATTERNS = _route_patterns()
    exact, templated = _PATTERNS
    if path in exact:
        return path
    for regex, template in templated:
        if regex.match(path):
            return template
    return _UNMATCHED


_PATTERNS: tuple[frozenset[str], list[tuple[re.Pattern[str], str]]] | None = None


def with_route_template(cls: type) -> type:
    """An ASGI middleware class (BentoML's request metrics, its access log) that sees the
    route template as the path, while the app inside it gets the real one."""
    if getattr(cls, "obliviate_templated", False):
        return cls

    class Templated(cls):  # type: ignore[misc, valid-type]
        obliviate_templated = True

        def __init__(self, app: ASGIApp, *args: Any, **kwargs: Any) -> None:
            super().__init__(_restore(app), *args, **kwargs)

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") in ("http", "websocket") and _REAL_PATH not in scope:
                scope = {**scope, "path": route_template(scope["path"]),
                         _REAL_PATH: scope["path"]}
            await super().__call__(scope, receive, send)

    Templated.__name__ = Templated.__qualname__ = cls.__name__
    return Templated


def _restore(app: ASGIApp) -> ASGIApp:
    """The app, called with the real path back in the scope."""
    async def real_path(scope: Scope, receive: Receive, send: Send) -> None:
        if _REAL_PATH in scope:
            real = scope[_REAL_PATH]
            scope = {k: v for k, v in scope.items() if k != _REAL_PATH}
            scope["path"] = real
        await app(scope, receive, send)
    return real_path


def template_paths() -> None:
    """Make BentoML's HTTP request metrics (`endpoint` label) and access log (`path=`)
    show route templates instead of paths, which hold request and subject ids.

    BentoML (1.4) labels its request metrics with the raw path and offers no setting
    for it; it imports these middleware classes from their modules when it builds a
    serving process's app, after importing the service, so replacing them in their
    modules here (at the service's import) is enough. Idempotent.
    """
    from bentoml._internal.server.http import access, instruments

    for module, name in ((instruments, "RunnerTrafficMetricsMiddleware"),
                         (instruments, "HTTPTrafficMetricsMiddleware"),
                         (access, "AccessLogMiddleware")):
        setattr(module, name, with_route_template(getattr(module, name)))

"""The service's JSON endpoints besides /v1/predict, and the audit page.

A Starlette app mounted into the BentoML service. Intake and audit endpoints need the
admin bearer token; the manifest, signed heads, proofs and the page are public; a
deletion receipt is for the admin or the subject holding its token. Each endpoint turns
a request into one call and its result into JSON; :func:`build_app` lists the routes.
See docs/sidecar.md (Service)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
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

from jobs.orchestration.registry import Registry
from ledger.forgotten import forgotten, receipt
from ledger.store import Ledger
from ledger.transform import schema_document
from ledger.validation import MAX_ID_LENGTH, show_value, storable_id
from service.middleware import BodyLimit
from service.public_view import version_dict
from service.usage import GuardUsage

AUDIT_DIR = Path(__file__).parent / "audit"
Handler = Callable[[Request], Awaitable[Response]]
_MAX_BIGINT = 2**63 - 1  # the largest tree size or sequence number a column holds
# ASCII digits only (int() also takes " 1_0" and other scripts' digits), 20 at most
_INTEGER = re.compile(r"-?[0-9]{1,20}")


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


Endpoint = Callable[[AppContext, Request], Awaitable[Response]]


def build_app(ctx: AppContext) -> Starlette:
    """The Starlette app over `ctx`: who may call what, at a glance."""

    def anyone(endpoint: Endpoint) -> Handler:
        async def handle(request: Request) -> Response:
            return await endpoint(ctx, request)
        return handle

    def admin(endpoint: Endpoint) -> Handler:
        async def handle(request: Request) -> Response:
            return _refuse_non_admin(ctx, request) or await endpoint(ctx, request)
        return handle

    get, post = ["GET"], ["POST"]
    routes = [
        Route("/v1/requests", admin(submit), methods=post),
        # the admin, or the subject with the request's receipt token
        Route("/v1/requests/{request_id:path}/receipt", anyone(deletion_receipt), methods=get),
        Route("/v1/requests/{request_id:path}", admin(request_history), methods=get),
        Route("/v1/forgotten/{request_id:path}", admin(forgotten_report), methods=get),
        Route("/v1/subjects/{subject_id:path}/requests", admin(subject_requests), methods=get),
        Route("/v1/models", anyone(models), methods=get),
        Route("/v1/models/lineage", anyone(lineage), methods=get),
        Route("/v1/ledger/heads", anyone(ledger_heads), methods=get),
        Route("/v1/ledger/consistency", anyone(ledger_consistency), methods=get),
        Route("/v1/guard/usage", admin(guard_usage), methods=get),
        Route("/v1/schema", anyone(schema), methods=get),
        Route("/audit", anyone(audit_page), methods=get),
    ]
    if AUDIT_DIR.is_dir():
        routes.append(Mount("/audit/static", StaticFiles(directory=AUDIT_DIR), name="audit"))
    return Starlette(routes=routes, middleware=[Middleware(BodyLimit)],
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


# ---------------------------------------------------------------------------- who asks
def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def _is_admin(ctx: AppContext, request: Request) -> bool:
    token = _bearer(request)
    return token is not None and secrets.compare_digest(token.encode(),
                                                        ctx.admin_token.encode())


def _refuse_non_admin(ctx: AppContext, request: Request) -> Response | None:
    """401 without a bearer token, 403 with one that is not the admin's; None for the admin."""
    if _bearer(request) is None:
        return _error(401, "this endpoint needs 'Authorization: Bearer <admin token>'",
                      headers={"WWW-Authenticate": "Bearer"})
    if not _is_admin(ctx, request):
        return _error(403, "the admin token is not valid")
    return None


# ---------------------------------------------------------------------------- parameters
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


# ---------------------------------------------------------------------------- answers
def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _ledger_answer(call: Callable[..., Any], *args: Any, missing: str) -> Response:
    """`call(*args)` off the event loop, as JSON: a KeyError is 404 (`missing` says what
    is not there), a ValueError 422 (its message says why the ledger cannot answer)."""
    try:
        result = await run_in_threadpool(call, *args)
    except KeyError:
        return _error(404, missing)
    except ValueError as exc:
        return _error(422, str(exc))
    return JSONResponse(result)


# ---------------------------------------------------------------------------- intake, audit
async def submit(ctx: AppContext, request: Request) -> Response:
    body = await request.body()
    if not body:
        return _error(400, "empty body; send one request as JSON")
    result = await run_in_threadpool(ctx.ledger.receive, body, "http")
    answer = result.as_dict()
    if result.status == "rejected":  # every 4xx body has an "error"
        answer["error"] = result.reason
    if result.status == "accepted":  # for the subject: GET /v1/requests/{id}/receipt
        answer["receipt_token"] = ctx.ledger.events.receipt_token(result.request_id)
    return JSONResponse(answer, status_code=result.http_status)


async def request_history(ctx: AppContext, request: Request) -> Response:
    rid = _path_id(request, "request_id")
    return await _ledger_answer(ctx.ledger.history, rid, missing=f"no request {rid!r}")


async def forgotten_report(ctx: AppContext, request: Request) -> Response:
    rid = _path_id(request, "request_id")
    return await _ledger_answer(forgotten, ctx.ledger, rid, missing=f"no request {rid!r}")


async def deletion_receipt(ctx: AppContext, request: Request) -> Response:
    """The deletion receipt (`ledger.receipt`), for the admin or the subject holding the
    request's receipt token (returned when the request was accepted)."""
    token = _bearer(request)
    if token is None:
        return _error(401, "this endpoint needs 'Authorization: Bearer <the request's "
                           "receipt token, or the admin token>'",
                      headers={"WWW-Authenticate": "Bearer"})
    rid = _path_id(request, "request_id")
    if not (_is_admin(ctx, request) or secrets.compare_digest(
            token.encode(), ctx.ledger.events.receipt_token(rid).encode())):
        return _error(403, "neither this request's receipt token nor the admin token")
    return await _ledger_answer(receipt, ctx.ledger, rid, missing=f"no request {rid!r}")


async def subject_requests(ctx: AppContext, request: Request) -> Response:
    """A page of the requests about a subject, oldest first: `limit` of them received
    after event `after`; `next_after` continues (null on the last page)."""
    sid = _path_id(request, "subject_id")
    limit = _int_param(request, "limit", 100, 1, 1000)
    after = _int_param(request, "after", 0, 0, _MAX_BIGINT)
    rows = await run_in_threadpool(ctx.ledger.lifecycle.requests_of_subject, sid, limit + 1,
                                   after)
    more = len(rows) > limit
    return JSONResponse({"subject_id": sid, "requests": rows[:limit],
                         "next_after": rows[limit - 1]["received_seq"] if more else None})


async def guard_usage(ctx: AppContext, request: Request) -> Response:
    bucket = _int_param(request, "bucket_s", 60, 1, 366 * 86_400)
    return JSONResponse(await run_in_threadpool(ctx.usage.summary, bucket))


# ---------------------------------------------------------------------------- public
async def models(ctx: AppContext, request: Request) -> Response:
    cur = await run_in_threadpool(ctx.registry.current)
    if cur is None:
        return _error(503, "no model version is published yet")
    full = _is_admin(ctx, request)  # seeds and host names for the admin only
    serving = ctx.status()
    if not full:
        serving = {k: v for k, v in serving.items() if k != "process"}
    return JSONResponse({"current": version_dict(cur, full, ctx.private), "serving": serving})


async def lineage(ctx: AppContext, request: Request) -> Response:
    """A page of the lineage, newest first: `limit` versions numbered below `before`;
    `next_before` continues (null on the last page)."""
    limit = _int_param(request, "limit", 100, 1, 1000)
    before = _int_param(request, "before", _MAX_BIGINT, 1, _MAX_BIGINT)
    rows = await run_in_threadpool(ctx.registry.lineage, limit + 1, before)
    full = _is_admin(ctx, request)
    more = len(rows) > limit
    return JSONResponse({"versions": [version_dict(v, full, ctx.private) for v in rows[:limit]],
                         "next_before": rows[limit - 1].seq if more else None})


async def ledger_heads(ctx: AppContext, request: Request) -> Response:
    """Signed tree heads are meant to be published (and saved by auditors)."""
    since = _int_param(request, "since", 0, 0, _MAX_BIGINT)
    limit = _int_param(request, "limit", 1000, 1, 10_000)
    return JSONResponse(await run_in_threadpool(ctx.ledger.heads.published, since, limit))


async def ledger_consistency(ctx: AppContext, request: Request) -> Response:
    """An RFC 6962 consistency proof between two tree sizes (hashes only)."""
    old = _int_param(request, "old", None, 0, _MAX_BIGINT)
    new = _int_param(request, "new", None, 0, _MAX_BIGINT)
    return await _ledger_answer(ctx.ledger.events.consistency, old, new,
                                missing=f"no consistency proof from {old} to {new}")


async def schema(ctx: AppContext, request: Request) -> Response:
    """What /v1/predict takes (feature names and ranges, scaling, classes)."""
    doc = await run_in_threadpool(ctx.ledger.records.schema)
    if doc is None:
        return _error(503, "the ledger holds no records yet: run `obliviate ledger init`")
    return JSONResponse(schema_document(doc))


async def audit_page(ctx: AppContext, request: Request) -> Response:
    return FileResponse(AUDIT_DIR / "index.html")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error(500, "internal error; the service log has the details")

"""The service's JSON endpoints besides /v1/predict, and the audit page.

Mounted into the BentoML service as an ASGI app. Intake and audit endpoints
need the admin bearer token: a deletion request and a request's history are
not for the public. The model manifest and the page itself are public (the
page asks for the token and sends it with each call).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jobs.registry import ModelVersion, Registry
from ledger.chain import iso
from ledger.forgotten import forgotten
from ledger.store import Ledger
from service.usage import GuardUsage

AUDIT_DIR = Path(__file__).parent / "audit"
Handler = Callable[[Request], Awaitable[Response]]


def _version_dict(v: ModelVersion) -> dict[str, Any]:
    return {"version": v.version, "seq": v.seq, "parent": v.parent,
            "created_at": iso(v.created_at), "manifest": v.manifest,
            "superseded_by_deletion": v.superseded_by_deletion,
            "destroyed_at": None if v.destroyed_at is None else iso(v.destroyed_at)}


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


def build_app(ctx: AppContext) -> Starlette:
    """The Starlette app over `ctx` (see the module docstring)."""

    def admin(handler: Handler) -> Handler:
        async def checked(request: Request) -> Response:
            admin_token = ctx.admin_token
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return JSONResponse({"error": "this endpoint needs 'Authorization: Bearer "
                                              "<admin token>'"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            if not secrets.compare_digest(token.encode(), admin_token.encode()):
                return JSONResponse({"error": "the admin token is not valid"}, status_code=403)
            return await handler(request)
        return checked

    async def submit(request: Request) -> Response:
        body = await request.body()
        if not body:
            return JSONResponse({"error": "empty body; send one request as JSON"},
                                status_code=400)
        result = await run_in_threadpool(ctx.ledger.receive, body, "http")
        return JSONResponse(result.as_dict(), status_code=result.http_status)

    async def request_history(request: Request) -> Response:
        rid = request.path_params["request_id"]
        try:
            history = await run_in_threadpool(ctx.ledger.history, rid)
        except KeyError:
            return JSONResponse({"error": f"no request {rid!r}"}, status_code=404)
        return JSONResponse(history)

    async def forgotten_report(request: Request) -> Response:
        rid = request.path_params["request_id"]
        try:
            report = await run_in_threadpool(forgotten, ctx.ledger, rid)
        except KeyError:
            return JSONResponse({"error": f"no request {rid!r}"}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(report)

    async def subject_requests(request: Request) -> Response:
        sid = request.path_params["subject_id"]
        rows = await run_in_threadpool(ctx.ledger.requests_of_subject, sid)
        return JSONResponse({"subject_id": sid, "requests": rows})

    async def models(request: Request) -> Response:
        cur = await run_in_threadpool(ctx.registry.current)
        if cur is None:
            return JSONResponse({"error": "no model version is published yet"},
                                status_code=503)
        return JSONResponse({"current": _version_dict(cur), "serving": ctx.status()})

    async def lineage(request: Request) -> Response:
        try:
            limit = min(int(request.query_params.get("limit", "100")), 1000)
        except ValueError:
            return JSONResponse({"error": "limit must be an integer"}, status_code=400)
        rows = await run_in_threadpool(ctx.registry.lineage, limit)
        return JSONResponse({"versions": [_version_dict(v) for v in rows]})

    async def guard_usage(request: Request) -> Response:
        try:
            bucket = max(1, int(request.query_params.get("bucket_s", "60")))
        except ValueError:
            return JSONResponse({"error": "bucket_s must be an integer"}, status_code=400)
        return JSONResponse(await run_in_threadpool(ctx.usage.summary, bucket))

    async def audit_page(request: Request) -> Response:
        return FileResponse(AUDIT_DIR / "index.html")

    routes = [
        Route("/v1/requests", admin(submit), methods=["POST"]),
        Route("/v1/requests/{request_id:path}", admin(request_history), methods=["GET"]),
        Route("/v1/forgotten/{request_id:path}", admin(forgotten_report), methods=["GET"]),
        Route("/v1/subjects/{subject_id:path}/requests", admin(subject_requests),
              methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/lineage", lineage, methods=["GET"]),
        Route("/v1/guard/usage", admin(guard_usage), methods=["GET"]),
        Route("/audit", audit_page, methods=["GET"]),
    ]
    if AUDIT_DIR.is_dir():
        routes.append(Mount("/audit/static", StaticFiles(directory=AUDIT_DIR), name="audit"))
    return Starlette(routes=routes)


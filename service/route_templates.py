"""Route templates instead of paths for BentoML's request metrics and access log.

Paths hold request and subject ids; a metric label or a log line must show neither,
and a label must take a bounded number of values. :func:`template_paths` makes
BentoML's middleware see `/v1/requests/{request_id}` where the app sees the real path.
See docs/operations.md (Metrics and alerts)."""

from __future__ import annotations

import re
from typing import Any

from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from service.http_api import AppContext, build_app

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

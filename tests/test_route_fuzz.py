"""No endpoint answers 5xx to what a client sends, on SQLite and on PostgreSQL (issue 26).

Hypothesis picks a route of the service's JSON app (every route it has, read from the
app itself, so a new one is fuzzed too) and fills its path and query parameters with
what a client could send: negative, zero, huge and non-numeric numbers, unicode digits,
NUL and other control characters, any unicode, very long values, the ledger's own ids;
`POST /v1/requests` gets the poison bodies of tests/test_poison.py. The app is the real
one (`service.http_api.build_app`) over a real ledger and registry holding a published
DaRE version, an applied deletion and an addition, in process through starlette's
TestClient. Every answer is below 500, an error is a JSON object with one string
"error", and after every request a known request's history still answers 200: no bad
request leaves the database connection unusable.

The red team's cases are pinned below (each a 500 on PostgreSQL before), and the one
whose connection was reset is replayed over a real socket on one keep-alive connection.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from jobs.orchestration.registry import Registry
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.local_broker import free_port
from ledger.store import Ledger
from service.http_api import AppContext, build_app
from service.usage import GuardUsage
from tests.conftest import seed
from tests.test_poison import build, recipes
from tests.waiting import wait_for

TOKEN = "route-fuzz-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KNOWN = "d1"  # an applied deletion: its history must answer 200 after every request
IDS = ["d1", "a1", "r001", "r002", "s00", "s01", "n1", "no-such-id"]
QUERY_NAMES = ["limit", "since", "old", "new", "bucket_s", "before", "after", "x"]


@pytest.fixture
def app(ledger: Ledger) -> Starlette:
    """The JSON app over `ledger` (SQLite or PostgreSQL) with a published DaRE version,
    deletion d1 (r001) and addition a1 (n1) applied."""
    seed(ledger)
    reg = Registry(ledger.engine, name=f"fuzz{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0))
    w.bootstrap("dare", {"n_estimators": 2, "max_depth": 2})
    assert ledger.receive({"request_id": "d1", "op": "delete",
                           "record_ids": ["r001"]}).status == "accepted"
    assert ledger.receive({"request_id": "a1", "op": "add", "subject_id": "s99", "payload": {
        "records": [{"record_id": "n1", "features": [0.1, 0.2, 0.3, 0.4],
                     "label": 1}]}}).status == "accepted"
    w.step()
    return build_app(AppContext(ledger=ledger, registry=reg, usage=GuardUsage(ledger.engine),
                                admin_token=TOKEN, status=lambda: {"version": "fuzz"}))


def _assert_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, str(r.request.url)[:300], r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str), r.text[:300]


def _still_usable(client: TestClient) -> None:
    r = client.get(f"/v1/requests/{KNOWN}", headers=AUTH)
    assert r.status_code == 200 and r.json()["request"]["status"] == "applied", r.text[:300]


# ------------------------------------------------------------------------------- values

_NUMBERS = st.one_of(
    st.integers(-10**30, 10**30).map(str),
    st.integers(-3, 3).map(str),
    st.sampled_from(["0", "1", "-1", "100", "1000", "1001", "10000", "10001",
                     str(2**63 - 1), str(2**63), str(-2**63 - 1), "1e3", "1.5", "-0",
                     "0x10", " 5", "5 ", "+5", "1_0", "\u0661\u0662", "\uff15", "", "NaN",
                     "inf", "5\x00", "\x00", "-", "9" * 5000]),
)
_TEXT = st.one_of(
    st.text(max_size=30),
    st.text(max_size=10).map(lambda t: t + "\x00" + t),
    st.integers(100, 5000).map(lambda n: "x" * n),
    st.text(min_size=120, max_size=140),
)
_IDS = st.one_of(
    st.sampled_from(IDS),
    st.sampled_from(IDS).flatmap(lambda i: st.sampled_from(
        [i + "\x00", "\x00" + i, i + " ", " " + i, i.upper(), i + "/x", i * 50])),
    _TEXT,
)


def _path_segment(value: str | bytes) -> str:
    return quote_from_bytes(value, safe="") if isinstance(value, bytes) else quote(value, safe="")


def _targets(app: Starlette) -> list[tuple[str, str]]:
    """(method, path template) of every route of the app; a Mount is one {path}."""
    out = []
    for route in app.routes:
        if isinstance(route, Mount):
            out.append(("GET", route.path + "/{path}"))
        elif isinstance(route, Route):
            out += [(m, route.path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return out


@st.composite
def requests(draw: st.DrawFn, targets: list[tuple[str, str]]) -> dict[str, Any]:
    """One request to one route: its path parameters drawn, query parameters drawn,
    an admin token mostly, a poison body for POST."""
    method, template = draw(st.sampled_from(targets))
    if draw(st.integers(0, 19)) == 0:  # now and then the wrong method
        method = "POST" if method == "GET" else "GET"
    path = re.sub(r"\{[^}]+\}", lambda _: _path_segment(draw(st.one_of(
        _IDS, st.binary(max_size=12)))), template)
    params = {name: draw(st.one_of(_NUMBERS, _TEXT))
              for name in draw(st.lists(st.sampled_from(QUERY_NAMES), max_size=3,
                                        unique=True))}
    headers = draw(st.sampled_from([AUTH, AUTH, AUTH, {}, {"Authorization": "Bearer x"}]))
    body = build(20_000 + draw(st.integers(0, 10**6)), draw(recipes())) \
        if method == "POST" else None
    return {"method": method, "url": path, "params": params, "headers": headers,
            "content": body}


@pytest.mark.slow
def test_every_route_answers_below_500_to_fuzzed_paths_and_queries(app: Starlette) -> None:
    targets = _targets(app)
    assert {t for _, t in targets} >= {"/v1/requests/{request_id:path}", "/v1/models/lineage",
                                       "/v1/ledger/heads", "/audit/static/{path}"}

    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests(targets))
    def fuzz(request: dict[str, Any]) -> None:
        _assert_answer(client.request(**request))
        _still_usable(client)

    with TestClient(app) as client:
        fuzz()


# ------------------------------------------------------------------------- the red team's

@pytest.mark.parametrize(("url", "admin", "error"), [
    ("/v1/models/lineage?limit=-1", False, "limit must be an integer from 1 to 1,000, got '-1'"),
    ("/v1/models/lineage?limit=0", False, "limit must be an integer from 1 to 1,000"),
    ("/v1/models/lineage?limit=1001", False, "limit must be an integer from 1 to 1,000"),
    ("/v1/models/lineage?limit=%D9%A1", False, "got '\u0661'"),  # an Arabic-Indic 1
    ("/v1/models/lineage?limit=" + "9" * 5000, False, "got '99999"),
    ("/v1/requests/%00x", True, "request_id must be 1-128 characters without NUL, "
                                "got '\\x00x'"),
    ("/v1/forgotten/d1%00", True, "request_id must be 1-128 characters without NUL"),
    ("/v1/subjects/s00%00/requests", True, "subject_id must be 1-128 characters"),
    ("/v1/requests/" + "x" * 129, True, "request_id must be 1-128 characters"),
    ("/v1/ledger/heads?since=9223372036854775808", False,
     "since must be an integer from 0 to 9,223,372,036,854,775,807"),
    ("/v1/ledger/heads?limit=0", False, "limit must be an integer from 1 to 10,000"),
    ("/v1/ledger/consistency?old=0&new=%2B3", False, "new must be an integer from 0"),
    ("/v1/ledger/consistency?old=0", False, "new must be an integer from 0 to "
                                            "9,223,372,036,854,775,807, got nothing"),
    ("/v1/guard/usage?bucket_s=0", True, "bucket_s must be an integer from 1 to 31,622,400"),
])
def test_bad_parameters_get_400_and_the_next_request_is_answered(
        app: Starlette, url: str, admin: bool, error: str) -> None:
    with TestClient(app) as client:
        r = client.get(url, headers=AUTH if admin else {})
        assert r.status_code == 400, r.text[:300]
        assert set(r.json()) == {"error"} and error in r.json()["error"], r.json()
        assert len(r.json()["error"]) < 200
        _still_usable(client)


def test_a_limit_within_the_cap_is_answered(app: Starlette) -> None:
    with TestClient(app) as client:
        for limit, n in (("1", 1), ("1000", 2), (None, 2)):
            r = client.get("/v1/models/lineage", params={} if limit is None else
                           {"limit": limit})
            assert r.status_code == 200 and len(r.json()["versions"]) == n, r.text[:300]
        assert client.get("/v1/ledger/heads", params={"since": "0", "limit": "1"}
                          ).status_code == 200
        assert client.get("/v1/guard/usage", params={"bucket_s": "86400"},
                          headers=AUTH).status_code == 200


def test_registry_lineage_refuses_a_limit_under_one(ledger: Ledger) -> None:
    """SQLite read LIMIT -1 as no limit (every version, past the cap); PostgreSQL raised."""
    reg = Registry(ledger.engine, name=f"fuzz{uuid.uuid4().hex[:8]}")
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"limit must be at least 1, got {limit}"):
            reg.lineage(limit)
    assert reg.lineage(1) == []


@contextmanager
def served(app: Starlette) -> Iterator[httpx.Client]:
    """`app` behind uvicorn on a free port, and a client (the admin's) over a real socket."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, "the server to start", interval_s=0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                          timeout=10) as http:
            yield http
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_lineage_and_a_subjects_requests_paginate_over_http(app: Starlette,
                                                                 ledger: Ledger) -> None:
    for rid, records in (("d2", ["r000"]), ("d3", ["r002"]), ("d4", ["r004"])):
        assert ledger.receive({"request_id": rid, "op": "delete",
                               "record_ids": records}).status == "accepted"
    with served(app) as http:
        whole = http.get("/v1/models/lineage").json()
        assert len(whole["versions"]) == 2 and whole["next_before"] is None
        pages, before = [], None
        while True:
            page = http.get("/v1/models/lineage", params={"limit": 1} if before is None
                            else {"limit": 1, "before": before}).json()
            pages += page["versions"]
            if page["next_before"] is None:
                break
            before = page["next_before"]
        assert pages == whole["versions"] and len(pages) == 2
        seen, after = [], None
        while True:  # s00 owns r000..r002: d1, d2 and d3 name its records, d4 does not
            page = http.get("/v1/subjects/s00/requests", params={"limit": 2} if after is None
                            else {"limit": 2, "after": after}).json()
            seen.append([r["request_id"] for r in page["requests"]])
            if page["next_after"] is None:
                break
            after = page["next_after"]
        assert seen == [["d1", "d2"], ["d3"]]
        r = http.get("/v1/models/lineage", params={"before": 0})
        assert r.status_code == 400 and "before must be an integer from 1" in r.json()["error"]


def test_a_nul_id_leaves_the_keep_alive_connection_usable_over_a_real_socket(
        app: Starlette) -> None:
    """The red team's `GET /v1/requests/%00x` answered 500 on PostgreSQL and the next
    request on that connection was reset: now 400, and the next is answered on the same
    connection."""
    with served(app) as http:
        answers = []
        for path in ("/v1/requests/%00x", f"/v1/requests/{KNOWN}",
                     "/v1/models/lineage?limit=-1", f"/v1/forgotten/{KNOWN}"):
            r = http.get(path)
            stream = r.extensions["network_stream"]
            answers.append((r.status_code, stream.get_extra_info("client_addr")))
    assert [status for status, _ in answers] == [400, 200, 400, 200], answers
    assert len({addr for _, addr in answers}) == 1, answers  # one keep-alive connection

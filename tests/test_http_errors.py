"""Every error the service answers has one shape, over real HTTP (issue 28).

`obliviate serve` (BentoML, one process) over an iris ledger with no model version
yet. Each error answer, whoever makes it (Starlette's router: 404, 405; BentoML:
/readyz 503; the body limit: 413; the JSON check: 415; the service: 503; the mounted
app: 401), is `application/json` holding one non-empty string, "error", which says
what to do: a body without `Content-Type` is told to send `application/json`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.sidecar import Sidecar

# `obliviate serve`
pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def sc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    sidecar = Sidecar(tmp_path_factory.mktemp("http-errors"), dataset="iris")
    try:
        sidecar.start(train=False)  # not ready: no version
        sidecar.wait_until(lambda: _answers(sidecar.url + "/healthz"), 180,
                           what="the server to answer /healthz")
        yield sidecar
    finally:
        sidecar.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


ROW = b'{"instances": [[5.1, 3.5, 1.4, 0.2]]}'
JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "says"), [
    ("GET", "/no/such/path", {}, 404, "no endpoint at /no/such/path"),
    ("GET", "/v1/predict", {}, 405, "GET is not allowed on /v1/predict"),
    ("POST", "/v1/predict", {"content": b"x" * (9 * 1_048_576), "headers": JSON}, 413,
     "over the limit"),
    ("POST", "/v1/predict", {"content": ROW}, 415, "'Content-Type: application/json'"),
    ("POST", "/v1/predict", {"content": ROW,
                             "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
     415, "'Content-Type: application/json'"),
    ("POST", "/v1/predict", {"content": ROW, "headers": JSON}, 503,
     "no model version is published yet"),
    ("GET", "/readyz", {}, 503, "no model version is loaded yet"),
    ("GET", "/v1/requests/x", {}, 401, "Authorization"),
])
def test_every_error_is_json_with_one_message(sc: Sidecar, method: str, path: str,
                                              kwargs: dict, status: int, says: str) -> None:
    r = httpx.request(method, sc.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert says in body["error"], body


def test_docs_describe_the_shape() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "sidecar.md").read_text()
    assert '{"error": "' in text and "415" in text and "405" in text

"""The service before any model exists: a 503 that says how to get one, in the one error
shape, and the schema a client needs already there (the BentoML app in-process)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.conftest import forget_bentoml_metrics

TOKEN = "a" * 40


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from ledger import datasets
    from ledger.config import LedgerSettings

    work = tmp_path_factory.mktemp("no-model")
    env = {"OBLIVIATE_DATABASE_URL": f"sqlite:///{work / 'ledger.db'}",
           "OBLIVIATE_HMAC_KEY_FILE": str(work / "hmac.key"),
           "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(work / "signing.key"),
           "OBLIVIATE_ADMIN_TOKEN": TOKEN,
           "OBLIVIATE_MODEL_NAME": f"nomodel{uuid.uuid4().hex[:8]}"}
    bentoml_log = logging.getLogger("bentoml")
    level = bentoml_log.level
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        ledger = LedgerSettings.from_env().open_ledger()
        ds = datasets.load("iris")
        ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name,
                            transform=ds.transform)
        from service.service import Obliviate

        bentoml_log.setLevel(logging.CRITICAL)
        try:
            with TestClient(Obliviate.to_asgi()) as c:
                yield c
        finally:
            bentoml_log.setLevel(level)
            ledger.close()
            forget_bentoml_metrics()


def test_predict_before_any_model_says_how_to_train_one(client: TestClient) -> None:
    r = client.post("/v1/predict", json={"instances": [[5.1, 3.5, 1.4, 0.2]]})
    assert r.status_code == 503
    body = r.json()
    assert set(body) == {"error"}, body
    assert "no model version is published yet" in body["error"]
    assert "`obliviate model train`" in body["error"]
    assert "`obliviate worker --train`" in body["error"]
    assert "unexpected error" not in body["error"]


def test_the_schema_is_there_before_the_model(client: TestClient) -> None:
    r = client.get("/v1/schema")
    assert r.status_code == 200
    doc = r.json()
    assert [f["name"] for f in doc["features"]][:2] == ["sepal length (cm)", "sepal width (cm)"]
    assert doc["classes"] == [0, 1, 2] and doc["n_features"] == 4


@pytest.mark.parametrize(("method", "path", "kwargs", "status"), [
    ("GET", "/v1/requests/x", {}, 401),
    ("GET", "/v1/requests/x", {"headers": {"Authorization": "Bearer wrong"}}, 403),
    ("GET", "/v1/requests/x", {"headers": {"Authorization": f"Bearer {TOKEN}"}}, 404),
    ("POST", "/v1/requests", {"headers": {"Authorization": f"Bearer {TOKEN}"},
                              "content": b"{not json"}, 422),
    ("GET", "/v1/models", {}, 503),
    ("GET", "/v1/models/lineage?limit=x", {}, 400),
    ("POST", "/v1/predict", {"content": b'{"instances": 1}',
                             "headers": {"Content-Type": "application/json"}}, 400),
    ("POST", "/v1/predict", {"content": b"x" * (9 * 1_048_576)}, 413),
])
def test_every_error_has_one_shape(client: TestClient, method: str, path: str,
                                   kwargs: dict, status: int) -> None:
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]

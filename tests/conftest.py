"""Shared fixtures: ledgers on SQLite and on the real PostgreSQL, and a real tansu broker."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from sqlalchemy import create_engine, select, text

from ledger.local_broker import LocalBroker
from ledger.store import Ledger
from tests.pg_schemas import new_schema

# BentoML reads its home once per process: give the test session its own model store.
os.environ.setdefault("BENTOML_DO_NOT_TRACK", "true")
os.environ.setdefault("BENTOML_HOME", tempfile.mkdtemp(prefix="obliviate-bentoml-"))
# and its own model store (OBLIVIATE_MODEL_STORE: ledgers share it under their identities)
os.environ.setdefault("OBLIVIATE_MODEL_STORE", tempfile.mkdtemp(prefix="obliviate-models-"))
# and its own key store (ledgers share it: each keeps its keys under its own identity)
os.environ.setdefault("OBLIVIATE_KEY_STORE_DIR", tempfile.mkdtemp(prefix="obliviate-keys-"))
# and the head `ledger verify` keeps for `--since-verified` goes in one of its own, not
# into the checkout's .obliviate/
os.environ.setdefault("OBLIVIATE_VERIFIED_HEAD_FILE", os.path.join(
    tempfile.mkdtemp(prefix="obliviate-verified-"), "verified-head.json"))

POSTGRES_URL = os.environ.get("OBLIVIATE_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")
HMAC_KEY = bytes(range(32))
# the head-signing key of the tests that sign heads (tests/test_tamper.py, test_receipt.py)
SIGNING_KEY = bytes(range(100, 132))


def _postgres_reason() -> str | None:
    """None when a PostgreSQL server answers, else why not (printed with the skip)."""
    try:
        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure to connect means "no server"
        return f"no PostgreSQL server answers at {POSTGRES_URL}: {exc.__class__.__name__}"


_PG_REASON = _postgres_reason()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty ledger database on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    if _PG_REASON:
        pytest.skip(_PG_REASON)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of the module's own. VACUUM FULL keeps the rows an open
    snapshot in the same database may still see, and other test processes share the
    `test` database: a module that scans files for purged bytes needs its own."""
    if _PG_REASON:
        pytest.skip(_PG_REASON)
    name = f"own_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    yield POSTGRES_URL.rsplit("/", 1)[0] + "/" + name
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def own_db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """Like `db_url`, but PostgreSQL's schema is in the module's own database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    yield new_schema(request.getfixturevalue("pg_database"))


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=10)
    yield led
    led.close()


def seed(ledger: Ledger, n: int = 30, n_features: int = 4, per_subject: int = 3) -> None:
    """n records r000..; subjects s00.. own `per_subject` records each; labels 0/1/2."""
    rng = np.random.default_rng(0)
    ledger.records.load([f"r{i:03d}" for i in range(n)],
                        [f"s{i // per_subject:02d}" for i in range(n)],
                        rng.random((n, n_features)), np.arange(n) % 3, name="toy")


def requests_of_subject_by_scan(ledger: Ledger, subject: str) -> list[dict]:
    """A subject's requests as its page found them before `request_records`: every request
    read and matched in Python (what the indexed query is held to)."""
    from ledger.chain import iso
    from ledger.tables import RECORDS, REQUESTS

    with ledger.engine.connect() as conn:
        own = set(conn.execute(select(RECORDS.c.record_id)
                               .where(RECORDS.c.subject_id == subject)).scalars())
        return [{"request_id": r.request_id, "op": r.op, "status": r.status,
                 "subject_id": r.subject_id, "record_ids": list(r.record_ids),
                 "received_at": iso(r.received_at), "received_seq": r.received_seq}
                for r in conn.execute(select(REQUESTS).order_by(REQUESTS.c.received_seq))
                if r.subject_id == subject or own.intersection(r.record_ids)]


@pytest.fixture
def seeded(ledger: Ledger) -> Ledger:
    seed(ledger)
    return ledger


@pytest.fixture
def seeded60(ledger: Ledger) -> Ledger:
    seed(ledger, n=60)
    return ledger


@pytest.fixture(scope="session")
def broker() -> Iterator[LocalBroker]:
    """One real Kafka-protocol broker for the session; tests use their own topics."""
    with LocalBroker() as b:
        yield b


@pytest.fixture
def topics(broker: LocalBroker) -> tuple[str, str]:
    from ledger.consumer import ensure_topics

    name = f"requests-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap, [name, name + ".dead"])
    return name, name + ".dead"


def forget_bentoml_metrics() -> None:
    """Unregister BentoML's own request metrics from prometheus_client's default registry:
    each in-process `Obliviate.to_asgi()` registers them again, which raises the second
    time in one test process."""
    from prometheus_client import REGISTRY

    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(n.startswith("bentoml_") for n in names):
            REGISTRY.unregister(collector)


@pytest.fixture
def signed(db_url: str) -> Iterator[Ledger]:
    """A seeded ledger that signs heads every 10 events (the timer out of the way)."""
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=10, signing_key=SIGNING_KEY,
                 head_interval_s=3600)
    seed(led)
    yield led
    led.close()


def delete_request(rid: str, *records: str) -> dict:
    return {"request_id": rid, "op": "delete", "record_ids": list(records)}

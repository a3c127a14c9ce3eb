"""Forget means gone: a purged record's values are in none of the ledger's database files.

After deletions go through the normal path (receive, claim, mark_applied) and the
ledger's own purge maintenance runs, the files are scanned byte by byte for the
deleted records' values: float64 and float32 (little-endian) bytes of every pair
of adjacent features and of the whole row (as the store writes it), the decimal text
`repr(v)` of every value and the JSON text stores before revision 0007 wrote. SQLite:
the database file, its -wal and -shm. PostgreSQL: the files of every relation of the
ledger's schema, their TOAST tables and indexes (`pg_relation_filepath` under
`SHOW data_directory`). The same scan must find a
live record's values, so that it cannot pass by looking at nothing.

PostgreSQL runs in a database of this module's own: VACUUM FULL keeps rows that
an open snapshot in the same database may still see, and other test sessions
share the `test` database.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from ledger.chain import legacy_record_fingerprint
from ledger.db import sqlite_files, sqlite_path
from ledger.store import Ledger
from tests.conftest import HMAC_KEY
from tests.db_files import db_files, is_superuser, pg_files, relation_paths
from tests.pg_schemas import new_schema

N, D = 30, 14  # records r000.., subjects s00.. of 3 records each, D features


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture
def url(own_db_url: str) -> str:
    return own_db_url


@pytest.fixture
def ledger(url: str) -> Iterator[Ledger]:
    led = Ledger(url, HMAC_KEY, checkpoint_every=10)
    yield led
    led.close()


@pytest.fixture
def pg_ledger(pg_database: str) -> Iterator[Ledger]:
    led = Ledger(new_schema(pg_database), HMAC_KEY)
    yield led
    led.close()


def features_of(i: int) -> list[float]:
    """Distinctive values: 17-digit decimals, no two records alike."""
    return np.random.default_rng(1000 + i).random(D).tolist()


def load(ledger: Ledger) -> dict[str, list[float]]:
    ids = [f"r{i:03d}" for i in range(N)]
    X = np.array([features_of(i) for i in range(N)])
    ledger.records.load(ids, [f"s{i // 3:02d}" for i in range(N)], X, np.arange(N) % 3)
    return dict(zip(ids, X.tolist(), strict=True))


def delete(rid: str, *records: str, subject: str | None = None) -> dict:
    msg: dict = {"request_id": rid, "op": "delete"}
    if records:
        msg["record_ids"] = list(records)
    if subject:
        msg["subject_id"] = subject
    return msg


def add(rid: str, record_id: str, features: list[float]) -> dict:
    return {"request_id": rid, "op": "add", "subject_id": "s99",
            "payload": {"records": [{"record_id": record_id, "features": features,
                                     "label": 1}]}}


def apply_all(ledger: Ledger, version: str) -> int:
    ids = [r.request_id for r in ledger.lifecycle.claim(100, worker="w1")]
    purged = ledger.lifecycle.mark_applied(ids, version, {"guarantee": "exact"})
    ledger.lifecycle.mark_verified(ids, version)
    return purged


# ---------------------------------------------------------------------------- the scan
def patterns(values: list[float]) -> dict[str, bytes]:
    out = {}
    for a, b in itertools.pairwise(values):
        out[f"float64 pair ({a!r}, {b!r})"] = struct.pack("<2d", a, b)
        out[f"float32 pair ({a!r}, {b!r})"] = struct.pack("<2f", a, b)
    for v in values:
        out[f"text {v!r}"] = repr(v).encode()
    out["JSON text"] = json.dumps(values).encode()
    out["float64 row"] = struct.pack(f"<{len(values)}d", *values)
    return out


def found(files: dict[str, bytes], values: list[float]) -> list[str]:
    """Which representations of `values` occur in which file."""
    return [f"{kind} in {name}" for kind, pat in patterns(values).items()
            for name, data in files.items() if pat in data]


def maintain(ledger: Ledger) -> dict:
    """The sidecar's maintenance call; retried (forced) while another session's snapshot
    holds the horizon back, as the worker's next call would."""
    result = ledger.maintenance.run()
    for _ in range(20):
        if result["pending"] == 0:
            break
        result = ledger.maintenance.run(force=True)
    assert result["pending"] == 0, result
    return result


# ---------------------------------------------------------------------------- tests
def test_purged_values_leave_the_database_files(ledger: Ledger) -> None:
    values = load(ledger)
    added = [0.8123456789012345 - k / 97 for k in range(D)]
    kept = [0.1234567890123456 + k / 89 for k in range(D)]
    assert ledger.receive(add("a1", "n1", added)).status == "accepted"
    assert ledger.receive(add("a2", "n2", kept)).status == "accepted"
    assert apply_all(ledger, "v1") == 0
    assert ledger.records.data(["n1"])[0].tolist() == [added]
    assert ledger.receive(delete("d1", "r003")).status == "accepted"
    assert ledger.receive(delete("d2", subject="s05")).record_ids == ("r015", "r016", "r017")
    assert ledger.receive(delete("d3", "n1")).status == "accepted"  # added, then deleted
    pg = ledger.engine.dialect.name == "postgresql"
    if pg and is_superuser(ledger):
        before = relation_paths(ledger)["record_payloads"]
    assert apply_all(ledger, "v2") == 5
    gone = {"r003": values["r003"], "r015": values["r015"], "r016": values["r016"],
            "r017": values["r017"], "n1": added}

    if pg:  # until maintenance, the dead tuples still hold the values
        assert ledger.maintenance.status()["pending"] == 1
        if is_superuser(ledger):
            assert found(pg_files(ledger), values["r003"])
        result = maintain(ledger)
        assert result["ran"] and result["tables"] == ["record_payloads", "sealed_payloads"]
        if is_superuser(ledger):  # the old files are emptied (unlinked at the next checkpoint)
            after = relation_paths(ledger)["record_payloads"]
            assert after != before
            datadir = Path(ledger.engine.connect().execute(text("SHOW data_directory")).scalar())
            old = datadir / before
            assert not old.exists() or old.stat().st_size == 0
    else:  # SQLite: mark_applied ran the checkpoint already
        assert ledger.maintenance.status()["pending"] == 0
        assert ledger.maintenance.run()["outcome"] == "nothing to do"

    files = db_files(ledger)
    for rid, v in gone.items():
        assert not found(files, v), f"{rid}'s values are still in the files: {found(files, v)}"
    # not vacuous: a live loaded record's values are there, as the float64 row the store
    # wrote; a live added record's are not (ciphertext under its key), yet it reads
    for live in (values["r000"], values["r029"]):
        hits = found(files, live)
        assert any(h.startswith("float64 row") for h in hits), hits
    assert not found(files, kept), found(files, kept)
    assert ledger.records.data(["n2"])[0].tolist() == [kept]
    assert ledger.sealer.has_key("n2") and not ledger.sealer.has_key("n1")
    status = ledger.maintenance.status()
    assert status["purges"] == status["erased"] == 1 and status["last_outcome"] == "erased"
    result = ledger.verify()
    assert result.ok, result.problems
    # readers of features still work
    live = ledger.records.live()
    assert "r003" not in set(live.record_ids) and "n2" in set(live.record_ids)
    assert live.X[list(live.record_ids).index("r000")].tolist() == values["r000"]
    with pytest.raises(KeyError, match="hold no data"):
        ledger.records.data(["r003"])


def test_sqlite_files_are_private(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    led = Ledger(f"sqlite:///{db}", HMAC_KEY)
    load(led)
    led.receive(delete("d1", "r001"))
    apply_all(led, "v2")
    paths = [p for p in sqlite_files(db) if p.exists()]
    assert [p.name for p in paths] == ["ledger.db", "ledger.db-wal", "ledger.db-shm"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == {
        p.name: 0o600 for p in paths}
    led.close()  # the last connection removes -wal and -shm
    # an existing world-readable file is made private when opened, and so its new WAL
    db.chmod(0o644)
    led = Ledger(f"sqlite:///{db}", HMAC_KEY)
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    led.receive(delete("d2", "r002"))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in sqlite_files(db))
    with led.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA secure_delete").scalar() == 1
    led.close()


def test_maintenance_is_throttled_and_survives_a_restart(url: str) -> None:
    led = Ledger(url, HMAC_KEY, purge_maintenance_s=3600)
    load(led)
    assert led.maintenance.run()["outcome"] == "nothing to do"
    led.receive(delete("d1", "r001"))
    apply_all(led, "v2")
    first = led.maintenance.run()  # SQLite: mark_applied ran it already
    assert first["erased"] and first["pending"] == 0
    led.receive(delete("d2", "r002"))
    apply_all(led, "v3")
    throttled = led.maintenance.run()
    assert throttled["outcome"] == "throttled" and not throttled["ran"]
    assert throttled["pending"] == 1 and 0 < throttled["due_in_s"] <= 3600
    led.close()  # a crash here: the pending purge is in the database, not in the process
    led = Ledger(url, HMAC_KEY, purge_maintenance_s=3600)
    assert led.maintenance.status()["pending"] == 1
    assert led.maintenance.run(force=True)["outcome"] == "erased"
    assert led.maintenance.status()["pending"] == 0
    led.close()


def test_verify_names_payloads_a_purge_left_or_lost(ledger: Ledger) -> None:
    load(ledger)
    ledger.receive(delete("d1", "r001"))
    apply_all(ledger, "v2")
    with ledger.engine.begin() as conn:
        conn.execute(text("INSERT INTO record_payloads (record_id, features, label) "
                          "VALUES ('r001', '[0.5]', 1), ('ghost', '[0.5]', 1)"))
        conn.execute(text("DELETE FROM record_payloads WHERE record_id = 'r002'"))
    problems = {p.where: p.message for p in ledger.verify().problems}
    assert "still holds raw" in problems["record r001"]
    assert "belong to no training record" in problems["record ghost"]
    assert "has no features or label" in problems["record r002"]
    with pytest.raises(ValueError, match="hold no data"):
        ledger.records.live()


def test_an_open_snapshot_keeps_purged_rows_until_it_ends(pg_ledger: Ledger) -> None:
    """VACUUM FULL copies rows an open snapshot may still see: maintenance notices and
    says "held", and the next run after the snapshot ends erases them."""
    ledger = pg_ledger
    values = load(ledger)
    maintain(ledger)
    holder = create_engine(ledger.url).connect()
    holder.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.exec_driver_sql("SELECT count(*) FROM events").scalar()  # takes the snapshot
    try:
        ledger.receive(delete("d1", "r004"))
        apply_all(ledger, "v2")
        held = ledger.maintenance.run()
        assert held["outcome"] == "held" and held["pending"] == 1
        if is_superuser(ledger):
            assert found(pg_files(ledger), values["r004"])  # the check was right
        assert ledger.maintenance.run()["outcome"] == "throttled"  # retried within 30 s
    finally:
        holder.rollback()
        holder.close()
    maintain(ledger)
    if is_superuser(ledger):
        assert not found(pg_files(ledger), values["r004"])


def test_deletion_intake_does_not_wait_for_the_payload_table(pg_ledger: Ledger) -> None:
    """While VACUUM FULL holds record_payloads, deletions are still received and claimed."""
    ledger = pg_ledger
    load(ledger)
    locker = create_engine(ledger.url).connect()
    locker.exec_driver_sql("BEGIN")
    locker.exec_driver_sql("LOCK TABLE record_payloads IN ACCESS EXCLUSIVE MODE")
    done: list[object] = []

    def intake() -> None:
        done.append(ledger.receive(delete("d1", "r001")).status)
        done.append(ledger.receive(delete("d2", subject="s03")).record_ids)
        done.append([r.request_id for r in ledger.lifecycle.claim(10, worker="w1")])

    t = threading.Thread(target=intake)
    t.start()
    t.join(20)
    locker.rollback()
    locker.close()
    t.join(30)
    assert done == ["accepted", ("r009", "r010", "r011"), ["d1", "d2"]]


# ---------------------------------------------------------------------------- upgrade
LEGACY_DDL = [
    """CREATE TABLE training_records (record_id VARCHAR(128) NOT NULL PRIMARY KEY,
       subject_id VARCHAR(128), features {json}, label INTEGER,
       record_hash VARCHAR(64) NOT NULL, state VARCHAR(16) NOT NULL,
       added_by VARCHAR(128), added_at {ts}, purged_by VARCHAR(128), purged_at {ts})""",
    """CREATE TABLE dataset_schema (id INTEGER NOT NULL PRIMARY KEY, name VARCHAR(128) NOT NULL,
       n_features INTEGER NOT NULL, classes {json} NOT NULL)""",
]


def test_a_ledger_from_before_record_payloads_is_migrated(url: str) -> None:
    """Raw data moves to record_payloads, and what old purges left behind is rewritten away."""
    live, old = features_of(1), features_of(2)
    rows = [(rid, "s1", json.dumps(x), 1,
             legacy_record_fingerprint(HMAC_KEY, rid, "s1", x, 1), "live")
            for rid, x in (("r1", live), ("r2", old))]
    sql = [*LEGACY_DDL, "INSERT INTO dataset_schema VALUES (1, 'old', 14, '[0, 1]')"]
    purge = "UPDATE training_records SET features = NULL, label = NULL, state = 'purged' " \
            "WHERE record_id = 'r2'"
    if url.startswith("sqlite"):
        path = sqlite_path(url)
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA secure_delete=OFF")  # as the old code left it on most builds
        for stmt in sql:
            conn.execute(stmt.format(json="JSON", ts="DATETIME"))
        conn.executemany("INSERT INTO training_records (record_id, subject_id, features, "
                         "label, record_hash, state) VALUES (?, ?, ?, ?, ?, ?)", rows)
        conn.commit()
        conn.execute(purge)
        conn.commit()
        conn.close()
        assert found({"db": path.read_bytes()}, old)  # the old purge left the values
    else:
        engine = create_engine(url)
        with engine.begin() as conn:
            for stmt in sql:
                conn.exec_driver_sql(stmt.format(json="JSON", ts="TIMESTAMP WITH TIME ZONE"))
            conn.exec_driver_sql("INSERT INTO training_records (record_id, subject_id, "
                                 "features, label, record_hash, state) VALUES "
                                 "(%s, %s, %s, %s, %s, %s)", rows)
        with engine.begin() as conn:
            conn.exec_driver_sql(purge)
        engine.dispose()

    led = Ledger(url, HMAC_KEY)
    Ledger(url, HMAC_KEY).close()  # a second process opening it finds it migrated
    assert led.maintenance.status()["rewrite_records"]
    result = maintain(led)
    assert result["outcome"] == "erased"
    assert not led.maintenance.status()["rewrite_records"]
    recs = led.records.live()
    assert recs.record_ids.tolist() == ["r1"] and recs.X.tolist() == [live]
    # the fingerprints and data are whole; only the log, which this synthetic old table
    # never had, is missing: no event loaded the records (nor announced their schema) nor
    # purged r2
    assert {p.where for p in led.verify().problems} == {
        "record r2", "records loaded at -", "dataset_schema"}, led.verify().problems
    if led.engine.dialect.name == "postgresql":
        assert result["tables"] == ["record_payloads", "sealed_payloads", "training_records"]
    files = db_files(led)
    assert not found(files, old), found(files, old)
    assert any(h.startswith("float64 row") for h in found(files, live))  # 0007 wrote it
    led.close()

"""The schema's Alembic migrations (ledger/migrations), on SQLite and on PostgreSQL.

- A database made by the code before migrations (commit ff838b8: its DDL and rows,
  recorded in tests/data by make_ff838b8_snapshot.py) is upgraded to head when a
  ledger opens it: every row survives, the raw data moves to record_payloads (as float64
  bytes, its fingerprints still those of the JSON scheme), the
  registry's and the schema's new columns appear, and the whole ledger still verifies
  (hash chain, checkpoints, every fingerprint) and takes new requests.
- A new database upgraded to head is exactly what the models declare (Alembic's own
  comparison), so the migrations and ledger/models.py, jobs/orchestration/registry.py,
  jobs/adaptive/budget.py and service/usage.py cannot drift apart.
- Processes opening one database at once upgrade it once; the constructors create no
  table of their own.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import column, create_engine, inspect, table, text

from jobs.orchestration.registry import Registry
from ledger import merkle, migrations, subtree_store
from ledger.chain import event_leaf
from ledger.db import make_engine
from ledger.store import Ledger
from tests.conftest import HMAC_KEY, requests_of_subject_by_scan, seed

DATA = Path(__file__).resolve().parent / "data"


def _old_database(url: str) -> None:
    """The ff838b8 schema and its rows, written without any of today's code."""
    engine = make_engine(url) if url.startswith("sqlite") else create_engine(url)
    dialect = engine.dialect.name
    ddl = "\n".join(line for line in (DATA / f"ff838b8.{dialect}.sql").read_text().splitlines()
                    if not line.startswith("--"))
    rows = json.loads((DATA / "ff838b8.rows.json").read_text())
    with engine.begin() as conn:
        for stmt in filter(str.strip, ddl.split(";")):
            conn.exec_driver_sql(stmt)
        for name, records in rows.items():
            if records:
                t = table(name, *[column(c) for c in records[0]])
                conn.execute(t.insert(), [{k: _decode(v) for k, v in r.items()}
                                          for r in records])
        if dialect == "postgresql":  # SERIAL sequences after explicit ids
            for name in ("requests", "guard_usage"):
                conn.exec_driver_sql(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                                     f"(SELECT max(id) FROM {name}))")
    engine.dispose()


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "$json" in value:
        return json.dumps(value["$json"])
    if isinstance(value, dict) and "$datetime" in value:
        return value["$datetime"]
    return value


def test_the_head_constant_is_alembics_head() -> None:
    assert migrations.script_heads() == [migrations.HEAD]


def test_a_database_of_the_previous_schema_is_upgraded_and_keeps_its_data(db_url: str) -> None:
    _old_database(db_url)
    old = json.loads((DATA / "ff838b8.rows.json").read_text())
    assert migrations.current(create_engine(db_url)) is None  # before migrations existed

    led = Ledger(db_url, HMAC_KEY, checkpoint_every=5, head_interval_s=1e9)
    assert led.schema_upgrade.before is None and led.schema_upgrade.upgraded
    assert migrations.current(led.engine) == migrations.HEAD
    cols = {t: {c["name"] for c in inspect(led.engine).get_columns(t)}
            for t in ("training_records", "model_versions", "dataset_schema")}
    assert "features" not in cols["training_records"] and "label" not in cols["training_records"]
    assert {"superseded_by_deletion", "destroyed_at"} <= cols["model_versions"]
    assert "transform" in cols["dataset_schema"]

    with led.engine.connect() as conn:
        def ids(name: str, key: str) -> list[Any]:
            return [r[0] for r in conn.execute(text(f"SELECT {key} FROM {name} ORDER BY {key}"))]

        # every row of every old table is still there, untouched where nothing moved
        assert ids("events", "seq") == [r["seq"] for r in old["events"]]
        hashes = [r[0] for r in conn.execute(text("SELECT hash FROM events ORDER BY seq"))]
        assert hashes == [r["hash"] for r in old["events"]]
        assert ids("requests", "request_id") == sorted(r["request_id"] for r in old["requests"])
        assert ids("checkpoints", "tree_size") == [r["tree_size"] for r in old["checkpoints"]]
        # 0005 stored the subtrees of the events there: the proofs read them
        n = len(old["events"])
        assert ids("merkle_nodes", "position") == list(range(n - n.bit_count()))
        assert subtree_store.root(conn, n) == merkle.root([event_leaf(h) for h in hashes])
        assert ids("training_records", "record_id") == [r["record_id"]
                                                        for r in old["training_records"]]
        assert ids("seed_lineages", "lineage") == ["v000001"]
        assert ids("guard_usage", "version") == ["v000001"]
        statuses = dict(conn.execute(text("SELECT request_id, status FROM requests")).all())
        # 0009 indexed each record id the old requests name
        links = conn.execute(text("SELECT record_id, received_seq, request_id "
                                  "FROM request_records")).all()
        assert sorted(links) == sorted((rec, r["received_seq"], r["request_id"])
                                       for r in old["requests"] for rec in r["record_ids"]["$json"])
        assert statuses == {r["request_id"]: r["status"] for r in old["requests"]}
        # the data of live and pending records moved to record_payloads (0007: as float64
        # bytes), none of the purged
        moved = {r.record_id: (np.frombuffer(bytes(r.features), "<f8").tolist(), r.label)
                 for r in conn.execute(text("SELECT * FROM record_payloads"))}
    kept = {r["record_id"]: (r["features"]["$json"], r["label"])
            for r in old["training_records"] if r["state"] != "purged"}
    assert moved == kept and len(kept) < len(old["training_records"])
    status = led.maintenance.status()
    assert status["rewrite_records"] and status["pending"] == 1  # the old table is rewritten

    # the schema row got the identity transform: raw == scaled, as before
    t = led.records.input_transform()
    assert not t.fitted and t.mins == (0.0,) * 4 and t.maxs == (1.0,) * 4
    # the registry reads its old rows, with the new columns empty
    cur = Registry(led.engine, "obliviate").current()
    assert cur.version == "v000001" and cur.destroyed_at is None \
        and cur.superseded_by_deletion is None
    # chain, checkpoints, fingerprints and the records' states still hold together
    result = led.verify()
    assert result.problems == [], result.problems
    assert result.records == len(old["training_records"])
    # and the upgraded ledger keeps working
    assert led.receive(json.dumps({"request_id": "after", "op": "delete",
                                   "record_ids": ["r001"]}).encode()).status == "accepted"
    assert led.maintenance.run(force=True)["outcome"] == "erased"
    assert led.verify().problems == []
    led.close()
    # a second process finds it at head and changes nothing
    again = Ledger(db_url, HMAC_KEY)
    assert not again.schema_upgrade.changed
    again.close()


def test_0009_indexes_the_requests_of_a_ledger_from_before_it(db_url: str) -> None:
    """A ledger taken back to 0008 (0009's downgrade drops `request_records`) and opened
    again is back-filled with what intake wrote, a request whose subject id is another's
    included, and each subject's page is what reading every request gave; the back-fill
    reads its requests in batches."""
    from alembic import command
    from alembic.config import Config

    from ledger.intake import backfill_request_records

    led = Ledger(db_url, HMAC_KEY)
    seed(led)
    for msg in ({"request_id": "d1", "op": "delete", "record_ids": ["r003", "r007"]},
                {"request_id": "d2", "op": "delete", "subject_id": "s01"},
                {"request_id": "d3", "op": "delete", "record_ids": ["r010"]}):
        assert led.receive(msg).status == "accepted"
    with led.engine.connect() as conn:
        written = sorted(conn.execute(text("SELECT * FROM request_records")).all())
    assert len(written) == 6
    with led.engine.begin() as conn:
        cfg = Config()
        cfg.set_main_option("script_location", str(migrations.SCRIPT_LOCATION))
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0008_source_topic_ids")
        conn.execute(text("UPDATE requests SET subject_id = 's05' WHERE request_id = 'd3'"))
    assert "request_records" not in inspect(led.engine).get_table_names()
    assert migrations.current(led.engine) == "0008_source_topic_ids"
    led.close()

    again = Ledger(db_url, HMAC_KEY)
    assert again.schema_upgrade.before == "0008_source_topic_ids"
    with again.engine.connect() as conn:
        assert sorted(conn.execute(text("SELECT * FROM request_records")).all()) == written
    for subject in ("s01", "s02", "s03", "s05"):
        assert (again.lifecycle.requests_of_subject(subject)
                == requests_of_subject_by_scan(again, subject)), subject
    assert [r["request_id"] for r in again.lifecycle.requests_of_subject("s05")] == ["d3"]
    with again.engine.begin() as conn:  # two requests a batch: the last one alone
        conn.execute(text("DELETE FROM request_records"))
        assert backfill_request_records(conn, batch=2) == len(written)
        assert sorted(conn.execute(text("SELECT * FROM request_records")).all()) == written
    again.close()


def test_a_new_database_at_head_is_what_the_models_declare(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import jobs.adaptive.budget  # noqa: F401 - every module that declares a table
    import ledger.models  # noqa: F401
    import service.usage  # noqa: F401

    led = Ledger(db_url, HMAC_KEY)
    with led.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, SQLModel.metadata)
    # every table=True model of the sidecar is declared, and the database is just that
    assert {t.name for t in SQLModel.metadata.sorted_tables} == {
        "requests", "request_records", "events", "training_records", "record_payloads",
        "purge_maintenance", "checkpoints", "signed_heads", "merkle_nodes", "source_offsets",
        "dataset_schema",
        "model_versions", "model_pointer", "sealed_payloads", "model_version_counters",
        "seed_lineages", "guard_usage"}
    assert diff == [], diff
    led.close()


def test_the_constructors_create_no_table_of_their_own(tmp_path: Path) -> None:
    """The registry, the budgets and the usage table come from the migrations: an engine
    that no migration has touched gets every table from the first constructor."""
    from jobs.adaptive.budget import SeedBudgets
    from service.usage import GuardUsage

    for i, make in enumerate((lambda e: Registry(e, "m"), lambda e: SeedBudgets(e, "m"),
                              GuardUsage)):
        engine = make_engine(f"sqlite:///{tmp_path / f'{i}.db'}")
        make(engine)
        names = set(inspect(engine).get_table_names())
        assert {"model_versions", "seed_lineages", "guard_usage", "events"} <= names
        assert migrations.current(engine) == migrations.HEAD
        engine.dispose()


def test_processes_opening_a_new_database_at_once_upgrade_it_once(db_url: str) -> None:
    errors: list[BaseException] = []
    upgrades = []

    def open_it() -> None:
        try:
            led = Ledger(db_url, HMAC_KEY)
            upgrades.append(led.schema_upgrade)
            led.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(u.changed for u in upgrades) == 1, upgrades
    assert [u.created for u in upgrades if u.changed] == [True]
    assert {u.after for u in upgrades} == {migrations.HEAD}


@pytest.mark.parametrize("argv", [["ledger", "migrate"]])
def test_ledger_migrate_reports_the_revision(argv: list[str], tmp_path: Path, capsys,
                                             monkeypatch) -> None:
    from service.cli import main

    url = f"sqlite:///{tmp_path / 'old.db'}"
    _old_database(url)
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    assert main([*argv, "--db", url]) == 0
    out = capsys.readouterr().out
    assert f"upgraded from no revision to {migrations.HEAD}" in out
    assert main([*argv, "--db", url]) == 0
    assert f"at revision {migrations.HEAD} (head)" in capsys.readouterr().out


def test_a_database_from_newer_code_is_refused_with_the_reason(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    Ledger(url, HMAC_KEY).close()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    engine.dispose()
    with pytest.raises(RuntimeError, match="revision '9999_future', which this version of "
                                           "obliviate does not know"):
        Ledger(url, HMAC_KEY)


def test_the_switch_to_wal_waits_for_the_lock_sqlite_does_not_wait_for() -> None:
    """SQLite takes the exclusive lock of a new database's journal switch without its busy
    handler: the connection retries while it reads "locked", and raises anything else."""
    import sqlite3

    from ledger.db import _enable_wal

    class Cursor:
        def __init__(self, errors: list[str]) -> None:
            self.errors, self.calls = errors, 0

        def execute(self, sql: str) -> None:
            assert sql == "PRAGMA journal_mode=WAL"
            self.calls += 1
            if self.errors:
                raise sqlite3.OperationalError(self.errors.pop(0))

    cur = Cursor(["database is locked", "database is locked"])
    _enable_wal(cur)
    assert cur.calls == 3
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        _enable_wal(Cursor(["disk I/O error"]))

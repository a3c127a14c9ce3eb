"""Keys never enter the database: versions' sealing keys and added records' payload keys
live in the key store, and what the database keeps of an addition is ciphertext.

The test that matters most greps PostgreSQL's write-ahead log after a real worker
added a record, deleted it and destroyed the versions that held it: neither the
destroyed versions' keys nor the record's values are there, in any representation.
"""

from __future__ import annotations

import itertools
import stat
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, inspect, text

from jobs.orchestration.registry import Registry
from jobs.orchestration.retention import destroy_due
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger import migrations
from ledger.keystore import DirectoryKeyStore, KeyStoreError
from ledger.sealed_payloads import PayloadKeyMissing
from ledger.store import Ledger
from tests.conftest import HMAC_KEY
from tests.db_files import is_superuser

D = 6


def _values(seed: int) -> list[float]:
    """17-digit decimals that occur nowhere else."""
    return np.random.default_rng(seed).random(D).tolist()


def _representations(values: list[float]) -> dict[str, bytes]:
    out = {f"text {v!r}": repr(v).encode() for v in values}
    for a, b in itertools.pairwise(values):
        out[f"float64 pair ({a!r}, {b!r})"] = struct.pack("<2d", a, b)
        out[f"float32 pair ({a!r}, {b!r})"] = struct.pack("<2f", a, b)
    return out


def _add(rid: str, record_id: str, features: list[float]) -> dict:
    return {"request_id": rid, "op": "add", "subject_id": "s-new",
            "payload": {"records": [{"record_id": record_id, "features": features,
                                     "label": 1}]}}


def _seeded(ledger: Ledger, n: int = 60) -> None:
    rng = np.random.default_rng(7)
    ledger.records.load([f"r{i:03d}" for i in range(n)], [f"s{i // 3:02d}" for i in range(n)],
                        rng.random((n, D)), np.arange(n) % 2, name="toy")


def _run_until_settled(worker: Worker, ledger: Ledger, passes: int = 200) -> None:
    for _ in range(passes):
        worker.step()
        counts = ledger.lifecycle.status_counts()
        if not counts.get("received") and not counts.get("claimed"):
            return
    raise AssertionError(f"requests did not settle: {ledger.lifecycle.status_counts()}")


def _apply(ledger: Ledger, version: str) -> None:
    """Claim the waiting requests and mark them applied on `version`."""
    ledger.lifecycle.mark_applied([r.request_id for r in ledger.lifecycle.claim(10, worker="w")],
                                  version)


@pytest.mark.slow
def test_a_destroyed_key_and_a_deleted_addition_are_not_in_pg_wal(db_url: str,
                                                                   tmp_path: Path) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's write-ahead log")
    ledger = Ledger(db_url, HMAC_KEY, key_store=DirectoryKeyStore(tmp_path / "keys"))
    if not is_superuser(ledger):
        pytest.skip("reading pg_wal needs a superuser")
    _seeded(ledger)
    registry = Registry(ledger.engine, f"m{uuid.uuid4().hex[:8]}", ledger.keys)
    worker = Worker(ledger, registry, WorkerConfig(
        batch_window_s=0, guard_process=False, verify_exactness=False, destroy_grace_s=0))
    worker.bootstrap("dare", {"n_estimators": 5, "max_depth": 4})
    added = _values(424242)
    assert ledger.receive(_add("a1", "n1", added)).status == "accepted"
    _run_until_settled(worker, ledger)
    assert ledger.records.data(["n1"])[0].tolist() == [added]
    assert ledger.receive({"request_id": "d1", "op": "delete",
                           "record_ids": ["n1", "r004"]}).status == "accepted"
    _run_until_settled(worker, ledger)
    # every version before the deletion: its key read now, then destroyed by the worker
    keys = {v.version: registry.key(v.version) for v in registry.lineage()
            if v.superseded_by_deletion is not None}
    assert len(keys) >= 2, registry.lineage()
    assert set(destroy_due(registry, ledger, grace_s=0)) == set(keys)  # the worker's call
    assert all(registry.get(v).destroyed_at is not None for v in keys)
    assert not any(registry.has_key(v) for v in keys)
    with pytest.raises(KeyError):
        ledger.records.data(["n1"])

    with ledger.engine.connect() as conn:
        conn.execute(text("CHECKPOINT"))
        datadir = Path(conn.execute(text("SHOW data_directory")).scalar())
        segments = conn.execute(text("SELECT name FROM pg_ls_waldir()")).scalars().all()
    wal = {name: (datadir / "pg_wal" / name).read_bytes() for name in segments
           if (datadir / "pg_wal" / name).is_file()}
    assert wal, "no WAL segment was read"
    patterns = _representations(added)
    for version, key in keys.items():
        patterns[f"{version}'s key as hex"] = key.hex().encode()
        patterns[f"{version}'s key as bytes"] = key
    hits = [f"{what} in {seg}" for what, pat in patterns.items()
            for seg, data in wal.items() if pat in data]
    assert not hits, hits
    # not vacuous: a loaded record's values, inserted as float64 bytes, are in the WAL
    live = ledger.records.data(["r000"])[0][0]
    assert any(live.astype("<f8").tobytes() in data for data in wal.values())
    ledger.close()


def test_an_addition_is_ciphertext_under_a_key_of_its_own(ledger: Ledger) -> None:
    _seeded(ledger)
    values = _values(99)
    assert ledger.receive(_add("a1", "n1", values)).status == "accepted"
    with ledger.engine.connect() as conn:
        blob = bytes(conn.execute(text("SELECT sealed FROM sealed_payloads "
                                       "WHERE record_id = 'n1'")).scalar())
        plain = conn.execute(text("SELECT count(*) FROM record_payloads "
                                  "WHERE record_id = 'n1'")).scalar()
    assert plain == 0
    assert not any(p in blob for p in _representations(values).values())
    assert ledger.sealer.open("n1", blob) == (values, 1)
    # a copy of the row (a backup, a WAL record) opens until the key is destroyed
    claimed = [r.request_id for r in ledger.lifecycle.claim(10, worker="w")]
    ledger.lifecycle.mark_applied(claimed, "v1")
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["n1"]})
    _apply(ledger, "v2")
    with pytest.raises(PayloadKeyMissing):
        ledger.sealer.open("n1", blob)
    assert ledger.verify().ok, ledger.verify().problems
    # a process that has not read the ledger's identity yet (SQLite: reading it on a
    # second connection inside verify's would wait for the lock)
    fresh = Ledger(ledger.url, HMAC_KEY)
    assert fresh.verify().ok
    assert Ledger(ledger.url, HMAC_KEY).maintenance.run(force=True)["ran"]
    fresh.close()


def test_verify_catches_a_missing_or_surviving_payload_key(ledger: Ledger) -> None:
    _seeded(ledger)
    ledger.receive(_add("a1", "n1", _values(1)))
    ledger.receive(_add("a2", "n2", _values(2)))
    _apply(ledger, "v1")
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["n2"]})
    _apply(ledger, "v2")
    ledger.keys.delete(ledger.sealer.key_name("n1"))  # a live record's key lost
    ledger.keys.put(ledger.sealer.key_name("n2"), bytes(32))  # a purged one's back
    found = [str(p) for p in ledger.verify().problems]
    assert any(p.startswith("record n1: is live but its data cannot be read") for p in found)
    assert any(p.startswith("record n2: is purged but its payload key is still in the key "
                            "store") for p in found), found


def test_a_crash_before_the_keys_are_destroyed_is_swept(ledger: Ledger, monkeypatch) -> None:
    _seeded(ledger)
    ledger.receive(_add("a1", "n1", _values(3)))
    _apply(ledger, "v1")
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["n1"]})
    monkeypatch.setattr(ledger.sealer, "destroy", lambda ids: 0)  # dies after the commit
    _apply(ledger, "v2")
    monkeypatch.undo()
    assert ledger.sealer.has_key("n1")
    ledger.maintenance.run(force=True)
    assert not ledger.sealer.has_key("n1")


def test_the_directory_store_is_private_and_refuses_odd_names(tmp_path: Path) -> None:
    store = DirectoryKeyStore(tmp_path / "keys")
    store.put("a/b/c", b"\x01" * 32)
    path = tmp_path / "keys" / "a" / "b" / "c"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert store.get("a/b/c") == b"\x01" * 32
    with pytest.raises(FileExistsError):
        store.put("a/b/c", b"\x02" * 32)
    assert store.names("a") == ["a/b/c"]
    assert store.delete("a/b/c") and not store.delete("a/b/c")
    assert store.get("a/b/c") is None
    for bad in ("../x", "a//b", "a/.. ", ""):
        with pytest.raises(KeyStoreError):
            store.put(bad, b"\x00" * 32)


def test_a_ledger_with_keys_in_the_database_moves_them_out(db_url: str,
                                                           tmp_path: Path) -> None:
    """A database of revision 0003 kept version keys in `version_keys`: the upgrade
    writes them to the key store and drops the table; without a key store it refuses."""
    from alembic import command
    from alembic.config import Config

    engine = create_engine(db_url)
    with engine.begin() as conn:
        cfg = Config()
        cfg.set_main_option("script_location", str(migrations.SCRIPT_LOCATION))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003_input_transform")
        conn.execute(text("INSERT INTO events (seq, request_id, kind, payload, model_version, "
                          "created_at, prev_hash, hash) VALUES (1, NULL, 'records_loaded', "
                          "'{}', NULL, '2026-01-01T00:00:00Z', :z, :h)"),
                     {"z": "0" * 64, "h": "ab" * 32})
        conn.execute(text("INSERT INTO version_keys (name, version, key) VALUES "
                          "('m', 'v000001', :k)"), {"k": "11" * 32})
    engine.dispose()
    with pytest.raises(RuntimeError, match="moves the model versions' keys out of the "
                                           "database"):
        migrations.upgrade(create_engine(db_url))
    store = DirectoryKeyStore(tmp_path / "keys")
    led = Ledger(db_url, HMAC_KEY, key_store=store)
    assert store.get(f"{'ab' * 8}/versions/m/v000001") == bytes.fromhex("11" * 32)
    assert "version_keys" not in inspect(led.engine).get_table_names()
    assert Registry(led.engine, "m", led.keys).key("v000001") == bytes.fromhex("11" * 32)
    led.close()

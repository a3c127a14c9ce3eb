"""Forget means gone: once deletions are verified and the grace period is over, no file
the sidecar wrote holds a deleted record (docs/security.md, "What a deletion leaves behind").

The promise is tested by scanning bytes, not by trusting the mechanism: the ledger
database (SQLite file, -wal and -shm; PostgreSQL relation files after the worker's
maintenance), every version left in the model store (raw and unsealed with its key),
the guard jobs' temporary directories and the logs, for the deleted records' values
and, in the model store, their ids. Deletions by record, by subject, and of a record
that arrived by an addition; for every learner and both databases.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jobs.orchestration.guard_job import JOB_DIR_PREFIX, remove_orphaned_job_dirs
from jobs.orchestration.leftovers import make_dir
from jobs.orchestration.registry import Registry, VersionUnavailable
from jobs.orchestration.retention import destroyed_versions
from jobs.orchestration.worker import RollbackRefused, Worker, WorkerConfig
from ledger.forgotten import forgotten
from ledger.store import Ledger
from service.demo.residue import TraceScanner
from service.model_holder import ModelHolder, NoModelError
from tests.conftest import HMAC_KEY
from tests.db_files import db_files

# every learner through deletions, scanning every byte it wrote
pytestmark = pytest.mark.slow

SMALL = {"dare": {"n_estimators": 8, "max_depth": 4, "k": 5},
         "sisa": {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]},
         "mlp": {"hidden": [8], "epochs": 5},
         "game": {"hidden": [8], "epochs": 5, "rounds": 5, "attack_steps": 50,
                  "third_fraction": 0.25}}
N, D = 60, 5


@pytest.fixture
def ledger(own_db_url: str) -> Iterator[Ledger]:
    """PostgreSQL in the module's own database: another test process's open snapshot in a
    shared one would make VACUUM FULL keep the purged rows until a retry."""
    led = Ledger(own_db_url, HMAC_KEY, checkpoint_every=10)
    yield led
    led.close()


def _stream(ledger: Ledger, tag: str):
    """60 records of 5 features; subject s05 owns 15..17; the records are unique to
    this test (the model store is shared by the session)."""
    rng = np.random.default_rng(abs(hash(tag)) % 2**32)
    ids = [f"{tag}-r{i:03d}" for i in range(N)]
    subjects = [f"{tag}-s{i // 3:02d}" for i in range(N)]
    X = rng.random((N, D))
    ledger.records.load(ids, subjects, X, np.arange(N) % 3, name="forget")
    return ids, X, rng


def _run(worker: Worker, seconds: float = 2.5) -> None:
    worker.run(max_seconds=seconds)  # the loop a deployed worker runs, retention included


@pytest.mark.parametrize("kind", ["dare", "sisa", "mlp", "game"])
def test_no_file_holds_a_deleted_record(ledger: Ledger, kind: str, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    tag = uuid.uuid4().hex[:8]
    ids, X, rng = _stream(ledger, tag)
    reg = Registry(ledger.engine, name=f"m{tag}")
    # the mlp's guard job keeps a LOO set with each version: every network in it but one
    # saw each record
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, destroy_grace_s=0.0,
                                         shard_bound_s=0.5 if kind == "mlp" else 0.0))
    first = w.bootstrap(kind, SMALL[kind])
    added = rng.random((2, D))
    add = {"request_id": f"{tag}-a1", "op": "add", "subject_id": f"{tag}-new",
           "payload": {"records": [{"record_id": f"{tag}-n{i}", "features": added[i].tolist(),
                                    "label": i} for i in range(2)]}}
    assert ledger.receive(add).status == "accepted"
    end = time.monotonic() + 60  # the additions are in a version before they are deleted
    while (ledger.history(add["request_id"])["request"]["status"] != "verified"
           and time.monotonic() < end):
        _run(w)
    deletions = [{"request_id": f"{tag}-d1", "op": "delete", "record_ids": [ids[1]]},
                 {"request_id": f"{tag}-d2", "op": "delete", "subject_id": f"{tag}-s05"},
                 {"request_id": f"{tag}-d3", "op": "delete", "subject_id": f"{tag}-new"}]
    for d in deletions:
        assert ledger.receive(d).status == "accepted"
    end = time.monotonic() + 120  # the game's requests wait for its exact retrain
    _run(w)
    while (any(ledger.history(d["request_id"])["request"]["status"] != "verified"
               for d in deletions) and time.monotonic() < end):
        _run(w)
    for r in [add, *deletions]:
        assert ledger.history(r["request_id"])["request"]["status"] == "verified"
    end = time.monotonic() + 90  # a maintenance that found an older snapshot retries in 30 s
    while ledger.maintenance.status()["pending"] and time.monotonic() < end:
        _run(w)
    assert ledger.maintenance.status()["pending"] == 0

    gone_rows = [1, 15, 16, 17]
    gone = {ids[i]: X[i] for i in gone_rows} | {f"{tag}-n{i}": added[i] for i in range(2)}
    live = [i for i in range(N) if i not in gone_rows]
    values = TraceScanner(gone, kept=X[live], ids=False)
    everything = TraceScanner(gone, kept=X[live])
    findings = ([(name, hit) for name, blob in db_files(ledger).items()
                 for hit in values.scan_bytes(blob)]
                + everything.scan_model_store(reg)
                + values.scan(Path(tempfile.gettempdir()).glob(f"{JOB_DIR_PREFIX}*")))
    assert findings == []
    assert values.scan_bytes(caplog.text.encode()) == set()
    # the scans are not blind: they do find the live records, in the database and in the
    # served version (unsealed), and a sealed file hides them from a raw byte scan
    kept = TraceScanner({ids[i]: X[i] for i in live[:3]})
    assert {rid for blob in db_files(ledger).values()
            for rid, _ in kept.scan_bytes(blob)} == {ids[i] for i in live[:3]}
    assert {f.record_id for f in kept.scan_model_store(reg)} == {ids[i] for i in live[:3]}
    assert kept.scan([reg.path(reg.current().version)]) == []

    # every version that held them is destroyed: files, key, loadability; a ledger event each
    destroyed = dict(destroyed_versions(reg))
    assert first in destroyed
    assert set(reg.stored_versions()).isdisjoint(destroyed)
    for v in destroyed:
        with pytest.raises(VersionUnavailable):
            reg.load(v)
    report = forgotten(ledger, f"{tag}-d2")
    assert [r["state"] for r in report["records"]] == ["purged"] * 3
    assert report["held_by"] and all(v["destroyed"] for v in report["held_by"])
    assert {v["version"] for v in report["held_by"]} <= set(destroyed)
    # the game's too: its requests are verified by the exact retrain that replaced them
    assert report["exactness"]["guarantee"] == "exact" and report["exactness"]["exact"] is True
    added_report = forgotten(ledger, f"{tag}-d3")  # added, then deleted: held from its add
    held = [v["version"] for v in added_report["held_by"]]
    assert first not in held and held
    assert ledger.verify().ok


def test_nothing_serves_or_loads_a_version_that_held_deleted_records(seeded: Ledger) -> None:
    ledger = seeded
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, destroy_grace_s=3600.0))
    v1 = w.bootstrap("dare", SMALL["dare"])
    holder = ModelHolder(reg, max_unconfirmed_s=0.5)
    holder.refresh()
    assert ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]}
                          ).status == "accepted"
    _run(w, 1.5)
    cur = reg.current().version
    assert cur != v1 and holder.refresh()
    # inside the grace period the old version's files exist, but nothing may load it
    assert v1 in reg.stored_versions() and reg.get(v1).superseded_by_deletion
    with pytest.raises(VersionUnavailable, match="holds records"):
        reg.load(v1)
    with pytest.raises(RollbackRefused, match="holds records"):
        w.rollback(v1)
    # an insider points the registry back at it: the service refuses to swap and keeps
    # serving its version, which the ledger still lets it serve
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE model_pointer SET version = '{v1}' WHERE name = "
                             f"'{reg.name}'")
    assert not holder.refresh()
    time.sleep(0.6)
    assert not holder.refresh()
    assert holder.predict(np.full((1, 4), 0.5))[1].version.version == cur
    # once the ledger no longer lets its own version be served either, it stops answering
    # when it cannot confirm that what it serves may be
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE model_versions SET superseded_by_deletion = 'v999999' "
                             f"WHERE name = '{reg.name}' AND version = '{cur}'")
    assert not holder.refresh()
    begun = holder.serving  # a request that began while it was confirmed ...
    time.sleep(0.6)
    with pytest.raises(NoModelError, match="could not be confirmed"):
        holder.predict(np.full((1, 4), 0.5))
    # ... finishes on it (the service asked twice, and a 500 came of the second asking)
    assert holder.predict(np.full((1, 4), 0.5), begun)[1] is begun
    # a restarted service never installs it either, and says why
    fresh = ModelHolder(reg)
    assert not fresh.refresh()
    with pytest.raises(NoModelError, match=f"the model pointer names {v1}, which may not be "
                                           "served: .* holds records"):
        fresh.serving  # noqa: B018 - the property raises


def test_a_rollback_is_a_new_version_of_the_same_training_set(seeded: Ledger) -> None:
    ledger = seeded
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0))
    v1 = w.bootstrap("dare", SMALL["dare"])
    with pytest.raises(RollbackRefused, match="current version already"):
        w.rollback(v1)
    assert ledger.receive({"request_id": "a1", "op": "add", "subject_id": "new",
                           "payload": {"records": [{"record_id": "n1", "features": [0.5] * 4,
                                                    "label": 1}]}}).status == "accepted"
    _run(w, 1.5)
    with pytest.raises(RollbackRefused, match="training set"):
        w.rollback(v1)  # it lacks the addition the ledger records


def test_a_sealed_version_opens_with_its_own_key_only(seeded: Ledger) -> None:
    from jobs import sealing

    reg = Registry(seeded.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(seeded, reg, WorkerConfig(name="w1", guard_process=False))
    v1 = w.bootstrap("dare", SMALL["dare"])
    files = [f for f in reg.path(v1).rglob("*") if f.is_file() and f.parent.name == "learner"]
    assert files and all(f.read_bytes().startswith(sealing.MAGIC) for f in files)
    with pytest.raises(sealing.SealedFileError, match="no key"):
        sealing.read_file(files[0])
    with sealing.sealed_with(sealing.new_key()), pytest.raises(sealing.SealedFileError):
        sealing.read_file(files[0])
    assert reg.load(v1).learner.n_records_ == 30


def test_a_killed_guard_jobs_directory_is_removed_at_the_next_start(tmp_path) -> None:
    dead = Path(tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}999999999-"))
    (dead / "guard").mkdir()
    (dead / "guard" / "tables.npz").write_bytes(b"half a guard")
    Path(f"{dead}.lock").touch()  # the lock file its killed owner held (tests/test_leftovers.py)
    mine = make_dir(Path(tempfile.gettempdir()), JOB_DIR_PREFIX)
    removed = remove_orphaned_job_dirs()
    assert dead in removed and not dead.exists()
    assert mine.path.exists()  # a live worker's job is left alone
    mine.release()

"""End to end: deletions and an addition sent to Kafka end up served, verified and purged.

Per learner (SISA, DaRE): a real tansu broker, the real processes (`obliviate serve`,
`obliviate worker`, `obliviate consume`) over one ledger, small models on breast_cancer.
Deletions by record id and by subject and one addition go to the requests topic with the
Kafka producer; once the ledger says `verified`:

- the service serves a version at or after every version the requests' events name;
- that version, loaded from the registry, holds none of the deleted records and the added
  one, and its `verify()` (retrain from scratch, compare hashes) is exact;
- the raw records are gone from the database (state `purged`, features and label NULL);
- `obliviate ledger verify` passes.

DaRE runs on PostgreSQL (when a server answers), SISA on SQLite.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from jobs.orchestration.registry import Registry
from ledger.config import LedgerSettings
from ledger.datasets import load
from ledger.local_broker import LocalBroker
from ledger.models import RecordPayload, TrainingRecord
from ledger.producer import produce
from tests.conftest import _PG_REASON
from tests.sidecar import Sidecar

# a real broker and the sidecar's processes
pytestmark = pytest.mark.processes

SMALL = {"sisa": {"n_shards": 3, "epochs_per_slice": 5},
         "dare": {"n_estimators": 10, "max_depth": 5}}
RECORDS = TrainingRecord.__table__
PAYLOADS = RecordPayload.__table__
# breast_cancer with 3 records per subject: subject s040 owns r120, r121, r122
BY_RECORD = [{"request_id": "e2e-rec-1", "op": "delete", "record_ids": ["r010"]},
             {"request_id": "e2e-rec-2", "op": "delete", "record_ids": ["r020", "r021"]}]
BY_SUBJECT = {"request_id": "e2e-subj", "op": "delete", "subject_id": "s040"}
DELETED = ["r010", "r020", "r021", "r120", "r121", "r122"]
ADDED = "e2e-added-1"


def _addition() -> dict:
    X = load("breast_cancer").X
    features = np.clip(X[:5].mean(axis=0), 0.0, 1.0).round(6).tolist()
    return {"request_id": "e2e-add", "op": "add", "subject_id": "s-new",
            "payload": {"records": [{"record_id": ADDED, "features": features, "label": 1}]}}


def _seq(version: str) -> int:
    return int(version.lstrip("v"))


def run_end_to_end(learner: str, workdir: Path, broker: LocalBroker, topics: tuple[str, str],
                   database_url: str | None = None) -> None:
    topic, dead = topics
    messages = [*BY_RECORD, BY_SUBJECT, _addition()]
    ids = [m["request_id"] for m in messages]
    sc = Sidecar(workdir, learner=learner, database_url=database_url,
                 kafka_bootstrap=broker.bootstrap, train_params=json.dumps(SMALL[learner]),
                 env={"OBLIVIATE_REQUESTS_TOPIC": topic, "OBLIVIATE_DEAD_LETTER_TOPIC": dead})
    try:
        sc.seed()
        # the consumer joins its group and the worker starts up while v1 trains
        sc.start_process("consumer", ["consume", "--group", f"e2e-{uuid.uuid4().hex[:8]}"])
        sc.start(seed=False, workers=1)  # v1 trained, the service ready
        assert produce(broker.bootstrap, topic, messages) == len(messages)
        sc.wait_until(lambda: all(sc.history(r) for r in ids), 60,
                      "the consumer to record every request")
        # (each poll builds inclusion proofs: a slow poll leaves the CPU to the worker's
        # low-priority guard refit, which the `verified` events wait for)
        histories = sc.wait_for_status(ids, "verified", timeout_s=120, interval_s=1.0)
        ledger_verify = sc.start_process("ledger-verify", ["ledger", "verify"])

        # served: a version at or after every version the requests' events name
        named = {e["model_version"] for h in histories.values() for e in h["events"]
                 if e["kind"] in ("applied", "verified")}
        assert named and all(named), histories
        newest = max(named, key=_seq)
        served = sc.wait_until(
            lambda: (v := sc.models()["serving"]["version"]) and _seq(v) >= _seq(newest) and v,
            30, f"the service to serve {newest} or later")
        X = load("breast_cancer").X
        assert _seq(sc.predict(X[:3])["model_version"]) >= _seq(newest)
        for h in histories.values():
            assert h["request"]["source"] == "kafka"
            applied = [e for e in h["events"] if e["kind"] == "applied"]
            assert len(applied) == 1 and _seq(applied[0]["model_version"]) <= _seq(served)

        ledger = LedgerSettings(
            database_url=sc.database_url, hmac_key_file=str(sc.hmac_key_file),
            ledger_signing_key_file=sc.env["OBLIVIATE_LEDGER_SIGNING_KEY_FILE"],
            key_store_dir=sc.env["OBLIVIATE_KEY_STORE_DIR"]).open_ledger()
        try:
            # that version, from the registry (the sidecar's model store): without the
            # deleted records, with the added one, and exactly what retraining gives
            model = Registry(ledger.engine, "obliviate", ledger.keys,
                             store=sc.env["OBLIVIATE_MODEL_STORE"]).load(served)
            held = set(model.learner.record_ids_.tolist())
            assert held.isdisjoint(DELETED) and ADDED in held
            assert held == set(ledger.records.live().record_ids.tolist())
            assert len(held) == 569 - len(DELETED) + 1
            report = model.learner.verify()
            assert report.exact, (report.served_hash, report.retrained_hash)

            # the raw records are gone: purged, their rows in record_payloads deleted
            with ledger.engine.connect() as conn:
                rows = {r.record_id: r for r in conn.execute(
                    select(RECORDS).where(RECORDS.c.record_id.in_([*DELETED, ADDED])))}
                left = conn.execute(select(func.count()).select_from(PAYLOADS).where(
                    PAYLOADS.c.record_id.in_(DELETED))).scalar()
                in_clear = conn.execute(select(func.count()).select_from(PAYLOADS).where(
                    PAYLOADS.c.record_id == ADDED)).scalar()
            assert {rows[r].state for r in DELETED} == {"purged"}
            assert left == 0
            # the addition is kept sealed under its own key (ledger.sealed_payloads)
            assert rows[ADDED].state == "live" and in_clear == 0
            assert ledger.records.data([ADDED])[1].tolist() == [1]
        finally:
            ledger.close()

        assert ledger_verify.wait(60) == 0, ledger_verify.tail()
        assert "ledger OK" in ledger_verify.tail()
    finally:
        sc.close()


# DaRE runs on PostgreSQL where a server answers (SKIP LOCKED claims, a schema of its own),
# SISA on SQLite: both learners and both backends in two runs of ~1 min each.
DARE_DB = "sqlite" if _PG_REASON else "postgres"


@pytest.mark.parametrize(("learner", "db_url"), [("sisa", "sqlite"), ("dare", DARE_DB)],
                         indirect=["db_url"])
def test_kafka_requests_are_served_verified_and_purged(
        learner: str, db_url: str, tmp_path: Path, broker: LocalBroker,
        topics: tuple[str, str]) -> None:
    run_end_to_end(learner, tmp_path, broker, topics, database_url=db_url)

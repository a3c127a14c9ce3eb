"""A table as exported, end to end (issue 28, docs/tables.md): text categories, a text
label, '?' for missing values and an id column, loaded straight from CSV (the real
`obliviate` processes, over HTTP) and from Parquet (every learner, in process); object
rows in raw values answered with label names, an addition with a new and a known
category, a subject deleted, and no file left holding the deleted records' values, raw
or encoded."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.orchestration.guard_job import JOB_DIR_PREFIX
from jobs.orchestration.registry import Registry
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.census import FEATURES, census_export
from ledger.datasets import Dataset, TableOptions, load_csv, load_parquet
from ledger.store import Ledger
from service.cli import main
from service.demo.residue import TraceScanner
from tests.conftest import HMAC_KEY
from tests.db_files import db_files
from tests.exported_tables import write_csv, write_parquet
from tests.sidecar import Sidecar

N = 300
INIT = ["--label-column", "income", "--subject-column", "person", "--id-column",
        "record_id", "--na", "?", "--impute", "median"]
OPTIONS = TableOptions(na="?", impute="median")
SMALL = {"dare": {"n_estimators": 8, "max_depth": 4, "k": 5},
         "sisa": {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]},
         "mlp": {"hidden": [8], "epochs": 5},
         "game": {"hidden": [8], "epochs": 5, "rounds": 5, "attack_steps": 50,
                  "third_fraction": 0.25}}
GONE_PERSON = "p005"  # rows a010 and a011


def raw_row(export: dict[str, list], i: int) -> dict[str, Any]:
    """Row i as a client sends it: an object of raw values, null where the table has '?'."""
    return {n: (None if export[n][i] == "?" else export[n][i]) for n in FEATURES}


def additions(export: dict[str, list], tag: str = "") -> dict[str, Any]:
    """One record with a category no one had at init (coded 'other'), one with known ones."""
    new = {**raw_row(export, 0), "native_country": "Atlantis-Upon-Sea", "fnlwgt": 987_651}
    known = {**raw_row(export, 1), "workclass": "State-gov", "fnlwgt": 876_541}
    return {"request_id": f"{tag}add-1", "op": "add", "subject_id": f"{tag}p-new",
            "payload": {"records": [
                {"record_id": f"{tag}n-new", "features": new, "label": ">50K"},
                {"record_id": f"{tag}n-known", "features": known, "label": "<=50K"}]}}


def scanners(ds: Dataset, export: dict[str, list], add: dict[str, Any], tag: str = ""
             ) -> tuple[TraceScanner, TraceScanner]:
    """(values only, values and ids) of the deleted records: the subject's two rows and
    both additions, in encoded form (as the ledger and the models hold them) and raw."""
    t = ds.transform
    gone_rows = [i for i, p in enumerate(export["person"]) if p == GONE_PERSON]
    live = [i for i in range(len(ds.X)) if i not in gone_rows]
    added = [r["features"] for r in add["payload"]["records"]]
    gone = {ds.record_ids[i]: ds.X[i] for i in gone_rows} | {
        f"{tag}n-{k}": np.array(t.scale_row(_encode(t, f))) for k, f in zip(
            ("new", "known"), added, strict=True)}
    raw = {ds.record_ids[i]: [export[n][i] for n in FEATURES] for i in gone_rows} | {
        f"{tag}n-{k}": list(f.values()) for k, f in zip(("new", "known"), added, strict=True)}
    kept_raw = [[export[n][i] for n in FEATURES] for i in live]
    return (TraceScanner(gone, kept=ds.X[live], ids=False, raw=raw, kept_raw=kept_raw),
            TraceScanner(gone, kept=ds.X[live], raw=raw, kept_raw=kept_raw))


def _encode(t: Any, row: dict[str, Any]) -> list[float]:
    from ledger.raw_rows import encode_row

    return encode_row(t, row, "row")


@pytest.mark.processes
def test_a_csv_export_through_the_real_sidecar(tmp_path: Path) -> None:
    export = census_export(N, seed=5, numeric_missing=0.02)
    table = write_csv(tmp_path / "adult.csv", export)  # outside the sidecar's directory
    ds = load_csv(table, "income", "person", "record_id", options=OPTIONS)
    sc = Sidecar(tmp_path / "sidecar", learner="dare", train_params=str(SMALL["dare"])
                 .replace("'", '"'), env={"OBLIVIATE_DESTROY_GRACE_S": "2"})
    try:  # not `with sc:`, which would seed a bundled table first
        out = sc.cli("ledger", "init", "--csv", str(table), *INIT)
        assert f"loaded {N} records of 'adult'" in out and "labels <=50K, >50K" in out
        sc.start(seed=False, workers=1)
        schema = sc.get("/v1/schema", admin=False).json()
        assert schema["label_names"] == ["<=50K", ">50K"]
        assert {c["name"]: c["kind"] for c in schema["columns"]}["workclass"] == "categorical"

        r = sc.http.post("/v1/predict", json={"instances": [raw_row(export, i)
                                                            for i in range(3)]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["label_names"] == [["<=50K", ">50K"][c] for c in body["labels"]]
        bad = sc.http.post("/v1/predict", json={"instances": [{**raw_row(export, 0),
                                                               "age": "old"}]})
        assert bad.status_code == 400 and "row 0, column 'age'" in bad.text

        add = additions(export)
        assert sc.submit(add).status_code == 202
        sc.wait_for_status(["add-1"], "verified")
        for rid, subject in (("del-1", GONE_PERSON), ("del-2", "p-new")):
            assert sc.submit({"request_id": rid, "op": "delete", "subject_id": subject}
                             ).status_code == 202
        sc.wait_for_status(["del-1", "del-2"], "verified")
        time.sleep(3.0)  # the superseded versions are destroyed 2 s after the deletion
        sc.stop_workers()
        assert "ledger OK" in sc.cli("ledger", "verify")
        values, _ = scanners(ds, export, add)
        # every file the sidecar wrote: the SQLite ledger, its logs, the model store
        # (sealed: ciphertext), the key store
        assert values.scan([sc.workdir]) == []
        # not blind: the table itself holds the deleted rows' raw values
        assert {f.record_id for f in values.scan([table])} == {"a010", "a011"}
    finally:
        sc.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dare", "sisa", "mlp", "game"])
def test_a_parquet_export_with_every_learner(tmp_path: Path, monkeypatch, capsys,
                                             kind: str) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_HEX", HMAC_KEY.hex())
    monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", str(tmp_path / "signing.key"))
    monkeypatch.setenv("OBLIVIATE_KEY_STORE_DIR", str(tmp_path / "keys"))
    tag = uuid.uuid4().hex[:6]
    export = census_export(N, seed=7, numeric_missing=0.02)
    export["record_id"] = [f"{tag}{r}" for r in export["record_id"]]
    table = write_parquet(tmp_path / "adult.parquet", export)
    assert main(["ledger", "init", "--parquet", str(table), "--db", url, *INIT]) == 0
    assert "labels <=50K, >50K" in capsys.readouterr().out
    ds = load_parquet(table, "income", "person", "record_id", options=OPTIONS)
    ledger = Ledger(url, HMAC_KEY)
    try:
        reg = Registry(ledger.engine, name=f"t{tag}")
        w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0,
                                             guard_process=False, guard_after_idle_s=0.0,
                                             destroy_grace_s=0.0,
                                             shard_bound_s=0.5 if kind == "mlp" else 0.0))
        w.bootstrap(kind, SMALL[kind])
        model = reg.load(reg.current().version)
        assert model.n_features == ds.X.shape[1] and set(model.classes.tolist()) == {0, 1}
        assert set(model.plain_labels(ds.X[:20]).tolist()) <= {0, 1}
        add = additions(export, tag)
        assert ledger.receive(add).status == "accepted"
        _run_until(w, ledger, [add["request_id"]])
        deletions = [{"request_id": f"{tag}d{i}", "op": "delete", "subject_id": s}
                     for i, s in enumerate((GONE_PERSON, f"{tag}p-new"))]
        for d in deletions:
            assert ledger.receive(d).status == "accepted"
        _run_until(w, ledger, [d["request_id"] for d in deletions])
        values, everything = scanners(ds, export, add, tag)
        findings = ([(n, hit) for n, blob in db_files(ledger).items()
                     for hit in values.scan_bytes(blob)]
                    + everything.scan_model_store(reg)
                    + values.scan(Path(tempfile.gettempdir()).glob(f"{JOB_DIR_PREFIX}*")))
        assert findings == []
        # not blind: live records are found, encoded, in the database and the served version
        alive = TraceScanner({ds.record_ids[i]: ds.X[i] for i in (0, 1, 2)})
        assert {rid for blob in db_files(ledger).values()
                for rid, _ in alive.scan_bytes(blob)} == set(ds.record_ids[:3])
        assert {f.record_id for f in alive.scan_model_store(reg)} == set(ds.record_ids[:3])
        assert ledger.verify().ok
    finally:
        ledger.close()


def _run_until(w: Worker, ledger: Ledger, request_ids: list[str], timeout_s: float = 90
               ) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        w.run(max_seconds=2.0)
        if all(ledger.history(r)["request"]["status"] == "verified" for r in request_ids):
            return
    raise AssertionError(f"{request_ids} not verified in {timeout_s} s")

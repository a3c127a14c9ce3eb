"""What is served is what the ledger published: every load holds a version's files to its
manifest (the learner's and the guard's content hashes) and the manifest to the digest its
publication event carries; a file without the seal is refused whenever a key is in effect.
Whoever can write the model store, but holds no key (or even holds it), cannot make the
worker, the service, a rollback or the guard job load a model or a guard that was not
published."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import Engine, create_engine, update

from jobs import sealing
from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.guard_job import ERROR_FILE, RESULT_FILE, fit_guard
from jobs.orchestration.registry import VERSIONS, Registry, VersionRefused
from jobs.orchestration.served_model import GUARD_DIR, LEARNER_DIR, ServedModel
from jobs.orchestration.worker import RollbackRefused, Worker, WorkerConfig
from ledger.store import Ledger
from service.model_holder import ModelHolder, NoModelError
from tests.test_quarantine import PARAMS, delete, status
from tests.waiting import wait_for

# the worker in-process publishing, refusing and reloading versions
pytestmark = pytest.mark.slow


def _worker(ledger: Ledger, reg: Registry, shard_bound_s: float = 0.0) -> Worker:
    return Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                            guard_after_idle_s=0.0, shard_bound_s=shard_bound_s))


def _drain(worker: Worker, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not worker.step() and not worker.busy:
            return
        time.sleep(0.02)
    raise AssertionError("the worker did not run out of work")


def _foreign(kind: str, ledger: Ledger) -> ServedModel:
    """A model of the same kind trained on records the ledger never held."""
    live = ledger.records.live()
    ids = np.array([f"x{i:03d}" for i in range(len(live.record_ids))], dtype=object)
    return ServedModel.train(kind, ids, live.X[::-1].copy(), live.y, PARAMS[kind])


def _forged_guard(kind: str, real: ServedModel, guard: Path) -> None:
    """The real guard state written without the seal, with its bounds zeroed where it has
    any (beta 0: every answer above a zero margin certified); for the game learner, which
    has no guard, a bound planted beside it."""
    shutil.rmtree(guard, ignore_errors=True)
    guard.mkdir()
    if kind == "dare":
        real.guard.save(guard)
    elif kind == "sisa":
        (guard / "shard_bounds.json").write_text(json.dumps({
            "networks": list(real.bounds.networks),
            "beta": np.zeros_like(real.bounds.beta).tolist(), "info": {}}))
    else:  # mlp: from the manifest alone (the network's hash, the LOO set's hash)
        bound = real.guard_record().get("bound", {})
        (guard / "bound.json").write_text(json.dumps({
            "network_hash": bound.get("network_hash", ""), "loo_hash": bound.get("loo_hash", ""),
            "beta": [0.0] * len(real.classes), "info": {}}))


def _tamperings(kind: str, ledger: Ledger, real: ServedModel, key: bytes
                ) -> dict[str, Callable[[Path], None]]:
    foreign = _foreign(kind, ledger)

    def learner(sealed: bool, keep_guard: bool) -> Callable[[Path], None]:
        def tamper(path: Path) -> None:
            shutil.rmtree(path / LEARNER_DIR)
            with sealing.sealed_with(key if sealed else None):
                foreign.learner.save(path / LEARNER_DIR)
            if not keep_guard:
                shutil.rmtree(path / GUARD_DIR, ignore_errors=True)
        return tamper

    return {"forged plaintext guard": lambda path: _forged_guard(kind, real, path / GUARD_DIR),
            "foreign plaintext learner": learner(sealed=False, keep_guard=True),
            "foreign plaintext learner, guard removed": learner(sealed=False, keep_guard=False),
            # an insider with the version's key: only the content hashes catch this one
            "foreign sealed learner": learner(sealed=True, keep_guard=True),
            "foreign sealed learner, guard removed": learner(sealed=True, keep_guard=False)}


def _assert_refused_everywhere(ledger: Ledger, reg: Registry, version: str, case: str) -> None:
    why = f"{version} is not what was published"
    with pytest.raises(VersionRefused, match=why):
        reg.load(version)  # the service's, the worker's and a rollback's loader
    # a serving process that starts now answers 503 and says why
    holder = ModelHolder(reg)
    assert not holder.refresh()
    with pytest.raises(NoModelError, match=why):
        holder.serving  # noqa: B018 - the property raises
    # a worker that starts now builds nothing on it: the deletion waiting stays unclaimed
    w = _worker(ledger, reg)
    assert w.step() is False
    assert status(ledger, "dz") == "received", case
    assert metrics.POINTER_REFUSED._value.get() == 1.0
    # the guard job refuses it too (the worker hands it the vouched manifest)
    out = Path(tempfile.mkdtemp())
    try:
        fit_guard(str(reg.path(version)), reg.key(version).hex(),
                  reg.vouched_manifest(reg.get(version)), str(out), False)
        assert not (out / RESULT_FILE).exists() and (out / ERROR_FILE).is_file(), case
    finally:
        shutil.rmtree(out)


@pytest.mark.parametrize("kind", ["dare", "sisa", "mlp", "game"])
def test_nothing_loads_files_that_are_not_what_was_published(seeded60: Ledger, kind: str,
                                                             tmp_path: Path) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = _worker(ledger, reg, shard_bound_s=1.0 if kind in ("sisa", "mlp") else 0.0)
    w.bootstrap(kind, PARAMS[kind])
    _drain(w)  # sisa and mlp: the guard job's bounds published with the version
    version = reg.current().version
    recorded = reg.current().manifest["guard"]["content_hash"]
    real = reg.load(version)
    assert real.guard_hash() == recorded and (recorded is None) == (kind == "game")
    if kind == "mlp":
        assert real.class_bounds() is not None, "the mlp version should hold a bound"
    path, backup = reg.path(version), tmp_path / "backup"
    shutil.copytree(path, backup)
    delete(ledger, "dz", "r001")
    for case, tamper in _tamperings(kind, ledger, real, reg.key(version)).items():
        tamper(path)
        _assert_refused_everywhere(ledger, reg, version, case)
        shutil.rmtree(path)
        shutil.copytree(backup, path)
    # the files as published load again, and the worker goes on from them
    assert reg.load(version).learner.content_hash() == reg.current().manifest["content_hash"]
    w = _worker(ledger, reg)
    _drain(w)
    assert status(ledger, "dz") == "verified"
    assert metrics.POINTER_REFUSED._value.get() == 0.0


def test_a_version_published_before_guards_were_hashed_is_upgraded(
        seeded60: Ledger, monkeypatch, caplog) -> None:
    """An upgrade meets versions whose manifest records no guard hash: their learner is held
    to the manifest, their guard is not loaded (noise-all, said in the log), and the worker
    refits the guard and publishes it, hashed; nothing is stuck."""
    import jobs.orchestration.publisher

    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    real_manifest = jobs.orchestration.publisher.manifest

    def unhashed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        man = real_manifest(*args, **kwargs)
        man["guard"].pop("content_hash")
        return man

    monkeypatch.setattr(jobs.orchestration.publisher, "manifest", unhashed)
    old = _worker(ledger, reg).bootstrap("dare", PARAMS["dare"])
    monkeypatch.undo()
    assert "content_hash" not in reg.current().manifest["guard"]
    with caplog.at_level(logging.WARNING, logger="obliviate.served_model"):
        legacy = reg.load(old)
    assert not legacy.guard_ready and "records no content hash of its guard" in caplog.text
    holder = ModelHolder(reg)
    assert holder.refresh() and holder.problem is None  # served, noised, while refitted
    w = _worker(ledger, reg)
    _drain(w)
    cur = reg.current()
    assert cur.version != old and cur.manifest["change"]["op"] == "guard"
    assert cur.manifest["guard"]["content_hash"] == reg.load(cur.version).guard_hash()
    assert reg.load(cur.version).guard_ready
    delete(ledger, "d1", "r001")
    _drain(w)
    assert status(ledger, "d1") == "verified"


def test_a_manifest_the_ledger_did_not_publish_is_refused(seeded60: Ledger) -> None:
    """The database's manifest row edited to name a foreign learner (sealed under the
    version's key and put in place): the digest the publication event carries does not
    match, so no load, rollback or guard job takes it."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = _worker(ledger, reg)
    v1 = w.bootstrap("dare", PARAMS["dare"])
    delete(ledger, "d1", "r001")
    _drain(w)
    v2 = reg.current().version
    foreign = _foreign("dare", ledger)
    path = reg.path(v1)
    shutil.rmtree(path / LEARNER_DIR)
    shutil.rmtree(path / GUARD_DIR)
    with sealing.sealed_with(reg.key(v1)):
        foreign.learner.save(path / LEARNER_DIR)
    man = {**reg.get(v1).manifest, "content_hash": foreign.learner.content_hash(),
           "guard": {**reg.get(v1).manifest["guard"], "content_hash": None}}
    man["training_set"] = reg.get(v2).manifest["training_set"]  # so a rollback would pass
    with ledger.engine.begin() as conn:
        conn.execute(update(VERSIONS).where(VERSIONS.c.name == reg.name,
                                            VERSIONS.c.version == v1)
                     .values(manifest=man, superseded_by_deletion=None))
    with pytest.raises(VersionRefused, match="not the one its publication event vouches for"):
        reg.load(v1)
    with pytest.raises(RollbackRefused, match="vouches for"):
        w.rollback(v1)
    with pytest.raises(VersionRefused, match="vouches for"):
        reg.vouched_manifest(reg.get(v1))  # what the worker hands the guard job
    assert reg.current().version == v2


def test_a_file_without_the_seal_is_refused_when_a_key_is_in_effect(tmp_path: Path) -> None:
    plain = tmp_path / "bound.json"
    plain.write_bytes(b'{"beta": [0, 0]}')
    assert sealing.read_file(plain) == b'{"beta": [0, 0]}'  # outside the registry: plain
    with sealing.sealed_with(sealing.new_key()):
        with pytest.raises(sealing.SealedFileError, match="is not sealed"):
            sealing.read_file(plain)
        assert sealing.unsealed(plain) == b'{"beta": [0, 0]}'  # a scan reads it as it is
        sealing.write_file(tmp_path / "x", b"sealed")
        assert sealing.read_file(tmp_path / "x") == b"sealed"


def _point_at(ledger: Ledger | Engine, name: str | None, version: str) -> None:
    """A hand edit of the model pointer (an insider, or a restore gone wrong)."""
    engine = ledger.engine if isinstance(ledger, Ledger) else ledger
    where = "" if name is None else f" WHERE name = '{name}'"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE model_pointer SET version = '{version}'{where}")


@pytest.mark.parametrize("target", ["destroyed", "never published"])
def test_a_pointer_to_a_destroyed_or_missing_version_stops_no_process(
        seeded60: Ledger, target: str, caplog: pytest.LogCaptureFixture) -> None:
    """The worker builds nothing on it and keeps running, with an alert gauge and one clear
    log line; the service keeps serving the version it has, and one that has none answers
    with what is wrong. Pointed back, the requests flow."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, destroy_grace_s=0.0,
                                         backoff_s=0.05, max_backoff_s=0.2))
    v1 = w.bootstrap("dare", PARAMS["dare"])
    holder = ModelHolder(reg, max_unconfirmed_s=0.5)
    delete(ledger, "d1", "r001")
    end = time.monotonic() + 60
    while reg.get(v1).destroyed_at is None:  # the retention pass destroys v1
        assert time.monotonic() < end
        w.step()
        time.sleep(0.05)
    v2 = reg.current().version
    assert holder.refresh() and holder.serving.version.version == v2
    named = v1 if target == "destroyed" else "v000042"
    _point_at(ledger, reg.name, named)
    delete(ledger, "d2", "r002")
    with caplog.at_level(logging.INFO, "obliviate.worker"):
        for _ in range(4):
            assert w.step() is False  # never raises
            time.sleep(0.1)
    assert status(ledger, "d2") == "received"  # not even claimed
    assert metrics.POINTER_REFUSED._value.get() == 1.0
    why = (f"{named}, which may not be served: {v1} was destroyed" if target == "destroyed"
           else f"{named}, which was never published")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1, said  # said once, not at every pass
    assert f"the model pointer names {why}" in said[0] and "obliviate ledger verify" in said[0]
    # the service keeps answering with its version, past the time it waits to confirm one
    time.sleep(0.6)
    assert not holder.refresh()
    assert holder.predict(np.full((1, 4), 0.5))[1].version.version == v2
    # one that starts now has no version, and says what is wrong
    fresh = ModelHolder(reg)
    assert not fresh.refresh()
    with pytest.raises(NoModelError) as err:
        fresh.serving  # noqa: B018 - the property raises
    assert f"the model pointer names {why}" in str(err.value)
    assert "published yet" not in str(err.value)
    _point_at(ledger, reg.name, v2)
    wait_for(lambda: not w.trouble.waiting(), 10, "the worker's back-off to end")
    _drain(w)
    assert status(ledger, "d2") == "verified"
    assert metrics.POINTER_REFUSED._value.get() == 0.0
    assert fresh.refresh() and fresh.serving.version.version == reg.current().version


@pytest.mark.processes
def test_the_real_worker_and_service_survive_a_pointer_to_a_destroyed_version(
        db_url: str, tmp_path: Path) -> None:
    """`obliviate worker` used to exit on it (and on every restart); `obliviate serve` said
    no version was published yet."""
    from tests.sidecar import Sidecar

    row = [[0.5] * 30]
    with Sidecar(tmp_path, learner="dare", database_url=db_url,
                 env={"OBLIVIATE_DESTROY_GRACE_S": "1"}) as sc:
        worker = sc.start_worker()
        assert sc.submit({"request_id": "d1", "op": "delete",
                          "record_ids": ["r001"]}).status_code == 202
        sc.wait_for_status(["d1"], "verified")
        engine = create_engine(sc.database_url)
        try:
            sc.wait_until(lambda: _destroyed(engine, "v000001"), 30, "v000001 destroyed")
            # the version the service has: the pointer's, once it stopped moving (the
            # exactness check may publish one more after `verified`; the service loads it
            # within its poll)
            served = sc.wait_until(lambda: _settled(sc, engine, row), 60, "a settled version")
            _point_at(engine, None, "v000001")
            assert sc.submit({"request_id": "d2", "op": "delete",
                              "record_ids": ["r002"]}).status_code == 202
            time.sleep(3)
            assert worker.running(), worker.tail()
            # nothing is applied on top of it: d2 waits, unclaimed, or claimed by a pass
            # that began before the pointer moved (its publication conflicts, the claim
            # waits for a version that loads)
            assert sc.history("d2")["request"]["status"] in ("received", "claimed")
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT version FROM model_pointer").scalar() \
                    == "v000001"
            log = worker.log_path.read_text()
            assert ("the model pointer names v000001, which may not be served: v000001 was "
                    "destroyed") in log and "obliviate ledger verify" in log
            assert sc.predict(row)["model_version"] == served  # 3 s: past its 0.5 s
            sc.stop_server()
            sc.start_server(wait=False)
            r = sc.wait_until(lambda: _answer(sc, row), 120, "the restarted server")
            assert r.status_code == 503
            assert "the model pointer names v000001, which may not be served" in \
                r.json()["error"]
            _point_at(engine, None, served)
        finally:
            engine.dispose()
        sc.wait_for_status(["d2"], "verified")
        assert worker.running()
        sc.wait_ready()
        assert sc.predict(row)["model_version"] != served


def _settled(sc: Any, engine: Engine, row: list[list[float]]) -> str | None:  # noqa: ANN401
    """The version the service answers with, when it is the pointer's and still is a
    second later; None otherwise."""
    def pointer() -> str:
        with engine.connect() as conn:
            return conn.exec_driver_sql("SELECT version FROM model_pointer").scalar()

    first = pointer()
    if sc.predict(row)["model_version"] != first:
        return None
    time.sleep(1.0)
    return first if pointer() == first == sc.predict(row)["model_version"] else None


def _destroyed(engine: Engine, version: str) -> bool:
    with engine.connect() as conn:
        return conn.exec_driver_sql(f"SELECT destroyed_at FROM model_versions WHERE version "
                                    f"= '{version}'").scalar() is not None


def _answer(sc: Any, row: list[list[float]]) -> httpx.Response | None:  # noqa: ANN401
    try:
        return sc.http.post("/v1/predict", json={"instances": row, "scaled": True})
    except httpx.HTTPError:
        return None

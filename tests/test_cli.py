"""The `obliviate` command line as an operator or auditor uses it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sqlalchemy import text

from ledger import merkle
from ledger.chain import event_leaf
from service.cli import main


@pytest.fixture
def env(tmp_path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("OBLIVIATE_DATABASE_URL", url)
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    return url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_init_submit_show_export_verify(env: str, capsys) -> None:
    code, out, _ = run(capsys, "ledger", "init", "--dataset", "wine")
    assert code == 0 and "loaded 178 records of 'wine'" in out
    code, out, _ = run(capsys, "submit", '{"request_id": "q1", "op": "delete", '
                                         '"subject_id": "s001"}')
    assert code == 0 and json.loads(out)["status"] == "accepted"
    code, out, _ = run(capsys, "submit", '{"request_id": "q2", "op": "delete", '
                                         '"record_ids": ["zzz"]}')
    assert code == 2 and "unknown record" in json.loads(out)["reason"]

    code, out, _ = run(capsys, "ledger", "show", "q1")  # a summary for a person
    assert code == 0 and out.startswith("request q1: delete subject s001, received")
    assert "received" in out.splitlines()[2] and "hash(es)" not in out.splitlines()[0]
    code, out, _ = run(capsys, "ledger", "show", "q1", "--json")  # the document (issue 28)
    history = json.loads(out)
    head = history["tree_head"]
    [ev] = history["events"]
    assert ev["payload"]["record_ids"] == ["r003", "r004", "r005"]
    assert merkle.verify_inclusion(event_leaf(ev["hash"]), ev["seq"] - 1, head["tree_size"],
                                   [bytes.fromhex(p) for p in ev["inclusion_proof"]],
                                   bytes.fromhex(head["root_hash"]))

    code, out, _ = run(capsys, "ledger", "export", "--since", "1")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [e["kind"] for e in lines] == ["received", "rejected"]

    code, out, _ = run(capsys, "ledger", "verify")
    assert code == 0 and "ledger OK: 3 events" in out


def test_verify_exits_1_and_names_the_first_bad_event(env: str, capsys) -> None:
    run(capsys, "ledger", "init", "--dataset", "iris")
    for i in range(3):
        run(capsys, "submit", json.dumps({"request_id": f"q{i}", "op": "delete",
                                          "record_ids": [f"r{i:03d}"]}))
    from sqlalchemy import create_engine
    engine = create_engine(env)
    with engine.begin() as conn:
        conn.execute(text("UPDATE events SET created_at = '2020-01-01T00:00:00.000000Z' "
                          "WHERE seq = 2"))
    code, _, err = run(capsys, "ledger", "verify")
    assert code == 1
    assert "first: event 2: content does not match its hash" in err


def test_show_unknown_request_and_bad_input(env: str, capsys) -> None:
    run(capsys, "ledger", "init", "--dataset", "iris")
    code, _, err = run(capsys, "ledger", "show", "nope")
    assert code == 1 and "no request or event with request_id 'nope'" in err
    code, _, err = run(capsys, "ledger", "init", "--dataset", "nope")
    assert code == 2 and "unknown data set 'nope'" in err


def test_init_from_csv(env: str, tmp_path, capsys) -> None:
    csv = tmp_path / "people.csv"
    csv.write_text("id,person,age,income,label\na1,p1,30,1000,0\na2,p1,40,2000,1\n"
                   "a3,p2,50,1500,1\n")
    code, out, _ = run(capsys, "ledger", "init", "--csv", str(csv), "--id-column", "id",
                       "--subject-column", "person")
    assert code == 0 and "loaded 3 records of 'people' (2 features, 2 classes)" in out
    code, out, _ = run(capsys, "submit", '{"request_id": "x", "op": "delete", '
                                         '"subject_id": "p1"}')
    assert json.loads(out)["record_ids"] == ["a1", "a2"]


@pytest.mark.processes
def test_forgotten_and_rollback_from_the_command_line(env: str, tmp_path, monkeypatch,
                                                      capsys) -> None:
    """An operator's path: train, delete a subject, run the worker, then ask the ledger
    what the deletion removed and try to roll back to the version that held it."""
    monkeypatch.setenv("OBLIVIATE_MODEL_NAME", f"cli{tmp_path.name[-8:].replace('-', '')}")
    monkeypatch.setenv("OBLIVIATE_DESTROY_GRACE_S", "0")
    assert run(capsys, "ledger", "init", "--dataset", "wine")[0] == 0
    code, out, _ = run(capsys, "model", "train", "--learner", "dare", "--params",
                       '{"n_estimators": 4, "max_depth": 3}')
    first = out.split()[-1]
    assert code == 0 and first == "v000001"
    code, out, _ = run(capsys, "ledger", "forgotten", "nope")
    assert code == 1
    assert run(capsys, "submit", '{"request_id": "q1", "op": "delete", '
                                 '"subject_id": "s001"}')[0] == 0
    code, out, _ = run(capsys, "ledger", "forgotten", "q1")
    assert code == 0 and "not applied yet" in out
    code, _, _ = run(capsys, "worker", "--metrics-port", "0", "--max-seconds", "10")
    assert code == 0
    code, out, _ = run(capsys, "ledger", "forgotten", "q1")
    assert code == 0, out
    assert out.count("purged at") == 3 and "first version without it: v000002" in out
    assert "held by 1 version(s): 1 destroyed" in out and "hash matches" in out
    assert f"{first} destroyed at" in out
    code, out, _ = run(capsys, "ledger", "forgotten", "q1", "--json")
    report = json.loads(out)
    assert report["held_by"][0]["version"] == first and report["exactness"]["exact"] is True
    code, out, err = run(capsys, "model", "rollback", first)
    assert code == 1 and "destroyed" in err
    code, out, _ = run(capsys, "model", "lineage")
    assert code == 0 and "destroyed" in out.splitlines()[-1]


def test_init_from_the_census_like_table(env: str, capsys) -> None:
    """The generated table with the character of real ones: ties, categories, skew."""
    code, out, _ = run(capsys, "ledger", "init", "--dataset", "census")
    assert code == 0 and "loaded 2000 records of 'census' (14 features, 2 classes)" in out
    from ledger import datasets

    ds = datasets.load("census", n_samples=5000)
    assert ds.X.shape == (5000, 14) and ds.feature_names[0] == "age"
    assert (ds.X >= 0).all() and (ds.X <= 1).all()
    distinct = [len(np.unique(ds.raw[:, j])) for j in range(14)]
    assert max(distinct[j] for j in (1, 3, 5, 6, 7, 8, 9)) <= 16  # coded categories
    assert 0.7 < 1 - ds.y.mean() < 0.82  # skewed labels
    np.testing.assert_array_equal(ds.X, datasets.load("census", n_samples=5000).X)

"""Records the database schema and data of commit ff838b8 (before the migrations).

Not a test: run once with that commit's sources, to (re)make the snapshot that
tests/test_migrations.py upgrades:

    git worktree add /tmp/ff838b8 ff838b8
    .venv/bin/python tests/data/make_ff838b8_snapshot.py /tmp/ff838b8

It writes `ff838b8.sqlite.sql` and `ff838b8.postgresql.sql` (the DDL that commit's
`create_all` emitted for every table of its models) and `ff838b8.rows.json` (rows a
ledger of that commit held after intake, deletions, an addition and a publication).
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import datetime
from pathlib import Path

OUT = Path(__file__).resolve().parent
HMAC_KEY = bytes(range(32))


def main(old_tree: str) -> None:
    sys.path.insert(0, old_tree)
    import numpy as np
    from sqlalchemy import JSON, select, text
    from sqlalchemy.dialects import postgresql, sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable
    from sqlmodel import SQLModel

    import jobs.adaptive.budget  # noqa: F401 - the other modules' tables of that commit
    import jobs.orchestration.registry  # noqa: F401
    import ledger.models  # noqa: F401 - the ledger's tables
    import service.usage  # noqa: F401
    from ledger.store import Ledger

    for name, dialect in (("sqlite", sqlite.dialect()), ("postgresql", postgresql.dialect())):
        out = []
        for t in SQLModel.metadata.sorted_tables:
            out.append(str(CreateTable(t).compile(dialect=dialect)).strip() + ";")
            for ix in sorted(t.indexes, key=lambda i: i.name):
                out.append(str(CreateIndex(ix).compile(dialect=dialect)).strip() + ";")
        (OUT / f"ff838b8.{name}.sql").write_text(
            f"-- the schema of commit ff838b8 ({name}), as its create_all made it\n\n"
            + "\n\n".join(out) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        led = Ledger(f"sqlite:///{tmp}/old.db", HMAC_KEY, checkpoint_every=5)
        SQLModel.metadata.create_all(led.engine)
        rng = np.random.default_rng(0)
        n = 12
        led.load_records([f"r{i:03d}" for i in range(n)], [f"s{i // 3:02d}" for i in range(n)],
                         rng.random((n, 4)).round(6), np.arange(n) % 2, name="toy")
        for msg in ({"request_id": "q-subject", "op": "delete", "subject_id": "s01"},
                    {"request_id": "q-record", "op": "delete", "record_ids": ["r010"]},
                    {"request_id": "q-add", "op": "add", "subject_id": "s99",
                     "payload": {"records": [{"record_id": "n1",
                                              "features": [0.1, 0.2, 0.3, 0.4],
                                              "label": 1}]}},
                    {"request_id": "q-pending", "op": "delete", "record_ids": ["r000"]},
                    {"request_id": "q-bad", "op": "delete", "record_ids": ["nope"]}):
            led.receive(json.dumps(msg).encode(), source="cli")
        led.receive(json.dumps({"request_id": "q-record", "op": "delete",
                                "record_ids": ["r010"]}).encode(), source="cli")  # duplicate
        led.claim(limit=3, worker="w1")

        def publish(conn) -> None:  # noqa: ANN001 - what the old registry wrote
            now = datetime.now().astimezone()
            conn.execute(text("INSERT INTO model_versions (name, version, seq, parent, "
                              "manifest, created_at) VALUES ('obliviate', 'v000001', 1, NULL, "
                              ":m, :t)"), {"m": json.dumps({"learner": "dare", "seed": 7}),
                                           "t": now})
            conn.execute(text("INSERT INTO model_pointer (name, version, seq, updated_at) "
                              "VALUES ('obliviate', 'v000001', 1, :t)"), {"t": now})

        led.mark_applied(["q-subject", "q-record", "q-add"], "v000001",
                         {"guarantee": "exact"}, in_transaction=publish)
        led.mark_verified(["q-subject"], "v000001", {"exactness": {"exact": True}})
        led.checkpoint()
        with led.engine.begin() as conn:
            now = datetime.now().astimezone()
            conn.execute(text("INSERT INTO seed_lineages VALUES ('obliviate', 'v000001', 0.5, "
                              "1e-05, 10.0, 20, 4, :t, NULL)"), {"t": now})
            conn.execute(text("INSERT INTO guard_usage (process, version, period_end, certain, "
                              "noised, fresh_noised, epsilon_spent) VALUES ('host:1', "
                              "'v000001', :t, 10, 2, 1, 1.0)"), {"t": now})
        rows = {}
        with led.engine.connect() as conn:
            for t in SQLModel.metadata.sorted_tables:
                rows[t.name] = [
                    {c.name: _encode(r._mapping[c.name], isinstance(c.type, JSON))
                     for c in t.columns}
                    for r in conn.execute(select(t).order_by(*t.primary_key.columns))]
        led.close()
    (OUT / "ff838b8.rows.json").write_text(json.dumps(rows, indent=1) + "\n")


def _encode(value, is_json: bool):  # noqa: ANN001, ANN202
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if is_json and value is not None:
        return {"$json": value}
    return value


if __name__ == "__main__":
    main(sys.argv[1])

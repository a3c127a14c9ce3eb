"""`verify`'s pass over the training records: each one's keyed fingerprint, recomputed
from its data, and what the events say happened to it.

At 10^6 records this pass is most of a full verify, so it reads only the columns it
needs and takes each fingerprint over the features' stored bytes
(`chain.stored_record_fingerprint`), judging a record by its values only where that
disagrees (a fingerprint of the scheme before revision 0007, or an edit).
See docs/ledger.md#what-ledger-verify-holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Connection, select

from ledger.chain import FEATURES_DTYPE, fingerprint_matches, stored_record_fingerprint
from ledger.log_check import LogFacts, Problem
from ledger.sealed_payloads import PayloadKeyMissing, PayloadSealer
from ledger.tables import PAYLOADS, RECORDS, SEALED

_BATCH = 20_000  # rows per fetch


class RecordCheck:
    """Holds every training record to its fingerprint and to the events' facts."""

    def __init__(self, hmac_key: bytes, sealer: PayloadSealer) -> None:
        self._key = hmac_key
        self._sealer = sealer

    def run(self, conn: Connection, status_of: dict[str, str], facts: LogFacts,
            problems: list[Problem]) -> int:
        """Every record against its fingerprint and the events; returns how many there are."""
        n_records = 0
        query = (select(RECORDS.c.record_id, RECORDS.c.subject_id, RECORDS.c.record_hash,
                        RECORDS.c.state, RECORDS.c.added_by, RECORDS.c.added_at,
                        RECORDS.c.purged_by, PAYLOADS.c.features,
                        PAYLOADS.c.label, PAYLOADS.c.record_id.label("payload_of"),
                        SEALED.c.sealed)
                 .select_from(RECORDS.outerjoin(PAYLOADS,
                                                PAYLOADS.c.record_id == RECORDS.c.record_id)
                              .outerjoin(SEALED, SEALED.c.record_id == RECORDS.c.record_id)))
        key, purged, loaded = self._key, facts.purged, facts.loaded_record
        for batch in conn.execution_options(yield_per=_BATCH).execute(query).partitions():
            for rec in batch:
                rid, subject, fp, state, added_by, added_at, _, features, label, _, _ = rec
                if state == "purged" or features is None or stored_record_fingerprint(
                        key, rid, subject, bytes(features), label) != fp:
                    problems.extend(self._check_data(rec))
                if added_by is None and state != "purged" and rid not in purged:
                    loaded(added_at, fp)  # most records: loaded, live, never deleted
                else:
                    problems.extend(facts.check_record(rec, status_of))
            n_records += len(batch)
        return n_records

    def _check_data(self, rec: Any) -> list[Problem]:
        """A record's data against its state and fingerprint, its features parsed (what
        `run` does for every record whose stored text does not already match)."""
        where = f"record {rec.record_id}"
        if rec.state == "purged":
            if rec.payload_of is not None or rec.sealed is not None:
                return [Problem(where, "is purged but still holds raw features or label "
                                       "(a row in record_payloads or sealed_payloads)")]
            if rec.added_by is not None and self._sealer.has_key(rec.record_id):
                return [Problem(where, "is purged but its payload key is still in the key "
                                       "store (copies of its sealed row would open)")]
            return []
        label, features = rec.label, rec.features
        if features is not None and len(features) % np.dtype(FEATURES_DTYPE).itemsize:
            return [Problem(where, "features or label do not match its keyed fingerprint "
                                   "(its stored features are not float64 values)")]
        if features is not None:
            features = np.frombuffer(bytes(features), dtype=FEATURES_DTYPE)
        if features is None and rec.sealed is not None:
            try:
                features, label = self._sealer.open(rec.record_id, bytes(rec.sealed))
            except (PayloadKeyMissing, ValueError) as exc:
                return [Problem(where, f"is {rec.state} but its data cannot be read: {exc}")]
        if features is None or label is None:
            return [Problem(where, f"is {rec.state} but has no features or label")]
        if not fingerprint_matches(self._key, rec.record_id, rec.subject_id, features, label,
                                   rec.record_hash):
            return [Problem(where, "features or label do not match its keyed fingerprint")]
        return []

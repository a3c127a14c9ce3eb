"""`verify`'s fast spellings of what it hashes: every event's chain entry and every record's
fingerprint are the bytes their definitions give (checked on random content), a record
fingerprinted by the JSON scheme before revision 0007 still matches by its values
(tests/test_migrations.py verifies a whole ledger of them), and an
edited or truncated feature row is named. See docs/ledger.md#what-ledger-verify-holds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from ledger.chain import (
    canonical_json,
    event_entry,
    fingerprint_matches,
    legacy_record_fingerprint,
    record_fingerprint,
    stored_record_fingerprint,
)
from ledger.store import Ledger
from tests.conftest import HMAC_KEY
from tests.test_ledger import tamper

texts = st.text(max_size=40)
maybe_text = st.none() | texts


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**63), maybe_text, texts, texts, maybe_text,
       texts, texts)
def test_an_event_entry_is_its_canonical_json(seq: int, request_id: str | None, kind: str,
                                              payload: str, model_version: str | None,
                                              created_at: str, prev_hash: str) -> None:
    canonical = canonical_json({
        "seq": seq, "request_id": request_id, "kind": kind, "payload": payload,
        "model_version": model_version, "created_at": created_at, "prev_hash": prev_hash,
    }).encode()
    assert event_entry(seq, request_id, kind, payload, model_version, created_at,
                       prev_hash) == canonical


def test_an_event_entry_of_other_types_goes_through_the_encoder() -> None:
    assert event_entry(True, 7, "k", "{}", None, "t", "0") == canonical_json(  # type: ignore[arg-type]
        {"seq": True, "request_id": 7, "kind": "k", "payload": "{}", "model_version": None,
         "created_at": "t", "prev_hash": "0"}).encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-10, 10),
                max_size=12),
       st.integers(-5, 5), texts, maybe_text)
def test_a_fingerprint_from_the_stored_bytes_is_the_fingerprint(features: list[float],
                                                               label: int, record_id: str,
                                                               subject_id: str | None) -> None:
    stored = np.asarray(features, dtype="<f8").tobytes()
    fp = stored_record_fingerprint(HMAC_KEY, record_id, subject_id, stored, label)
    assert fp == record_fingerprint(HMAC_KEY, record_id, subject_id, features, label)
    # and it is not the fingerprint of other content: another label, id, subject or value
    assert fp != stored_record_fingerprint(HMAC_KEY, record_id, subject_id, stored, label + 1)
    assert fp != stored_record_fingerprint(HMAC_KEY, record_id + "x", subject_id, stored, label)
    other_subject = None if subject_id is not None else ""
    assert fp != stored_record_fingerprint(HMAC_KEY, record_id, other_subject, stored, label)
    assert fp != stored_record_fingerprint(HMAC_KEY, record_id, subject_id,
                                           stored + bytes(8), label)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=12),
       st.integers(-5, 5), texts, maybe_text)
def test_a_fingerprint_of_the_json_scheme_still_matches(features: list[float], label: int,
                                                         record_id: str,
                                                         subject_id: str | None) -> None:
    """Records fingerprinted before revision 0007 (over canonical JSON) verify by value."""
    old = legacy_record_fingerprint(HMAC_KEY, record_id, subject_id, features, label)
    stored = np.frombuffer(np.asarray(features, dtype="<f8").tobytes(), dtype="<f8")
    assert fingerprint_matches(HMAC_KEY, record_id, subject_id, stored, label, old)
    assert not fingerprint_matches(HMAC_KEY, record_id, subject_id, stored, label + 1, old)


def _features(ledger: Ledger, record_id: str) -> bytes:
    with ledger.engine.connect() as conn:
        return bytes(conn.execute(text("SELECT features FROM record_payloads "
                                       "WHERE record_id = :r"), {"r": record_id}).scalar())


def test_edited_or_unreadable_features_are_named(seeded: Ledger) -> None:
    stored = _features(seeded, "r005")
    values = np.frombuffer(stored, dtype="<f8").copy()
    values[0] += 1e-9
    tamper(seeded, "UPDATE record_payloads SET features = :f WHERE record_id = 'r005'",
           f=values.tobytes())
    tamper(seeded, "UPDATE record_payloads SET features = :f WHERE record_id = 'r006'",
           f=_features(seeded, "r006")[:-3])
    problems = {p.where: p.message for p in seeded.verify().problems}
    assert "fingerprint" in problems["record r005"]
    assert "not float64 values" in problems["record r006"]

"""`verify`'s fast spellings of what it hashes: every event's chain entry and every record's
fingerprint are the bytes the canonical JSON encoder gives (checked on random content), and a
record whose stored features are spelled otherwise, or are not JSON, is still judged by
its values. See docs/ledger.md#what-ledger-verify-holds."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from ledger.chain import (
    canonical_json,
    event_entry,
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
def test_a_fingerprint_from_the_stored_text_is_the_fingerprint(features: list[float],
                                                              label: int, record_id: str,
                                                              subject_id: str | None) -> None:
    assert stored_record_fingerprint(HMAC_KEY, record_id, subject_id, json.dumps(features),
                                     label) == record_fingerprint(HMAC_KEY, record_id,
                                                                  subject_id, features, label)


def test_stored_text_holding_a_string_is_parsed_not_respelled() -> None:
    # '["0.1, 0.2"]' made '["0.1,0.2"]' would fingerprint another value: never respelled
    assert stored_record_fingerprint(HMAC_KEY, "r", None, '["0.1, 0.2"]', 1) is None


def _features(ledger: Ledger, record_id: str) -> list[float]:
    with ledger.engine.connect() as conn:
        row = conn.execute(text("SELECT features FROM record_payloads WHERE record_id = :r"),
                           {"r": record_id}).scalar()
    return json.loads(row) if isinstance(row, str) else row


def test_features_spelled_otherwise_verify_by_their_values(seeded: Ledger) -> None:
    values = _features(seeded, "r004")
    respelled = "[ " + " ,".join(f"{v:.17e}" for v in values) + " ]"
    assert json.loads(respelled) == values and respelled != json.dumps(values)
    tamper(seeded, "UPDATE record_payloads SET features = :f WHERE record_id = 'r004'",
           f=respelled)
    result = seeded.verify()
    assert result.ok, result.problems


def test_edited_or_unreadable_features_are_named(seeded: Ledger) -> None:
    values = _features(seeded, "r005")
    tamper(seeded, "UPDATE record_payloads SET features = :f WHERE record_id = 'r005'",
           f=json.dumps([values[0] + 1e-9, *values[1:]]))
    unreadable = seeded.engine.dialect.name == "sqlite"  # PostgreSQL refuses bad JSON
    if unreadable:
        tamper(seeded, "UPDATE record_payloads SET features = '[0.1, ' "
                       "WHERE record_id = 'r006'")
    problems = {p.where: p.message for p in seeded.verify().problems}
    assert "fingerprint" in problems["record r005"]
    if unreadable:
        assert "not JSON" in problems["record r006"]

"""How an event is hashed into the chain, and how a record is fingerprinted.

An event's hash covers its position, content and predecessor, so editing,
inserting, deleting or reordering any row breaks the chain from there on. The
Merkle leaf of an event is built from that hash, so an auditor holding one
event, its inclusion proof and a published root can check it alone.
See docs/ledger.md (Tables)."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np

from ledger import merkle

GENESIS_HASH = "0" * 64


# Built once: json.dumps with options would build a new encoder per call (hot path).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)
_TEXT = json.encoder.encode_basestring  # how _CANONICAL spells a string (C-accelerated)


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces, UTF-8, no NaN."""
    return _CANONICAL.encode(obj)


def utc_now() -> datetime:
    return datetime.now(UTC)


def as_utc(ts: datetime) -> datetime:
    """Times are stored in UTC; SQLite hands them back without a zone."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def iso(ts: datetime) -> str:
    """Fixed-width UTC timestamp, so text order is time order."""
    return as_utc(ts).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(ts: str) -> datetime:
    """An event's `created_at` (ISO 8601, UTC, `Z`) as an aware datetime."""
    return as_utc(datetime.fromisoformat(ts))


def event_entry(seq: int, request_id: str | None, kind: str, payload: str,
                model_version: str | None, created_at: str, prev_hash: str) -> bytes:
    """The exact bytes an event's hash is taken over: the canonical JSON of its fields.

    Spelled out key by key (in sorted order) rather than through the encoder, since
    `verify` hashes every event: the same bytes (tests/test_ledger.py holds it), at a
    third of the cost. Anything but text, None and an int seq goes through the encoder."""
    if type(seq) is int:
        try:
            return (f'{{"created_at":{_TEXT(created_at)},"kind":{_TEXT(kind)},'
                    f'"model_version":{_text(model_version)},"payload":{_TEXT(payload)},'
                    f'"prev_hash":{_TEXT(prev_hash)},"request_id":{_text(request_id)},'
                    f'"seq":{seq}}}').encode()
        except TypeError:  # a field that is not text (or None): the encoder spells it
            pass
    return canonical_json({
        "seq": seq, "request_id": request_id, "kind": kind, "payload": payload,
        "model_version": model_version, "created_at": created_at, "prev_hash": prev_hash,
    }).encode()


def _text(value: str | None) -> str:
    """A string or None as canonical JSON spells it (TypeError for anything else)."""
    return "null" if value is None else _TEXT(value)


def event_hash(seq: int, request_id: str | None, kind: str, payload: str,
               model_version: str | None, created_at: str, prev_hash: str) -> str:
    entry = event_entry(seq, request_id, kind, payload, model_version, created_at, prev_hash)
    return hashlib.sha256(entry).hexdigest()


def event_leaf(event_hash_hex: str) -> bytes:
    """RFC 6962 leaf hash of an event (over its chain hash)."""
    return merkle.leaf_hash(bytes.fromhex(event_hash_hex))


# A record's fingerprint message: this prefix, the canonical JSON of its label, id and
# subject (no NUL: JSON escapes control characters), a NUL, then its features as stored:
# little-endian float64 bytes. The prefix keeps it apart from the JSON messages of
# fingerprints taken before revision 0007 (`legacy_record_fingerprint`).
_RECORD_V2 = b"obliviate-record-v2\0"
FEATURES_DTYPE = "<f8"


def feature_bytes(features: Any) -> bytes:
    """A record's features as `record_payloads` stores and fingerprints them."""
    return np.ascontiguousarray(features, dtype=FEATURES_DTYPE).tobytes()


def record_fingerprint(key: bytes, record_id: str, subject_id: str | None,
                       features: Any, label: int) -> str:
    """HMAC of a record's content: proves what was deleted without keeping it."""
    return stored_record_fingerprint(key, record_id, subject_id, feature_bytes(features),
                                     label)


def stored_record_fingerprint(key: bytes, record_id: str, subject_id: str | None,
                              features: bytes, label: int) -> str:
    """`record_fingerprint` over the features as stored (float64 bytes): no per-value
    work, so a load or `verify` of 10^6 records pays one HMAC each."""
    head = (f'{{"label":{label if type(label) is int else canonical_json(label)},'
            f'"record_id":{_TEXT(record_id)},"subject_id":{_text(subject_id)}}}')
    return hmac.digest(key, b"".join((_RECORD_V2, head.encode(), b"\0", features)),
                       "sha256").hex()


def legacy_record_fingerprint(key: bytes, record_id: str, subject_id: str | None,
                              features: list[float], label: int) -> str:
    """The fingerprint of a record taken before revision 0007: HMAC of the canonical JSON
    of its content (`verify` accepts it for those records)."""
    msg = canonical_json({"record_id": record_id, "subject_id": subject_id,
                          "features": features, "label": label}).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def fingerprint_matches(key: bytes, record_id: str, subject_id: str | None,
                        features: Any, label: int, fingerprint: str) -> bool:
    """The record's content is what `fingerprint` was taken over, by either scheme."""
    if record_fingerprint(key, record_id, subject_id, features, label) == fingerprint:
        return True
    values = np.asarray(features, dtype=np.float64).tolist()
    return legacy_record_fingerprint(key, record_id, subject_id, values, label) == fingerprint

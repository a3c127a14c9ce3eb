"""Structural validation: every bad message gets a reason, nothing else escapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.models import DatasetSchema
from ledger.validation import InvalidRequest, parse_request

SCHEMA = DatasetSchema(name="toy", n_features=3, classes=[0, 1])


def parse(doc) -> object:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_request(raw, SCHEMA)


def test_valid_delete_and_add() -> None:
    d = parse({"request_id": "a", "op": "delete", "record_ids": ["r1", 7],
               "requested_at": "2026-01-02T03:04:05+00:00"})
    assert d.record_ids == ("r1", "7") and d.op == "delete"
    a = parse({"request_id": "b", "op": "add", "subject_id": "u1",
               "payload": {"records": [{"record_id": "n1", "features": [0, 0.5, 1],
                                        "label": 1}]}})
    assert a.records[0].features == [0.0, 0.5, 1.0] and a.record_ids == ("n1",)


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{nope", "malformed JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]", "must be a JSON object, got a list"),
    (b"x" * 2_000_000, "exceeds the limit"),
    ({"op": "delete", "record_ids": ["r"]}, "missing field 'request_id'"),
    ({"request_id": "a", "record_ids": ["r"]}, "missing field 'op'"),
    ({"request_id": "a", "op": "forget", "record_ids": ["r"]}, "unknown op 'forget'"),
    ({"request_id": "a", "op": "delete"}, "needs 'subject_id' or 'record_ids'"),
    ({"request_id": "a", "op": "delete", "record_ids": []}, "non-empty list"),
    ({"request_id": "a", "op": "delete", "record_ids": ["r", "r"]}, "names a record twice"),
    ({"request_id": "a", "op": "delete", "subject": "u"}, "unknown field(s): 'subject'"),
    ({"request_id": "", "op": "delete", "record_ids": ["r"]}, "'request_id' must be 1-128"),
    ({"request_id": True, "op": "delete", "record_ids": ["r"]}, "must be a string"),
    ({"request_id": "a", "op": "delete", "record_ids": ["r"], "requested_at": "yesterday"},
     "is not an ISO 8601 time"),
    ({"request_id": "a", "op": "add", "subject_id": "u"}, "missing field 'payload'"),
    ({"request_id": "a", "op": "add", "payload": {"records": []}}, "needs the 'subject_id'"),
    ({"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [
        {"record_id": "n", "features": [0, 1], "label": 0}]}}, "list of 3 numbers"),
    ({"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [
        {"record_id": "n", "features": [0, "x", 1], "label": 0}]}}, "features[1] must be"),
    ({"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [
        {"record_id": "n", "features": [0, 1, 1], "label": 5}]}}, "label 5 is not one"),
    ({"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [
        {"record_id": "n", "features": [0, 1, 1]}]}}, "missing 'label'"),
])
def test_reasons(raw, reason: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(raw)
    assert reason in info.value.reason


def test_nan_features_are_refused() -> None:
    raw = (b'{"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": '
           b'[{"record_id": "n", "features": [0, NaN, 1], "label": 0}]}}')
    with pytest.raises(InvalidRequest, match=r"features\[1\] must be a finite number"):
        parse_request(raw, SCHEMA)


def test_add_without_schema_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="no feature schema"):
        parse_request({"request_id": "a", "op": "add", "subject_id": "u",
                       "payload": {"records": []}}, None)


def test_request_id_is_kept_on_rejection_when_readable() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"request_id": "abc", "op": "nope"})
    assert info.value.request_id == "abc"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["request_id", "op", "subject_id", "record_ids", "payload",
                         "requested_at", "records", "features", "label", "record_id", "x"]),
        inner, max_size=6),
    max_leaves=20)


@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzzed_input_is_accepted_or_rejected_with_a_reason(raw: bytes) -> None:
    try:
        parse_request(raw, SCHEMA)
    except InvalidRequest as exc:
        assert exc.reason

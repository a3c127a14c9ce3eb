"""Structural validation: every bad message gets a reason, nothing else escapes.

Intake refuses what no learner can take (issue 26): a raw feature more than
FAR_OUTSIDE times its range outside it (1e40 is not even a float32), a pre-scaled
one outside [0, 1], a key twice in one object (the last would win), and ids that are
not strings (7 and "7" would name one record).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.models import DatasetSchema
from ledger.transform import InputTransform
from ledger.validation import FAR_OUTSIDE, InvalidRequest, parse_request, storable_id

SCHEMA = DatasetSchema(name="toy", n_features=3, classes=[0, 1])
# a fitted transform: "age" 20..70, "income" 0..1e5, "flag" constant 3 (span 1)
FITTED = DatasetSchema(name="people", n_features=3, classes=[0, 1], transform=InputTransform(
    ("age", "income", "flag"), (20.0, 0.0, 3.0), (70.0, 1e5, 3.0)).to_json())


def parse(doc) -> object:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_request(raw, SCHEMA)


def test_valid_delete_and_add() -> None:
    d = parse({"request_id": "a", "op": "delete", "record_ids": ["r1", "7"],
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
    # an integer id is refused, not coerced: 7 and "7" would name the same record
    ({"request_id": 7, "op": "delete", "record_ids": ["r"]},
     "'request_id' must be a string, got a number"),
    ({"request_id": "a", "op": "delete", "subject_id": 42},
     "'subject_id' must be a string, got a number"),
    ({"request_id": "a", "op": "delete", "record_ids": ["r1", 7]},
     "'record_ids[1]' must be a string, got a number"),
    ({"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [
        {"record_id": 5, "features": [0, 1, 1], "label": 0}]}},
     "'payload.records[0].record_id' must be a string, got a number"),
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


def _add(features: list, scaled: bool | None = None) -> dict:
    payload: dict = {"records": [{"record_id": "n", "features": features, "label": 0}]}
    if scaled is not None:
        payload["scaled"] = scaled
    return {"request_id": "a", "op": "add", "subject_id": "u", "payload": payload}


@pytest.mark.parametrize(("raw", "reason"), [
    # the red team's keys: the last "op" won, and an addition became a deletion
    (b'{"request_id": "a", "op": "add", "op": "delete", "record_ids": ["r1"]}',
     "key 'op' appears twice in one object"),
    (b'{"request_id": "a", "request_id": "b", "op": "delete", "record_ids": ["r1"]}',
     "key 'request_id' appears twice"),
    (b'{"request_id": "a", "op": "add", "subject_id": "u", "payload": {"records": [{"record_id":'
     b' "n", "features": [0, 0, 0], "label": 0, "label": 1}]}}', "key 'label' appears twice"),
    (b'{"request_id": "a", "op": "add", "subject_id": "u", "payload": {"scaled": false, '
     b'"scaled": true, "records": []}}', "key 'scaled' appears twice"),
])
def test_a_key_twice_in_any_object_is_refused(raw: bytes, reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        parse_request(raw, SCHEMA)


@pytest.mark.parametrize("features", [[1e40, 0.5, 0.5], [0.5, 1e300, 0.5], [0.5, 0.5, -1e6]])
def test_a_raw_feature_far_outside_its_range_is_refused(features: list) -> None:
    """Over float32's range (1e40) or FAR_OUTSIDE times the range: SISA, game and mlp
    refused such an addition in the worker and stopped every deletion behind it."""
    with pytest.raises(InvalidRequest) as info:
        parse(_add(features))
    j = next(i for i, v in enumerate(features) if v != 0.5)
    assert f"payload.records[0].features[{j}] ('x{j}')" in info.value.reason
    assert "more than 1,000 times the feature's range outside it" in info.value.reason
    assert "raw values from -1000 to 1001 are accepted" in info.value.reason


def test_the_bound_names_the_feature_and_its_raw_range() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(_add([30, 1e40, 3]), FITTED)
    assert info.value.reason == (
        "payload.records[0].features[1] ('income') is 1e+40: more than 1,000 times the "
        "feature's range outside it; raw values from -1e+08 to 1.001e+08 are accepted (its "
        "range is 0 to 100000)")
    with pytest.raises(InvalidRequest, match=r"features\[2\] \('flag'\) is -998: .* from "
                       r"-997 to 1004 are accepted \(its range is 3 to 3\)"):
        parse_request(_add([30, 5e4, -998]), FITTED)
    # at the bound itself, and far but within it: accepted, and scaled
    edge = parse_request(_add([20 - FAR_OUTSIDE * 50, 1.001e8, 3 + 1001]), FITTED)
    assert edge.records[0].features == [-1000.0, 1001.0, 1001.0]
    assert parse_request(_add([25, 1e5, 3]), FITTED).records[0].features == [0.1, 1.0, 0.0]


@pytest.mark.parametrize("value", [1.5, -0.001, 1e300, -1e40, 2])
def test_a_pre_scaled_feature_outside_the_unit_interval_is_refused(value: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(_add([0.5, value, 0.5], scaled=True), FITTED)
    assert info.value.reason.startswith(f"payload.records[0].features[1] is {value!r}, "
                                        "outside [0, 1]: with \"scaled\": true")
    ok = parse_request(_add([0, 0.25, 1], scaled=True), FITTED)
    assert ok.records[0].features == [0.0, 0.25, 1.0]


def test_ids_the_database_cannot_store_are_told_apart() -> None:
    assert storable_id("r001") and storable_id(" a b ") and storable_id("x" * 128)
    assert not any(storable_id(t) for t in ("", "x" * 129, "a\x00b", "\ud800"))


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


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzzed_input_is_accepted_or_rejected_with_a_reason(raw: bytes) -> None:
    try:
        parse_request(raw, SCHEMA)
    except InvalidRequest as exc:
        assert exc.reason

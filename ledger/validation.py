"""Structural validation of a request message, shared by Kafka, HTTP and the CLI.

Everything that can be decided from the message alone is decided here, before the
database sees it, with a reason a producer can act on (checks that need the database
happen in the transaction that records the request). An addition is refused unless every
learner can take it: a worker that could not apply an accepted addition would stop every
deletion behind it. See docs/ledger.md (Limits and rejections)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ledger.models import DatasetSchema, Event, RecordPayload, Request, TrainingRecord
from ledger.raw_rows import RowError, encode_row, label_code
from ledger.transform import InputTransform


def _length(model: type, column: str) -> int:
    return model.__table__.c[column].type.length  # type: ignore[attr-defined]


MAX_MESSAGE_BYTES = 1_048_576
MAX_RECORDS_PER_REQUEST = 10_000
# Every column a request's own identifiers are stored in: an id that passes fits them all.
ID_COLUMNS = ((Request, "request_id"), (Request, "subject_id"), (Event, "request_id"),
              (TrainingRecord, "record_id"), (TrainingRecord, "subject_id"),
              (TrainingRecord, "added_by"), (RecordPayload, "record_id"))
MAX_ID_LENGTH = min(_length(m, c) for m, c in ID_COLUMNS)  # 128
MAX_TIMESTAMP_LENGTH = _length(Request, "requested_at")  # 64
# An integer literal longer than this is refused while parsing (int() is never asked to
# convert more): no field takes one that long, and every shorter one is a finite float.
MAX_INT_DIGITS = MAX_ID_LENGTH
# How far outside its range a raw feature of an addition may lie, in multiples of the
# range: (x - min) / (max - min) in [-FAR_OUTSIDE, 1 + FAR_OUTSIDE]. Beyond that it is
# an error of units, not data (and 1e40 is not even a float32).
FAR_OUTSIDE = 1000
MAX_REASON_CHARS = 1000  # a reason goes to the ledger and to a dead letter's header
OPS = ("delete", "add")
_FIELDS = {"request_id", "op", "subject_id", "record_ids", "payload", "requested_at"}


class InvalidRequest(ValueError):
    """The message cannot be accepted; `reason` says why in words a producer can act on."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS - 1] + "\u2026"
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


@dataclass(frozen=True)
class NewRecord:
    record_id: str
    features: list[float]
    label: int


@dataclass(frozen=True)
class RequestMessage:
    """A structurally valid request, not yet checked against the ledger."""

    request_id: str
    op: str
    subject_id: str | None
    record_ids: tuple[str, ...] | None
    records: tuple[NewRecord, ...]
    requested_at: str | None


def parse_request(raw: bytes | str | dict[str, Any], schema: DatasetSchema | None,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> RequestMessage:
    """Parse and validate one request; raise `InvalidRequest` with the reason."""
    if raw is None:
        raise InvalidRequest("the message has no value (null); send one request as JSON")
    if isinstance(raw, dict):
        doc: Any = raw
    else:
        if isinstance(raw, str):
            try:
                raw = raw.encode()
            except UnicodeEncodeError:
                raise InvalidRequest("message is not UTF-8 text") from None
        elif isinstance(raw, bytearray | memoryview):
            raw = bytes(raw)
        elif not isinstance(raw, bytes):
            raise InvalidRequest(f"message must be JSON text, got {type(raw).__name__}")
        if len(raw) > max_bytes:
            raise InvalidRequest(f"message of {len(raw)} bytes exceeds the limit of {max_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("message is not UTF-8 text") from None
        try:
            doc = json.loads(text, parse_int=_parse_int, object_pairs_hook=_object)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"malformed JSON: {exc.msg} at position {exc.pos}") from None
        except RecursionError:
            raise InvalidRequest("malformed JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"message must be a JSON object, got {_kind(doc)}")
    if "request_id" not in doc:
        raise InvalidRequest("missing field 'request_id'")
    request_id = _identifier(doc["request_id"], "request_id")
    try:
        return _parse_fields(doc, request_id, schema)
    except InvalidRequest as exc:
        exc.request_id = request_id
        raise


def _parse_fields(doc: dict[str, Any], request_id: str,
                  schema: DatasetSchema | None) -> RequestMessage:
    unknown = sorted(set(doc) - _FIELDS, key=show_value)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(map(show_value, unknown))}")
    if "op" not in doc:
        raise InvalidRequest("missing field 'op'")
    op = doc["op"]
    if type(op) is not str or op not in OPS:
        raise InvalidRequest(f"unknown op {show_value(op)}: expected 'delete' or 'add'")
    subject_id = doc.get("subject_id")
    if subject_id is not None:
        subject_id = _identifier(subject_id, "subject_id")
    requested_at = doc.get("requested_at")
    if requested_at is not None:
        requested_at = _timestamp(requested_at)
    if op == "delete":
        if "payload" in doc:
            raise InvalidRequest("a 'delete' takes no 'payload'")
        record_ids = doc.get("record_ids")
        if record_ids is None and subject_id is None:
            raise InvalidRequest("a 'delete' needs 'subject_id' or 'record_ids'")
        ids = None if record_ids is None else _id_list(record_ids, "record_ids")
        return RequestMessage(request_id, op, subject_id, ids, (), requested_at)
    if "record_ids" in doc:
        raise InvalidRequest("an 'add' names its records inside 'payload', not in 'record_ids'")
    if subject_id is None:
        raise InvalidRequest("an 'add' needs the 'subject_id' that owns the data")
    if schema is None:
        raise InvalidRequest("no feature schema is set: load a data set before adding records")
    records = _records(doc.get("payload"), schema)
    return RequestMessage(request_id, op, subject_id, tuple(r.record_id for r in records),
                          records, requested_at)


def _records(payload: Any, schema: DatasetSchema) -> tuple[NewRecord, ...]:
    if payload is None:
        raise InvalidRequest("missing field 'payload' for an 'add'")
    if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
        raise InvalidRequest("'payload' must be an object with a list 'records'")
    extra = sorted(set(payload) - {"records", "scaled"}, key=show_value)
    if extra:
        raise InvalidRequest(f"'payload' has unknown field(s): {', '.join(map(show_value, extra))}")
    scaled = payload.get("scaled", False)
    if not isinstance(scaled, bool):
        raise InvalidRequest(f"'payload.scaled' must be true or false, got {show_value(scaled)}")
    # raw features (the default) go through the transform stored at `ledger init`
    transform = None if scaled else schema.input_transform
    items = payload["records"]
    if not items:
        raise InvalidRequest("'payload.records' is empty")
    if len(items) > MAX_RECORDS_PER_REQUEST:
        raise InvalidRequest(f"'payload.records' has {len(items)} records; the limit is "
                             f"{MAX_RECORDS_PER_REQUEST}")
    out = []
    for i, item in enumerate(items):
        where = f"payload.records[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object")
        extra = sorted(set(item) - {"record_id", "features", "label"}, key=show_value)
        if extra:
            raise InvalidRequest(f"{where} has unknown field(s): "
                                 f"{', '.join(map(show_value, extra))}")
        for name in ("record_id", "features", "label"):
            if name not in item:
                raise InvalidRequest(f"{where} is missing '{name}'")
        rid = _identifier(item["record_id"], f"{where}.record_id")
        feats = item["features"]
        if transform is not None and (isinstance(feats, dict) or transform.columns):
            values = _encoded(feats, where, transform)  # a table with text, or an object
        else:
            if not isinstance(feats, list) or len(feats) != schema.n_features:
                got = len(feats) if isinstance(feats, list) else _kind(feats)
                raise InvalidRequest(f"{where}.features must be a list of {schema.n_features} "
                                     f"numbers (schema {schema.name!r}), got {got}")
            values = _features(feats, where, transform)
        label = label_code(schema.input_transform, schema.classes, item["label"])
        if label is None:
            names = schema.input_transform.labels
            raise InvalidRequest(f"{where}.label {show_value(item['label'])} is not one of the "
                                 f"schema's classes {schema.classes}"
                                 + (f" or label names {list(names)}" if names else ""))
        out.append(NewRecord(rid, values, label))
    ids = [r.record_id for r in out]
    if len(set(ids)) != len(ids):
        raise InvalidRequest("'payload.records' names a record_id twice")
    return tuple(out)


def _features(feats: list[Any], where: str, transform: InputTransform | None
              ) -> list[float]:
    """An addition's features in the model's input space, or the reason one cannot be
    there: not a finite number, pre-scaled (`transform` None) outside [0, 1], or raw
    further than FAR_OUTSIDE times its range outside it."""
    values = []
    for j, v in enumerate(feats):
        try:  # an int too large for a float (only a dict can hold one) is not finite
            f = math.inf if isinstance(v, bool) or not isinstance(v, int | float) \
                else float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise InvalidRequest(f"{where}.features[{j}] must be a finite number, "
                                 f"got {show_value(v)}")
        values.append(f)
    if transform is None:
        bad = next((j for j, f in enumerate(values) if not 0.0 <= f <= 1.0), None)
        if bad is not None:
            raise InvalidRequest(f"{where}.features[{bad}] is {show_value(feats[bad])}, outside "
                                 "[0, 1]: with \"scaled\": true features must be in the "
                                 "model's input space (send raw values without it)")
        return values
    return _within_reach(values, feats, where, transform)


def _encoded(feats: Any, where: str, transform: InputTransform) -> list[float]:
    """A raw row of a table with text columns, or an object keyed by column name, in
    the model's input space (:mod:`ledger.raw_rows` encodes it)."""
    try:
        values = encode_row(transform, feats, f"{where}.features")
    except RowError as exc:
        raise InvalidRequest(str(exc)) from None
    return _within_reach(values, values, where, transform)


def _within_reach(values: list[float], feats: list[Any], where: str,
                  transform: InputTransform) -> list[float]:
    """The encoded `values` scaled, unless one lies further than FAR_OUTSIDE times its
    range outside it (`feats`: what was sent, for the reason)."""
    scaled = transform.scale_row(values)
    bad = next((j for j, z in enumerate(scaled)
                if not -FAR_OUTSIDE <= z <= 1 + FAR_OUTSIDE), None)
    if bad is not None:
        lo, span = transform.mins[bad], transform.spans[bad]
        raise InvalidRequest(
            f"{where}.features[{bad}] ({show_value(transform.names[bad])}) is "
            f"{show_value(feats[bad])}: more than {FAR_OUTSIDE:,} times the feature's range "
            f"outside it; raw values from {lo - FAR_OUTSIDE * span:g} to "
            f"{lo + (1 + FAR_OUTSIDE) * span:g} are accepted (its range is {lo:g} to "
            f"{transform.maxs[bad]:g})")
    return scaled


def _identifier(value: Any, name: str, index: int | None = None) -> str:
    # Hot path: one call per id in every message, so the error text is built only on error.
    if type(value) is not str:  # an integer too: 7 and "7" must not name one record
        raise InvalidRequest(f"'{_at(name, index)}' must be a string, got {_kind(value)}")
    if not value or len(value) > MAX_ID_LENGTH or not value.isprintable() \
            or value != value.strip():
        raise InvalidRequest(f"'{_at(name, index)}' must be 1-{MAX_ID_LENGTH} printable "
                             "characters without surrounding spaces")
    return value


def storable_id(text: str) -> bool:
    """Whether every id column can hold `text` (1-128 characters, no NUL, UTF-8): an id
    in a path or query that fails is in no row, and must not reach the database, which
    refuses it with an error (PostgreSQL: NUL) instead of finding nothing."""
    if not 0 < len(text) <= MAX_ID_LENGTH or "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _at(name: str, index: int | None) -> str:
    return name if index is None else f"{name}[{index}]"


def _id_list(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"'{name}' must be a non-empty list")
    if len(value) > MAX_RECORDS_PER_REQUEST:
        raise InvalidRequest(f"'{name}' has {len(value)} entries; the limit is "
                             f"{MAX_RECORDS_PER_REQUEST}")
    ids = tuple([_identifier(v, name, i) for i, v in enumerate(value)])
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"'{name}' names a record twice")
    return ids


def _timestamp(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"'requested_at' must be an ISO 8601 string, got {_kind(value)}")
    if len(value) > MAX_TIMESTAMP_LENGTH:
        raise InvalidRequest(f"'requested_at' has {len(value)} characters; the limit is "
                             f"{MAX_TIMESTAMP_LENGTH}")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"'requested_at' {value[:40]!r} is not an ISO 8601 time") from None
    return value


_MAX_ID_BITS = int(MAX_ID_LENGTH * math.log2(10))  # every int of this many bits has <= 128 digits


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: a key twice in one object is refused, at any depth (the
    last would win: `"op": "add", "op": "delete"` would be a deletion)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidRequest(f"key {show_value(key)} appears twice in one object; each "
                                     "key may appear once")
            seen.add(key)
    return doc


def _parse_int(digits: str) -> int:
    """json.loads' integer hook: refuses a literal longer than any field can use before
    int() is asked to convert it (Python refuses beyond 4,300 digits, float() beyond 309)."""
    if len(digits) > MAX_INT_DIGITS + 1:
        raise InvalidRequest(f"an integer of {len(digits.lstrip('-'))} digits; at most "
                             f"{MAX_INT_DIGITS} digits are accepted")
    return int(digits)


def show_value(value: Any, limit: int = 40) -> str:
    """A short, safe repr of a value a client sent (a message, a path, a query), for a
    reason."""
    if type(value) is int and value.bit_length() > _MAX_ID_BITS:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, str | int | float | bool | type(None)):
        text = repr(value)
        return text if len(text) <= limit else text[:limit] + "\u2026"
    return _kind(value)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")

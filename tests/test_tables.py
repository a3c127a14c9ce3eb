"""Tables as users export them (issue 28, docs/tables.md): text categories, a text label,
missing values as '?', ids, from CSV and Parquet; one encoding, stored, applied to every
query and addition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ledger.census import CATEGORY_NAMES, census_export
from ledger.columns import OTHER
from ledger.datasets import CsvError, TableOptions, load_csv, load_parquet
from ledger.raw_rows import RowError, encode_row
from ledger.store import Ledger
from ledger.transform import InputTransform
from ledger.validation import InvalidRequest, parse_request
from service.demo.residue import TraceScanner
from tests.exported_tables import write_csv, write_parquet

OPTIONS = TableOptions(na="?", impute="median")
FEATURES = ("age", "workclass", "fnlwgt", "education", "education_num", "marital",
            "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
            "hours_per_week", "native_country")


@pytest.fixture(scope="module")
def export() -> dict[str, list]:
    return census_export(400, seed=3, numeric_missing=0.02)


@pytest.fixture(scope="module")
def files(export, tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tables")
    return write_csv(d / "adult.csv", export), write_parquet(d / "adult.parquet", export)


def raw_row(export: dict[str, list], i: int) -> dict:
    return {name: (None if export[name][i] == "?" else export[name][i]) for name in FEATURES}


def test_kinds_are_inferred_and_rare_categories_are_not_stored(files, export) -> None:
    ds = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    t = ds.transform
    kinds = {c.name: c.kind for c in t.columns}
    assert {n for n, k in kinds.items() if k == "categorical"} == set(CATEGORY_NAMES)
    assert {n for n, k in kinds.items() if k == "numeric"} == set(FEATURES) - set(
        CATEGORY_NAMES)
    assert t.labels == ("<=50K", ">50K")
    assert ds.y.tolist() == [t.labels.index(v) for v in export["income"]]
    assert ds.record_ids == export["record_id"] and ds.subject_ids == export["person"]
    countries = next(c for c in t.columns if c.name == "native_country")
    counts = {v: export["native_country"].count(v) for v in set(export["native_country"])}
    # every stored category was seen at least 5 times; the rarer ones are only 'other'
    assert set(countries.categories) == {v for v, n in counts.items() if n >= 5}
    assert "?" in countries.categories and countries.missing == "?"
    rare = [v for v, n in counts.items() if n < 5]
    stored = {c for col in t.columns for c in col.categories} | {
        n.split("=", 1)[-1] for n in t.names}
    assert rare and stored.isdisjoint(rare)
    other = t.names.index(f"native_country={OTHER}")
    rows = [i for i, v in enumerate(export["native_country"]) if v in rare]
    assert ds.X[rows, other].tolist() == [1.0] * len(rows)
    assert ds.X.shape == (400, t.n_features) and ds.X.min() >= 0 and ds.X.max() <= 1


def test_csv_and_parquet_give_the_same_records_and_schema(files) -> None:
    a = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    b = load_parquet(files[1], "income", "person", "record_id", options=OPTIONS)
    assert a.transform.to_json() == b.transform.to_json()
    assert a.X.tobytes() == b.X.tobytes() and a.y.tolist() == b.y.tolist()


def test_a_csv_read_in_chunks_is_the_table_read_at_once(files, tmp_path, monkeypatch
                                                       ) -> None:
    """The CSV is coded a chunk of rows at a time; chunks change nothing, not even the line
    an error names, and cells padded with spaces are the same category."""
    import ledger.datasets as datasets

    whole = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    monkeypatch.setattr(datasets, "_CSV_CHUNK", 7)
    chunked = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    assert chunked.transform.to_json() == whole.transform.to_json()
    assert chunked.X.tobytes() == whole.X.tobytes() and chunked.y.tolist() == whole.y.tolist()
    assert chunked.record_ids == whole.record_ids and chunked.subject_ids == whole.subject_ids
    padded = tmp_path / "padded.csv"
    padded.write_text("c,x,y\n" + "".join(f"{' a' if i % 3 else 'a '},{i},0\n" for i in range(20))
                      + "b,5,1\nb,6,1\nb,7,1\nb,8,1\nb,oops,1\n")
    with pytest.raises(CsvError, match="line 26, column 'x': 'oops' is not a number"):
        load_csv(padded, "y", options=TableOptions(numeric=("x",)))
    padded.write_text(padded.read_text().replace("oops", "9"))
    ds = load_csv(padded, "y")
    assert ds.transform.columns[0].categories == ("a", "b") and ds.X[:20, 0].tolist() == [1.0] * 20


def test_a_missing_number_is_refused_or_imputed_with_a_value_no_record_holds(files, export
                                                                             ) -> None:
    with pytest.raises(CsvError, match=r"line \d+, column 'hours_per_week': '\?' "
                                       r"\(missing\).*--impute median"):
        load_csv(files[0], "income", "person", "record_id", options=TableOptions(na="?"))
    with pytest.raises(CsvError, match=r"row \d+, column 'hours_per_week': missing \(null\)"):
        load_parquet(files[1], "income", "person", "record_id", options=TableOptions(na="?"))
    ds = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    hours = next(c for c in ds.transform.columns if c.name == "hours_per_week")
    held = {v for v in export["hours_per_week"] if v != "?"}
    assert hours.impute is not None and hours.impute not in held
    assert abs(hours.impute - float(np.median(sorted(held, key=float)))) < 1.0
    gaps = [i for i, v in enumerate(export["hours_per_week"]) if v == "?"]
    j = ds.transform.names.index("hours_per_week")
    assert gaps and set(ds.raw[gaps, j].tolist()) == {hours.impute}


def test_declared_kinds_and_hints_point_at_the_right_fix(tmp_path, export) -> None:
    path = write_csv(tmp_path / "t.csv", export)
    with pytest.raises(CsvError, match="column 'record_id': 'a000' looks like an id.*"
                                       "pass --id-column record_id"):
        load_csv(path, "income", "person", options=OPTIONS)
    with pytest.raises(CsvError, match="column 'sex': 'Male' is not a number"):
        load_csv(path, "income", "person", "record_id",
                 options=TableOptions(na="?", impute="mean", numeric=("sex",)))
    ds = load_csv(path, "income", "person", "record_id",
                  options=TableOptions(na="?", impute="mean", categorical=("education_num",)))
    edu = next(c for c in ds.transform.columns if c.name == "education_num")
    assert edu.kind == "categorical" and "13" in edu.categories
    flags = tmp_path / "flags.csv"
    flags.write_text("smoker,age,y\nyes,30,a\nno,40,b\nYES,50,a\n")
    ds = load_csv(flags, "y")
    assert [c.kind for c in ds.transform.columns] == ["boolean", "numeric"]
    assert ds.X[:, 0].tolist() == [1.0, 0.0, 1.0] and ds.transform.labels == ("a", "b")


def test_plain_numeric_tables_store_the_document_they_always_did(tmp_path) -> None:
    path = tmp_path / "plain.csv"
    path.write_text("age,income,label\n30,1000.5,0\n40,2000,1\n55,1500,1\n")
    ds = load_csv(path, "label")
    raw = np.array([[30, 1000.5], [40, 2000], [55, 1500]], dtype=np.float64)
    old = InputTransform.fit(raw, ["age", "income"])
    assert ds.transform.to_json() == old.to_json()
    assert set(old.to_json()) == {"kind", "features"}
    assert ds.X.tobytes() == old.scale(raw).tobytes() and ds.y.tolist() == [0, 1, 1]
    back = InputTransform.from_json(old.to_json(), 2)
    assert [c.kind for c in back.raw_columns] == ["numeric", "numeric"] and not back.labels


def test_object_rows_and_arrays_encode_alike_and_errors_name_row_and_column(files, export
                                                                             ) -> None:
    ds = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    t = ds.transform
    for i in range(40):
        row = raw_row(export, i)
        as_object = t.scale_row(encode_row(t, row, "row 0"))
        as_array = t.scale_row(encode_row(t, [export[n][i] for n in FEATURES], "row 0"))
        assert as_object == as_array == ds.X[i].tolist()  # bit for bit what init stored
    row = raw_row(export, 0)
    unseen = t.scale_row(encode_row(t, {**row, "workclass": "Astronaut"}, "row 0"))
    assert unseen[t.names.index(f"workclass={OTHER}")] == 1.0
    for bad, message in [
        ({**row, "shoe_size": 44}, "row 0: unknown column 'shoe_size'"),
        ({k: v for k, v in row.items() if k != "age"}, "row 0: missing column 'age'"),
        ({**row, "age": "x"}, "row 0, column 'age': 'x' is not a number"),
        ({**row, "sex": 1.5}, "row 0, column 'sex': 1.5 is not a category"),
        ([1, 2], "row 0 has 2 values; the table has 14 columns"),
    ]:
        with pytest.raises(RowError) as exc:
            encode_row(t, bad, "row 0")
        assert message in str(exc.value)


def add(record: dict, label: object, rid: str = "n1") -> dict:
    return {"request_id": f"add-{rid}", "op": "add", "subject_id": "p-new",
            "payload": {"records": [{"record_id": rid, "features": record, "label": label}]}}


def test_an_addition_takes_raw_values_and_a_label_name(ledger: Ledger, files, export) -> None:
    ds = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, ds.name, ds.transform)
    schema = ledger.records.schema()
    msg = parse_request(add(raw_row(export, 5), ">50K"), schema)
    assert msg.records[0].features == ds.X[5].tolist() and msg.records[0].label == 1
    with pytest.raises(InvalidRequest, match=r"label '>70K' is not one of the schema's "
                                             r"classes \[0, 1\] or label names"):
        parse_request(add(raw_row(export, 5), ">70K"), schema)
    with pytest.raises(InvalidRequest, match="payload.records.0..features, column 'age': "
                                             "'old' is not a number"):
        parse_request(add({**raw_row(export, 5), "age": "old"}, 0), schema)
    new = {**raw_row(export, 7), "native_country": "Atlantis", "workclass": "State-gov"}
    assert ledger.receive(add(new, "<=50K", "n2")).status == "accepted"
    X, y = ledger.records.data(["n2"])
    t = ds.transform
    assert X[0, t.names.index(f"native_country={OTHER}")] == 1.0
    assert X[0, t.names.index("workclass=State-gov")] == 1.0 and y.tolist() == [0]
    assert ledger.verify().ok


def test_the_service_answers_object_rows(files, export) -> None:
    from service.service import parse_instances

    ds = load_csv(files[0], "income", "person", "record_id", options=OPTIONS)
    t = ds.transform
    rows = [raw_row(export, i) for i in range(5)]
    Z = parse_instances(rows, t.n_features, t, scaled=False)
    assert Z.tobytes() == np.clip(ds.X[:5], 0, 1).tobytes()
    one = parse_instances([export[n][0] for n in FEATURES], t.n_features, t, scaled=False)
    assert one.tolist() == [ds.X[0].tolist()]
    from bentoml.exceptions import InvalidArgument
    with pytest.raises(InvalidArgument, match="row 1, column 'race': 7.5 is not a category"):
        parse_instances([rows[0], {**rows[1], "race": 7.5}], t.n_features, t, scaled=False)


def test_the_residue_scan_finds_raw_values_no_kept_record_holds(export) -> None:
    gone = [export[n][0] for n in FEATURES]
    kept = [[export[n][i] for n in FEATURES] for i in range(1, 50)]
    rare = {**dict(zip(FEATURES, gone, strict=True)), "native_country": "Outer-Mongolia",
            "fnlwgt": 987654}
    scanner = TraceScanner({"a0": np.zeros(3)}, raw={"a0": list(rare.values())},
                           kept_raw=kept, ids=False)
    assert ("a0", "raw[13] text") in scanner.scan_bytes(b'{"c": "Outer-Mongolia"}')
    assert ("a0", "raw[2] text") in scanner.scan_bytes(b"x,987654,y")
    assert scanner.scan_bytes(b"x,9876543,y Outer-Mongoliax United-States") == set()
    numbers = np.array([v for v in rare.values() if isinstance(v, int)], np.float64)
    assert ("a0", "raw row float64") in scanner.scan_bytes(numbers.tobytes())

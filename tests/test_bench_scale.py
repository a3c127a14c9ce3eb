"""tests/bench/bench_scale.py's table at 10^3 rows: the character issue 29 asks for (ties,
categories, skew, label noise), written fast and read by `ledger init`'s own loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from sklearn.tree import DecisionTreeClassifier

from ledger.census import CATEGORY_NAMES, MISSING, census_columns, census_export, census_like
from ledger.datasets import TableOptions, load_csv
from tests.exported_tables import write_arrays_csv, write_csv

ROOT = Path(__file__).resolve().parents[1]


def test_the_generated_table_has_ties_categories_skew_and_label_noise() -> None:
    X, y = census_like(1000, seed=0)
    distinct = [len(np.unique(c)) for c in X.T]
    assert max(distinct) < 1000 and sum(d <= 16 for d in distinct) >= 7  # ties, categories
    gain = X[:, 10]
    assert (gain == 0).mean() > 0.85 and gain.max() > 5 * np.median(gain[gain > 0])  # skew
    assert 0.7 < 1 - y.mean() < 0.82  # skewed labels
    tree = DecisionTreeClassifier(max_depth=4, random_state=0).fit(X[:700], y[:700])
    held_out = tree.score(X[700:], y[700:])
    assert 0.76 < held_out < 0.95  # a signal, and noise no tree removes
    np.testing.assert_array_equal(X, census_like(1000, seed=0)[0])  # seeded


def test_the_fast_csv_is_the_export_and_loads_as_ledger_init_reads_it(tmp_path: Path) -> None:
    columns = census_columns(1000, seed=4, numeric_missing=0.02)
    assert set(columns["workclass"]) <= {*CATEGORY_NAMES["workclass"], MISSING}
    assert (columns["native_country"] == MISSING).any()
    fast = write_arrays_csv(tmp_path / "fast.csv", columns)
    slow = write_csv(tmp_path / "slow.csv", census_export(1000, seed=4, numeric_missing=0.02))
    assert fast.read_text() == slow.read_text().replace("\r\n", "\n")
    ds = load_csv(fast, "income", "person", "record_id", options=TableOptions(
        na=MISSING, impute="median"))
    assert len(ds.y) == 1000 and ds.X.shape[1] > 14  # categories one-hot
    assert ds.record_ids[0] == "a000" and ds.subject_ids[1] == "p000"


def test_bench_scale_imports_and_names_its_stages() -> None:
    out = subprocess.run([sys.executable, "tests/bench/bench_scale.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "--stages" in out and "--sizes" in out
    bad = subprocess.run([sys.executable, "tests/bench/bench_scale.py", "--stages", "nope"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--stages nope: choose from init" in bad.stderr

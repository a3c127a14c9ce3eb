"""A generated census-style table: what real tables look like, with nothing downloaded.

The columns of the UCI Adult table with their kind of skew, ties and categories, and a
noisy non-monotone label (about 76% zeros), because ``make_classification`` (every value
distinct) flatters tree learners. :func:`census_export` is the same table as users
download it: text categories, a text label, `?` for missing, id and person columns.
See docs/tables.md and docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

import numpy as np

FEATURES = ("age", "workclass", "fnlwgt", "education", "education_num", "marital",
            "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
            "hours_per_week", "native_country")
_EDUCATION = np.array([2, 3, 4, 5, 6, 7, 32, 22, 4, 4, 16, 6, 2, 1, 3, 3]) / 120
_OCCUPATION = np.array([13, 12, 12, 11, 10, 9, 6, 5, 4, 4, 3, 5, 3, 3]) / 100
_OCCUPATION_EFFECT = np.array([1.0, -0.6, 0.9, -0.4, 0.1, -1.0, 0.3, -0.8, 1.2, -0.2, 0.0,
                               -1.2, 0.5, -0.5])
_WORKCLASS_EFFECT = np.array([0.0, 0.5, -0.3, 0.4, 0.6, -0.6, 0.2, -1.0])


def census_like(n: int = 32_560, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(features in their own units (n, 14), binary labels (n,))."""
    if n < 1:
        raise ValueError(f"a census-like table needs at least one row, got n={n}")
    rng = np.random.default_rng(seed)
    age = np.clip(np.round(17 + rng.gamma(3.0, 7.0, n)), 17, 90)
    workclass = rng.choice(8, n, p=[.70, .08, .06, .04, .04, .03, .03, .02])
    fnlwgt = np.round(np.exp(rng.normal(12.0, 0.5, n)))
    education = rng.choice(16, n, p=_EDUCATION)
    edu_num = np.clip(education + 1 + rng.integers(-1, 2, n) * (rng.random(n) < 0.1), 1, 16)
    marital = rng.choice(7, n, p=[.46, .33, .14, .03, .03, .007, .003])
    occupation = rng.choice(14, n, p=_OCCUPATION)
    rel = np.where(marital == 0, rng.choice([0, 5], n, p=[.88, .12]),
                   rng.choice([1, 2, 3, 4], n, p=[.45, .3, .15, .1]))
    race = rng.choice(5, n, p=[.85, .1, .03, .01, .01])
    sex = np.where(rel == 0, 1, np.where(rel == 5, 0, (rng.random(n) < 0.55).astype(int)))
    gain = np.where(rng.random(n) < 0.08, np.round(np.exp(rng.normal(8.5, 1.2, n))), 0.0)
    gain = np.minimum(gain, 99999)
    loss = np.where(rng.random(n) < 0.05, np.round(rng.normal(1900, 300, n)).clip(0, 4356), 0.0)
    hours = np.clip(np.round(rng.normal(40, 12, n)), 1, 99)
    country = np.where(rng.random(n) < 0.9, 0, rng.integers(1, 41, n))
    z = (-3.7 + 2.3 * (marital == 0) + 0.33 * (edu_num - 9) + _OCCUPATION_EFFECT[occupation]
         + _WORKCLASS_EFFECT[workclass] + 2.0 * np.exp(-(((age - 50) / 14) ** 2))
         - 1.5 * (age < 25) + 0.035 * (hours - 40) + 0.3 * sex - 0.2 * (race > 0)
         + np.where(gain > 7000, 4.5, np.where(gain > 0, -0.5, 0.0))
         + np.where(loss > 1800, 1.2, 0.0))
    y = (rng.random(n) < 1 / (1 + np.exp(-1.5 * (z + 0.2)))).astype(np.int64)
    X = np.column_stack([age, workclass, fnlwgt, education, edu_num, marital, occupation, rel,
                         race, sex, gain, loss, hours, country]).astype(np.float64)
    return X, y


# the text of each coded category, in code order (UCI Adult's names)
CATEGORY_NAMES = {
    "workclass": ("Private", "Self-emp-not-inc", "Local-gov", "State-gov", "Self-emp-inc",
                  "Federal-gov", "Without-pay", "Never-worked"),
    "education": ("Preschool", "1st-4th", "5th-6th", "7th-8th", "9th", "10th", "HS-grad",
                  "Some-college", "11th", "12th", "Bachelors", "Assoc-voc", "Assoc-acdm",
                  "Masters", "Prof-school", "Doctorate"),
    "marital": ("Married-civ-spouse", "Never-married", "Divorced", "Separated", "Widowed",
                "Married-spouse-absent", "Married-AF-spouse"),
    "occupation": ("Prof-specialty", "Craft-repair", "Exec-managerial", "Adm-clerical",
                   "Sales", "Other-service", "Machine-op-inspct", "Transport-moving",
                   "Handlers-cleaners", "Farming-fishing", "Tech-support", "Protective-serv",
                   "Priv-house-serv", "Armed-Forces"),
    "relationship": ("Husband", "Not-in-family", "Own-child", "Unmarried", "Other-relative",
                     "Wife"),
    "race": ("White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other"),
    "sex": ("Female", "Male"),
    "native_country": (
        "United-States", "Mexico", "Philippines", "Germany", "Puerto-Rico", "Canada",
        "El-Salvador", "India", "Cuba", "England", "Jamaica", "South", "China", "Italy",
        "Dominican-Republic", "Vietnam", "Guatemala", "Japan", "Poland", "Columbia", "Taiwan",
        "Haiti", "Iran", "Portugal", "Nicaragua", "Peru", "Greece", "France", "Ecuador",
        "Ireland", "Hong", "Trinadad&Tobago", "Cambodia", "Thailand", "Laos", "Yugoslavia",
        "Outlying-US(Guam-USVI-etc)", "Hungary", "Honduras", "Scotland",
        "Holand-Netherlands"),
}
LABEL_NAMES = ("<=50K", ">50K")
MISSING = "?"
# where the download has '?' (workclass and occupation are missing together)
_MISSING_FRACTION = {"workclass": 0.05, "native_country": 0.02}


def census_columns(n: int = 32_560, seed: int = 0, rows_per_person: int = 2,
                   numeric_missing: float = 0.0) -> dict[str, np.ndarray]:
    """:func:`census_export` as numpy arrays, built without a Python loop over rows (10^6
    rows in seconds): text columns are string arrays, numbers int64 (strings when
    `numeric_missing` puts `?` among them)."""
    X, y = census_like(n, seed)
    rng = np.random.default_rng(seed + 1)
    width = len(str(max(n - 1, 1)))
    index = np.char.zfill(np.arange(n).astype(str), width)
    person = np.char.zfill((np.arange(n) // rows_per_person).astype(str), width)
    out: dict[str, np.ndarray] = {"record_id": np.char.add("a", index),
                                  "person": np.char.add("p", person)}
    for j, name in enumerate(FEATURES):
        codes = X[:, j].astype(np.int64)
        names = CATEGORY_NAMES.get(name)
        out[name] = np.array(names)[codes] if names else codes
    for name, fraction in _MISSING_FRACTION.items():
        missing = rng.random(n) < fraction
        out[name] = np.where(missing, MISSING, out[name])
        if name == "workclass":
            out["occupation"] = np.where(missing, MISSING, out["occupation"])
    missing = rng.random(n) < numeric_missing
    if missing.any():
        out["hours_per_week"] = np.where(missing, MISSING, out["hours_per_week"].astype(str))
    out["income"] = np.array(LABEL_NAMES)[y]
    return out


def census_export(n: int = 32_560, seed: int = 0, rows_per_person: int = 2,
                  numeric_missing: float = 0.0) -> dict[str, list[Any]]:
    """:func:`census_like` as exported, column by column: `record_id`, `person` (the
    subject: `rows_per_person` rows each), the features with text categories and `?`
    where the download has missing values (`numeric_missing`: that fraction of
    `hours_per_week` too), and the text label `income`."""
    out = {k: v.tolist() for k, v in
           census_columns(n, seed, rows_per_person, numeric_missing).items()}
    if numeric_missing > 0:
        out["hours_per_week"] = [v if v == MISSING else int(v) for v in out["hours_per_week"]]
    return out

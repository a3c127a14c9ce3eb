"""Game-theoretic unlearning benchmark: retrain vs. game vs. plain fine-tuning.

    python tests/bench/bench_game.py [--quick] [--only DATA] [--set NAME=VALUE ...]

``--set`` overrides a :class:`GameUnlearningNet` parameter (e.g. ``--set rounds=200``)
to try other game settings; ``--only`` runs one data set.

Data sets: scikit-learn's breast cancer (MLP), 8x8 digits (small CNN) and a
synthetic table (make_classification, 4 classes, 5% label noise; MLP).
Features min-max scaled on the training split. 60% train; of the other 40%,
half is ``D_third`` (given to ``fit`` as ``X_third``, as in the paper: a part of
the test set) and half the test set every figure below is measured on.

Per data set one :class:`GameUnlearningNet` is fitted (default parameters but
for the network: MLP (64,) or CNN, 30 epochs; ``--quick``: fewer records and
epochs). Per removal setting -- 1, 2, 5, 10% of the training records at random,
and on digits one whole class -- three models forget the same records, each
starting from a copy of the fitted model:

* retrain: :meth:`GameUnlearningNet.retrain` (the network trained from scratch
  on the retain set: the reference, exact by definition);
* game: ``delete(ids)`` (default game parameters: 100 rounds, Adam, ...);
* fine-tune: ``delete(ids, method="finetune")`` (3 epochs on the retain set).

Each is evaluated by :func:`jobs.eval.evaluate_unlearning` against the model
before the deletion (``original``), the retrain and the model's frozen attacker
``M_A``. Timings are ratios to the retrain in the same process
(``speedup = retrain seconds / delete seconds``, the delete including any
surrogate retraining; fit-time preparation -- surrogate, shadow retrain,
attacker -- is reported once per data set as a ratio to the plain training).
One line per setting:

    RESULT data=... removed=... acc_retrain=... acc_game=... priaa_game=...
    priaa_retrained_attacker=... mia_game=... mia_retrain=... speedup=... [more]

accuracy on the test split; ``priaa_*`` = mean_i |p_i - 0.5| of the frozen
attacker on the forget set (``*_avg``: |mean_i p_i - 0.5|);
``priaa_retrained_attacker`` the same for an attacker retrained against the
game's output (``auc_*`` its ROC AUC, forget vs. kept and unseen records);
``mia_*`` the share of the forget set a Shokri-style attack calls "member"
(``mia_unseen``: the same share on unseen test records, the level a retrain
should show); ``acc_forget_*`` accuracy on the forget set (a game value below
the retrain's is over-forgetting); ``kl_*`` mean KL(retrain || model) on test.
"""

from __future__ import annotations

import argparse
import ast
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, make_classification
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jobs.eval import AttackConfig, FrozenScores, evaluate_unlearning  # noqa: E402
from jobs.learners.game.stackelberg import GameUnlearningNet  # noqa: E402


def _split(X, y, seed=0):
    Xtr, Xo, ytr, yo = train_test_split(X, y, test_size=0.4, random_state=seed, stratify=y)
    Xth, Xte, _, yte = train_test_split(Xo, yo, test_size=0.5, random_state=seed, stratify=yo)
    lo, span = Xtr.min(axis=0), np.maximum(Xtr.max(axis=0) - Xtr.min(axis=0), 1e-12)

    def scale(A):
        return np.clip((A - lo) / span, 0.0, 1.0)

    return scale(Xtr), ytr, scale(Xth), scale(Xte), yte


def datasets(quick: bool):
    X, y = load_breast_cancer(return_X_y=True)
    yield "breast_cancer", _split(X, y), {"model": "mlp", "hidden": (64,)}, None
    X, y = load_digits(return_X_y=True)
    if quick:
        X, y = X[:700], y[:700]
    yield "digits", _split(X, y), {"model": "cnn", "hidden": (64,)}, 3
    X, y = make_classification(n_samples=2000 if quick else 6000, n_features=20,
                               n_informative=10, n_redundant=4, n_classes=4, flip_y=0.05,
                               class_sep=1.5, random_state=0)
    yield "synthetic", _split(X, y), {"model": "mlp", "hidden": (128,)}, None


def _warm_up() -> None:
    """Torch's lazy initialisation (MLP and CNN paths) before anything is timed."""
    rng = np.random.default_rng(0)
    X, y = rng.random((40, 16)), np.arange(40) % 2
    for model in ("mlp", "cnn"):
        m = GameUnlearningNet(model=model, hidden=(8,), epochs=1, rounds=2, attack_steps=2,
                              device="cpu").fit(X, y, record_ids=np.arange(40))
        m.delete([0, 1])


def run_setting(name, data, fitted, forget_rows, removed, attack):
    Xtr, ytr, _, Xte, yte = data
    keep = np.setdiff1d(np.arange(len(Xtr)), forget_rows)
    sets = {"X_retain": Xtr[keep], "y_retain": ytr[keep], "X_forget": Xtr[forget_rows],
            "y_forget": ytr[forget_rows], "X_test": Xte, "y_test": yte}
    before = FrozenScores(fitted, Xtr, Xte)
    ids = np.asarray(forget_rows)

    game = copy.deepcopy(fitted)
    rep = game.delete(ids)
    t_game = rep.seconds
    t0 = time.perf_counter()
    ref = game.retrain()
    t_retrain = time.perf_counter() - t0
    ft = copy.deepcopy(fitted)
    t_ft = ft.delete(ids, method="finetune").seconds

    ev = {}
    for label, model in (("game", game), ("retrain", ref), ("finetune", ft)):
        ev[label] = evaluate_unlearning(model, ref, original=before, attacker=fitted.attacker_,
                                        random_state=0, attack_config=attack, **sets)
    g, r, f = ev["game"], ev["retrain"], ev["finetune"]
    row = {
        "data": name, "removed": removed, "n_forget": len(ids),
        "acc_original": g["acc_test_original"], "acc_retrain": r["acc_test"],
        "acc_game": g["acc_test"], "acc_finetune": f["acc_test"],
        "priaa_game": g["priaa_frozen"], "priaa_game_avg": g["priaa_frozen_avg"],
        "priaa_retrain": r["priaa_frozen"], "priaa_finetune": f["priaa_frozen"],
        "priaa_retrained_attacker": g.get("priaa_retrained", float("nan")),
        "auc_retrained_attacker": g.get("attack_auc_retrained", float("nan")),
        "auc_retrained_attacker_retrain": r.get("attack_auc_retrained", float("nan")),
        "mia_game": g["mia_forget"], "mia_retrain": r["mia_forget"],
        "mia_finetune": f["mia_forget"], "mia_unseen": r["mia_test"],
        "acc_forget_retrain": r["acc_forget"], "acc_forget_game": g["acc_forget"],
        "acc_forget_finetune": f["acc_forget"],
        "kl_game": g["kl_test"], "kl_finetune": f["kl_test"],
        "speedup": t_retrain / t_game, "speedup_finetune": t_retrain / t_ft,
    }
    seconds = {"retrain": t_retrain, "game": t_game, "finetune": t_ft,
               "surrogate": rep.metrics.get("surrogate_seconds", 0.0)}
    return row, seconds


def _fmt(row):
    return " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller data and grid, < 1 minute")
    ap.add_argument("--only", choices=["breast_cancer", "digits", "synthetic"])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a GameUnlearningNet parameter (Python literal)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = ast.literal_eval(v)
    torch.set_num_threads(1)
    quick = args.quick
    fractions = [0.05] if quick else [0.01, 0.02, 0.05, 0.10]
    epochs = 15 if quick else 30
    attack = AttackConfig(steps=200 if quick else 500)
    print(f"torch {torch.__version__}, device cpu, 1 thread; removals={fractions} "
          f"epochs={epochs}{' (quick)' if quick else ''} overrides={overrides}", flush=True)
    _warm_up()
    rows = []
    t_all = time.perf_counter()
    for name, data, net, drop_class in datasets(quick):
        if args.only and name != args.only:
            continue
        Xtr, ytr, Xth, Xte, _ = data
        params = {**net, "epochs": epochs, "device": "cpu", "random_state": 0}
        if quick:
            params["attack_steps"] = 200
        params.update(overrides)
        fitted = GameUnlearningNet(**params).fit(Xtr, ytr, record_ids=np.arange(len(Xtr)),
                                                 X_third=Xth)
        fs = fitted.fit_seconds_
        print(f"\n== {name}: train={len(Xtr)} third={len(Xth)} test={len(Xte)} "
              f"model={net['model']} fit: preparation / plain training = "
              f"{(fs['surrogate'] + fs['attacker']) / fs['main']:.2f}", flush=True)
        rng = np.random.default_rng(1)
        settings = [(np.sort(rng.choice(len(Xtr), size=max(2, round(f * len(Xtr))),
                                        replace=False)), f"{round(f * 100)}%")
                    for f in fractions]
        if drop_class is not None:
            settings.append((np.flatnonzero(ytr == drop_class), f"class{drop_class}"))
        for forget_rows, removed in settings:
            row, sec = run_setting(name, data, fitted, forget_rows, removed, attack)
            rows.append(row)
            print("  seconds: " + " ".join(f"{k}={v:.2f}" for k, v in sec.items()))
            print("RESULT " + _fmt(row), flush=True)

    def share(cond):
        return f"{sum(map(cond, rows))}/{len(rows)}"

    within = share(lambda r: abs(r["acc_game"] - r["acc_retrain"]) <= 0.01)
    over = share(lambda r: r["acc_forget_game"] < r["acc_forget_retrain"] - 0.01)
    sharper = share(lambda r: r["auc_retrained_attacker"]
                    > r["auc_retrained_attacker_retrain"] + 0.05)
    print(f"\nSUMMARY settings={len(rows)} acc_within_1pt_of_retrain={within} "
          f"priaa_game_le_0.1={share(lambda r: r['priaa_game'] <= 0.1)} "
          f"speedup_ge_2={share(lambda r: r['speedup'] >= 2)} over_forgetting={over} "
          f"retrained_attacker_auc_gt_retrain={sharper} "
          f"wall_s={time.perf_counter() - t_all:.0f}")
    for row in rows:  # the last lines: one RESULT per setting
        print("RESULT " + _fmt(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Game-theoretic unlearning benchmark: retrain vs. game vs. plain fine-tuning, and the
game as the sidecar serves it (approximate at once, then an exact retrain).

    python tests/bench/bench_game.py [--quick] [--only DATA] [--set NAME=VALUE ...]

``--set`` overrides a :class:`GameUnlearningNet` parameter (e.g. ``--set rounds=200``)
to try other game settings; ``--only`` runs one data set.

Data sets: scikit-learn's breast cancer (MLP), 8x8 digits (small CNN) and a
synthetic table (make_classification, 4 classes, 5% label noise; MLP).
Features min-max scaled on the training split. 60% train; of the other 40%,
half is ``D_third`` (given to ``fit`` as ``X_third``, as in the paper: a part of
the test set) and half the test set every figure below is measured on.

Per data set one :class:`GameUnlearningNet` is fitted (default parameters but
for the network: MLP (64,) or CNN, 30 epochs; ``--quick``: breast cancer only, fewer
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

Served (issue 30; ``mode=stream`` lines, one per data set; ``--quick``: breast cancer
only): a stream of ``STREAM_BATCHES`` (5) deletions of 2% of the training records each,
applied with the game to one fitted model; after each, test accuracy of the answers of
this design (the approximate version's plain labels), of noise-all (the same model's
labels through the label guard with no bound, epsilon 1: how the game was served
before) and of plain (no guard; it is the design's answer while approximate, and stays
approximate after the stream, with no exact replacement) -- ``acc_*_during`` their mean
over the stream. Then the exact replacement (:meth:`GameUnlearningNet.exact_retrain`,
the worker's background job) and its check by content hash (``verify``):
``acc_*_after`` with the replacement served (plain: still the approximate model).
``adv_*``: attack advantage on the forgotten records, the ROC AUC of a Shokri-style
membership attack (forgotten vs unseen test records) minus 0.5, for the model before the
stream (``original``), the approximate version and the exact retrain. ``game_s`` the
game's seconds over the stream, ``exact_s`` the replacement's retrain (M_o and the
attacker), ``verify_s`` its check; ``hash_match`` whether the check reproduced its bits.
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
from jobs.guard.label_guard import LabelGuard, clip_unit  # noqa: E402
from jobs.learners.game.stackelberg import GameUnlearningNet  # noqa: E402

STREAM_BATCHES = 5  # deletions in the served stream, each of STREAM_FRACTION of the records
STREAM_FRACTION = 0.02


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


def _noise_all_accuracy(guard, version, model, X, y):
    """Accuracy of `model`'s answers through a label guard with no bound (every answer
    noised at the guard's epsilon), as the sidecar served the game before issue 30."""
    guard.bind(version, sound=False)
    Xq = clip_unit(np.asarray(X, dtype=np.float64))
    idx = guard.answer(Xq, np.argmax(model.scores(Xq), axis=1), np.zeros(len(Xq), bool),
                       lambda C: np.argmax(model.scores(C), axis=1))
    return float(np.mean(model.classes_[idx] == y))


def _advantage(model, exact, sets, attack):
    """The membership attack's advantage on the forgotten records: its ROC AUC of
    forgotten vs unseen test records, minus 0.5 (0: they look unseen)."""
    ev = evaluate_unlearning(model, exact, attacker=None, random_state=0,
                             attack_config=attack, **sets)
    return ev["mia_auc_forget_vs_test"] - 0.5


def run_stream(name, data, fitted, attack):
    """A stream of game deletions served as the sidecar does (module docstring)."""
    Xtr, ytr, _, Xte, yte = data
    model = copy.deepcopy(fitted)
    order = np.random.default_rng(2).permutation(len(Xtr))
    per = max(1, round(STREAM_FRACTION * len(Xtr)))
    guard = LabelGuard(len(fitted.classes_), epsilon=1.0, random_state=0)
    served, noised, game_s = [], [], 0.0
    for b in range(STREAM_BATCHES):
        game_s += model.delete(order[b * per:(b + 1) * per]).seconds
        served.append(float(np.mean(model.predict(Xte) == yte)))
        noised.append(_noise_all_accuracy(guard, f"a{b}", model, Xte, yte))
    t0 = time.perf_counter()
    exact = model.exact_retrain()
    exact_s = time.perf_counter() - t0
    check = exact.verify()
    gone = np.sort(order[:STREAM_BATCHES * per])
    keep = np.setdiff1d(np.arange(len(Xtr)), gone)
    sets = {"X_retain": Xtr[keep], "y_retain": ytr[keep], "X_forget": Xtr[gone],
            "y_forget": ytr[gone], "X_test": Xte, "y_test": yte}
    return {
        "data": name, "mode": "stream", "batches": STREAM_BATCHES, "n_forget": len(gone),
        "acc_served_during": float(np.mean(served)),
        "acc_noise_all_during": float(np.mean(noised)),
        "acc_plain_during": float(np.mean(served)),
        "acc_served_after": float(np.mean(exact.predict(Xte) == yte)),
        "acc_noise_all_after": _noise_all_accuracy(guard, "exact", exact, Xte, yte),
        "acc_plain_after": float(np.mean(model.predict(Xte) == yte)),
        "adv_original": _advantage(fitted, exact, sets, attack),
        "adv_approximate": _advantage(model, exact, sets, attack),
        "adv_exact": _advantage(exact, exact, sets, attack),
        "game_s": game_s, "exact_s": exact_s, "verify_s": check.seconds,
        "hash_match": check.exact,
    }


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
    rows, streams = [], []
    t_all = time.perf_counter()
    for name, data, net, drop_class in datasets(quick):
        if (args.only or ("breast_cancer" if quick else name)) != name:
            continue  # --quick: breast cancer alone, to stay under a minute
        Xtr, ytr, Xth, Xte, _ = data
        params = {**net, "epochs": epochs, "device": "cpu", "random_state": 0}
        if quick:
            params["attack_steps"] = 200
        params.update(overrides)
        fitted = GameUnlearningNet(**params).fit(Xtr, ytr, record_ids=np.arange(len(Xtr)),
                                                 X_third=Xth)
        streams.append(run_stream(name, data, fitted, attack))
        print("RESULT " + _fmt(streams[-1]), flush=True)
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
    for row in [*rows, *streams]:  # the last lines: one RESULT per setting and stream
        print("RESULT " + _fmt(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How well did a model forget? One entry point for every learner: :func:`evaluate_unlearning`.
See docs/learners.md (Privacy evaluation)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from jobs.learners.game.attacks import (
    DEFAULT_ATTACK,
    AttackConfig,
    Attacker,
    cross_val_attack,
    member_features,
    pair_features_np,
    train_attacker,
)
from jobs.learners.keyed import prf_u64
from jobs.learners.scoring import accuracy, agreement, as_probabilities, auc, mean_kl, priaa


class Scorer(Protocol):
    def scores(self, X: np.ndarray) -> np.ndarray: ...


def _rows(X: Any) -> tuple[np.ndarray, list[bytes]]:
    a = np.ascontiguousarray(np.asarray(X, dtype=np.float64))
    if a.ndim != 2:
        raise ValueError(f"X must be 2-D, got shape {a.shape}")
    return a, [r.tobytes() for r in a]


class FrozenScores:
    """A model's scores on given rows, captured now, answered later by ``scores(X)``.

    Learners update in place; to compare the model after a deletion with the one
    before (the pair attack needs both), capture the "before" scores of the rows
    the evaluation will ask about::

        before = FrozenScores(learner, X_retain, X_forget, X_test)
        learner.delete(ids)
        evaluate_unlearning(learner, original=before, ...)

    Rows are looked up by their float64 bytes, so any subset or reordering of
    the captured rows is answered; a row that was not captured raises ``KeyError``.
    """

    def __init__(self, model: Scorer, *arrays: Any) -> None:
        classes = getattr(model, "classes_", None)
        self.classes_ = None if classes is None else np.asarray(classes).copy()
        self._table: dict[bytes, np.ndarray] = {}
        for X in arrays:
            a, keys = _rows(X)
            if len(a):
                self._table.update(zip(keys, np.array(model.scores(a), dtype=np.float64),
                                       strict=True))

    def scores(self, X: Any) -> np.ndarray:
        a, keys = _rows(X)
        try:
            rows = [self._table[k] for k in keys]
        except KeyError:
            raise KeyError("FrozenScores: a row was not captured") from None
        width = len(next(iter(self._table.values()))) if self._table else 0
        return np.array(rows).reshape(len(a), width)


def _label_index(y: Any, classes: np.ndarray | None, n_classes: int) -> np.ndarray:
    """Class index of each label; -1 for a label the model does not know."""
    arr = np.asarray(y)
    if classes is None:
        idx = arr.astype(np.int64)
        return np.where((idx >= 0) & (idx < n_classes), idx, -1)
    lookup = {c: k for k, c in enumerate(np.asarray(classes).tolist())}
    return np.array([lookup.get(v, -1) for v in arr.tolist()], dtype=np.int64)


def _probs(model: Scorer, X: np.ndarray) -> np.ndarray:
    if len(X) == 0:
        return np.zeros((0, 0))
    return as_probabilities(model.scores(X))


def _mia(P: dict[str, np.ndarray], yi: dict[str, np.ndarray], halves: dict[str, np.ndarray],
         seed: int, config: AttackConfig) -> dict[str, float]:
    """Shokri-style attack: members (retain, first half) vs non-members (test, first half),
    the target model as its own shadow model (a stronger attacker than Shokri's)."""

    def feats(name: str, rows: np.ndarray) -> np.ndarray:
        return member_features(P[name][rows], yi[name][rows])

    r_tr, r_ev = halves["retain"]
    t_tr, t_ev = halves["test"]
    if min(len(r_tr), len(t_tr)) == 0:
        return {}
    att = train_attacker(feats("retain", r_tr), feats("test", t_tr), seed=seed, config=config)
    p_forget = att.predict_proba(feats("forget", np.arange(len(yi["forget"]))))
    p_test = att.predict_proba(feats("test", t_ev))
    p_retain = att.predict_proba(feats("retain", r_ev))
    return {
        "mia_forget": float((p_forget > 0.5).mean()) if len(p_forget) else float("nan"),
        "mia_retain": float((p_retain > 0.5).mean()) if len(p_retain) else float("nan"),
        "mia_test": float((p_test > 0.5).mean()) if len(p_test) else float("nan"),
        "mia_auc_forget_vs_test": auc(p_forget, p_test),
    }


def evaluate_unlearning(
    model: Scorer,
    retrained: Scorer | None = None,
    *,
    X_retain: Any,
    y_retain: Any,
    X_forget: Any,
    y_forget: Any,
    X_test: Any,
    y_test: Any,
    original: Scorer | None = None,
    attacker: Attacker | str | None = "auto",
    random_state: int = 0,
    max_retain: int = 1000,
    folds: int = 3,
    attack_config: AttackConfig = DEFAULT_ATTACK,
) -> dict[str, float]:
    """Privacy and utility of a model that was asked to forget ``(X_forget, y_forget)``.

    Works on anything with ``scores(X)`` (probabilities, votes or logits; see
    :func:`jobs.learners.scoring.as_probabilities`) and, optionally, ``classes_``
    (labels are mapped through it; without it labels are class indices).

    Parameters
    ----------
    model : the unlearned model ``M_u``.
    retrained : a model retrained from scratch without the forget set ``M_r``
        (optional): adds the gap to it.
    X_retain, y_retain : records the model still holds (subsampled to ``max_retain``).
    X_forget, y_forget : the records it was asked to forget.
    X_test, y_test : records it never saw; split in two halves (keyed by
        ``random_state``): one trains the attackers, the other is held out.
    original : the model before the deletion ``M_o`` (optional; a
        :class:`FrozenScores` does): adds the pair attacks.
    attacker : the frozen pair attacker ``M_A`` for the PriAA of the game;
        ``"auto"`` takes ``model.attacker_`` when the model has one, ``None`` skips it.
    random_state : seed of the splits and of every attacker trained here.
    max_retain : at most this many retain records are used (a keyed sample).
    folds : folds of the cross-validated retrained pair attacker.
    attack_config : how the attackers trained here are built.

    Returns
    -------
    dict[str, float], keys present only when computable (JSON-safe apart from
    ``nan`` for an empty set):

    * ``acc_test``, ``acc_retain``, ``acc_forget``: accuracy of ``model``.
    * Shokri-style membership attack on ``model`` alone (members = retain half,
      non-members = test half; the model is its own shadow model): ``mia_forget``
      (share of the forget set called "member": the paper's attack success),
      ``mia_retain`` and ``mia_test`` (the same share on held-out members and
      non-members: what "remembered" and "never seen" look like),
      ``mia_auc_forget_vs_test`` (0.5: the forget set looks like unseen data).
    * with ``original``: ``acc_test_original``, ``acc_forget_original``;
      ``priaa_frozen`` = mean_i |p_i - 0.5| and ``priaa_frozen_avg`` =
      |mean_i p_i - 0.5| of the frozen attacker on the forget set (when there is
      one); ``priaa_retrained``, ``priaa_retrained_avg`` and
      ``attack_auc_retrained``: the same for an attacker RETRAINED against this
      model (forget pairs positive; retain and test pairs, half each, negative;
      out-of-fold probabilities), with ``attack_p_forget_retrained`` the mean
      probability it gives the forget set (> 0.5: "deleted" is visible; < 0.5:
      looks not deleted).
    * with ``retrained``: ``acc_test_retrained``, ``acc_retain_retrained``,
      ``acc_forget_retrained``, ``acc_gap_test`` / ``acc_gap_retain`` /
      ``acc_gap_forget`` (model minus retrained), ``kl_test``, ``kl_forget``,
      ``kl_retain`` (mean KL(retrained || model)), ``agreement_test``.
    """
    seed = int(random_state)
    rng = np.random.default_rng(prf_u64(seed, "eval-split") & ((1 << 63) - 1))
    X = {"retain": np.asarray(X_retain, dtype=np.float64),
         "forget": np.asarray(X_forget, dtype=np.float64),
         "test": np.asarray(X_test, dtype=np.float64)}
    Y = {"retain": np.asarray(y_retain), "forget": np.asarray(y_forget),
         "test": np.asarray(y_test)}
    if len(X["retain"]) > max_retain:
        keep = np.sort(rng.choice(len(X["retain"]), size=max_retain, replace=False))
        X["retain"], Y["retain"] = X["retain"][keep], Y["retain"][keep]
    P = {k: _probs(model, v) for k, v in X.items()}
    C = next(p.shape[1] for p in P.values() if p.size)
    classes = getattr(model, "classes_", None)
    yi = {k: _label_index(v, classes, C) for k, v in Y.items()}
    out: dict[str, float] = {f"acc_{k}": accuracy(P[k], yi[k]) for k in ("test", "retain",
                                                                          "forget")}
    halves = {k: np.array_split(rng.permutation(len(X[k])), 2) for k in ("retain", "test")}
    out.update(_mia(P, yi, halves, seed, attack_config))

    if original is not None:
        if attacker == "auto":
            attacker = getattr(model, "attacker_", None)
        out.update(_against_original(original, attacker, X, yi, P, rng, seed, folds,
                                     attack_config))
    if retrained is not None:
        Pr = {k: _probs(retrained, v) for k, v in X.items()}
        for k in ("test", "retain", "forget"):
            out[f"acc_{k}_retrained"] = accuracy(Pr[k], yi[k])
            out[f"acc_gap_{k}"] = out[f"acc_{k}"] - out[f"acc_{k}_retrained"]
            out[f"kl_{k}"] = mean_kl(Pr[k], P[k])
        out["agreement_test"] = agreement(Pr["test"], P["test"])
    return out


def _against_original(original: Scorer, attacker: Attacker | str | None,
                      X: dict[str, np.ndarray], yi: dict[str, np.ndarray],
                      P: dict[str, np.ndarray], rng: np.random.Generator, seed: int,
                      folds: int, attack_config: AttackConfig) -> dict[str, float]:
    """What comparing the model with its state before the deletion shows: the frozen pair
    attacker's PriAA, and an attacker retrained against this pair of models."""
    Po = {k: _probs(original, v) for k, v in X.items()}
    out = {"acc_test_original": accuracy(Po["test"], yi["test"]),
           "acc_forget_original": accuracy(Po["forget"], yi["forget"])}
    pairs = {k: pair_features_np(Po[k], P[k]) for k in X if len(X[k])}
    if isinstance(attacker, Attacker) and "forget" in pairs:
        out["priaa_frozen"], out["priaa_frozen_avg"] = priaa(
            attacker.predict_proba(pairs["forget"]))
    if len(pairs.get("forget", ())) >= 2:
        m = min(len(X["retain"]), len(X["test"]))
        neg = np.concatenate([pairs["retain"][rng.permutation(len(X["retain"]))[:m]],
                              pairs["test"][rng.permutation(len(X["test"]))[:m]]])
        p_pos, p_neg = cross_val_attack(pairs["forget"], neg, folds=folds,
                                        seed=prf_u64(seed, "pair-attack"),
                                        config=attack_config)
        if np.isfinite(p_pos).all():
            out["priaa_retrained"], out["priaa_retrained_avg"] = priaa(p_pos)
            out["attack_auc_retrained"] = auc(p_pos, p_neg)
            out["attack_p_forget_retrained"] = float(p_pos.mean())
    return out

"""Plain metrics over class-score arrays: probabilities, accuracy, PriAA, KL, AUC.
See docs/learners.md (Privacy evaluation)."""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

_EPS = 1e-12


def as_probabilities(scores: Any) -> np.ndarray:
    """Rows of class probabilities from what a learner's ``scores()`` returns.

    ``scores()`` may give probabilities (DaRE, the game network, SISA "mean"),
    vote counts (SISA "vote") or logits. Rows that are non-negative are
    normalised to sum to 1 (probabilities stay as they are, votes become vote
    shares; an all-zero row becomes uniform); if any entry is negative the
    array is taken as logits and soft-maxed.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] == 0:
        raise ValueError(f"scores must be 2-D (n, n_classes), got shape {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("scores contain NaN or infinite values")
    if (s >= 0).all():
        tot = s.sum(axis=1, keepdims=True)
        uniform = np.full_like(s, 1.0 / s.shape[1])
        return np.where(tot > 0, s / np.where(tot > 0, tot, 1.0), uniform)
    z = s - s.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def accuracy(probs: np.ndarray, y_idx: np.ndarray) -> float:
    """Share of rows whose argmax (ties to the lowest index) is the label index."""
    if len(y_idx) == 0:
        return float("nan")
    return float((np.argmax(probs, axis=1) == y_idx).mean())


def priaa(p: Any) -> tuple[float, float]:
    """Privacy attack advantage of attack probabilities ``p`` (Liu et al., Eq. 12).

    Returns ``(mean_i |p_i - 0.5|, |mean_i p_i - 0.5|)``, both in [0, 0.5]. The
    first is the stricter one: per-record confidence cannot cancel out across
    records. Empty input: ``(nan, nan)``.
    """
    a = np.asarray(p, dtype=np.float64).ravel()
    if a.size == 0:
        return float("nan"), float("nan")
    return float(np.abs(a - 0.5).mean()), float(abs(a.mean() - 0.5))


def mean_kl(p_ref: np.ndarray, p: np.ndarray) -> float:
    """Mean over rows of KL(p_ref || p) in nats (probabilities clipped at 1e-12)."""
    if len(p_ref) == 0:
        return float("nan")
    a = np.clip(np.asarray(p_ref, dtype=np.float64), _EPS, 1.0)
    b = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1.0)
    a /= a.sum(axis=1, keepdims=True)
    b /= b.sum(axis=1, keepdims=True)
    return float((a * (np.log(a) - np.log(b))).sum(axis=1).mean())


def agreement(p_a: np.ndarray, p_b: np.ndarray) -> float:
    """Share of rows on which two score arrays predict the same class."""
    if len(p_a) == 0:
        return float("nan")
    return float((np.argmax(p_a, axis=1) == np.argmax(p_b, axis=1)).mean())


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC of scores ``pos`` (label 1) against ``neg`` (label 0); nan if one is empty."""
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return float(roc_auc_score(y, np.r_[np.asarray(pos, float), np.asarray(neg, float)]))

"""The unlearning evaluation: metrics on known cases, any learner with scores(), seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.ensemble import ExtraTreesClassifier

from jobs.eval import FrozenScores, as_probabilities, evaluate_unlearning, mean_kl, priaa
from jobs.learners.dare.forest import DaREForest
from jobs.learners.game.attacks import AttackConfig, cross_val_attack, pair_features
from jobs.learners.networks.torch_nets import torch_threads
from jobs.learners.scoring import auc

FAST = AttackConfig(hidden=(16,), steps=150, lr=0.02, batch_size=64)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


class Sk:
    """A scikit-learn classifier seen through the learner interface's ``scores``."""

    def __init__(self, est) -> None:
        self.est = est
        self.classes_ = est.classes_

    def scores(self, X):
        return self.est.predict_proba(X)


def _split(seed: int = 0):
    """Retain/test follow a rule; the forget set's labels are noise (only memory fits them)."""
    rng = np.random.default_rng(seed)
    X = rng.random((700, 5))
    y = (X[:, 0] + X[:, 1] > 1).astype(int)
    r, f, t = slice(0, 400), slice(400, 460), slice(460, 700)
    yf = rng.integers(0, 2, 60)
    return X[r], y[r], X[f], yf, X[t], y[t]


@pytest.fixture(scope="module")
def known():
    Xr, yr, Xf, yf, Xt, yt = _split()
    memorised = Sk(ExtraTreesClassifier(40, random_state=0).fit(np.r_[Xr, Xf], np.r_[yr, yf]))
    unseen = Sk(ExtraTreesClassifier(40, random_state=0).fit(Xr, yr))
    data = {"X_retain": Xr, "y_retain": yr, "X_forget": Xf, "y_forget": yf, "X_test": Xt,
            "y_test": yt}
    return memorised, unseen, data


def test_plain_metrics():
    np.testing.assert_allclose(as_probabilities([[0.2, 0.8]]), [[0.2, 0.8]])
    np.testing.assert_allclose(as_probabilities([[3.0, 1.0], [0.0, 0.0]]),
                               [[0.75, 0.25], [0.5, 0.5]])  # votes; no votes: uniform
    np.testing.assert_allclose(as_probabilities([[-1.0, 1.0]]).sum(), 1.0)  # logits
    assert as_probabilities([[-1.0, 1.0]])[0, 1] > 0.85
    assert priaa([0.0, 1.0]) == (0.5, 0.0)  # the two aggregations can disagree completely
    assert priaa([0.5, 0.5]) == (0.0, 0.0)
    assert priaa([0.9, 0.8]) == pytest.approx((0.35, 0.35))
    p = np.array([[0.9, 0.1], [0.2, 0.8]])
    assert mean_kl(p, p) == pytest.approx(0.0, abs=1e-12)
    assert mean_kl(p, p[::-1]) > 0.5
    assert mean_kl(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])) > 20  # clipped, finite
    assert auc(np.array([0.9, 0.8]), np.array([0.1, 0.2])) == 1.0


def test_pair_features_are_differentiable_in_the_new_posterior():
    po = torch.tensor([[0.1, 0.7, 0.2]])
    pu = torch.tensor([[0.3, 0.4, 0.3]], requires_grad=True)
    f = pair_features(po, pu)
    assert f.shape == (1, 15)
    np.testing.assert_allclose(f[0, :3].detach(), [0.7, 0.2, 0.1])  # ordered by p_o
    f.sum().backward()
    assert pu.grad is not None and torch.isfinite(pu.grad).all()


def test_memorised_versus_never_seen(known):
    memorised, unseen, data = known
    mem = evaluate_unlearning(memorised, attack_config=FAST, **data)
    new = evaluate_unlearning(unseen, attack_config=FAST, **data)
    assert mem["acc_forget"] == 1.0 and new["acc_forget"] < 0.75
    # the membership attack calls the memorised forget set "member" like the retain set;
    # the never-seen one looks no more like a member than unseen test data does (less:
    # its noisy labels get a low probability, the mark of a non-member)
    assert mem["mia_forget"] > mem["mia_test"] + 0.4
    assert mem["mia_auc_forget_vs_test"] > 0.85
    assert new["mia_auc_forget_vs_test"] < 0.6
    assert new["mia_forget"] <= new["mia_test"] + 0.1
    assert new["mia_forget"] < mem["mia_forget"] - 0.3
    for k in ("acc_test", "acc_retain", "mia_retain"):
        assert 0.0 <= new[k] <= 1.0


def test_pair_attack_and_gap_to_a_retrain(known):
    memorised, unseen, data = known
    before = FrozenScores(memorised, data["X_retain"], data["X_forget"], data["X_test"])
    # exact unlearning (the retrain): the change on the forget set is what gives it away
    retrain = evaluate_unlearning(unseen, unseen, original=before, attack_config=FAST, **data)
    # no unlearning at all: nothing changed, the forget set looks like kept records
    nothing = evaluate_unlearning(memorised, unseen, original=before, attack_config=FAST, **data)
    assert retrain["attack_auc_retrained"] > 0.9
    assert retrain["priaa_retrained"] > 0.25
    assert retrain["attack_p_forget_retrained"] > 0.7
    assert nothing["attack_auc_retrained"] < retrain["attack_auc_retrained"] - 0.1
    assert "priaa_frozen" not in retrain  # no frozen attacker given
    assert retrain["kl_test"] == 0.0 and retrain["acc_gap_forget"] == 0.0
    assert retrain["agreement_test"] == 1.0
    assert nothing["kl_forget"] > 1.0 and nothing["acc_gap_forget"] > 0.25
    assert nothing["acc_forget_original"] == 1.0


def test_seeded_and_reproducible(known):
    memorised, unseen, data = known
    before = FrozenScores(memorised, data["X_retain"], data["X_forget"], data["X_test"])
    a = evaluate_unlearning(unseen, original=before, random_state=3, attack_config=FAST, **data)
    b = evaluate_unlearning(unseen, original=before, random_state=3, attack_config=FAST, **data)
    assert a == b
    c = evaluate_unlearning(unseen, original=before, random_state=4, attack_config=FAST, **data)
    assert c.keys() == a.keys()


def test_frozen_scores_answer_subsets_and_refuse_the_rest(known):
    memorised, _, data = known
    before = FrozenScores(memorised, data["X_test"])
    Xt = data["X_test"]
    np.testing.assert_array_equal(before.scores(Xt[[5, 2]]), memorised.scores(Xt[[5, 2]]))
    with pytest.raises(KeyError):
        before.scores(data["X_forget"][:1])


def test_cross_validated_attack_scores_every_row_out_of_fold():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(2, 1, (30, 3)), rng.normal(-2, 1, (50, 3))
    p_pos, p_neg = cross_val_attack(pos, neg, folds=3, config=FAST)
    assert p_pos.shape == (30,) and p_neg.shape == (50,)
    assert auc(p_pos, p_neg) > 0.95
    one, _ = cross_val_attack(pos[:1], neg, config=FAST)
    assert np.isnan(one).all()


def test_works_on_an_exact_learner_dare():
    Xr, yr, Xf, yf, Xt, yt = _split(1)
    X, y = np.r_[Xr, Xf], np.r_[yr, yf]
    ids = np.arange(len(X))
    params = {"n_estimators": 10, "max_depth": 6, "k": 5, "random_state": 0}
    forest = DaREForest(**params).fit(X, y, record_ids=ids)
    before = FrozenScores(forest, Xr, Xf, Xt)
    rep = forest.delete(ids[len(Xr):])
    assert rep.guarantee == "exact"
    retrained = DaREForest(**params).fit(Xr, yr, record_ids=ids[: len(Xr)])
    out = evaluate_unlearning(forest, retrained, original=before, X_retain=Xr, y_retain=yr,
                              X_forget=Xf, y_forget=yf, X_test=Xt, y_test=yt,
                              attack_config=FAST)
    # exact unlearning: no gap to the retrain at all
    assert out["kl_test"] == 0.0 and out["kl_forget"] == 0.0 and out["acc_gap_test"] == 0.0
    assert out["acc_forget_original"] > out["acc_forget"]
    assert all(np.isfinite(v) for v in out.values())

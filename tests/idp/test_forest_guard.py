"""Soundness of the DaRE forest guard against ALL leave-one-out forests, computed exactly."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, make_classification, make_moons

from jobs.guard.forest.forest_guard import NOISE_ALL, SOUND, ForestGuard
from jobs.learners.base import hash_arrays
from jobs.learners.dare.forest import DaREForest


def _two_d(rng):
    X = rng.random((160, 2))
    y = ((X[:, 0] + 0.3 * np.sin(6 * X[:, 1]) > 0.6) ^ (rng.random(160) < 0.1)).astype(int)
    return X, y


def _cancer(rng):
    X, y = load_breast_cancer(return_X_y=True)
    idx = rng.permutation(len(y))[:200]
    X = X[idx]
    X = (X - X.min(axis=0)) / (X.max(axis=0) - X.min(axis=0) + 1e-12)
    return X, y[idx]


def _three(rng):
    X, y = make_classification(
        n_samples=180, n_features=5, n_informative=3, n_redundant=0, n_classes=3,
        n_clusters_per_class=1, class_sep=1.2, random_state=int(rng.integers(1000)),
    )  # fmt: skip
    return X, np.array(["a", "b", "c"])[y]


CASES = {
    # name: (data, n_train, forest params)
    "2d": (_two_d, 100, dict(n_estimators=15, max_depth=5, k=5, d_rmax=1)),
    "cancer": (_cancer, 120, dict(n_estimators=15, max_depth=4, k=5)),
    "3class": (_three, 120, dict(n_estimators=12, max_depth=6, k=5, d_rmax=2)),
}


def _queries(rng, forest, Xtr, n_random=3000):
    lo, hi = Xtr.min(axis=0), Xtr.max(axis=0)
    span = hi - lo
    Q = [lo - 0.1 * span + rng.random((n_random, Xtr.shape[1])) * 1.2 * span, Xtr]
    L = forest.leaves()
    thr = [(j, v) for j in range(Xtr.shape[1])
           for v in np.unique(np.concatenate([L["lo"][:, j], L["hi"][:, j]]))
           if np.isfinite(v)]  # fmt: skip
    base = Xtr[rng.integers(len(Xtr), size=len(thr) * 3)]
    near = base.copy()
    for i, (j, v) in enumerate(thr):
        for k, w in enumerate((v, np.nextafter(v, np.inf), np.nextafter(v, -np.inf))):
            near[3 * i + k, j] = w
    Q.append(near)
    return np.concatenate(Q)


def _loo_scores(forest, Q):
    """Scores of every LOO forest in the served class space: (n_records, n_q, C)."""
    C = forest.n_classes_
    index = {c: i for i, c in enumerate(forest.classes_.tolist())}
    out = []
    for rid in forest.record_ids_.tolist():
        g = copy.deepcopy(forest)
        g.delete([rid])
        s = np.zeros((len(Q), C))
        s[:, [index[c] for c in g.classes_.tolist()]] = g.scores(Q)
        out.append(s)
    return np.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sound_against_all_loo_forests(name):
    rng = np.random.default_rng(7)
    make, n_train, params = CASES[name]
    X, y = make(rng)
    Xtr, ytr, Xte, yte = X[:n_train], y[:n_train], X[n_train:], y[n_train:]
    ids = np.array([f"r{i}" for i in range(n_train)])
    forest = DaREForest(random_state=3, **params).fit(Xtr, ytr, record_ids=ids)
    h0 = forest.content_hash()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    assert forest.content_hash() == h0
    rep = guard.fit_report

    Q = _queries(rng, forest, Xtr)
    scores, delta, H = guard.bounds(Q)
    labels, certain = guard.certain(Q)
    assert np.array_equal(labels, np.argmax(forest.scores(Q), axis=1))
    loo = _loo_scores(forest, Q)
    # delta(q) bounds the true largest change of any class probability
    true_change = np.abs(loo - scores[None]).max(axis=(0, 2))
    assert (delta >= true_change - 1e-12).all()
    # H bounds how far any class gains on any other
    d = loo - scores[None]
    gain = (d[:, :, None, :] - d[:, :, :, None]).max(axis=0)
    assert (gain <= H + 1e-12).all()
    # ... and both are exact (per-record aggregation), up to rounding
    assert np.allclose(delta, true_change, rtol=0, atol=1e-12)
    assert np.allclose(H, gain, rtol=0, atol=1e-12)
    # every certified query is predicted identically by every LOO forest (argmax ties low)
    loo_pred = np.argmax(loo, axis=2)
    agree = (loo_pred == labels[None]).all(axis=0)
    assert agree[certain].all()
    # complete up to tol: where every LOO forest keeps the label by more than tol, certain
    idx = np.arange(len(Q))
    loo_margin = loo[:, idx, labels][:, :, None] - loo  # (records, n, C)
    loo_margin[:, idx, labels] = np.inf
    gap = scores[idx, labels][:, None] - scores
    gap[idx, labels] = np.inf
    clear = (loo_margin > 2 * guard.tol).all(axis=(0, 2)) & (gap > 2 * guard.tol).all(axis=1)
    assert certain[clear].all()
    # certain implies the weaker "margin > 2 delta" can fail, never the converse
    top = np.sort(scores, axis=1)
    margin = top[:, -1] - top[:, -2]
    assert certain[margin > 2 * delta + guard.tol].all()
    # leaves too large to read per query (every leaf here, with leaf_scan 0) are bounded
    # per class: never tighter than the exact sums, and still above every LOO forest's
    exact_q = guard._query
    guard._query = exact_q._replace(leaf_scan=0)
    _, b_delta, b_H = guard.bounds(Q)
    _, b_certain = guard.certain(Q)
    guard._query = exact_q
    assert (b_H >= H - 1e-12).all() and (b_delta >= delta - 1e-12).all()
    assert (gain <= b_H + 1e-12).all() and (b_delta >= true_change - 1e-12).all()
    assert agree[b_certain].all() and not (b_certain & ~certain).any()

    # accuracy at eps = 0 (uncertain answers uniform) vs the plain forest
    plain = forest.predict(Xte)
    answered = guard.answer(Xte)
    _, cte = guard.certain(Xte)
    assert np.array_equal(answered[cte], plain[cte])
    print(
        f"\n[{name}] fit {rep.seconds:.2f}s, {rep.n_records} records x {rep.n_trees} trees, "
        f"{rep.fragile_pairs} fragile (record, tree) pairs; "
        f"certain {certain.mean():.3f} of {len(Q)} queries (LOO-stable {agree.mean():.3f}), "
        f"margin>2delta {np.mean(margin > 2 * delta + guard.tol):.3f}; "
        f"test: certain {cte.mean():.3f}, acc plain {np.mean(plain == yte):.3f}, "
        f"acc guarded eps=0 {np.mean(answered == yte):.3f}"
    )


@pytest.mark.slow
def test_hash_mismatch_is_noise_all_until_refit():
    rng = np.random.default_rng(1)
    X, y = _two_d(rng)
    ids = np.array([f"r{i}" for i in range(60)])
    forest = DaREForest(n_estimators=8, max_depth=4, k=5, random_state=0).fit(X[:60], y[:60],
                                                                              record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=1.0, random_state=0)
    assert guard.mode == SOUND
    Q = rng.random((500, 2))
    _, c0 = guard.certain(Q)
    assert c0.any()
    forest.delete(["r3"])
    assert guard.mode == NOISE_ALL
    labels, c1 = guard.certain(Q)
    assert not c1.any()
    assert np.array_equal(labels, np.argmax(forest.scores(Q), axis=1))
    guard.answer(Q[:10])
    assert guard.guard.sound is False and guard.guard.counts.certain == 0
    with pytest.raises(RuntimeError):
        guard.bounds(Q)
    guard.refit()
    assert guard.mode == SOUND
    _, c2 = guard.certain(Q)
    assert c2.any()


def test_guard_notices_every_change_without_rehashing_each_query() -> None:
    """The generation check is what makes serving cheap; it must still see a deletion."""
    X, y = make_moons(60, noise=0.2, random_state=0)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))
    ids = [f"m{i}" for i in range(60)]
    forest = DaREForest(n_estimators=5, max_depth=4, k=5, random_state=0).fit(X, y, record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    assert guard.mode == SOUND
    before = forest.generation_
    forest.delete(["m3"])
    assert forest.generation_ != before
    assert guard.mode == NOISE_ALL
    assert not guard.certain(X)[1].any()
    guard.refit()
    assert guard.mode == SOUND and np.isfinite(guard.bounds(X)[1]).all()


def _small_forest(n=60, seed=0, **params):
    X, y = make_moons(n, noise=0.25, random_state=seed)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))
    ids = [f"m{i}" for i in range(n)]
    kw = dict(n_estimators=8, max_depth=5, k=5, d_rmax=1, random_state=seed) | params
    return DaREForest(**kw).fit(X, y, record_ids=ids), X


@pytest.mark.slow
def test_own_routing_and_scores_match_the_forest_bit_for_bit():
    """The guard routes queries itself; its leaves and scores must be the forest's."""
    rng = np.random.default_rng(3)
    forest, X = _small_forest()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    Q = _queries(rng, forest, X)
    assert np.array_equal(guard._st.forest_node[guard._rows(Q)], forest.leaf_nodes(Q))
    # more than 100_000 / T queries: DaREForest.scores sums the trees in chunks
    for batch in (Q[:1], Q, np.concatenate([Q] * (100_000 // (8 * len(Q)) + 1))):
        assert np.array_equal(guard._scores(guard._rows(batch)), forest.scores(batch))


def test_save_load_roundtrip_and_refusals(tmp_path):
    rng = np.random.default_rng(5)
    forest, X = _small_forest()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    guard.save(tmp_path / "g")
    loaded = ForestGuard.load(tmp_path / "g", forest, epsilon=0.5, memo_size=10, random_state=1)
    assert loaded.mode == SOUND and loaded.guard.epsilon == 0.5 and loaded.guard.memo.size == 10
    assert loaded.state_budget == np.inf  # later updates keep to the budget it was fitted with
    Q = np.concatenate([rng.random((4000, 2)), _queries(rng, forest, X)])
    for a, b in zip(guard.certain(Q), loaded.certain(Q), strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(guard.bounds(Q), loaded.bounds(Q), strict=True):
        assert np.array_equal(a, b)
    assert loaded.bound_summary == guard.bound_summary
    assert loaded.fit_report == guard.fit_report

    # a forest in any other state is refused: after a deletion, or with another seed
    other = copy.deepcopy(forest)
    other.delete(["m7"])
    with pytest.raises(ValueError, match="fitted to forest"):
        ForestGuard.load(tmp_path / "g", other)
    with pytest.raises(ValueError, match="fitted to forest"):
        ForestGuard.load(tmp_path / "g", _small_forest(seed=1)[0])
    # ... and a copy with the same content is accepted
    assert ForestGuard.load(tmp_path / "g", copy.deepcopy(forest)).mode == SOUND

    # tampered tables are refused, and so are tables whose indices do not fit the forest
    # (even with a matching recorded hash: the compiled kernels do not check bounds)
    with np.load(tmp_path / "g" / "pairs.npz") as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(tmp_path / "g" / "pairs.npz", **{**arrays, "cnt": arrays["cnt"] + 1})
    with pytest.raises(ValueError, match="recorded hash"):
        ForestGuard.load(tmp_path / "g", forest)
    bad = {**arrays, "prec": arrays["prec"] + 60}
    np.savez(tmp_path / "g" / "pairs.npz", **bad)
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    meta["tables_hash"] = hash_arrays(*(bad[k] for k in sorted(bad)))
    (tmp_path / "g" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not fit"):
        ForestGuard.load(tmp_path / "g", forest)

    # a loaded guard still notices a later update of its forest
    loaded.forest.delete(["m3"])
    assert loaded.mode == NOISE_ALL and not loaded.certain(Q)[1].any()


def test_bound_summary_is_small_json_and_bounds_every_change():
    forest, X = _small_forest()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    s = guard.bound_summary
    assert json.loads(json.dumps(s)) == s
    assert s["forest_hash"] == forest.content_hash() and s["n_records"] == 60
    assert 0 <= s["fragile_share"] <= 1 and s["fragile_pairs"] <= 60 * 8
    Q = np.random.default_rng(0).random((2000, 2))
    _, delta, _ = guard.bounds(Q)
    assert delta.max() <= s["delta_max_bound"] + 1e-12
    s["n_records"] = -1  # a copy: the guard's record is read-only
    assert guard.bound_summary["n_records"] == 60


# ----------------------------------------------------------------- fragility, budget, updates

def _tied(rng, n=300, d=5, levels=4):
    """A table's character: few distinct values per feature (ties), a noisy label."""
    X = np.round(rng.random((n, d)) * levels) / levels
    y = (X[:, 0] + X[:, 1] + rng.normal(0, 0.3, n) > 1).astype(int)
    return X, y


def _skewed(rng, n=300, d=5):
    """Counts and amounts: a few common values and a long tail of rare ones, so that a big
    node holds value groups of one record (near its listed pairs) beside large ones."""
    X = np.minimum(rng.geometric(0.25, size=(n, d)), 25) / 25.0
    y = (X[:, 0] + X[:, 1] + rng.normal(0, 0.15, n) > 0.3).astype(int)
    return X, y


def _one_hot(rng, n=300):
    """A table as the sidecar encodes it: two tied numbers and four categories of 4 to 8
    values as one 0/1 feature per category (26 features: wider than the kernel's
    record-major rows, and most slots of a node are a category's flag)."""
    nums = np.round(rng.random((n, 2)) * 5) / 5
    cats = [rng.integers(0, k, n) for k in (4, 6, 8, 8)]
    flags = [(c[:, None] == np.arange(k)).astype(float) for c, k in zip(cats, (4, 6, 8, 8),
                                                                      strict=True)]
    X = np.hstack([nums, *flags])
    from jobs.guard.forest.fragility import _ROW_VALUES
    assert X.shape[1] + 1 > _ROW_VALUES  # the wide path: ranks read by attribute
    y = (nums[:, 0] + (cats[0] % 2) * 0.6 + (cats[2] > 4) * 0.4
         + rng.normal(0, 0.3, n) > 1).astype(int)
    return X, y


def _tree_leaves(forest, t):
    L = forest.leaves()
    m = L["tree"] == t
    return L["path"][m], L["lo"][m], L["hi"][m], L["counts"][m]


@pytest.mark.slow
@pytest.mark.parametrize("data,params", [
    ("tied", dict(n_estimators=5, max_depth=6, k=5, d_rmax=1, random_state=1)),
    ("tied", dict(n_estimators=5, max_depth=7, k=3, d_rmax=1, min_samples_leaf=2,
                  criterion="entropy", random_state=2)),
    ("continuous", dict(n_estimators=5, max_depth=6, k=10, d_rmax=0, random_state=3)),
    ("onehot", dict(n_estimators=5, max_depth=7, k=5, d_rmax=1, random_state=4)),
    ("skewed", dict(n_estimators=5, max_depth=6, k=5, d_rmax=1, random_state=5)),
])
def test_every_stable_claim_holds_against_the_actual_deletion(data, params):
    """A record called stable at every node of its path in a tree must, when actually
    deleted, leave that tree with the same leaves (paths, boxes) and one leaf's counts one
    lower: the fact the closed form rests on. Fragile claims are the guard's caution."""
    from jobs.guard.forest.fragility import domain_fragile, fragile_records
    from jobs.learners.dare import view as dv

    rng = np.random.default_rng(11)
    if data == "tied":
        X, y = _tied(rng)
    elif data == "skewed":
        X, y = _skewed(rng)
    elif data == "onehot":
        X, y = _one_hot(rng)
    else:
        X = rng.random((300, 5))
        y = (X[:, 0] + X[:, 1] + rng.normal(0, 0.3, 300) > 1).astype(int)
    ids = np.array([f"r{i:04d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(**params).fit(X, y, record_ids=ids)
    tally: dict[str, float] = {}
    nodes, off, slots = fragile_records(forest, tally=tally)
    # rare values: some nodes are decided by the records of their near groups alone, and
    # some of those records are fragile
    assert data != "skewed" or (tally["looked_up_nodes"] > 0
                                and tally["looked_up_fragile"] > 0)
    v = dv.view(forest)
    fragile = np.zeros((forest.n_estimators, len(v.y)), bool)
    for i, nd in enumerate(nodes.tolist()):
        fragile[v.tree[nd], slots[off[i]:off[i + 1]]] = True
    for _, slot, _ in domain_fragile(forest):
        fragile[:, slot] = True
    before = [_tree_leaves(forest, t) for t in range(forest.n_estimators)]
    stable = 0
    for rid in ids[rng.permutation(len(ids))[:120]].tolist():
        slot = forest.state_.records.slot[rid]
        after = copy.deepcopy(forest)
        after.delete([rid])
        for t in range(forest.n_estimators):
            if fragile[t, slot]:
                continue
            stable += 1
            p0, lo0, hi0, c0 = before[t]
            p1, lo1, hi1, c1 = _tree_leaves(after, t)
            assert np.array_equal(p0, p1) and np.array_equal(lo0, lo1) \
                and np.array_equal(hi0, hi1), (rid, t)
            assert (c0 - c1).sum() == 1 and (c0 != c1).any(axis=1).sum() == 1, (rid, t)
    assert stable > 0.5 * 120 * forest.n_estimators  # the claims are not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.0, 0.3])
def test_a_small_state_budget_stays_sound(budget):
    """Pairs the budget cannot afford are charged the worst a tree can do: H still bounds
    every LOO forest's gain, and fewer queries are certain than with every pair exact."""
    rng = np.random.default_rng(4)
    X, y = _tied(rng, n=140, d=4)
    ids = np.array([f"r{i}" for i in range(len(y))])
    forest = DaREForest(n_estimators=10, max_depth=6, k=5, d_rmax=1,
                        random_state=5).fit(X, y, record_ids=ids)
    small = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=budget)
    exact = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    assert small.fit_report.detail["exact_pairs"] < exact.fit_report.detail["exact_pairs"]
    Q = _queries(rng, forest, X, n_random=1500)
    scores, _, H = small.bounds(Q)
    d = _loo_scores(forest, Q) - scores[None]
    gain = (d[:, :, None, :] - d[:, :, :, None]).max(axis=0)
    assert (gain <= H + 1e-12).all()
    assert (exact.bounds(Q)[2] - 1e-12 <= H).all()
    assert small.certain(Q)[1].sum() <= exact.certain(Q)[1].sum()


@pytest.mark.slow
@pytest.mark.parametrize("budget", [np.inf, 1.5])
def test_an_incremental_update_equals_a_full_refit(budget):
    """update(deleted, added) recomputes only what the records can have changed; the
    result must be the guard a fit from scratch on the updated forest gives (with a
    finite state budget: the same pairs, and bounds no smaller than the exact ones)."""
    rng = np.random.default_rng(8)
    X, y = _tied(rng, n=460, d=6, levels=10)
    ids = np.array([f"r{i:04d}" for i in range(len(y))], dtype=object)
    n = 400
    forest = DaREForest(n_estimators=10, max_depth=7, k=5, d_rmax=1, random_domain=2.0,
                        random_state=1).fit(X[:n], y[:n], record_ids=ids[:n])
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=budget)
    Q = rng.random((1500, X.shape[1]))
    live = list(ids[:n])
    for step in range(3):
        deleted = [live.pop(int(i)) for i in sorted(rng.choice(len(live), 6, replace=False),
                                                    reverse=True)]
        forest.delete(deleted)
        added = []
        if step == 1:
            added = list(ids[n:n + 5])
            forest.add(added, X[n:n + 5], y[n:n + 5])
        rep = guard.update(deleted, added)
        assert rep.detail["incremental"] and guard.mode == SOUND
        full = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=budget)
        assert rep.fragile_pairs == full.fit_report.fragile_pairs
        if np.isinf(budget):
            for a, b in zip(guard.bounds(Q), full.bounds(Q), strict=True):
                assert np.allclose(a, b, rtol=0, atol=1e-12)
        else:  # the budget may go to other pairs than a fit's: sound against exact gains
            exact = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
            scores, delta, H = guard.bounds(Q)
            e_scores, e_delta, e_H = exact.bounds(Q)
            assert np.allclose(scores, e_scores, rtol=0, atol=1e-12)
            assert (e_H - 1e-12 <= H).all() and (e_delta - 1e-12 <= delta).all()


def _pair_keys(guard):
    """The guard's pairs as (tree, heap path, record id, exact) rows, sorted."""
    st, p = guard._st, guard._pairs
    rows = zip(st.tree[p.node].tolist(), st.path[p.node].tolist(),
               guard._ids[p.prec].tolist(), (p.root >= 0).tolist(), strict=True)
    return sorted(rows)


def test_an_update_decides_each_signature_once_and_equals_a_fit():
    """On a tied table a few deletions cross the top of every tree, and each changed
    node holds most records: the update must run the per-record rule for a few (label,
    signature) classes, not for each of the (node, record) pairs it visits, and still give
    a fit's pairs and bounds."""
    rng = np.random.default_rng(31)
    X, y = _tied(rng, n=4000, d=6, levels=6)
    ids = np.array([f"r{i:05d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(n_estimators=6, max_depth=7, k=10, d_rmax=1, random_domain=2.0,
                        random_state=2).fit(X, y, record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    deleted = ids[rng.permutation(len(ids))[:10]].tolist()
    forest.delete(deleted)
    rep = guard.update(deleted)
    # the pairs it looked at: read (visited) or told from counts (settled)
    looked = rep.detail["visited"] + rep.detail["settled_pairs"]
    assert rep.detail["incremental"] and looked > 2 * len(ids)
    assert rep.detail["rule_runs"] < 0.1 * looked  # 8% here, 3% at 10^5
    full = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    assert _pair_keys(guard) == _pair_keys(full) and rep.fragile_pairs > 0
    Q = rng.random((1000, X.shape[1]))
    for a, b in zip(guard.bounds(Q), full.bounds(Q), strict=True):
        assert np.allclose(a, b, rtol=0, atol=1e-12)
    # and a fit's fragile sets are those of deciding every record on its own
    from jobs.guard.forest.fragility import fragile_records

    for a, b in zip(fragile_records(forest, margin=False), fragile_records(forest),
                    strict=True):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_an_update_out_of_time_stays_sound_and_a_refit_completes_it():
    """update(grow_seconds=0) grows no subtree: its fresh pairs are worst-case pairs. The
    guard must still bound every LOO forest's gain (checked exactly), certify no query a
    complete guard would not, say it is not complete, survive further such updates (the
    pool of subtrees may empty) and be completed by a refit."""
    rng = np.random.default_rng(12)
    X, y = _tied(rng, n=260, d=5, levels=8)
    ids = np.array([f"r{i:04d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(n_estimators=8, max_depth=6, k=5, d_rmax=1,
                        random_state=3).fit(X, y, record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    assert guard.complete and guard.bound_summary["complete"] is True
    live = list(ids)
    for _ in range(3):
        deleted = [live.pop(int(i)) for i in sorted(rng.choice(len(live), 15, replace=False),
                                                    reverse=True)]
        forest.delete(deleted)
        rep = guard.update(deleted, grow_seconds=0.0)
        assert guard.mode == SOUND and not guard.complete
        assert rep.detail["deferred_pairs"] > 0 and guard.bound_summary["complete"] is False
    Q = _queries(rng, forest, X[np.isin(ids, live)], n_random=1000)
    scores, _, H = guard.bounds(Q)
    d = _loo_scores(forest, Q) - scores[None]
    gain = (d[:, :, None, :] - d[:, :, :, None]).max(axis=0)
    assert (gain <= H + 1e-12).all()
    full = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    assert (full.bounds(Q)[2] - 1e-12 <= H).all()
    coarse = guard.certain(Q)[1]
    assert not (coarse & ~full.certain(Q)[1]).any()
    guard.refit()
    assert guard.complete and guard.certain(Q)[1].sum() == full.certain(Q)[1].sum()
    with pytest.raises(ValueError, match="grow_seconds"):
        guard.update([], grow_seconds=-1.0)


def test_an_update_that_removes_or_brings_a_class_equals_a_full_refit():
    """The last record of a class deleted (the forest drops the class and renumbers its
    counts), then a record of a new class added: the guard follows both."""
    rng = np.random.default_rng(2)
    X = rng.random((90, 3))
    y = np.where(np.arange(90) < 3, 2, (X[:, 0] > 0.5).astype(int))
    ids = np.array([f"r{i:03d}" for i in range(90)], dtype=object)
    forest = DaREForest(n_estimators=6, max_depth=5, k=5, random_state=0).fit(X, y, record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
    Q = rng.random((800, 3))
    for deleted, added in ((["r000", "r001", "r002"], []), ([], ["n0"])):
        if deleted:
            forest.delete(deleted)
        else:
            forest.add(np.array(added, dtype=object), rng.random((1, 3)), np.array([7]))
        guard.update(deleted, added)
        full = ForestGuard.fit(forest, epsilon=0.0, random_state=0, state_budget=np.inf)
        assert guard.mode == SOUND and guard.forest.n_classes_ == (2 if deleted else 3)
        for a, b in zip(guard.bounds(Q), full.bounds(Q), strict=True):
            assert np.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("data,params", [
    ("tied", dict(n_estimators=4, max_depth=8, k=10, d_rmax=1, random_state=4)),
    ("tied", dict(n_estimators=4, max_depth=6, k=3, criterion="entropy", min_samples_leaf=3,
                  random_state=5)),
    ("continuous", dict(n_estimators=4, max_depth=8, k=10, random_state=6)),
    ("three", dict(n_estimators=4, max_depth=7, k=5, criterion="entropy", random_state=7)),
    ("onehot", dict(n_estimators=4, max_depth=8, k=10, d_rmax=1, random_state=8)),
    ("skewed", dict(n_estimators=4, max_depth=8, k=10, d_rmax=1, random_state=9)),
])
def test_the_margin_shortcut_decides_every_record_as_the_full_rule(data, params):
    """Nodes far from a tie skip the per-record rule for records that cannot move their
    listed pairs: the fragile sets must be exactly those of deciding every record."""
    from jobs.guard.forest.fragility import fragile_records

    rng = np.random.default_rng(21)
    n = 3000
    if data == "tied":
        X, y = _tied(rng, n=n, d=6, levels=6)
    elif data == "skewed":
        X, y = _skewed(rng, n=n)
    elif data == "onehot":
        X, y = _one_hot(rng, n=n)
    else:
        X = rng.random((n, 6))
        y = (X[:, 0] + X[:, 1] + rng.normal(0, 0.3, n) > 1).astype(int)
        if data == "three":
            y = y + (X[:, 2] > 0.7)
    ids = np.array([f"r{i:05d}" for i in range(n)], dtype=object)
    forest = DaREForest(**params).fit(X, y, record_ids=ids)
    forest.delete(ids[rng.permutation(n)[:40]].tolist())  # counts moved, some splits too
    full = fragile_records(forest, margin=False)
    tally: dict[str, float] = {}
    short = fragile_records(forest, tally=tally)
    for a, b in zip(full, short, strict=True):
        assert np.array_equal(a, b)
    assert len(full[2]) > 0
    if data in ("tied", "onehot", "skewed"):  # few values: tables, and nodes told from
        assert tally["settled_pairs"] > 0  # counts (and the records of near groups) alone
    assert data != "skewed" or (tally["looked_up_nodes"] > 0
                                and tally["looked_up_fragile"] > 0)


@pytest.mark.slow
def test_the_margin_shortcut_on_many_random_forests():
    """The same on 24 forests drawn at random: sizes, value levels (ties or none), classes,
    k, min_samples_leaf, criterion, and a batch of deletions and additions since the fit."""
    from jobs.guard.forest.fragility import fragile_records

    for seed in range(24):
        rng = np.random.default_rng(100 + seed)
        n = int(rng.integers(200, 1500))
        d = int(rng.integers(2, 8))
        levels = [2, 3, 5, 20, 0][seed % 5]
        X = rng.random((n + 20, d))
        if levels:
            X = np.round(X * levels) / levels
        C = int(rng.integers(2, 5))
        score = X[:, 0] + 0.5 * X[:, -1] + rng.normal(0, 0.25, n + 20)
        y = np.digitize(score, np.quantile(score, np.linspace(0, 1, C + 1)[1:-1]))
        ids = np.array([f"r{i:05d}" for i in range(n + 20)], dtype=object)
        forest = DaREForest(n_estimators=3, max_depth=int(rng.integers(3, 9)),
                            k=int(rng.integers(1, 12)), d_rmax=int(rng.integers(0, 2)),
                            min_samples_leaf=int(rng.integers(1, 4)),
                            criterion=["gini", "entropy"][seed % 2],
                            random_state=seed).fit(X[:n], y[:n], record_ids=ids[:n])
        forest.delete(ids[rng.permutation(n)[:int(rng.integers(1, 30))]].tolist())
        forest.add(ids[n:], X[n:], y[n:])
        full = fragile_records(forest, margin=False)
        short = fragile_records(forest)
        for a, b in zip(full, short, strict=True):
            assert np.array_equal(a, b), seed


@pytest.mark.slow
def test_lists_kept_by_cached_nodes_are_the_split_search_s():
    """dare_view.candidates hands out a cached node's own lists (kept up to date by every
    deletion and addition) instead of searching again: on random forests, tied or not,
    after batches of deletions and additions, every greedy node's lists are a prefix of a
    fresh split search's over its records (its first k + buffer pairs; the all-pairs flag
    where the list is shorter than that), and a shorter prefix still holds k + 2 pairs,
    what one more deletion needs."""
    from jobs.learners.dare import view as dv
    from jobs.learners.dare.split_search import greedy_splits

    cached = prefixes = 0
    for seed in range(8):
        rng = np.random.default_rng(300 + seed)
        n = int(rng.integers(800, 2500))
        X = rng.random((n + 200, 5))
        if seed % 2:
            X = np.round(X * int(rng.integers(3, 12))) / 10
        y = ((X[:, 0] + 0.3 * rng.standard_normal(n + 200)) > 0.5).astype(int)
        ids = np.array([f"r{i:05d}" for i in range(n + 200)], dtype=object)
        forest = DaREForest(n_estimators=4, max_depth=7, k=int(rng.integers(2, 11)),
                            d_rmax=seed % 2, random_state=seed).fit(X[:n], y[:n],
                                                                    record_ids=ids[:n])
        KB = forest.k + forest.tuning.buffer
        need = forest.k + min(2, forest.tuning.buffer)
        for step in range(3):
            forest.delete(rng.choice(forest.record_ids_, int(rng.integers(1, 60)),
                                     replace=False).tolist())
            new = slice(n + 50 * step, n + 50 * step + int(rng.integers(0, 50)))
            if new.stop > new.start:
                forest.add(ids[new], X[new], y[new])
            v = dv.view(forest)
            nodes = np.flatnonzero(v.used & (v.kind == dv.GREEDY))
            pool = forest.state_.nodes
            cached += int((pool.cid[nodes] >= 0).sum())
            rows, off = dv.node_records(forest, nodes)
            got = dv.candidates(forest, nodes, rows, off[:-1], off[1:])
            ok, attr, r1, _r2, lists = greedy_splits(
                forest.state_, pool.tree[nodes].astype(np.int64),
                pool.path[nodes].astype(np.int64), pool.n[nodes].astype(np.int64),
                pool.cnt[nodes].astype(np.int64), rows, off, np.ones(len(nodes), dtype=bool))
            ct, sa, al, eo, ln = (lists.task, lists.slot_attr, lists.all_pairs, lists.off,
                                  lists.length)
            e_r1, e_r2, e_left = lists.e_r1, lists.e_r2, lists.e_left
            assert np.array_equal(got.ok, ok) and np.array_equal(got.split_attr, attr)
            assert np.array_equal(got.split_r1, r1)
            assert np.array_equal(got.attr[ct], sa)
            glen = got.length[ct]
            assert np.all(glen <= ln)
            cut = (glen < ln) & (sa >= 0)
            prefixes += int(cut.sum())
            assert np.all(glen[cut] >= need) and not got.all_pairs[ct][cut].any()
            whole = (glen == ln) & (ln < KB)
            assert np.array_equal(got.all_pairs[ct][whole], al[whole])
            for i, s in zip(*np.nonzero(sa >= 0), strict=True):
                a, b, m = got.off[ct[i], s], eo[i, s], glen[i, s]
                assert np.array_equal(got.e_r1[a:a + m], e_r1[b:b + m])
                assert np.array_equal(got.e_r2[a:a + m], e_r2[b:b + m])
                assert np.array_equal(got.e_left[a:a + m], e_left[b:b + m])
    assert cached > 1000 and prefixes > 0  # the cached path was taken, short lists too


def test_a_batch_that_changes_almost_every_node_refits():
    """When the changed nodes hold nearly every (node, record) pair, update() refits
    from scratch (cheaper than recomputing them one by one) and says so."""
    rng = np.random.default_rng(9)
    X, y = _tied(rng, n=400, d=6, levels=10)
    ids = np.array([f"r{i:04d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(n_estimators=6, max_depth=6, k=5, d_rmax=1, random_domain=2.0,
                        random_state=2).fit(X, y, record_ids=ids)
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    deleted = list(ids[rng.permutation(len(ids))[:200]])
    forest.delete(deleted)
    rep = guard.update(deleted)
    assert not rep.detail["incremental"] and guard.mode == SOUND
    full = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    Q = rng.random((500, X.shape[1]))
    for a, b in zip(guard.bounds(Q), full.bounds(Q), strict=True):
        assert np.allclose(a, b, rtol=0, atol=1e-12)


def test_grown_subtrees_are_the_same_when_tasks_share_nodes():
    """dare_view.grow decides each distinct (node, records) once and hands the decision to
    the tasks that repeat it (pairs whose deletions move a split the same way grow the
    same child away from the record). Every task's subtree must be the one it grows
    alone: many pairs of one node (duplicate children) and exact duplicate tasks."""
    from jobs.learners.dare import view as dv

    rng = np.random.default_rng(21)
    X, y = _tied(rng, n=400, d=5, levels=6)
    ids = np.array([f"r{i:04d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(n_estimators=3, max_depth=6, k=4, d_rmax=0,
                        random_state=2).fit(X, y, record_ids=ids)
    v = dv.view(forest)
    roots = np.flatnonzero(v.used & (v.depth == 1))[:2]
    rows, off = dv.node_records(forest, roots)
    tasks = []  # (node, rows): each node's records minus one, and one task twice
    for i, u in enumerate(roots):
        mine = rows[off[i]:off[i + 1]]
        tasks += [(u, np.delete(mine, j)) for j in range(0, len(mine), 7)]
    tasks.append(tasks[0])
    u = np.array([t[0] for t in tasks])
    all_rows = np.concatenate([t[1] for t in tasks])
    all_off = np.concatenate([[0], np.cumsum([len(t[1]) for t in tasks])]).astype(np.int64)
    together = dv.grow(forest, v.tree[u], v.path[u], v.depth[u], all_rows, all_off)
    for i, (node, r) in enumerate(tasks):
        alone = dv.grow(forest, v.tree[[node]], v.path[[node]], v.depth[[node]], r,
                        np.array([0, len(r)], dtype=np.int64))
        a, b = slice(together.off[i], together.off[i + 1]), slice(0, alone.off[1])
        base = together.off[i]
        for name in ("leaf", "attr", "thr", "cnt", "n"):
            assert np.array_equal(getattr(together, name)[a], getattr(alone, name)[b]), name
        for name in ("left", "right"):
            t, s = getattr(together, name)[a], getattr(alone, name)[b]
            assert np.array_equal(np.where(t >= 0, t - base, -1), s), name


def test_fragile_records_decided_in_chunks_are_those_decided_at_once(monkeypatch) -> None:
    """The nodes are decided a chunk of (node, record) pairs at a time, to bound the
    memory of the records' slots: any chunk size gives the same nodes, counts and slots."""
    import jobs.guard.forest.fragility as fragility

    X, y = load_breast_cancer(return_X_y=True)
    forest = DaREForest(n_estimators=5, max_depth=8, k=5, d_rmax=1, random_state=0).fit(
        X, y, record_ids=np.arange(len(y)))
    whole = fragility.fragile_records(forest)
    monkeypatch.setattr(fragility, "_CHUNK_PAIRS", 997)
    chunked = fragility.fragile_records(forest)
    assert len(whole[2]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_the_forests_value_group_tables_the_kernel_reads_are_its_nodes_records(tmp_path):
    """On a wide table the kernel takes a slot's value groups from the forest's own table
    rather than reading the node's records: after deletions, additions and a save (which
    drops deleted records' slots and renumbers the value ranks), every table it is
    handed holds exactly the node's live records, by value and label (and the fragile
    sets with them are the full rule's: the margin test above)."""
    from jobs.guard.forest.fragility import _tables
    from jobs.learners.dare import view as dv

    rng = np.random.default_rng(31)
    X, y = _one_hot(rng, n=2400)
    ids = np.array([f"r{i:05d}" for i in range(len(y))], dtype=object)
    forest = DaREForest(n_estimators=4, max_depth=8, k=10, d_rmax=1, random_state=8).fit(
        X[:2300], y[:2300], record_ids=ids[:2300])
    forest.delete(ids[rng.permutation(2300)[:60]].tolist())
    forest.add(ids[2300:], X[2300:], y[2300:])
    forest.save(tmp_path / "f")  # compacts the store: ranks renumbered in the tables too
    forest.delete(rng.choice(forest.record_ids_, 5, replace=False).tolist())
    v = dv.view(forest)
    greedy = np.flatnonzero(v.used & (v.kind == dv.GREEDY))
    rows, off = dv.node_records(forest, greedy)
    cand = dv.candidates(forest, greedy, rows, off[:-1], off[1:])
    tab = _tables(forest, greedy, cand, use=True)
    checked = 0
    for i, s in zip(*np.nonzero(tab.length > 0), strict=True):
        mine = rows[off[i]:off[i + 1]]
        a = cand.attr[i, s]
        lo, hi = tab.off[i, s], tab.off[i, s] + tab.length[i, s]
        held = {(int(q), c): int(m) for q, counts in zip(tab.rank[lo:hi], tab.cnt[lo:hi],
                                                         strict=True)
                for c, m in enumerate(counts.tolist()) if m}
        counted: dict[tuple[int, int], int] = {}
        for q, c in zip(v.rank[a, mine].tolist(), v.y[mine].tolist(), strict=True):
            counted[q, c] = counted.get((q, c), 0) + 1
        assert held == counted, (i, s)
        checked += 1
    assert checked > 20  # the kernel has tables to read
    assert not _tables(forest, greedy, cand, use=False).length.any()


def test_the_live_slots_a_guard_reads_follow_the_forest_through_updates_and_saves(
        tmp_path) -> None:
    """`live_slots` is kept between calls: after a deletion, an addition and the
    compaction of a save (which renumbers slots without a new generation) it is the
    slot of every live record in id order, as computed afresh."""
    from jobs.learners.dare import view as dv

    rng = np.random.default_rng(2)
    X = rng.normal(size=(300, 4))
    y = (X[:, 0] > 0).astype(int)
    ids = np.array([f"s{i:03d}" for i in range(300)], dtype=object)
    forest = DaREForest(n_estimators=3, max_depth=4, k=3, random_state=0).fit(
        X[:250], y[:250], record_ids=ids[:250])

    def afresh() -> np.ndarray:
        slot = forest.state_.records.slot
        return np.array([slot[i] for i in forest.record_ids_.tolist()])

    for step in (lambda: None, lambda: forest.delete(ids[:20]),
                 lambda: forest.add(ids[250:260], X[250:260], y[250:260]),
                 lambda: forest.save(tmp_path / "m"), lambda: forest.delete(ids[20:25])):
        step()
        got = dv.live_slots(forest)
        assert np.array_equal(got, afresh()) and not got.flags.writeable
        assert dv.live_slots(forest) is got  # kept while nothing changed

"""SISA ensemble: exact unlearning, checked bit for bit against a retrain from scratch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from jobs.guard.lucid.shard_bounds import ensemble_loo_set
from jobs.learners.base import DuplicateRecordError, UnknownRecordError
from jobs.learners.keyed import prf_u64
from jobs.learners.networks.loo_training import MLPParams, schedule_keys, train_single
from jobs.learners.networks.torch_nets import (
    build_net,
    epoch_batches,
    hash_state,
    init_net,
    mlp_state,
    stage_epochs,
    state_to_cpu,
    states_equal,
)
from jobs.learners.sisa.ensemble import SISAEnsemble
from ledger import datasets
from tests.leaks import traces_found

TINY = {"hidden": (8,), "epochs_per_slice": 2, "min_steps": 0, "batch_size": 8, "lr": 0.05}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _pool(n: int = 200, d: int = 5, n_classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, d))
    y = (X[:, 0] * n_classes).astype(int).clip(0, n_classes - 1)
    ids = np.array([f"p{i}" for i in range(n)], dtype=object)
    return ids, X, y


def _model(**kw) -> SISAEnsemble:
    params = {**TINY, "device": "cpu", **kw}
    return SISAEnsemble(**params)


def _live(m: SISAEnsemble):
    return m.record_ids_, m.X_, m.classes_[m.y_]


def _where(m: SISAEnsemble, some_ids) -> tuple[np.ndarray, np.ndarray]:
    """(memberships (n, S), slices) of live records."""
    return m.memberships(some_ids), m.slice_of_[np.searchsorted(m.record_ids_, some_ids)]


def _tombstones_of(m: SISAEnsemble, member: np.ndarray, gone) -> dict[int, list[int]]:
    """Expected tombstones: per shard, the sorted schedule keys (under the shard's
    seed) of the deleted records ``gone`` whose memberships (n, S) put them there."""
    gone = np.asarray(gone, dtype=object)
    return {s: sorted(schedule_keys(prf_u64(m.seed_, "init", s), gone[member[:, s]]).tolist())
            for s in np.flatnonzero(member.any(axis=0)).tolist()}


def _keys(m: SISAEnsemble) -> dict[int, list[int]]:
    return {s: keys.tolist() for s, keys in m.tombstones_.items()}


def _earliest(member: np.ndarray, slices: np.ndarray) -> dict[int, int]:
    """Per shard holding any of the records, the earliest of their slices."""
    return {int(s): int(slices[member[:, s]].min()) for s in np.flatnonzero(member.any(axis=0))}


# --------------------------------------------------------------------------- basics


def test_fit_predict_shapes_and_learns():
    ids, X, y = _pool(300)
    m = _model(n_shards=3, n_slices=2, epochs_per_slice=6).fit(X[:240], y[:240],
                                                               record_ids=ids[:240])
    assert m.fit(X[:240], y[:240], record_ids=ids[:240]) is m
    assert m.guarantee == "exact"
    sc = m.scores(X[240:])
    assert sc.shape == (60, 3)
    np.testing.assert_array_equal(sc.sum(axis=1), np.full(60, m.active_shards_.sum()))
    assert m.shard_logits(X[240:]).shape == (3, 60, 3)
    assert m.shard_predictions(X[240:]).shape == (3, 60)
    acc = (m.predict(X[240:]) == y[240:]).mean()
    assert acc > 0.6
    assert m.shard_sizes_.sum() == 240


def test_same_seed_same_bits_and_row_order_irrelevant():
    ids, X, y = _pool(80)
    a = _model(n_shards=2, n_slices=2).fit(X, y, record_ids=ids)
    perm = np.random.default_rng(1).permutation(80)
    b = _model(n_shards=2, n_slices=2).fit(X[perm], y[perm], record_ids=ids[perm])
    assert a.content_hash() == b.content_hash()
    c = _model(n_shards=2, n_slices=2, random_state=1).fit(X, y, record_ids=ids)
    assert c.content_hash() != a.content_hash()


def test_bits_independent_of_process_thread_setting():
    ids, X, y = _pool(80)
    a = _model(n_shards=1).fit(X, y, record_ids=ids)
    torch.set_num_threads(2)
    try:
        b = _model(n_shards=1).fit(X, y, record_ids=ids)
        assert torch.get_num_threads() == 2  # restored after training
    finally:
        torch.set_num_threads(1)
    assert a.content_hash() == b.content_hash()


def test_sklearn_conventions():
    m = _model(n_shards=4)
    assert m.get_params()["n_shards"] == 4
    c = clone(m)
    assert c.get_params() == m.get_params()
    assert not hasattr(c, "checkpoints_")
    with pytest.raises(NotFittedError):
        m.predict(np.zeros((1, 5)))
    with pytest.raises(ValueError, match="model"):
        _model(model="rf").fit([[0.0]], [0], record_ids=["a"])
    with pytest.raises(ValueError, match="aggregation"):
        _model(aggregation="max").fit([[0.0]], [0], record_ids=["a"])
    with pytest.raises(ValueError, match="n_shards"):
        _model(n_shards=0).fit([[0.0]], [0], record_ids=["a"])


@pytest.mark.parametrize("hidden", [[8], [16, 8]])
def test_compiled_mlp_training_is_torchs_adam_loop(hidden):
    """An MLP on the CPU trains in one compiled loop (jobs.learners.networks.mlp_kernels) instead of
    torch's per-step calls: the same batches, forward, cross-entropy, back-propagation and
    Adam, so the weights after a few epochs are torch's up to float32 summation order, and
    the same bits on every run (exact unlearning needs that, not torch's bits)."""
    from jobs.learners.networks import torch_nets as nets

    rng = np.random.default_rng(3)
    n, d, C = 300, 6, 3
    X = torch.from_numpy(rng.random((n, d)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, C, n).astype(np.int64))
    keys = np.array([prf_u64(0, "batch", i) for i in range(n)], dtype=np.uint64)

    def trained(torch_loop=False):
        net = init_net(build_net("mlp", d, C, hidden), 5)
        # its layers as a plain Sequential are not an MLP: train_stage runs torch's loop
        body = net.net if torch_loop else net
        nets.train_stage(body, X, y, keys, seed=1, stage_key=(0, 0), epochs=4, batch_size=16,
                         lr=0.01)
        return list(state_to_cpu(net).values())

    compiled, again, reference = trained(), trained(), trained(torch_loop=True)
    start = list(init_net(build_net("mlp", d, C, hidden), 5).state_dict().values())
    for a, b, r, s0 in zip(compiled, again, reference, start, strict=True):
        assert torch.equal(a, b)
        assert torch.allclose(a, r, rtol=0, atol=1e-4)
        assert not torch.equal(a, s0)  # it trained


def test_keyed_batches_are_a_function_of_the_set():
    keys = np.array([prf_u64(0, "batch", f"r{i}") for i in range(50)], dtype=np.uint64)
    full = epoch_batches(keys, 123, 4)
    assert sorted(np.concatenate(full).tolist()) == list(range(50))
    # dropping row 7: every other row keeps its batch and its order within the batch
    mask = np.arange(50) != 7
    part = epoch_batches(keys[mask], 123, 4)
    kept = np.flatnonzero(mask)
    mapped = [kept[b].tolist() for b in part]
    expected = [[i for i in b.tolist() if i != 7] for b in full]
    assert mapped == [b for b in expected if b]


# --------------------------------------------------------------------------- property


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_update_sequences_stay_exact(data):
    ids, X, y = _pool(60, n_classes=3, seed=2)
    S = data.draw(st.integers(1, 4), label="S")
    R = data.draw(st.integers(1, 3), label="R")
    add_slice = data.draw(st.sampled_from(["last", "keyed"]), label="add_slice")
    agg = data.draw(st.sampled_from(["vote", "mean"]), label="aggregation")
    n0 = data.draw(st.integers(1, 30), label="n0")
    sampling = data.draw(st.sampled_from(["partition", "independent"]), label="sampling")
    # sliced shards under the LOO schedule too (tombstones per slice)
    schedule = data.draw(st.sampled_from(["auto", "loo"]), label="schedule")
    m = _model(
        schedule=schedule,
        sampling=sampling,
        shard_prob=0.5,
        n_shards=S,
        n_slices=R,
        add_slice=add_slice,
        aggregation=agg,
        classes=(0, 1, 2),
        random_state=data.draw(st.integers(0, 3), label="seed"),
    )
    m.fit(X[:n0], y[:n0], record_ids=ids[:n0])
    live = set(range(n0))
    for _ in range(data.draw(st.integers(1, 5), label="n_ops")):
        op = data.draw(st.sampled_from(["add", "delete", "bad_delete", "bad_add"]), label="op")
        before = m.content_hash()
        if op == "add":
            free = sorted(set(range(60)) - live)
            if not free:
                continue
            pick = data.draw(
                st.lists(st.sampled_from(free), min_size=1, max_size=4, unique=True), label="add"
            )
            rep = m.add(ids[pick], X[pick], y[pick])
            live |= set(pick)
            member, slices = _where(m, ids[pick])
            if add_slice == "last":
                assert (slices == R - 1).all()
                if m.config_["schedule"] == "adam":  # (a re-added tombstone moves it back)
                    assert set(rep.retrained["from_slice"].values()) <= {R - 1}
            assert rep.retrained["shards"] == np.flatnonzero(member.any(axis=0)).tolist()
        elif op == "delete":
            if not live:
                continue
            pick = data.draw(
                st.lists(st.sampled_from(sorted(live)), min_size=1, max_size=4, unique=True),
                label="delete",
            )
            member, slices = _where(m, ids[pick])
            rep = m.delete(ids[pick])
            live -= set(pick)
            assert rep.retrained["from_slice"] == _earliest(member, slices)
        elif op == "bad_delete":
            gone = sorted(set(range(60)) - live)
            with pytest.raises(UnknownRecordError):
                m.delete(ids[[*sorted(live)[:1], *gone[:1]]] if gone else ["nope"])
            assert m.content_hash() == before
        else:
            if not live:
                continue
            k = sorted(live)[0]
            with pytest.raises(DuplicateRecordError):
                m.add(ids[[k]], X[[k]], y[[k]])
            assert m.content_hash() == before
    assert set(m.record_ids_.tolist()) == {ids[i] for i in live}
    rep = m.verify()
    assert rep.exact, rep.detail
    assert rep.served_hash == rep.retrained_hash
    assert m.config_["schedule"] == "loo" or len(m.tombstones_) == 0
    if add_slice == "keyed" and live and len(m.tombstones_) == 0:
        # with keyed slices (and no tombstones) the model IS a plain fit on the live set
        lid, lX, ly = _live(m)
        fresh = clone(m).fit(lX, ly, record_ids=lid)
        assert fresh.content_hash() == m.content_hash()


def test_independent_sampling_joins_each_shard_with_probability_p(tmp_path):
    ids, X, y = _pool(400)
    m = _model(n_shards=4, sampling="independent", shard_prob=0.3, epochs_per_slice=1)
    m.fit(X, y, record_ids=ids)
    member = m.memberships(ids)
    assert member.shape == (400, 4)
    assert abs(member.mean() - 0.3) < 0.05  # 1,600 keyed draws
    assert m.max_shards_per_record_ == member.sum(axis=1).max() > 1
    assert (m.shard_sizes_ == member.sum(axis=0)).all()
    with pytest.raises(ValueError, match="memberships"):
        m.locate(ids[:1])
    # a deletion retrains every shard holding the record, and only those
    k = int(np.flatnonzero(member.sum(axis=1) >= 2)[0])
    before = [m.shard_hash(s) for s in range(4)]
    rep = m.delete(ids[[k]])
    assert rep.retrained["shards"] == np.flatnonzero(member[k]).tolist()
    after = [m.shard_hash(s) for s in range(4)]
    assert [b != a for b, a in zip(before, after, strict=True)] == member[k].tolist()
    assert m.verify().exact
    m.save(tmp_path / "m")
    back = SISAEnsemble.load(tmp_path / "m")
    assert back.content_hash() == m.content_hash()
    live = m.record_ids_[:50]
    assert (back.memberships(live) == m.memberships(live)).all()
    # the same seed gives the same memberships; another seed other ones
    other = _model(n_shards=4, sampling="independent", shard_prob=0.3, epochs_per_slice=1,
                   random_state=1).fit(X, y, record_ids=ids)
    assert (other.memberships(ids[:50]) != member[:50]).any()
    with pytest.raises(ValueError, match="shard_prob"):
        _model(sampling="independent", shard_prob=0.0).fit(X, y, record_ids=ids)
    with pytest.raises(ValueError, match="sampling"):
        _model(sampling="bagging").fit(X, y, record_ids=ids)


def test_delete_equals_fresh_fit_on_live_set():
    ids, X, y = _pool(90)
    m = _model(n_shards=3, n_slices=3, classes=(0, 1, 2)).fit(X, y, record_ids=ids)
    m.delete(ids[[3, 10, 44, 45, 80]])
    keep = np.setdiff1d(np.arange(90), [3, 10, 44, 45, 80])
    fresh = _model(n_shards=3, n_slices=3, classes=(0, 1, 2)).fit(X[keep], y[keep],
                                                                  record_ids=ids[keep])
    assert fresh.content_hash() == m.content_hash()
    for s in range(3):
        for r in range(3):
            assert fresh.checkpoint_hash(s, r) == m.checkpoint_hash(s, r)


# --------------------------------------------------------------------------- locality


def test_deletion_retrains_only_affected_shard():
    ids, X, y = _pool(100)
    m = _model(n_shards=5).fit(X, y, record_ids=ids)
    before = [m.shard_hash(s) for s in range(5)]
    (s,), _ = m.locate([ids[17]])
    rep = m.delete([ids[17]])
    assert rep.retrained["shards"] == [int(s)]
    assert rep.guarantee == "exact" and rep.op == "delete" and rep.record_ids == [ids[17]]
    after = [m.shard_hash(k) for k in range(5)]
    for k in range(5):
        assert (after[k] == before[k]) == (k != s)
    assert m.verify_shard(int(s)).exact
    assert m.verify().exact


def test_deleting_from_slice_r_keeps_earlier_checkpoints():
    ids, X, y = _pool(120)
    R = 4
    m = _model(n_shards=2, n_slices=R).fit(X, y, record_ids=ids)
    shards, slices = m.locate(ids)
    for r in (3, 1, 0, 2):
        cand = [i for i in range(120) if slices[i] == r and ids[i] in m.state_.records.row]
        i = cand[0]
        s = int(shards[i])
        old = [m.checkpoint_hash(s, k) for k in range(R)]
        other = [m.checkpoint_hash(1 - s, k) for k in range(R)]
        rep = m.delete([ids[i]])
        assert rep.retrained["from_slice"] == {s: r}
        new = [m.checkpoint_hash(s, k) for k in range(R)]
        assert new[:r] == old[:r]
        assert all(new[k] != old[k] for k in range(r, R))
        assert [m.checkpoint_hash(1 - s, k) for k in range(R)] == other
    assert m.verify().exact


def test_add_goes_to_last_slice_and_retrains_only_it():
    ids, X, y = _pool(120)
    R = 3
    m = _model(n_shards=2, n_slices=R).fit(X[:100], y[:100], record_ids=ids[:100])
    old = {s: [m.checkpoint_hash(s, k) for k in range(R)] for s in range(2)}
    rep = m.add(ids[100:103], X[100:103], y[100:103])
    _, slices = m.locate(ids[100:103])
    assert (slices == R - 1).all()
    assert set(rep.retrained["from_slice"].values()) == {R - 1}
    for s in range(2):
        new = [m.checkpoint_hash(s, k) for k in range(R)]
        assert new[: R - 1] == old[s][: R - 1]
    # a record that was fitted, deleted and re-added lives in the last slice now
    (s0,), (r0,) = m.locate([ids[0]])
    m.delete([ids[0]])
    m.add([ids[0]], X[[0]], y[[0]])
    assert m.locate([ids[0]])[1][0] == R - 1
    assert m.verify().exact


def test_add_keyed_slice_option():
    ids, X, y = _pool(120)
    m = _model(n_shards=2, n_slices=3, add_slice="keyed", classes=(0, 1, 2))
    m.fit(X[:100], y[:100], record_ids=ids[:100])
    rep = m.add(ids[100:110], X[100:110], y[100:110])
    _, slices = m.locate(ids[100:110])
    assert min(rep.retrained["from_slice"].values()) == min(slices)
    full = clone(m).fit(X[:110], y[:110], record_ids=ids[:110])
    assert full.content_hash() == m.content_hash()


# --------------------------------------------------------------------------- edge cases


def test_multiclass_and_removing_last_record_of_a_class():
    ids, X, y = _pool(100, n_classes=4, seed=3)
    y = y.copy()
    y[7] = 9  # class 9 has exactly one record
    m = _model(n_shards=3, n_slices=2).fit(X, y, record_ids=ids)
    assert m.classes_.tolist() == [0, 1, 2, 3, 9]
    m.delete([ids[7]])
    assert m.classes_.tolist() == [0, 1, 2, 3, 9]  # output layer keeps the class
    assert m.scores(X[:5]).shape == (5, 5)
    assert m.verify().exact
    m.add(["new9"], X[[7]], [9])  # the class can come back
    assert m.verify().exact


def test_string_labels_and_int_ids():
    _, X, y = _pool(50)
    labels = np.array(["cat", "dog", "emu"])[y]
    m = _model(n_shards=2).fit(X, labels, record_ids=np.arange(50))
    assert set(m.predict(X[:10])) <= {"cat", "dog", "emu"}
    m.delete([3, 4])
    m.add([1000], X[[3]], ["emu"])
    with pytest.raises(UnknownRecordError):
        m.delete([3])
    assert m.verify().exact


def test_values_outside_seen_range_duplicates_and_constant_attributes():
    ids, X, y = _pool(60)
    X = X.copy()
    X[:, 2] = 0.5  # constant attribute
    X[10:20] = X[10]  # duplicate feature rows (different ids, same and different labels)
    y = y.copy()
    y[15] = (y[10] + 1) % 3
    m = _model(n_shards=3, n_slices=2).fit(X, y, record_ids=ids)
    out = np.array([[5.0, -3.0, 0.5, 1e3, -1e-3], [0, 0, 0, 0, 0]], dtype=float)
    m.add(["far1", "far2"], out, [0, 2])
    m.add(["dupX"], X[[10]], [y[10]])
    m.delete([ids[12], ids[15]])
    assert m.verify().exact
    assert np.isfinite(m.shard_logits(out)).all()


def test_deleting_everything_in_a_shard_and_everything_at_all():
    ids, X, y = _pool(60)
    m = _model(n_shards=3, n_slices=2).fit(X, y, record_ids=ids)
    shards, _ = m.locate(ids)
    victims = ids[shards == 1]
    rep = m.delete(victims)
    assert rep.retrained["shards"] == [1]
    assert not m.active_shards_[1] and m.active_shards_.sum() == 2
    init = hash_state(state_to_cpu(init_net(build_net("mlp", 5, 3, (8,)), prf_u64(0, "init", 1))))
    assert m.checkpoint_hash(1, 0) == m.checkpoint_hash(1, 1) == m.shard_hash(1) == init
    assert (m.scores(X).sum(axis=1) == 2).all()  # the empty shard does not vote
    assert (m.shard_predictions(X)[1] == -1).all()
    assert m.verify().exact
    m.add(victims[:2], X[shards == 1][:2], y[shards == 1][:2])
    assert m.active_shards_[1]
    assert m.verify().exact
    # everything gone: no votes, deterministic answer, updates still exact
    m.delete(m.record_ids_.copy())
    assert len(m.record_ids_) == 0 and not m.active_shards_.any()
    assert (m.scores(X[:4]) == 0).all()
    assert (m.predict(X[:4]) == m.classes_[0]).all()
    assert m.verify().exact
    m.add(ids[:5], X[:5], y[:5])
    assert m.verify().exact


def test_mean_aggregation():
    ids, X, y = _pool(90)
    m = _model(n_shards=3, aggregation="mean").fit(X, y, record_ids=ids)
    sc = m.scores(X[:20])
    np.testing.assert_allclose(sc.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(m.predict(X[:20]), m.classes_[sc.argmax(axis=1)])
    m.delete(ids[:5])
    assert m.verify().exact


def test_vote_tie_breaks_to_lowest_class():
    ids, X, y = _pool(90)
    m = _model(n_shards=2, epochs_per_slice=1).fit(X, y, record_ids=ids)
    Q = np.random.default_rng(5).random((2000, 5))
    sp = m.shard_predictions(Q)
    split = np.flatnonzero(sp[0] != sp[1])
    assert len(split) > 0, "the two shard models never disagree on 2000 random points"
    np.testing.assert_array_equal(m.predict(Q[split]), m.classes_[sp[:, split].min(axis=0)])


def test_unknown_duplicate_and_invalid_requests_leave_model_unchanged():
    ids, X, y = _pool(40)
    m = _model(n_shards=2).fit(X[:30], y[:30], record_ids=ids[:30])
    h = m.content_hash()
    with pytest.raises(UnknownRecordError) as e:
        m.delete(["never-seen"])
    assert e.value.record_ids == ["never-seen"]
    m.delete([ids[0]])
    h = m.content_hash()
    with pytest.raises(UnknownRecordError):
        m.delete([ids[0]])  # already deleted
    with pytest.raises(UnknownRecordError):
        m.delete([ids[1], ids[0]])  # one good, one gone: nothing happens
    with pytest.raises(DuplicateRecordError):
        m.delete([ids[1], ids[1]])
    with pytest.raises(DuplicateRecordError):
        m.add([ids[5]], X[[5]], y[[5]])
    with pytest.raises(DuplicateRecordError):
        m.add([ids[31], ids[31]], X[[31, 31]], y[[31, 31]])
    with pytest.raises(ValueError, match="features"):
        m.add([ids[31]], X[[31], :3], y[[31]])
    with pytest.raises(ValueError, match="rows"):
        m.add([ids[31], ids[32]], X[[31]], y[[31]])
    with pytest.raises(ValueError, match="NaN"):
        m.add([ids[31]], np.full((1, 5), np.nan), [0])
    with pytest.raises(ValueError, match="NaN"):
        m.add([ids[31]], np.full((1, 5), np.inf), [0])
    with pytest.raises(ValueError, match="unknown label"):
        m.add([ids[31]], X[[31]], [7])
    with pytest.raises(ValueError, match="labels"):
        m.add([ids[31]], X[[31]], [0, 1])
    with pytest.raises(ValueError):
        m.predict(X[:2, :4])
    with pytest.raises(ValueError, match="NaN"):
        m.predict(np.full((1, 5), np.nan))
    with pytest.raises(DuplicateRecordError):
        _model().fit(X[:2], y[:2], record_ids=["a", "a"])
    assert m.content_hash() == h
    assert ids[0] not in set(m.record_ids_)
    assert len(m.record_ids_) == 29
    rep = m.delete([])
    assert rep.retrained["shards"] == [] and m.content_hash() == h
    assert m.verify().exact


def test_verify_detects_tampering():
    ids, X, y = _pool(60)
    m = _model(n_shards=2, n_slices=2).fit(X, y, record_ids=ids)
    assert m.verify().exact
    with torch.no_grad():
        next(m.state_.nets[1].parameters()).view(-1)[0] += 1e-6
    rep = m.verify()
    assert not rep.exact and rep.detail["served_differs_from_checkpoint"] == [1]
    assert not m.verify_shard(1).exact and m.verify_shard(0).exact
    m2 = _model(n_shards=2, n_slices=2).fit(X, y, record_ids=ids)
    m2.slice_of_[0] = (m2.slice_of_[0] + 1) % 2  # a record claimed to be in another slice
    rep = m2.verify()
    assert not rep.exact and rep.detail["assignment_errors"] == 1


# --------------------------------------------------------------------------- persistence


def test_save_load_round_trip_then_updates_stay_exact(tmp_path):
    ids, X, y = _pool(80)
    labels = np.array(["a", "b", "c"])[y]
    m = _model(n_shards=3, n_slices=2, aggregation="mean").fit(X[:60], labels[:60],
                                                               record_ids=ids[:60])
    m.add(ids[60:65], X[60:65], labels[60:65])
    m.delete(ids[:3])
    m.save(tmp_path / "m")
    state = torch.load(tmp_path / "m" / "state.pt", weights_only=True)  # tensors only
    assert set(state) == {"X", "y", "added", "checkpoints"}
    assert ids[0] not in json.loads((tmp_path / "m" / "meta.json").read_text())["record_ids"]
    m2 = SISAEnsemble.load(tmp_path / "m")
    assert m2.content_hash() == m.content_hash()
    assert m2.get_params() == m.get_params()
    np.testing.assert_array_equal(m2.scores(X[60:]), m.scores(X[60:]))
    np.testing.assert_array_equal(m2.predict(X[60:]), m.predict(X[60:]))
    for mm in (m, m2):  # the same updates on both give the same bits
        mm.delete(ids[[10, 61]])
        mm.add(ids[65:70], X[65:70], labels[65:70])
    assert m2.content_hash() == m.content_hash()
    assert m2.verify().exact
    # the added records keep their origin (last slice) across save/load
    assert (m2.locate(ids[62:65])[1] == 1).all()


def test_load_rejects_altered_bundle(tmp_path):
    ids, X, y = _pool(40)
    m = _model(n_shards=2).fit(X, y, record_ids=ids)
    m.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    meta["content_hash"] = "0" * 64
    (tmp_path / "m" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="hash"):
        SISAEnsemble.load(tmp_path / "m")


# --------------------------------------------------------------------------- CNN


@pytest.mark.slow
def test_cnn_on_small_digits_subset():
    from sklearn.datasets import load_digits

    Xd, yd = load_digits(return_X_y=True)
    Xd = Xd / 16.0
    ids = np.array([f"d{i}" for i in range(len(Xd))], dtype=object)
    tr, te = slice(0, 300), slice(300, 500)
    m = SISAEnsemble(
        n_shards=2,
        n_slices=2,
        model="cnn",
        hidden=(16,),
        epochs_per_slice=4,
        batch_size=16,
        lr=0.01,
        device="cpu",
        random_state=0,
    )
    m.fit(Xd[tr], yd[tr], record_ids=ids[tr])
    assert m.shard_logits(Xd[te]).shape == (2, 200, 10)
    assert (m.predict(Xd[te]) == yd[te]).mean() > 0.6
    m.delete(ids[[0, 1, 2]])
    m.add(ids[500:505], Xd[500:505], yd[500:505])
    assert m.verify().exact
    with pytest.raises(ValueError, match="square"):
        SISAEnsemble(model="cnn", device="cpu").fit([[0.0, 0.1, 0.2]], [0], record_ids=["a"])


# --------------------------------------------------------------------------- schedules


@pytest.mark.slow
def test_schedule_resolution_and_validation(tmp_path):
    ids, X, y = _pool(40)
    one = SISAEnsemble(n_shards=2, hidden=(8,), epochs_per_slice=1, device="cpu").fit(
        X, y, record_ids=ids)
    # each schedule's defaults: a table network for "loo", the former ones for Adam
    assert one.config_["schedule"] == "loo" and one.config_["lr"] == 0.2
    assert one.config_["min_steps"] == 8000 and one.config_["hidden"] == [8]
    assert one.config_["weight_decay"] == 1e-5
    sliced = SISAEnsemble(n_shards=2, n_slices=2, device="cpu").fit(X, y, record_ids=ids)
    assert sliced.config_["schedule"] == "adam" and sliced.config_["lr"] == 0.01
    assert sliced.config_["min_steps"] == 0 and sliced.config_["hidden"] == [64]
    assert sliced.config_["epochs_per_slice"] == 20
    table = SISAEnsemble(n_shards=2, device="cpu").fit(X, y, record_ids=ids)
    assert (table.config_["hidden"], table.config_["epochs_per_slice"]) == ([64, 64], 40)
    assert table.get_params()["hidden"] is None  # resolved at fit, into config_
    table.save(tmp_path / "t")
    back = SISAEnsemble.load(tmp_path / "t")
    assert back.content_hash() == table.content_hash() and back.verify().exact
    adam = _model(n_shards=2, schedule="adam").fit(X, y, record_ids=ids)
    assert adam.config_["schedule"] == "adam" and adam.config_["lr"] == 0.05
    assert adam.content_hash() != _model(n_shards=2).fit(X, y, record_ids=ids).content_hash()
    assert adam.verify().exact
    with pytest.raises(ValueError, match="schedule"):
        _model(schedule="sgd").fit(X, y, record_ids=ids)
    with pytest.raises(ValueError, match="model='mlp'"):
        _model(schedule="loo", model="cnn").fit(X, y, record_ids=ids)
    with pytest.raises(ValueError, match="weight_decay"):
        _model(weight_decay=-1.0).fit(X, y, record_ids=ids)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_steps"):
            _model(min_steps=bad).fit(X, y, record_ids=ids)


def test_loo_schedule_shard_is_the_loo_kernel_on_the_shard_records():
    """schedule="loo": shard s is jobs.learners.networks.loo_training.train_single on its live
    records with
    shard_training_args(s) (which carry the shard's tombstones); the batch count follows
    the live shard size, also after a deletion that changes it."""
    ids, X, y = _pool(90)
    m = _model(n_shards=3, classes=(0, 1, 2)).fit(X, y, record_ids=ids)
    for s in range(3):
        rid, Xs, ys = m.shard_records(s)
        p = train_single(Xs, ys, rid, **m.shard_training_args(s))
        assert states_equal(mlp_state(p.weights, p.biases), m.shard_state(s))
    # delete records until some shard's batch count B = ceil(n_s / 8) drops
    sizes = m.shard_sizes_
    s = int(np.argmax(sizes % 8 == 1)) if (sizes % 8 == 1).any() else 0
    victims = m.shard_records(s)[0][: (int(sizes[s]) - 1) % 8 + 1]
    B0 = m.shard_training_args(s)["n_batches"]
    m.delete(victims)
    assert m.shard_training_args(s)["n_batches"] == B0 - 1
    assert m.shard_training_args(s)["tombstones"] == sorted(
        schedule_keys(prf_u64(m.seed_, "init", s), victims).tolist())
    for k in range(3):
        rid, Xs, ys = m.shard_records(k)
        p = train_single(Xs, ys, rid, **m.shard_training_args(k))
        assert states_equal(mlp_state(p.weights, p.biases), m.shard_state(k))
    assert m.verify().exact
    with pytest.raises(ValueError, match="schedule"):
        _model(n_slices=2).fit(X, y, record_ids=ids).shard_training_args(0)


def test_min_steps_floor_follows_the_live_count_and_stays_exact():
    """The step floor makes a shard's epochs a function of its batch count B, so a
    deletion that lowers B raises the epochs, and the update still equals the retrain,
    train_single with shard_training_args, and the LOO network of sisa_bounds."""
    assert stage_epochs(30, 8, 2, 0) == 2 and stage_epochs(30, 8, 2, 40) == 10
    assert stage_epochs(24, 8, 2, 40) == 14 and stage_epochs(500, 8, 2, 40) == 2
    ids, X, y = _pool(90)
    m = _model(n_shards=3, min_steps=40, classes=(0, 1, 2)).fit(X, y, record_ids=ids)
    s = int(np.argmax(m.shard_sizes_))
    extra = (int(m.shard_sizes_[s]) - 1) % 8  # bring shard s to 8 k + 1 records
    if extra:
        m.delete(m.shard_records(s)[0][-extra:])
    args = m.shard_training_args(s)
    assert args["epochs"] == max(2, -(-40 // args["n_batches"]))
    loo = ensemble_loo_set(m, s)  # checks its base network against the served shard
    assert loo is not None
    victim = m.shard_records(s)[0][0]
    m.delete([victim])  # B drops by one, so the floor gives more epochs
    assert m.shard_training_args(s)["n_batches"] == args["n_batches"] - 1
    assert m.shard_training_args(s)["epochs"] > args["epochs"]
    gone = loo.loo(victim)
    assert states_equal(mlp_state(gone.weights, gone.biases), m.shard_state(s))
    for k in range(3):
        rid, Xs, ys = m.shard_records(k)
        p = train_single(Xs, ys, rid, **m.shard_training_args(k))
        assert states_equal(mlp_state(p.weights, p.biases), m.shard_state(k))
    assert m.verify().exact
    # the Adam stages of a sliced ensemble take the same floor per stage
    sliced = _model(n_shards=2, n_slices=3, min_steps=30).fit(X, y, record_ids=ids)
    unfloored = _model(n_shards=2, n_slices=3).fit(X, y, record_ids=ids)
    assert sliced.content_hash() != unfloored.content_hash()
    sliced.delete(ids[:5])
    sliced.add(["new1", "new2"], X[:2], y[:2])
    assert sliced.verify().exact


@pytest.mark.slow
def test_five_shards_learn_a_census_like_table():
    """The sidecar's shard network (one hidden layer of 32, 20 epochs, the default SGD
    rate) beats the majority class clearly with 5 shards of 480 records. With an
    Adam-sized rate (0.01) the SGD schedule voted the majority class here."""
    ds = datasets.load("census", n_samples=3000)
    X, y = ds.X, ds.y
    ids = np.array(ds.record_ids, dtype=object)
    tr, te = slice(0, 2400), slice(2400, None)
    m = SISAEnsemble(n_shards=5, hidden=(32,), epochs_per_slice=20, device="cpu",
                     random_state=0).fit(X[tr], y[tr], record_ids=ids[tr])
    majority = max(y[te].mean(), 1 - y[te].mean())
    acc = (m.predict(X[te]) == y[te]).mean()
    assert acc >= majority + 0.05, (acc, majority)


def test_loo_schedule_empty_shard_keeps_its_initialisation():
    ids, X, y = _pool(30)
    m = _model(n_shards=3).fit(X, y, record_ids=ids)
    shards, _ = m.locate(ids)
    m.delete(ids[shards == 2])
    init = hash_state(state_to_cpu(init_net(build_net("mlp", 5, 3, (8,)), prf_u64(0, "init", 2))))
    assert m.shard_hash(2) == init and not m.active_shards_[2]
    assert m.verify().exact


@pytest.mark.parametrize("schedule", ["loo", "adam"])
def test_bundle_from_before_the_compiled_kernel_retrains_with_torch(tmp_path, monkeypatch,
                                                                   schedule):
    """A bundle without a recorded training kernel was trained by torch's loops: loaded, it
    keeps training with them, so its deletions stay exact (a retrain with the compiled
    loop would give other bits), and a new fit records the compiled one."""
    ids, X, y = _pool(60)
    from jobs.learners.sisa import ensemble

    resolved = ensemble.resolve_config
    monkeypatch.setattr(ensemble, "resolve_config",
                        lambda params, relu_mlp=None: {**resolved(params, relu_mlp),
                                                       "kernel": "torch"})
    m = _model(n_shards=2, schedule=schedule).fit(X, y, record_ids=ids)
    monkeypatch.undo()
    m.save(tmp_path / "m")
    meta_path = tmp_path / "m" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"].pop("kernel")
    meta_path.write_text(json.dumps(meta))
    old = SISAEnsemble.load(tmp_path / "m")
    assert old.config_["kernel"] == "torch"
    old.delete(ids[:3])
    assert old.verify().exact
    new = _model(n_shards=2, schedule=schedule).fit(X, y, record_ids=ids)
    assert new.config_["kernel"] == "compiled"
    assert new.content_hash() != m.content_hash()  # the kernel changes the bits
    new.delete(ids[:3])
    assert new.verify().exact


def test_bundle_without_schedule_loads_as_adam(tmp_path):
    """Bundles written before schedules existed were trained with Adam."""
    ids, X, y = _pool(40)
    m = _model(n_shards=2, schedule="adam", weight_decay=0.0).fit(X, y, record_ids=ids)
    m.save(tmp_path / "m")
    meta_path = tmp_path / "m" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("schedule", "weight_decay"):
        meta["config"].pop(key)
        meta["params"].pop(key)
    meta["params"]["lr"] = 0.05
    meta_path.write_text(json.dumps(meta))
    m2 = SISAEnsemble.load(tmp_path / "m")
    assert m2.config_["schedule"] == "adam" and m2.schedule == "adam"
    assert m2.content_hash() == m.content_hash()
    m2.delete(ids[:2])
    assert m2.verify().exact


@pytest.mark.slow
def test_vote_rule_is_sound_when_records_sit_in_several_shards():
    """Every answer the bound-free vote rule certifies survives every single deletion."""
    import copy

    from jobs.orchestration.served_model import ShardVoteModel

    ids, X, y = _pool(120, n_classes=2, seed=4)
    # a record in m shards can swing 2m votes: certifying needs many shards, few per record
    m = _model(n_shards=10, sampling="independent", shard_prob=0.12, epochs_per_slice=60,
               lr=0.5)
    m.fit(X, y, record_ids=ids)
    assert m.max_shards_per_record_ >= 3
    Q = np.random.default_rng(3).random((400, 5))
    winner, certain = ShardVoteModel(m).certain(Q)
    assert certain.any()
    for rid in ids:
        g = copy.deepcopy(m)
        g.delete([rid])
        assert (g.predict(Q[certain]) == m.classes_[winner[certain]]).all(), rid


def test_loo_schedule_keeps_deleted_records_as_tombstone_keys(tmp_path):
    """Deleted records stay in the schedule as masked rows, given by their schedule keys
    under the shard seed (no id, no data), so that the shard after a deletion is the LOO
    network bit for bit; re-adding an id lifts its tombstone; the bundle keeps the keys
    (an older bundle's tombstone ids become keys on load); adam ensembles keep none."""
    _, X, y = _pool(40)
    ids = np.array([f"rec-{i:04d}" for i in range(40)], dtype=object)  # none inside another
    m = _model(n_shards=2).fit(X, y, record_ids=ids)
    assert len(m.tombstones_) == 0
    member = m.memberships(ids[:3])
    m.delete(ids[:3])
    assert _keys(m) == _tombstones_of(m, member, ids[:3])
    assert all(k.dtype == np.uint64 for k in m.tombstones_.values())
    m.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert "tombstones" not in meta
    assert meta["tombstone_keys"] == {str(s): k for s, k in _keys(m).items()}
    back = SISAEnsemble.load(tmp_path / "m")
    assert _keys(back) == _keys(m)
    assert back.verify().exact
    # an older bundle named the deleted ids: loading keeps only their keys
    meta["tombstones"] = ids[:3].tolist()
    del meta["tombstone_keys"]
    (tmp_path / "m" / "meta.json").write_text(json.dumps(meta))
    old = SISAEnsemble.load(tmp_path / "m")
    assert _keys(old) == _keys(m)
    old.save(tmp_path / "resaved")
    assert traces_found(tmp_path / "resaved", ids[:3], X[:3]) == set()
    m.add(ids[:1], X[:1], y[:1])
    assert _keys(m) == _tombstones_of(m, member[1:], ids[1:3])
    assert m.verify().exact
    adam = _model(n_shards=2, schedule="adam").fit(X, y, record_ids=ids)
    adam.delete(ids[:3])
    assert len(adam.tombstones_) == 0 and adam.verify().exact


@pytest.mark.parametrize("sampling", ["partition", "independent"])
def test_saved_bundle_holds_no_trace_of_deleted_records(tmp_path, sampling):
    """Security requirement: no byte of the saved bundle is a deleted record's id or two
    adjacent features of it (float32 or float64), while every shard stays bit for bit
    the retrain with those records masked in place (independent sampling: a deleted
    record sits in several shards, and leaves its key in each)."""
    rng = np.random.default_rng(11)
    n = 60
    X = rng.random((n, 5))
    y = (X[:, 0] * 3).astype(int).clip(0, 2)
    ids = np.array([f"rec-{i:04d}" for i in range(n)], dtype=object)
    m = _model(n_shards=3, sampling=sampling, shard_prob=0.5).fit(X, y, record_ids=ids)
    member_all = m.memberships(ids)
    held = member_all.sum(axis=1)
    gone_rows = [0, 17, 42]
    if sampling == "independent":  # two records held by several shards, one by a single shard
        gone_rows = [*np.flatnonzero(held >= 2)[:2].tolist(), int(np.flatnonzero(held == 1)[0])]
    gone = ids[gone_rows]
    member = member_all[gone_rows]
    # the deleted records masked in place: each shard's retrain with the smaller B
    expect = {}
    for s in range(3):
        rid, Xs, ys = m.shard_records(s)
        out = [r for r in gone.tolist() if r in rid]
        if out:
            kw = m.shard_training_args(s, len(rid) - len(out))
            p = train_single(Xs, ys, rid, exclude=out, **kw)
            expect[s] = mlp_state(p.weights, p.biases)
    m.delete(gone)
    assert sorted(expect) == sorted(_keys(m))
    assert _keys(m) == _tombstones_of(m, member, gone)
    for s, state in expect.items():
        assert states_equal(state, m.shard_state(s)), s
    m.save(tmp_path / "m")
    assert traces_found(tmp_path / "m", gone, X[gone_rows]) == set()
    # the scan does see what the bundle keeps: the live records' ids and float32 features
    live = [i for i in range(n) if i not in gone_rows][:3]
    seen = traces_found(tmp_path / "m", ids[live], X[live])
    assert {r for r, t in seen if t.startswith("id")} == set(ids[live].tolist())
    assert {r for r, t in seen if t.endswith("float32")} == set(ids[live].tolist())
    back = SISAEnsemble.load(tmp_path / "m")
    assert _keys(back) == _keys(m) and back.content_hash() == m.content_hash()
    assert back.verify().exact


def test_sliced_loo_schedule_keeps_tombstones_in_their_slices(tmp_path):
    """Sliced shards under the LOO schedule: a deletion from slice r keeps checkpoints
    0..r-1 and leaves a tombstone in slice r (saved and loaded with the bundle); stage r
    is train_single on the records and tombstones of slices 0..r from checkpoint r-1;
    re-adding the record lifts its tombstone, and its shard retrains from that slice."""
    ids, X, y = _pool(120)
    m = _model(n_shards=2, n_slices=3, schedule="loo", classes=(0, 1, 2)).fit(X, y, record_ids=ids)
    assert m.config_["schedule"] == "loo"
    s = 0
    rid = m.shard_records(s)[0]
    slices = m.shard_slices(s)
    victim = rid[int(np.flatnonzero(slices == 1)[0])]
    before = [m.checkpoint_hash(s, r) for r in range(3)]
    rep = m.delete([victim])
    assert rep.retrained["from_slice"] == {s: 1}
    assert m.checkpoint_hash(s, 0) == before[0] and m.checkpoint_hash(s, 1) != before[1]
    assert m.tombstone_slices_[s].tolist() == [1]
    for r in range(3):  # stage r from checkpoint r - 1, the tombstone from stage 1 on
        args = m.shard_training_args(s, stage=r)
        assert len(args["tombstones"]) == (r >= 1)
        rid, Xs, ys = m.shard_records(s)
        sel = m.shard_slices(s) <= r
        init = None if r == 0 else MLPParams.from_state(m.checkpoints_[s][r - 1])
        p = train_single(Xs[sel], ys[sel], np.asarray(rid)[sel].tolist(), init=init, **args)
        assert states_equal(mlp_state(p.weights, p.biases), m.checkpoints_[s][r])
    m.save(tmp_path / "m")
    back = SISAEnsemble.load(tmp_path / "m")
    assert back.tombstone_slices_[s].tolist() == [1]
    assert back.verify().exact
    k = int(np.flatnonzero(ids == victim)[0])
    rep = back.add(ids[[k]], X[[k]], y[[k]])
    assert rep.retrained["from_slice"] == {s: 1}  # its tombstone leaves stages 1 and 2
    assert back.tombstones_.get(s) is None and back.verify().exact

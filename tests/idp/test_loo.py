"""Leave-one-out training: batched networks equal single runs bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from jobs.learners.keyed import prf_u64_many
from jobs.learners.networks import loo_training as loo_mod
from jobs.learners.networks.loo_training import LOOSet, schedule_keys, train_loo, train_single
from jobs.learners.networks.torch_nets import MLP, init_net

from .conftest import tiny_data

KW = dict(hidden=(8, 8), epochs=5, batch_size=8, seed=3)


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("n_classes", [2, 3])
def test_every_batched_loo_network_equals_its_single_run(n_classes: int, kernel: str) -> None:
    """On both CPU kernels: the compiled loops (one network at a time) and torch's batched
    ops (slots padded so that no op's code path depends on a slot's position)."""
    X, y, ids = tiny_data(n_classes)
    kw = {**KW, "kernel": kernel}
    loo = train_loo(X, y, ids, chunk_size=7, **kw)
    assert loo.n_networks == len(ids) + 1 and loo.meta["kernel"] == kernel
    assert train_single(X, y, ids, **kw).equal(loo.full())
    for rid in ids:
        assert train_single(X, y, ids, exclude=rid, **kw).equal(loo.loo(rid)), rid
    # and the LOO networks really differ from N
    assert not loo.loo(ids[0]).equal(loo.full())
    # the two kernels run the same update: close, not the same bits
    other = train_loo(X, y, ids, chunk_size=7,
                      **{**KW, "kernel": "torch" if kernel == "compiled" else "compiled"})
    for a, b in zip(loo.full().weights, other.full().weights, strict=True):
        assert np.allclose(a, b, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="kernel"):
        train_single(X, y, ids, **{**KW, "kernel": "gpu"})


def test_bits_do_not_depend_on_chunking_or_on_the_removed_features() -> None:
    X, y, ids = tiny_data(3)
    kw = dict(hidden=(10,), epochs=4, batch_size=5, seed=1)
    a = train_loo(X, y, ids, chunk_size=3, **kw)
    b = train_loo(X, y, ids, chunk_size=1000, **kw)
    assert a.content_hash() == b.content_hash()
    X2, y2 = X.copy(), y.copy()
    X2[7] = [0.9, 0.1]
    y2[7] = (y[7] + 1) % 3
    c = train_loo(X2, y2, ids, **kw)
    assert c.loo(ids[7]).equal(a.loo(ids[7]))  # record 7's data never reaches N_{-7}
    assert not c.full().equal(a.full())


def test_odd_shapes_and_singleton_batches() -> None:
    rng = np.random.default_rng(1)
    X, y = rng.random((23, 3)), rng.integers(0, 3, 23)
    ids = list(range(100, 123))
    kw = dict(hidden=(7, 33, 5), epochs=3, batch_size=1, seed=2)  # many batches of 0-2 rows
    loo = train_loo(X, y, ids, **kw)
    for rid in ids[::4]:
        assert train_single(X, y, ids, exclude=rid, **kw).equal(loo.loo(rid))


def test_swap_in_the_loo_network_after_a_deletion() -> None:
    """After deleting x, T with x's schedule key as a tombstone and the old B gives
    N' == old N_{-x}; the tombstone is the key, never the id."""
    X, y, ids = tiny_data(2)
    loo = train_loo(X, y, ids, **KW)
    x = ids[11]
    keep = [i for i, r in enumerate(ids) if r != x]
    rest = [ids[i] for i in keep]
    key = schedule_keys(KW["seed"], [x]).tolist()
    new = train_loo(X[keep], y[keep], rest, tombstones=key, n_batches=loo.config.n_batches,
                    **KW)
    assert new.full().equal(loo.loo(x))
    assert new.meta["tombstones"] == key and list(new.record_ids) == rest
    assert train_single(X[keep], y[keep], rest, exclude=x, **KW).equal(loo.loo(x))
    assert train_single(X[keep], y[keep], rest, tombstones=key, **KW).equal(loo.loo(x))
    with pytest.raises(TypeError, match="schedule keys"):
        train_single(X[keep], y[keep], rest, tombstones=[x], **KW)  # an id is refused


def test_schedule_keys_must_be_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are ordered by key alone, so two records (or tombstones) with one key raise."""
    X, y, ids = tiny_data(2)
    keys = schedule_keys(KW["seed"], ids)
    with pytest.raises(ValueError, match="live record's key"):
        train_single(X, y, ids, tombstones=keys[:1].tolist(), **KW)
    with pytest.raises(ValueError, match="share a 64-bit schedule key"):
        train_single(X[1:], y[1:], ids[1:], tombstones=[keys[0], keys[0]], **KW)
    monkeypatch.setattr(loo_mod, "prf_u64_many", lambda seed, tag, it: np.fromiter(
        (7 if i in ("r003", "r009") else prf_u64_many(seed, tag, [i])[0] for i in it),
        dtype=np.uint64))
    with pytest.raises(ValueError, match="share a 64-bit schedule key"):
        train_loo(X, y, ids, **KW)


def test_masked_mean_is_the_mean_over_present_records() -> None:
    """One batch per epoch: N_{-x} is full-batch SGD on D minus x with the MEAN loss."""
    X, y, ids = tiny_data(3)
    kw = dict(hidden=(6,), epochs=3, batch_size=64, seed=4, lr=0.1, weight_decay=1e-5)
    loo = train_loo(X, y, ids, **kw)
    assert loo.config.n_batches == 1
    keep = np.arange(len(ids)) != 5
    net = init_net(MLP(2, 3, (6,)), 4).double()
    Xt, yt = torch.from_numpy(X[keep]), torch.from_numpy(y[keep])
    for _ in range(3):
        net.zero_grad()
        F.cross_entropy(net(Xt), yt).backward()  # mean over the 39 present records
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * (p.grad + 1e-5 * p)
    ref = [p.detach().numpy() for p in net.parameters()]
    got = loo.loo(ids[5])
    for r, g in zip(ref, [got.weights[0], got.biases[0], got.weights[1], got.biases[1]],
                    strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_save_load_hash_logits(tmp_path) -> None:
    X, y, ids = tiny_data(2)
    loo = train_loo(X, y, ids, classes=["a", "b"], **KW)
    digest = loo.save(tmp_path / "loo.npz")
    back = LOOSet.load(tmp_path / "loo.npz")
    assert back.content_hash() == digest == loo.content_hash()
    assert back.config == loo.config and list(back.record_ids) == ids
    assert list(back.classes) == ["a", "b"]
    for i in (0, 1, 40):
        assert back.network(i).equal(loo.network(i))
    lg = loo.logits(X)
    assert lg.shape == (41, 40, 2)
    with torch.no_grad():
        mod = loo.network(3).to_module()(torch.from_numpy(X).float()).numpy()
    np.testing.assert_allclose(lg[3], mod, atol=1e-5)
    np.testing.assert_allclose(loo.network(3).logits(X), lg[3], rtol=0, atol=1e-12)
    # tampering is detected
    data = dict(np.load(tmp_path / "loo.npz"))
    data["W0"] = data["W0"].copy()
    data["W0"][0, 0, 0] += 1.0
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="hash"):
        LOOSet.load(tmp_path / "bad.npz")
    assert loo.index_of(ids[0]) == 1 and math.isfinite(float(lg.sum()))
    with pytest.raises(KeyError):
        loo.index_of("nope")

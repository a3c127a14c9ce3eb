"""A DaRE forest on disk: ``meta.json`` (JSON) and ``arrays.npz`` (plain arrays, no
pickle), the saved names of format ``obliviate.dare/2``. The value group tables, the
score bounds and the cost model are derived state: a loaded forest rebuilds them.
Format 2 stores the features as codes into each feature's sorted values, the value
index a load needs anyway (a one-hot feature in one byte, not eight); format 1 (float64
features) still loads. See docs/learners.md (DaRE)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jobs.learners.base import read_bundle_meta, read_bundle_payload, write_bundle
from jobs.learners.dare import pools
from jobs.learners.dare import state as fs
from jobs.learners.dare.costs import BatchPolicy, CostModel
from jobs.learners.dare.training import tree_keys
from jobs.learners.dare.values import (
    domains_of_index,
    index_of_codes,
    new_domains,
    rerank,
)

FORMAT = "obliviate.dare/2"
#: the model a content hash names (its header's format): the state both formats hold
MODEL_FORMAT = "obliviate.dare/1"
_READ = (MODEL_FORMAT, FORMAT)  # the formats a forest loads from
ARRAYS = "arrays.npz"

#: (saved name, state group, field), in the order they are written
_SAVED = (
    ("y", "records", "y"), ("alive", "records", "alive"), ("class_n", "records", "class_n"),
    ("n_tree", "nodes", "tree"), ("n_depth", "nodes", "depth"), ("n_path", "nodes", "path"),
    ("n_kind", "nodes", "kind"), ("n_why", "nodes", "why"), ("n_left", "nodes", "left"),
    ("n_right", "nodes", "right"), ("n_attr", "nodes", "attr"), ("n_thr", "nodes", "thr"),
    ("n_r1", "nodes", "r1"), ("n_r2", "nodes", "r2"), ("n_draw", "nodes", "draw"),
    ("n_n", "nodes", "n"), ("n_cnt", "nodes", "cnt"), ("n_s", "nodes", "start"),
    ("n_e", "nodes", "end"), ("n_cid", "nodes", "cid"), ("n_used", "nodes", "used"),
    ("nfree", "nodes", "free"), ("c_attr", "caches", "attr"), ("c_off", "caches", "off"),
    ("c_len", "caches", "length"), ("c_all", "caches", "all_pairs"),
    ("c_cutp", "caches", "cut_prio"), ("c_cutv", "caches", "cut_value"),
    ("cfree", "caches", "free"), ("er1", "entries", "r1"), ("er2", "entries", "r2"),
    ("eleft", "entries", "left"), ("samp", "layout", "slot_at"), ("pos", "layout", "pos"),
    ("root", "layout", "root"),
)  # fmt: skip


def _scalars(st: fs.ForestState) -> dict[str, int]:
    """The counts the format saves (capacities and counters, under their saved names)."""
    rec, c = st.records, st.counts
    return {
        "_cap": rec.capacity, "_nrec": rec.n_slots, "_nlive": rec.n_live,
        "_ncap": len(st.nodes.tree), "_nfree_n": c.free_nodes, "_ccap": len(st.caches.attr),
        "_cfree_n": c.free_caches, "_ecap": len(st.entries.r1), "_eused": c.entries_used,
        "_egarb": c.entries_garbage,
    }  # fmt: skip


def state_arrays(st: fs.ForestState) -> dict[str, np.ndarray]:
    """The state's arrays a bundle holds, under their saved names."""
    return {name: getattr(getattr(st, group), field) for name, group, field in _SAVED}


def _saved_arrays(st: fs.ForestState) -> dict[str, np.ndarray]:
    """What :func:`save` writes: the state's arrays and the records (ids as strings)."""
    arrays = state_arrays(st) | _coded_features(st)
    rec = st.records
    arrays["ids"] = np.array(rec.ids[: rec.n_slots].tolist(), dtype=str)
    arrays["classes"] = np.asarray(rec.classes)
    if arrays["classes"].dtype == object:
        arrays["classes"] = arrays["classes"].astype(str)
    return arrays


_CODE_TYPES = (np.uint8, np.uint16, np.uint32)  # x_code8, x_code16, x_code32


def _coded_features(st: fs.ForestState) -> dict[str, np.ndarray]:
    """The live records' features as codes into each attribute's sorted values (the value
    index of a compact store), each attribute's in the smallest type of `_CODE_TYPES` that
    holds them (``x_code8`` and its attributes ``x_attr8``, ...). A code names one value's
    bits: the forest holds no -0.0 (:func:`check_features` makes it 0.0) and no NaN."""
    rec, val = st.records, st.values
    width = np.searchsorted([np.iinfo(t).max for t in _CODE_TYPES], np.diff(val.voff) - 1)
    out = {"x_vals": val.vals, "x_voff": val.voff}
    for w, t in enumerate(_CODE_TYPES):
        attrs = np.flatnonzero(width == w)
        bits = 8 * np.dtype(t).itemsize
        out[f"x_code{bits}"] = val.rank[attrs, : rec.n_slots].astype(t)
        out[f"x_attr{bits}"] = attrs.astype(np.int64)
    return out


def save(st: fs.ForestState, path: str | Path, params: dict[str, Any], content_hash: str) -> None:
    """Write the bundle of a compact forest (:func:`jobs.learners.dare.records.compact_store`)."""
    arrays = _saved_arrays(st)
    meta = {
        "format": FORMAT,
        "params": {k: (int(v) if isinstance(v, np.integer) else v) for k, v in params.items()},
        "n_features": st.n_features,
        "scalars": _scalars(st),
        "content_hash": content_hash,
    }  # fmt: skip
    write_bundle(Path(path), meta, ARRAYS, lambda fh: np.savez(fh, **arrays))


def read(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The meta and the arrays of a bundle (refusing one of another format)."""
    meta = read_bundle_meta(Path(path), _READ, "DaRE")
    with np.load(read_bundle_payload(Path(path), ARRAYS), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays


def _value_lists(vals: np.ndarray, voff: np.ndarray) -> list[np.ndarray]:
    """Each feature's sorted values, from all of them one after another."""
    return [vals[voff[a] : voff[a + 1]] for a in range(len(voff) - 1)]


def _codes(arrays: dict[str, np.ndarray], p: int) -> list[np.ndarray]:
    """Each attribute's codes of a format 2 bundle."""
    codes: list[np.ndarray | None] = [None] * p
    named = 0
    for t in _CODE_TYPES:
        bits = 8 * np.dtype(t).itemsize
        block, attrs = arrays[f"x_code{bits}"], arrays[f"x_attr{bits}"]
        if block.dtype != t or len(block) != len(attrs) or attrs.min(initial=0) < 0 \
                or attrs.max(initial=0) >= p:
            raise ValueError("the bundle's feature codes do not fit its features")
        for row, a in zip(block, attrs.tolist(), strict=True):
            codes[a] = row
        named += len(attrs)
    if named != p or any(c is None for c in codes):
        raise ValueError("the bundle's feature codes do not name every feature once")
    return codes  # type: ignore[return-value]


def _decode(arrays: dict[str, np.ndarray], X: np.ndarray, n: int) -> None:
    """Fill the `n` slots of `X` (features, capacity) from a format 2 bundle's codes,
    refusing codes that are not the dense ranks of strictly increasing values (the
    kernels trust the index)."""
    vals, codes = _value_lists(arrays["x_vals"], arrays["x_voff"]), _codes(arrays, len(X))
    if len(vals) != len(X):
        raise ValueError("the bundle's feature values do not fit its features")
    for a, (v, c) in enumerate(zip(vals, codes, strict=True)):
        if (len(c) != n or np.any(v[1:] <= v[:-1]) or (n and int(c.max()) >= len(v))
                or (n and not np.bincount(c, minlength=len(v)).all())):
            raise ValueError(f"the bundle's codes of feature {a} are not the ranks of its values")
        np.take(v, c, out=X[a, :n])


def coded_features(arrays: dict[str, np.ndarray]) -> np.ndarray | None:
    """The (features, records) float64 matrix a format 2 bundle's arrays encode (None for
    arrays that hold no codes): what a scan for a record's bytes must see, since the
    file holds its values only as codes."""
    if "x_vals" not in arrays:
        return None
    codes = _codes(arrays, len(arrays["x_voff"]) - 1)
    n = len(codes[0]) if codes else 0
    X = np.zeros((len(codes), n), dtype=np.float64)
    _decode(arrays, X, n)
    return X


def _store(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> fs.RecordStore:
    s = meta["scalars"]
    cap, n = int(s["_cap"]), int(s["_nrec"])
    X = np.zeros((int(meta["n_features"]), cap), dtype=np.float64)
    if "x_vals" in arrays:
        _decode(arrays, X, n)
    else:
        X[:, :n] = arrays["X"]
    ids = np.empty(cap, dtype=object)
    ids[:n] = arrays["ids"].tolist()
    alive = arrays["alive"]
    return fs.RecordStore(
        X=X, y=arrays["y"], alive=alive, ids=ids,
        slot={ids[i]: i for i in np.flatnonzero(alive[:n]).tolist()}, n_slots=n,
        n_live=int(s["_nlive"]), class_n=arrays["class_n"], classes=arrays["classes"],
    )  # fmt: skip


@dataclass(frozen=True)
class CodedIndex:
    """The value index and domains of a forest loaded from a format 2 bundle, built from
    its codes when an update or the guard first needs them (:class:`fs.PendingIndex`)."""

    vals: np.ndarray
    voff: np.ndarray
    codes: list[np.ndarray]
    random_domain: float | None

    def build(self, records: fs.RecordStore) -> tuple[fs.ValueIndex, fs.Domains]:
        n = len(self.codes[0]) if self.codes else 0
        if records.n_slots != n or not records.alive[:n].all():
            raise RuntimeError("the records changed before the value index was built")
        index = index_of_codes(self.codes, _value_lists(self.vals, self.voff),
                               records.capacity)
        return index, domains_of_index(index, self.random_domain)


def _group(arrays: dict[str, np.ndarray], group: str) -> dict[str, np.ndarray]:
    return {field: arrays[name] for name, grp, field in _SAVED if grp == group}


def restore(meta: dict[str, Any], arrays: dict[str, np.ndarray], rule: fs.SplitRule,
            random_state: int, random_domain: float | None, policy: BatchPolicy
            ) -> fs.ForestState:
    """The forest a bundle holds, its derived state rebuilt (the value group tables on
    its first update)."""
    rec = _store(meta, arrays)
    pending = None
    if "x_vals" in arrays:  # derived on first use (serving reads the sorted values only)
        values, domains = None, None
        pending = CodedIndex(vals=arrays["x_vals"], voff=arrays["x_voff"],
                             codes=_codes(arrays, len(rec.X)), random_domain=random_domain)
    else:
        values = rerank(rec, None)[0]
        domains = (domains_of_index(values, random_domain) if rec.alive[: rec.n_slots].all()
                   else new_domains(rec, random_domain))
    s = meta["scalars"]
    node_fields = _group(arrays, "nodes")
    bound, sampled = pools.fresh_bounds(len(node_fields["tree"]), rule.n_sampled)
    nodes = fs.NodePool(**node_fields, bound=bound, sampled=sampled)
    cache_fields = _group(arrays, "caches")
    shape = cache_fields["attr"].shape
    caches = fs.CachePool(**cache_fields, table_off=np.zeros(shape, dtype=np.int64),
                          table_len=np.zeros(shape, dtype=np.int32))
    return fs.ForestState(
        rule=rule, records=rec, value_index=values, value_domains=domains, pending=pending,
        tree_keys=tree_keys(random_state, rule.n_trees),
        nodes=nodes, caches=caches, entries=fs.EntryPool(**_group(arrays, "entries")),
        tables=pools.new_table_pool(0, len(rec.classes)),
        layout=fs.Layout(**_group(arrays, "layout")),
        counts=fs.PoolCounts(free_nodes=int(s["_nfree_n"]), free_caches=int(s["_cfree_n"]),
                             entries_used=int(s["_eused"]), entries_garbage=int(s["_egarb"]),
                             tables_used=0, tables_garbage=0),
        # = what the builder went through
        costs=CostModel(policy, rule.n_trees, int(nodes.n[nodes.used].sum()), rec.n_live),
        tables_stale=True,
    )  # fmt: skip

"""The content hash of a DaRE forest: SHA-256 over everything that determines its
predictions and its future updates, and nothing that depends on the order of updates,
memory layout or record slots (so an updated forest and a retrain hash alike).
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jobs.learners.dare import builder
from jobs.learners.dare.common import GREEDY, LEAF, RANDOM, _ranges
from jobs.learners.dare.state import ForestState


def canonical_nodes(st: ForestState) -> np.ndarray:
    """The used nodes, tree by tree, each tree depth first (pre-order)."""
    nd = st.nodes
    nodes = np.flatnonzero(nd.used)
    dep = nd.depth[nodes].astype(np.int64)
    dm = int(dep.max()) + 1
    key = (nd.path[nodes] - (np.int64(1) << dep)) << (dm - dep)
    return nodes[np.lexsort((dep, key, nd.tree[nodes]))]


def _selected_candidates(st: ForestState, nodes: np.ndarray) -> list[np.ndarray]:
    """The k selected pairs of every cache slot of `nodes` (canonically ordered): per pair
    its slot's (node index, slot, attribute), the pair's slot index, v1, v2, left counts."""
    cc, e = st.caches, st.entries
    vals, voff = st.sorted_values()
    k = st.rule.k
    cached = np.flatnonzero(st.nodes.cid[nodes] >= 0)
    cid = st.nodes.cid[nodes[cached]].astype(np.int64)
    sa = cc.attr[cid]
    sn, ss = np.nonzero(sa >= 0)
    a = sa[sn, ss].astype(np.int64)
    ln = cc.length[cid[sn], ss].astype(np.int64)
    E = _ranges(cc.off[cid[sn], ss], ln)
    seg = np.repeat(np.arange(len(sn)), ln)
    alive = e.r1[E] >= 0
    ca = np.cumsum(alive)
    before = np.concatenate([[0], ca])[np.cumsum(ln) - ln]
    sel = alive & (ca - alive - np.repeat(before, ln) < k)
    E, seg = E[sel], seg[sel]
    ea = a[seg]
    v1 = vals[voff[ea] + e.r1[E]]
    v2 = vals[voff[ea] + e.r2[E]]
    return [cached[sn].astype(np.int64), ss.astype(np.int64), a, seg.astype(np.int64), v1, v2,
            e.left[:, E].T.astype(np.int64)]


def _structure(st: ForestState, nodes: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """Per node in canonical order: its place and kind, split, counts, children (as
    indices into the order); thresholds and the greedy splits' values."""
    nd = st.nodes
    vals, voff = st.sorted_values()
    kind = nd.kind[nodes]
    g = kind == GREEDY
    a = nd.attr[nodes].astype(np.int64)
    v1 = np.zeros(len(nodes))
    v2 = np.zeros(len(nodes))
    v1[g] = vals[voff[a[g]] + nd.r1[nodes[g]]]
    v2[g] = vals[voff[a[g]] + nd.r2[nodes[g]]]
    thr = np.where(kind != LEAF, nd.thr[nodes], 0.0)
    draw = np.where(kind == RANDOM, nd.draw[nodes], -1).astype(np.int64)
    struct = np.stack([
        nd.tree[nodes], nd.depth[nodes], nd.path[nodes], kind, nd.why[nodes],
        np.where(kind != LEAF, a, -1), draw, nd.n[nodes],
        idx[np.where(kind != LEAF, nd.left[nodes], nodes)],
        idx[np.where(kind != LEAF, nd.right[nodes], nodes)],
    ], axis=1).astype(np.int64)  # fmt: skip
    return [struct, thr, v1, v2, nd.cnt[nodes].astype(np.int64)]


def _leaf_members(st: ForestState, nodes: np.ndarray, idx: np.ndarray,
                  lslots: np.ndarray | slice) -> Iterator[np.ndarray]:
    """Each leaf's records, by id: the leaf index of every live record in every tree, one
    tree's row at a time (the rows of a (trees, records) array, without building it: at
    10^6 records that array and its gathers were GBs)."""
    nd = st.nodes
    leaves = nodes[nd.kind[nodes] == LEAF]
    tree = nd.tree[leaves].astype(np.int64)
    owner = np.empty(st.records.capacity, dtype=np.int64)
    for t in range(st.rule.n_trees):
        mine = leaves[tree == t]
        rows, off = builder.node_rows(st, mine)
        owner.fill(-1)
        owner[rows] = np.repeat(idx[mine], np.diff(off))
        yield owner[lslots]


def _hash_array(h: Any, parts: Iterable[np.ndarray], dtype: np.dtype, shape: tuple[int, ...]
                ) -> None:
    """Hash an array given as its rows in order: the same bytes as the whole array's."""
    h.update(str(np.dtype(dtype)).encode())
    h.update(repr(shape).encode())
    for part in parts:
        h.update(np.ascontiguousarray(part, dtype=dtype))  # its buffer: no copy of GBs


def content_hash(st: ForestState, header: dict[str, Any]) -> str:
    """SHA-256 over the header (format, parameters, classes, width, live ids) and the
    forest: structure, thresholds, counts, the selected candidates of cached nodes with
    their counts, the keyed draw indices, each leaf's records and the live training set."""
    nodes = canonical_nodes(st)
    idx = np.full(len(st.nodes.tree), -1, dtype=np.int64)
    idx[nodes] = np.arange(len(nodes))
    rec = st.records
    live_ids = sorted(rec.slot)
    lslots: np.ndarray | slice = np.array([rec.slot[i] for i in live_ids], dtype=np.int64)
    if np.array_equal(lslots, np.arange(len(live_ids))):  # slots in id order (a fit's,
        lslots = slice(0, len(live_ids))  # kept by compaction): views, not gathers
    sel = _selected_candidates(st, nodes)
    h = hashlib.sha256()
    h.update(json.dumps({**header, "ids": live_ids}, sort_keys=True).encode())
    for arr in (*_structure(st, nodes, idx), *sel):
        _hash_array(h, [arr], arr.dtype, arr.shape)
    n = len(live_ids)
    _hash_array(h, _leaf_members(st, nodes, idx, lslots), np.dtype(np.int64),
                (st.rule.n_trees, n))
    _hash_array(h, (rec.X[a, lslots] for a in range(rec.X.shape[0])), rec.X.dtype,
                (rec.X.shape[0], n))
    _hash_array(h, [rec.y[lslots]], np.dtype(np.int64), (n,))
    return h.hexdigest()

"""A sound iDP label guard for DaRE forests (docs/DESIGN.md, "Beyond LUCID, for DaRE forests").

A :class:`~jobs.learners.dare.DaREForest` answers ``argmax_c p_c(q)`` (lowest class index
on ties) with ``p(q) = mean_t p_t(q)`` and ``p_t(q) = counts / max(n, 1)`` of the leaf of
tree t that q reaches. Its deletions are exact, so the leave-one-out (LOO) forest
``F_{-x}`` is what a deletion of x leaves behind.

The certificate
---------------
Write ``Delta_{t,x}(q) = p_{t,-x}(q) - p_t(q)`` (a vector over the classes). One deletion
removes ONE record x, so ``p_{-x}(q) = p(q) + mean_t Delta_{t,x}(q)``, and the gain of class
b on class a under the worst deletion is ``H(q)[a, b] = max_x mean_t (Delta_{t,x,b} -
Delta_{t,x,a})(q)``. The query is **certain** when, for its predicted class w and every
c != w, ``p_w(q) - p_c(q) > H(q)[w, c] + tol`` (STRICT: with ``>=`` a LOO forest could tie
w with a class c < w and answer c). ``tol`` (1e-9 plus 8 T 2^-53) covers the rounding of
means of T numbers in [-1, 1].

How each Delta is known without building the LOO forests
--------------------------------------------------------
:mod:`jobs.idp.forest_fragility` decides, for every (node, record), whether deleting the
record alone leaves the node's decision as it is ("stable") or may change it ("fragile").
Then, per tree t and record x:

* if x is stable at every node of its path, the LOO tree has the same splits and differs
  only in x's leaf l, whose counts lose x: ``Delta_{t,x} = (n_c - [c = y_x]) / (n - 1) -
  n_c / n`` at queries in l, and 0 elsewhere (exact, in closed form, from the leaf's
  counts and x's label);
* if x is fragile at some node u of its path (the highest such u), the LOO tree has the
  same splits above u (only counts change there, and counts of internal nodes reach no
  prediction) and, below u, the subtree DaRE grows from u's records without x (every
  DaRE node is a pure function of its records, so that IS the subtree the deletion
  leaves). The guard grows it (:func:`jobs.learners.dare_view.grow`, the forest's own
  split search, without touching the forest) and keeps it: an "exact pair". At a query
  on u's path, the tree's change is the grown subtree's leaf there against q's leaf;
* a record whose deletion moves a random node's value domain (only when the forest's
  ``random_domain`` is data-dependent) is fragile at every random node on that
  attribute, and the subtree is grown there with the moved domain.

The aggregation is per record (one deletion is one record): at q the kernel adds up,
over the trees, each record's change (closed form for the stable records of q's leaf,
the grown subtrees for the exact pairs on q's path) and takes the largest gain: the
exact LOO answer, up to rounding.

The state budget
----------------
Only the fragile pairs cost storage (their subtrees; the leaves' record lists are the
forest's own). A pair near a leaf grows a few nodes, one near a root a whole tree, and at
small n most splits are near-ties, so the subtrees are capped: ``state_budget`` times the
forest's saved size (default 1.5). The pairs whose subtrees are smallest are grown first;
the rest are "worst-case pairs": at a query on their node's path the tree is charged the
worst any tree can do (class b gains ``1 - p_b``, class a loses ``p_a``), which bounds
whatever subtree the deletion grows, so H stays an upper bound (sound) and only fewer
queries are certain. Pairs at nodes of more than ``grow_rows`` records (default 1,024)
are worst-case pairs too: growing one costs its node's records, and a near-tie node high
in a tree makes many of its records fragile, so growing them all would cost the square
of the node's size. With ``state_budget=inf, grow_rows=inf`` every pair is exact.

Cost and updates
----------------
Fitting needs every greedy node's candidate lists (a node of 128 records or more keeps
them up to date in the forest itself; the split search runs for the others), one pass
over every (node, record) of every tree, and grows one subtree per exact pair, mostly
small ones near the leaves: near-linear in the number of records (``tests/bench/
bench_guard_scale.py``). After an update only nodes whose records changed can change
their decisions or their subtrees: :meth:`update` (the deleted and added records)
finds them (the records' paths, and every node whose split or counts moved, with its
subtree), :meth:`refit` with ``nodes=`` recomputes the pairs there and keeps every other
pair with its subtree, since its node holds the same records, so the same decisions and
the same subtree; a record that now turns fragile higher up drops its lower pair. A
record whose pair sat at a changed node and that is fragile at no changed node at or
above it any more needs its nodes further down, which were never computed (a pair is
the highest fragile node only): those below it on its path that did not change are
computed for it. The result equals a fit from scratch (``tests/idp/test_forest_guard.py``;
with a finite state budget the same pairs, though the budget may make other ones
exact). The worker calls it before it publishes each version, so a published forest is
always guarded; it bounds the time spent growing subtrees (``update(grow_seconds=)``,
those of the records with the most pairs first), and the pairs left ungrown are
worst-case pairs, sound like those the state budget leaves (:attr:`ForestGuard.complete` is
then False until a fit). A pair's subtree is grown level by level with the other pairs'
subtrees, and a node that several of them share (same tree, path and records: the child
away from the deleted record, where their deletions move a split the same way) is
decided once.

Binding and persistence
-----------------------
The state is tied to ``forest.content_hash()`` at fit time. Every :meth:`certain` /
:meth:`answer` checks the forest: the hash is recomputed only when the forest's
``generation_`` moved; on a mismatch (the forest was updated and the guard was not)
nothing is certain and the :class:`~jobs.idp.guard.LabelGuard` is bound in noise-all
mode until :meth:`update` or :meth:`refit`. :meth:`save` writes the pairs (by tree, node
path and record position) and their subtrees with the hash; :meth:`load` refuses any
other forest. Queries are not clipped: the certificate holds on all of R^d.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from jobs.idp.forest_fragility import domain_fragile, fragile_records
from jobs.idp.guard import LabelGuard
from jobs.learners import dare_view as dv
from jobs.learners.base import (
    check_features,
    hash_arrays,
    read_bundle_meta,
    read_bundle_payload,
    write_bundle,
)
from jobs.learners.dare import DaREForest
from jobs.learners.dare_shared import _ranges

SOUND = "sound"
NOISE_ALL = "noise-all"
FORMAT = "obliviate.forest-guard/2"
_TABLES = "pairs.npz"
_CHUNK_ROWS = 2_000_000  # records handed to the subtree grower at once
# The grown subtrees of the fragile pairs are the guard's state. It may take at most this
# many times the forest's own saved size (as arrays); the pairs whose subtrees are
# smallest are grown first, the others are charged the worst a tree can do below their
# node (few at large n: near-ties high up in a tree; many at small n, where most splits
# are near-ties).
STATE_BUDGET = 1.5  # the default of ForestGuard(state_budget=)
# Growing a pair's subtree costs about its node's records times the levels below it, and a
# near-tie node high up a tree makes many of its records fragile: growing all of those
# would cost (records at the node)^2. Pairs at nodes with more records than this are
# worst-case pairs, which keeps fit and update near-linear (bench_guard_scale.py: at 16k
# records, 1,024 halves the fit and costs 0.1 points of accuracy at epsilon 0).
GROW_ROWS = 1024  # the default of ForestGuard(grow_rows=)
# An update whose changed nodes hold more than this share of all (node, record) pairs
# refits instead. Measured (one run each, 2 cores): at 16k records 10 deletions change 75%
# of them and update in 3.4 s, 50 change 92% (6.8 s), 200 change 98% (8.8 s), where a
# fit takes 7.6 s; at 2k, 3 change 57% (0.6 s), 10 change 78% (1.4 s), a fit takes
# 1.1-1.6 s. An update pays for what it keeps only when it keeps enough
REFIT_SHARE = 0.9
_PAIR_BYTES = 12  # node, record, root (int32)
# what the saved state stores (the kernels read int64; thresholds stay exact float64)
_SAVED_DTYPES = {"node": np.int32, "prec": np.int32, "root": np.int32, "leaf": np.bool_,
                 "attr": np.int16, "thr": np.float64, "left": np.int32, "right": np.int32,
                 "cnt": np.int32, "n": np.int32}


@dataclass
class ForestFitReport:
    seconds: float
    n_records: int
    n_trees: int
    n_leaves: int
    #: (record, tree) pairs where the record is fragile somewhere on its path
    fragile_pairs: int
    forest_hash: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Structure:
    """The forest's trees in compact node ids, depth-first per tree (a subtree is the
    range [u, u + size[u])): routing, cells, leaves and their records."""

    root: np.ndarray
    kind: np.ndarray
    left: np.ndarray
    right: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    cnt: np.ndarray  # (nodes, C) class counts (leaves' give the probabilities)
    n: np.ndarray
    tree: np.ndarray
    path: np.ndarray
    depth: np.ndarray
    size: np.ndarray
    lo: np.ndarray  # (nodes, features) cells: lo < q <= hi
    hi: np.ndarray
    rec_off: np.ndarray  # leaves' records: rec[rec_off[u]:rec_off[u + 1]]
    rec: np.ndarray  # record positions (in the forest's sorted record ids)
    y: np.ndarray  # label index of each record position
    forest_node: np.ndarray  # compact id -> the forest's node id
    node_of: dict[int, int]  # the forest's node id -> compact id

    @classmethod
    def of(cls, forest: DaREForest) -> _Structure:
        v = dv.view(forest)
        order = _depth_first(v)
        compact = np.full(len(v.used), -1, dtype=np.int64)
        compact[order] = np.arange(len(order))
        kind = v.kind[order].astype(np.int64)
        inner = kind != dv.LEAF
        left = np.where(inner, compact[np.maximum(v.left[order], 0)], -1)
        right = np.where(inner, compact[np.maximum(v.right[order], 0)], -1)
        attr = np.maximum(v.attr[order], 0).astype(np.int64)
        thr = v.thr[order].astype(np.float64)
        p = v.X.shape[0]
        lo = np.full((len(order), p), -np.inf)
        hi = np.full((len(order), p), np.inf)
        size = np.ones(len(order), dtype=np.int64)
        for u in range(len(order) - 1, -1, -1):  # children come after their parent
            if inner[u]:
                size[u] += size[left[u]] + size[right[u]]
        for u in range(len(order)):
            if inner[u]:
                for c, cut in ((left[u], "hi"), (right[u], "lo")):
                    lo[c], hi[c] = lo[u], hi[u]
                    if cut == "hi":
                        hi[c, attr[u]] = min(hi[u, attr[u]], thr[u])
                    else:
                        lo[c, attr[u]] = max(lo[u, attr[u]], thr[u])
        pos = _positions(forest)
        leaves = np.flatnonzero(~inner)
        rows, off = dv.node_records(forest, order[leaves])
        rec_n = np.zeros(len(order), dtype=np.int64)
        rec_n[leaves] = np.diff(off)
        y = np.zeros(int(forest.n_records_), dtype=np.int64)
        live = pos >= 0
        y[pos[live]] = v.y[: len(pos)][live]
        return cls(
            root=compact[v.root], kind=kind, left=left, right=right, attr=attr, thr=thr,
            cnt=v.cnt[order].astype(np.int64), n=v.n[order].astype(np.int64),
            tree=v.tree[order].astype(np.int64), path=v.path[order].astype(np.int64),
            depth=v.depth[order].astype(np.int64), size=size, lo=lo, hi=hi,
            rec_off=np.concatenate([[0], np.cumsum(rec_n)]).astype(np.int64),
            rec=pos[rows], y=y, forest_node=order,
            node_of={int(u): i for i, u in enumerate(order.tolist())},
        )  # fmt: skip

    def probabilities(self) -> np.ndarray:
        return self.cnt / np.maximum(self.n, 1)[:, None].astype(np.float64)

    def kernel(self) -> tuple[np.ndarray, ...]:
        """What the query kernels read: routing, counts, the leaves' records, labels."""
        return (self.root, self.kind, self.left, self.right, self.attr, self.thr, self.cnt,
                self.n, self.rec_off, self.rec, self.y)

    def keys(self) -> np.ndarray:
        """(tree, heap path) rows: what names a node across updates."""
        return np.stack([self.tree, self.path], axis=1)


def _depth_first(v: dv.ForestView) -> np.ndarray:
    """The forest's used node ids, tree by tree, each tree in depth-first pre-order."""
    out: list[int] = []
    for r in v.root.tolist():
        stack = [r]
        while stack:
            u = stack.pop()
            out.append(u)
            if v.kind[u] != dv.LEAF:
                stack += [int(v.right[u]), int(v.left[u])]
    return np.array(out, dtype=np.int64)


def _positions(forest: DaREForest) -> np.ndarray:
    """Slot -> position of the record in the forest's sorted record ids (-1: no record)."""
    ids = forest.record_ids_
    pos = np.full(len(dv.view(forest).y), -1, dtype=np.int64)
    pos[[forest._slot[i] for i in ids.tolist()]] = np.arange(len(ids))
    return pos


@dataclass
class _Pairs:
    """The fragile (record, node) pairs, one per (tree, record): its highest fragile node.
    An exact pair carries the subtree a deletion of its record grows at its node, as nodes
    of one pool from its ``root`` (leaf flag, routing ``x <= thr`` left, class counts);
    a worst-case pair (``root`` -1) has none."""

    node: np.ndarray  # per pair: compact node, record position, pool root or -1
    prec: np.ndarray
    root: np.ndarray
    leaf: np.ndarray  # per pool node
    attr: np.ndarray
    thr: np.ndarray
    left: np.ndarray
    right: np.ndarray
    cnt: np.ndarray
    n: np.ndarray

    ARRAYS = ("node", "prec", "root", "leaf", "attr", "thr", "left", "right", "cnt", "n")

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.ARRAYS}

    def pool(self) -> tuple[np.ndarray, ...]:
        """The subtrees' nodes, as the query kernel reads them."""
        return tuple(getattr(self, k) for k in self.ARRAYS[3:])

    @classmethod
    def empty(cls, C: int) -> _Pairs:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, np.zeros(0, bool), z, np.zeros(0), z, z, np.zeros((0, C), np.int64),
                   z)

    def by_node(self, n_nodes: int, exact: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR per compact node of the exact (or the worst-case) pairs: records, roots."""
        sel = (self.root >= 0) == exact
        node, prec, root = self.node[sel], self.prec[sel], self.root[sel]
        order = np.argsort(node, kind="stable")
        off = np.searchsorted(node[order], np.arange(n_nodes + 1))
        return off.astype(np.int64), prec[order], root[order]

    def select(self, keep: np.ndarray, node: np.ndarray | None = None,
               prec: np.ndarray | None = None) -> _Pairs:
        """The pairs where `keep`, their subtrees packed anew (optionally renamed)."""
        node = self.node if node is None else node
        prec = self.prec if prec is None else prec
        old_root = self.root[keep]
        has = old_root >= 0  # worst-case pairs own no block
        size = np.zeros(len(old_root), dtype=np.int64)
        size[has] = self._block_sizes()[old_root[has]]
        idx = _ranges(np.maximum(old_root, 0), size)
        new_of = np.full(len(self.leaf), -1, dtype=np.int64)
        new_of[idx] = np.arange(len(idx))
        root = np.full(len(old_root), -1, dtype=np.int64)
        root[has] = new_of[old_root[has]]
        kid = lambda a: np.where(a[idx] >= 0, new_of[np.maximum(a[idx], 0)], -1)  # noqa: E731
        return _Pairs(node=node[keep], prec=prec[keep], root=root, leaf=self.leaf[idx],
                      attr=self.attr[idx], thr=self.thr[idx], left=kid(self.left),
                      right=kid(self.right), cnt=self.cnt[idx], n=self.n[idx])

    def _block_sizes(self) -> np.ndarray:
        """Per pool node that is a pair's root: its subtree's size. Each subtree is one
        block, root first (as grown, concatenated and packed), so a block ends where the
        next begins."""
        starts = np.unique(self.root[self.root >= 0])
        out = np.zeros(len(self.leaf), dtype=np.int64)
        out[starts] = np.diff(np.append(starts, len(self.leaf)))
        return out

    def fits(self, n_nodes: int, n_records: int, n_features: int, C: int) -> bool:
        g = len(self.leaf)
        inner = ~self.leaf
        return bool(
            self.node.shape == self.prec.shape == self.root.shape
            and self.cnt.shape == (g, C) and self.n.shape == (g,)
            and ((self.node >= 0) & (self.node < n_nodes)).all()
            and ((self.prec >= 0) & (self.prec < n_records)).all()
            and ((self.root >= -1) & (self.root < g)).all()
            and ((self.attr >= 0) & (self.attr < n_features)).all()
            and ((self.left[inner] >= 0) & (self.left[inner] < g)).all()
            and ((self.right[inner] >= 0) & (self.right[inner] < g)).all()
            and (self.left[inner] > np.flatnonzero(inner)).all()  # children after parents
            and (self.right[inner] > np.flatnonzero(inner)).all())  # fmt: skip

    @classmethod
    def concat(cls, parts: list[_Pairs], C: int) -> _Pairs:
        if not parts:
            return cls.empty(C)
        base = np.cumsum([0] + [len(p.leaf) for p in parts])[:-1]

        def shift(a: np.ndarray, b: int) -> np.ndarray:
            return np.where(a >= 0, a + b, -1)

        return cls(
            node=np.concatenate([p.node for p in parts]).astype(np.int64),
            prec=np.concatenate([p.prec for p in parts]).astype(np.int64),
            root=np.concatenate([shift(p.root, b) for p, b in zip(parts, base, strict=True)]),
            leaf=np.concatenate([p.leaf for p in parts]).astype(bool),
            attr=np.concatenate([p.attr for p in parts]).astype(np.int64),
            thr=np.concatenate([p.thr for p in parts]).astype(np.float64),
            left=np.concatenate([shift(p.left, b) for p, b in zip(parts, base, strict=True)]),
            right=np.concatenate([shift(p.right, b) for p, b in zip(parts, base, strict=True)]),
            cnt=np.concatenate([p.cnt for p in parts]).astype(np.int64).reshape(-1, C),
            n=np.concatenate([p.n for p in parts]).astype(np.int64))


def _pairs(forest: DaREForest, st: _Structure, nodes: np.ndarray | None) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """(compact node, record position, domain override or NaN) of every record's highest
    fragile node, among `nodes` (forest ids; None: all) and, for records whose deletion
    moves a value domain, every random node on that attribute."""
    pos = _positions(forest)
    done, off, slots = fragile_records(forest, nodes)
    comp = np.array([st.node_of[int(u)] for u in done.tolist()], dtype=np.int64)
    sizes = np.diff(off)
    node = np.repeat(comp, sizes)
    prec = pos[slots]
    v = dv.view(forest)
    dom = np.full(len(node), np.nan)
    extra_n, extra_r, extra_d = [], [], []
    for a, slot, moved in domain_fragile(forest):  # (attribute, slot, the moved domain)
        rnd = [st.node_of[int(u)] for u in np.flatnonzero(v.used & (v.kind == dv.RANDOM)
                                                          & (v.attr == a))]
        extra_n += rnd
        extra_r += [int(pos[slot])] * len(rnd)
        extra_d += [moved] * len(rnd)
    if extra_n:
        node = np.concatenate([node, extra_n]).astype(np.int64)
        prec = np.concatenate([prec, extra_r]).astype(np.int64)
        dom = np.concatenate([dom, extra_d])
    return _highest(st, node, prec, dom)


def _highest(st: _Structure, node: np.ndarray, prec: np.ndarray, dom: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pair per (tree, record): the highest node (smallest depth; a domain pair
    first)."""
    order = np.lexsort((np.isnan(dom), st.depth[node], prec, st.tree[node]))
    node, prec, dom = node[order], prec[order], dom[order]
    first = np.ones(len(node), dtype=bool)
    first[1:] = (st.tree[node][1:] != st.tree[node][:-1]) | (prec[1:] != prec[:-1])
    return node[first], prec[first], dom[first]


def _below_dropped(forest: DaREForest, st: _Structure, touched: np.ndarray,
                   dropped: tuple[np.ndarray, np.ndarray], node: np.ndarray,
                   prec: np.ndarray, dom: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The recomputed pairs plus, for each dropped pair (a live record's pair at a
    changed node) whose record has no recomputed pair at or above that node's depth, the
    record's fragile nodes below it on its path that did not change."""
    d_node, d_prec = dropped
    # per dropped pair: the highest recomputed pair of its (tree, record), if any
    order = np.lexsort((st.depth[node], prec, st.tree[node]))
    key = np.stack([st.tree[node], prec], axis=1)[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (key[1:] != key[:-1]).any(axis=1)
    at = _match(key[first], np.stack([st.tree[d_node], d_prec], axis=1))
    top = np.where(at >= 0, st.depth[node[order[first]]][np.maximum(at, 0)], 1 << 30)
    covered = top <= st.depth[d_node]
    changed = np.zeros(len(st.kind), dtype=bool)
    changed[touched] = True
    X = dv.view(forest).X  # (attribute, slot)
    slot = np.array([forest._slot[i] for i in forest.record_ids_.tolist()], dtype=np.int64)
    want: dict[int, set[int]] = {}  # compact node -> record positions to compute there
    for u, r in zip(d_node[~covered].tolist(), d_prec[~covered].tolist(), strict=True):
        k = u
        while st.kind[k] != dv.LEAF:
            k = st.left[k] if X[st.attr[k], slot[r]] <= st.thr[k] else st.right[k]
            if not changed[k]:
                want.setdefault(int(k), set()).add(r)
    if not want:
        return node, prec, dom
    comp = np.array(sorted(want), dtype=np.int64)
    done, off, slots = fragile_records(forest, st.forest_node[comp])
    pos = _positions(forest)
    extra_n, extra_r = [], []
    for i, u in enumerate(done.tolist()):
        c = st.node_of[int(u)]
        for r in pos[slots[off[i]:off[i + 1]]].tolist():
            if r in want[c]:
                extra_n.append(c)
                extra_r.append(r)
    return (np.concatenate([node, extra_n]).astype(np.int64),
            np.concatenate([prec, extra_r]).astype(np.int64),
            np.concatenate([dom, np.full(len(extra_n), np.nan)]))


def _within_budget(st: _Structure, node: np.ndarray, budget_nodes: int,
                   grow_rows: float) -> np.ndarray:
    """Which pairs get their subtrees: those at nodes of at most `grow_rows` records, the
    smallest first (by the old subtree's size), while they fit the budget."""
    small = np.flatnonzero(st.n[node] <= grow_rows)
    order = small[np.argsort(st.size[node[small]], kind="stable")]
    fits = np.cumsum(st.size[node][order]) <= budget_nodes
    out = np.zeros(len(node), dtype=bool)
    out[order[fits]] = True
    return out


def _grow_pairs(forest: DaREForest, st: _Structure, node: np.ndarray, prec: np.ndarray,
                dom: np.ndarray, budget_nodes: int, grow_rows: float,
                deadline: float = math.inf) -> tuple[_Pairs, int]:
    """The pairs with the subtrees a deletion of their record grows at their node (for
    the pairs the budget admits; the others are worst-case pairs), and how many pairs
    the budget admits that are left worst-case because `deadline` (perf_counter) came
    first."""
    C = st.cnt.shape[1]
    exact = _within_budget(st, node, budget_nodes, grow_rows)
    order = np.arange(len(node))
    chunk_rows = _CHUNK_ROWS
    if math.isfinite(deadline):
        # a record's worst-case pairs add up in its bound: the records with the most
        # pairs first, the smaller subtrees first within a record's count (measured at
        # 16k records, 166 deletions per update: 0.4-0.7 points more certified than
        # smallest first, 1-1.5 more than the records with the fewest pairs first)
        per = np.bincount(prec, minlength=int(prec.max(initial=0)) + 1)[prec]
        order = np.lexsort((st.size[node], -per))
        chunk_rows = _CHUNK_ROWS // 8  # finer steps between looks at the clock
    order = order[exact[order]]
    node_x, prec_x, dom_x = node[order], prec[order], dom[order]
    ids = forest.record_ids_
    slot = np.array([forest._slot[i] for i in ids.tolist()], dtype=np.int64)
    n_rows = st.n[node_x]
    parts = []
    start = 0
    while start < len(node_x):
        if time.perf_counter() > deadline:
            exact[order[start:]] = False
            break
        stop = start + 1
        while stop < len(node_x) and n_rows[start:stop + 1].sum() <= chunk_rows:
            stop += 1
        sel = np.arange(start, stop)
        u = node_x[sel]
        rows, off = dv.node_records(forest, st.forest_node[u])
        owner = np.repeat(np.arange(len(sel)), np.diff(off))
        keep = rows != slot[prec_x[sel]][owner]  # the record itself leaves its node
        rows = rows[keep]
        off = np.concatenate([[0], np.cumsum(np.bincount(owner[keep], minlength=len(sel)))])
        for idx, g in _grow_with_domains(forest, st, u, rows, off.astype(np.int64),
                                         dom_x[sel]):
            parts.append(_Pairs(u[idx], prec_x[sel][idx], g.off[:-1], g.leaf, g.attr, g.thr,
                                g.left, g.right, g.cnt, g.n))
        start = stop
    late = len(node_x) - start
    worst = _Pairs.empty(C)
    worst = _Pairs(node[~exact], prec[~exact], np.full(int((~exact).sum()), -1, np.int64),
                   *list(worst.arrays().values())[3:])
    return _Pairs.concat([worst, *parts], C), late


def _grow_with_domains(forest: DaREForest, st: _Structure, u: np.ndarray, rows: np.ndarray,
                       off: np.ndarray, dom: np.ndarray) -> list[tuple[np.ndarray, dv.Grown]]:
    """Grow the subtrees, in groups: (the tasks of the group, their subtrees). A pair with a
    moved value domain (dom not NaN: the new D of its random node's attribute) grows with
    that domain."""
    plain = np.isnan(dom)
    groups = [(np.flatnonzero(plain), None)]
    for a, d in sorted({(int(st.attr[x]), float(dd)) for x, dd in zip(u[~plain], dom[~plain],
                                                                       strict=True)}):
        groups.append((np.flatnonzero(~plain & (st.attr[u] == a) & (dom == d)), (a, d)))
    v = dv.view(forest)
    out = []
    for idx, override in groups:
        if not idx.size:
            continue
        sub_rows = np.concatenate([rows[off[i]:off[i + 1]] for i in idx])
        sub_off = np.concatenate([[0], np.cumsum(np.diff(off)[idx])]).astype(np.int64)
        fu = st.forest_node[u[idx]]
        out.append((idx, dv.grow(forest, v.tree[fu], v.path[fu], v.depth[fu], sub_rows,
                                 sub_off, domain=override)))
    return out


# --------------------------------------------------------------------------- kernels


class _PairIndex(NamedTuple):
    """Per compact node (CSR): the exact pairs' records and subtree roots, and the
    worst-case pairs' records."""

    f_off: np.ndarray
    f_rec: np.ndarray
    f_root: np.ndarray
    w_off: np.ndarray
    w_rec: np.ndarray


@njit(cache=True)
def _route(Q, tr):  # pragma: no cover - compiled
    """Leaf (compact id) of every (tree, query), shape (T, n); `tr`: _Structure.kernel()."""
    root, kind, left, right, attr, thr = tr[:6]
    n = Q.shape[0]
    T = root.shape[0]
    out = np.empty((T, n), dtype=np.int64)
    for i in range(n):
        for t in range(T):
            k = root[t]
            while kind[k] != 0:
                k = left[k] if Q[i, attr[k]] <= thr[k] else right[k]
            out[t, i] = k
    return out


@njit(cache=True)
def _gains(Q, tr, ix, g_, n_records, depth_max):  # pragma: no cover - compiled
    """Per query i: H[i, a, b] = max over records x of sum_t (hi_{t,x,b} - lo_{t,x,a}) / T
    and delta[i] = max over x, c of the largest |sum_t| of its bounds / T, where a tree's
    (hi, lo) for x is its exact change (closed form for a stable record of q's leaf; for
    an exact fragile pair on q's path, the leaf of its grown subtree that q reaches
    against q's leaf), or the worst a tree can do for a worst-case pair on q's path:
    hi_b = 1 - p_b, lo_a = -p_a. Records whose deletion changes nothing at q give 0.
    `tr`: the trees (:meth:`_Structure.kernel`), `ix`: the pairs by node
    (:class:`_PairIndex`), `g_`: their grown subtrees (:meth:`_Pairs.pool`)."""
    root, kind, left, right, attr, thr, cnt, nn, rec_off, rec, y = tr
    f_off, f_rec, f_root, w_off, w_rec = ix
    g_leaf, g_attr, g_thr, g_left, g_right, g_cnt, g_n = g_
    n = Q.shape[0]
    T = root.shape[0]
    C = cnt.shape[1]
    hi = np.zeros((n_records, C))
    lo = np.zeros((n_records, C))
    stamp = np.full(n_records, -1, np.int64)
    met = np.zeros(n_records, np.bool_)
    touched = np.empty(n_records, np.int64)
    path = np.empty(depth_max + 2, np.int64)
    p = np.empty(C)
    H = np.zeros((n, C, C))
    delta = np.zeros(n)
    for i in range(n):
        nt = 0
        for t in range(T):
            k = root[t]
            d = 0
            while kind[k] != 0:
                path[d] = k
                d += 1
                k = left[k] if Q[i, attr[k]] <= thr[k] else right[k]
            path[d] = k
            d += 1
            nl = nn[k]
            for c in range(C):
                p[c] = cnt[k, c] / max(nl, 1)
            for j in range(d):
                u = path[j]
                for e in range(f_off[u], f_off[u + 1]):  # exact pair: its grown subtree
                    x = f_rec[e]
                    stamp[x] = t
                    if not met[x]:
                        met[x] = True
                        touched[nt] = x
                        nt += 1
                    g = f_root[e]
                    while not g_leaf[g]:
                        g = g_left[g] if Q[i, g_attr[g]] <= g_thr[g] else g_right[g]
                    for c in range(C):
                        dc = g_cnt[g, c] / max(g_n[g], 1) - p[c]
                        hi[x, c] += dc
                        lo[x, c] += dc
                for e in range(w_off[u], w_off[u + 1]):  # worst-case pair
                    x = w_rec[e]
                    stamp[x] = t
                    if not met[x]:
                        met[x] = True
                        touched[nt] = x
                        nt += 1
                    for c in range(C):
                        hi[x, c] += 1.0 - p[c]
                        lo[x, c] -= p[c]
            for e in range(rec_off[k], rec_off[k + 1]):  # stable in q's leaf: closed form
                x = rec[e]
                if stamp[x] == t or nl <= 1:
                    continue
                if not met[x]:
                    met[x] = True
                    touched[nt] = x
                    nt += 1
                yx = y[x]
                for c in range(C):
                    dc = (cnt[k, c] - (1.0 if c == yx else 0.0)) / (nl - 1) - p[c]
                    hi[x, c] += dc
                    lo[x, c] += dc
        base = 0.0 if nt < n_records else -np.inf
        for a in range(C):
            for b in range(C):
                H[i, a, b] = base if a != b else 0.0
        for m in range(nt):
            x = touched[m]
            for a in range(C):
                delta[i] = max(delta[i], max(abs(hi[x, a]), abs(lo[x, a])) / T)
                for b in range(C):
                    if a != b:
                        H[i, a, b] = max(H[i, a, b], (hi[x, b] - lo[x, a]) / T)
            for c in range(C):
                hi[x, c] = 0.0
                lo[x, c] = 0.0
            stamp[x] = -1
            met[x] = False
    return H, delta


# --------------------------------------------------------------------------- the guard


class ForestGuard:
    """Label-only, eps-iDP answers from a DaRE forest (see the module docstring).

    Build with :meth:`fit` (or :meth:`load` a saved one); :meth:`certain` gives (class
    indices, certainty mask), :meth:`answer` publishes labels through :class:`LabelGuard`.
    """

    def __init__(self, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None, state_budget: float = STATE_BUDGET,
                 grow_rows: float = GROW_ROWS) -> None:
        if not state_budget >= 0:
            raise ValueError(f"state_budget must be >= 0, got {state_budget!r}")
        if not grow_rows >= 0:
            raise ValueError(f"grow_rows must be >= 0, got {grow_rows!r}")
        self.forest = forest
        self.state_budget = state_budget
        self.grow_rows = grow_rows
        self.guard = LabelGuard(max(2, forest.n_classes_), epsilon=epsilon,
                                memo_size=memo_size, random_state=random_state)
        self.forest_hash: str | None = None
        self.fit_report: ForestFitReport | None = None
        self._st: _Structure | None = None
        self._pairs: _Pairs | None = None
        self._ids: np.ndarray | None = None  # what the pairs' record positions name
        self._P: np.ndarray | None = None
        self._kernel_args: tuple = ()
        self._summary: dict[str, Any] = {}
        self._checked: tuple[int, str, bool] | None = None  # (generation, hash, matches)

    @classmethod
    def fit(cls, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
            random_state: int | None = None, state_budget: float = STATE_BUDGET,
            grow_rows: float = GROW_ROWS) -> ForestGuard:
        """Compute the fragile pairs and their subtrees for `forest`; `state_budget`: the
        most the subtrees may take, as a multiple of the forest's saved size; `grow_rows`:
        the most records a pair's node may hold for its subtree to be grown (both inf:
        every pair exact, whatever it costs)."""
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state,
                   state_budget=state_budget, grow_rows=grow_rows)
        self.refit()
        return self

    def refit(self, nodes: np.ndarray | None = None) -> ForestFitReport:
        """Bring the guard up to date with the forest as it is now; sound mode afterwards.

        `nodes` (the forest's node ids): every node whose records changed since the last
        fit (the paths of the updated records and the retrained subtrees); the pairs at
        all other nodes are kept (see the module docstring). None recomputes everything."""
        return self._refit(nodes, _Structure.of(self.forest), time.perf_counter())

    def _refit(self, nodes: np.ndarray | None, st: _Structure, t0: float,
               grow_seconds: float = math.inf) -> ForestFitReport:
        """refit() with the forest's structure as it is now (`st`), timed from `t0`; pairs
        not grown within `grow_seconds` stay worst-case (:attr:`complete` False)."""
        h = self.forest.content_hash()
        C = st.cnt.shape[1]
        incremental = nodes is not None and self._pairs is not None
        if incremental:
            v = dv.view(self.forest)
            nodes = np.asarray(nodes, dtype=np.int64)
            nodes = nodes[(nodes >= 0) & (nodes < len(v.used))]
            # random nodes are recomputed always: a deletion that moves a value domain
            # reaches all of them (there are few)
            nodes = np.union1d(nodes[v.used[nodes]],
                               np.flatnonzero(v.used & (v.kind == dv.RANDOM)))
            touched = np.array(sorted({st.node_of[int(u)] for u in nodes.tolist()}),
                               dtype=np.int64)
            kept, dropped = self._kept(st, touched)
        node, prec, dom = _pairs(self.forest, st, nodes if incremental else None)
        if incremental:
            node, prec, dom = _highest(st, *_below_dropped(self.forest, st, touched, dropped,
                                                           node, prec, dom))
            node, prec, dom, kept = _merge_kept(st, node, prec, dom, kept)
        node_bytes = 23 + 4 * C  # a grown node as saved: see _SAVED_DTYPES
        budget = self.state_budget * dv.saved_nbytes(self.forest) - _PAIR_BYTES * len(node)
        if incremental:
            budget -= _PAIR_BYTES * len(kept.node) + node_bytes * len(kept.leaf)
        fresh, late = _grow_pairs(self.forest, st, node, prec, dom,
                                  int(min(max(budget / node_bytes, 0), 2**62)), self.grow_rows,
                                  time.perf_counter() + grow_seconds)
        pairs = _Pairs.concat([kept, fresh], C) if incremental else fresh
        # kept pairs an earlier update left worst-case for time stay worst-case
        complete = late == 0 and (not incremental or self.complete)
        rep = ForestFitReport(
            seconds=time.perf_counter() - t0, n_records=int(self.forest.n_records_),
            n_trees=int(self.forest.n_estimators), n_leaves=int((st.kind == dv.LEAF).sum()),
            fragile_pairs=int(len(pairs.node)), forest_hash=h,
            detail={"incremental": bool(incremental), "pairs_grown": int(len(node)),
                    "exact_pairs": int((pairs.root >= 0).sum()),
                    "subtree_nodes": int(len(pairs.leaf)), "deferred_pairs": late,
                    "complete": complete})
        self._install(st, pairs, rep)
        return rep

    def update(self, deleted: Sequence[str] = (), added: Sequence[str] = (),
               grow_seconds: float | None = None) -> ForestFitReport:
        """After the forest deleted and added these records (one batch or several since the
        last fit): recompute what they can have changed and keep the rest. The changed
        nodes: the deleted records' paths before, the added ones' after, and every node
        whose split or counts moved, with its subtree.

        `grow_seconds`: grow the new pairs' subtrees for at most this long (once the
        fragile pairs are known; the records with the most pairs first); the pairs not
        grown by then are worst-case pairs, which is sound and certifies fewer queries:
        :attr:`complete` turns False until a fit. The worker publishes with such a guard at
        once and refits it when the stream pauses."""
        t0 = time.perf_counter()
        if grow_seconds is None:
            grow_seconds = math.inf
        elif not grow_seconds >= 0:
            raise ValueError(f"grow_seconds must be >= 0, got {grow_seconds!r}")
        if (self._st is None or self._pairs is None
                or not np.array_equal(self._classes, self.forest.classes_)):
            # a class that came or went renumbers every count
            return self._refit(None, _Structure.of(self.forest), t0, grow_seconds)
        old = self._st
        new = _Structure.of(self.forest)
        gone = np.asarray(list(deleted), dtype=object)
        old_pos = np.searchsorted(self._ids, gone)
        found = (old_pos < len(self._ids)) & (
            self._ids[np.minimum(old_pos, len(self._ids) - 1)] == gone)
        ids = self.forest.record_ids_
        on_paths = np.concatenate([
            _path_keys(old, old_pos[found]),
            _path_keys(new, np.searchsorted(ids, np.asarray(list(added), dtype=object)))])
        new_keys = new.keys()
        # a node whose split moved (or that is new) sends other records to its children:
        # its whole subtree changed; one whose counts alone moved holds fewer or more
        # records, and only itself changed (its children are on the same paths)
        i = _match(old.keys(), new_keys)
        j = np.maximum(i, 0)
        split = ((i < 0) | (old.kind[j] != new.kind) | (old.attr[j] != new.attr)
                 | (old.thr[j] != new.thr))
        counts = ~split & ((old.n[j] != new.n) | (old.cnt[j] != new.cnt).any(axis=1))
        cover = np.zeros(len(new.kind) + 1, dtype=np.int64)
        top = np.flatnonzero(split)
        np.add.at(cover, top, 1)
        np.add.at(cover, top + new.size[top], -1)
        split = np.cumsum(cover[:-1]) > 0
        changed = split | counts | (_match(on_paths, new_keys) >= 0)
        # a big batch (or a forest refitted from scratch) changes most nodes: recomputing
        # them one by one, keeping the few others, then costs more than a fit; not so when
        # growth is bounded in time: what is kept keeps its subtrees, a fit would not
        if math.isinf(grow_seconds) and new.n[changed].sum() > REFIT_SHARE * new.n.sum():
            return self._refit(None, new, t0, grow_seconds)
        nodes = np.unique(new.forest_node[changed])
        return self._refit(nodes.astype(np.int64), new, t0, grow_seconds)

    @property
    def complete(self) -> bool:
        """Every pair the state budget admits has its subtree (no update ran out of time
        since the last fit)."""
        return self.fit_report is not None and bool(self.fit_report.detail.get("complete",
                                                                               True))

    def _kept(self, st: _Structure, touched: np.ndarray
              ) -> tuple[_Pairs, tuple[np.ndarray, np.ndarray]]:
        """The last fit's pairs at nodes that did not change (with their subtrees), moved to
        the new compact ids and record positions, pairs of deleted records dropped; and
        (node, record) of the live records' pairs at `touched` nodes (compact ids)."""
        old_st, old = self._st, self._pairs
        remap_node = _match(st.keys(), old_st.keys())
        ids = self.forest.record_ids_
        held = self._ids[old.prec]
        at = np.searchsorted(ids, held)
        ok = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == held)
        node = remap_node[old.node]
        hit = np.isin(node, touched)
        keep = (node >= 0) & ok & ~hit
        gone = (node >= 0) & ok & hit
        return (old.select(keep, node=node, prec=np.where(ok, at, -1)),
                (node[gone], at[gone]))

    def _install(self, st: _Structure, pairs: _Pairs, rep: ForestFitReport) -> None:
        self._st, self._pairs, self._P = st, pairs, st.probabilities()
        self._ids = self.forest.record_ids_
        self._classes = self.forest.classes_.copy()
        f_off, f_rec, f_root = pairs.by_node(len(st.kind), True)
        w_off, w_rec, _ = pairs.by_node(len(st.kind), False)
        self._kernel_args = (st.kernel(), _PairIndex(f_off, f_rec, f_root, w_off, w_rec),
                             pairs.pool(), int(self.forest.n_records_),
                             int(st.depth.max(initial=0)))
        self.forest_hash = rep.forest_hash
        self.fit_report = rep
        self._summary = self._summarise()
        self._checked = (self.forest.generation_, rep.forest_hash, True)

    @property
    def tol(self) -> float:
        return 1e-9 + 8.0 * float(self.forest.n_estimators) * 2.0**-53

    # ---------------------------------------------------------------- persistence

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (forest hash, fit report, summary) and ``path/pairs.npz``
        (no pickle): the pairs and their subtrees, nodes named by (tree, path)."""
        if self._st is None or self.fit_report is None:
            raise RuntimeError("nothing to save: the guard has not been fitted")
        arrays = {k: a.astype(_SAVED_DTYPES[k]) for k, a in self._pairs.arrays().items()}
        arrays |= {"node_tree": self._st.tree, "node_path": self._st.path}
        meta = {
            "format": FORMAT,
            "forest_hash": self.forest_hash,
            "n_classes": int(self.forest.n_classes_),
            # the budget later updates keep to (JSON has no inf: None)
            "state_budget": None if math.isinf(self.state_budget) else self.state_budget,
            "grow_rows": None if math.isinf(self.grow_rows) else self.grow_rows,
            "tables_hash": hash_arrays(*(arrays[k] for k in sorted(arrays))),
            "fit_report": asdict(self.fit_report),
            "summary": self._summary,
        }
        write_bundle(Path(path), meta, _TABLES, lambda fh: np.savez(fh, **arrays))

    @classmethod
    def load(cls, path: str | Path, forest: DaREForest, epsilon: float = 1.0,
             memo_size: int = 100_000, random_state: int | None = None) -> ForestGuard:
        """Read the state written by :meth:`save` for `forest`.

        Raises ValueError when `forest` is not the forest it was fitted to (content hash)
        or the state does not match its recorded hash: pairs of another forest would
        certify answers that a LOO forest of this one may give differently.
        """
        p = Path(path)
        meta = read_bundle_meta(p, FORMAT, "forest guard")
        h = forest.content_hash()
        if h != meta["forest_hash"]:
            raise ValueError(f"{p}: the guard was fitted to forest {meta['forest_hash'][:16]}..., "
                             f"not to the given forest {h[:16]}...; refit it")
        with np.load(read_bundle_payload(p, _TABLES), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        if sorted(arrays) != sorted((*_Pairs.ARRAYS, "node_tree", "node_path")) or hash_arrays(
                *(arrays[k] for k in sorted(arrays))) != meta["tables_hash"]:
            raise ValueError(f"{p}: the guard's state does not match its recorded hash")
        st = _Structure.of(forest)
        pairs = _Pairs(**{k: arrays[k].astype(np.float64 if k == "thr" else bool if k == "leaf"
                                             else np.int64) for k in _Pairs.ARRAYS})
        # equal hashes imply equal trees; checked because the kernels do not check bounds
        if not (np.array_equal(st.tree, arrays["node_tree"])
                and np.array_equal(st.path, arrays["node_path"])
                and pairs.fits(len(st.kind), forest.n_records_, forest.n_features_,
                               forest.n_classes_)):  # fmt: skip
            raise ValueError(f"{p}: the guard's state does not fit the forest's nodes")
        budget, rows = meta.get("state_budget", STATE_BUDGET), meta.get("grow_rows", GROW_ROWS)
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state,
                   state_budget=math.inf if budget is None else float(budget),
                   grow_rows=math.inf if rows is None else float(rows))
        self._install(st, pairs, ForestFitReport(**meta["fit_report"]))
        return self

    def _summarise(self) -> dict[str, Any]:
        rep = self.fit_report
        T = rep.n_trees
        return {
            "rule": "forest-loo-fragility",
            "forest_hash": rep.forest_hash,
            "n_records": rep.n_records,
            "n_trees": T,
            "n_leaves": rep.n_leaves,
            "fragile_pairs": rep.fragile_pairs,
            "fragile_share": round(rep.fragile_pairs / max(1, rep.n_records * T), 6),
            "entries": int(rep.detail.get("entries", 0)),
            "fit_seconds": round(float(rep.seconds), 3),
            "complete": self.complete,
            # a record is met once per tree: it moves a class probability by at most 1/T
            # there, so by at most 1 over the forest
            "delta_max_bound": 1.0,
        }

    @property
    def bound_summary(self) -> dict[str, Any]:
        """Small JSON-able record of what the guard rests on, for a model manifest."""
        return dict(self._summary)

    # ---------------------------------------------------------------- binding

    def _sound(self) -> bool:
        """Whether the state is the forest's; re-hashes only when `generation_` moved."""
        gen = self.forest.generation_
        if self._checked is None or self._checked[0] != gen:
            h = self.forest.content_hash()
            self._checked = (gen, h, self.forest_hash is not None and h == self.forest_hash)
        _, h, ok = self._checked
        self.guard.bind(h, ok)  # cheap; also binds a replaced LabelGuard
        return ok

    @property
    def mode(self) -> str:
        return SOUND if self._sound() else NOISE_ALL

    # ---------------------------------------------------------------- queries

    def _rows(self, Q: np.ndarray) -> np.ndarray:
        return _route(Q, self._kernel_args[0])

    def _scores(self, rows: np.ndarray) -> np.ndarray:
        """Forest scores from the leaves, with DaREForest.scores' own numpy arithmetic
        (same chunks of trees, same reductions), so the labels are bit for bit its argmax."""
        T, n = rows.shape
        out = np.zeros((n, self._P.shape[1]))
        step = max(1, 100_000 // max(1, n))
        for t0 in range(0, T, step):
            out += self._P[rows[t0:t0 + step]].sum(axis=0)
        return out / T

    def bounds(self, X: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores (n, C), delta (n,), H (n, C, C)) with delta(q) = max_x,c |p_{-x,c} - p_c|
        and H[q, a, b] = max_x of how far class b gains on class a at q. Raises when the
        forest no longer matches the guard."""
        if not self._sound():
            raise RuntimeError("the forest changed since the guard was fitted; call refit()")
        Q = check_features(X, None, self.forest.n_features_)
        H, delta = _gains(Q, *self._kernel_args)
        return self._scores(self._rows(Q)), delta, H

    def certain(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Predicted class index (lowest on ties) and whether every LOO forest agrees."""
        Q = check_features(X, None, self.forest.n_features_)
        if not self._sound():
            return np.argmax(self.forest.scores(Q), axis=1), np.zeros(len(Q), dtype=bool)
        scores, _delta, H = self.bounds(Q)
        w = np.argmax(scores, axis=1)
        rows = np.arange(len(Q))
        margin = scores[rows, w][:, None] - scores
        need = H[rows, w, :] + self.tol
        need[rows, w] = -np.inf
        return w, (margin > need).all(axis=1)

    def answer(self, X: Any) -> np.ndarray:
        """Published labels (values of forest.classes_): certain ones as is, the rest through
        the exponential mechanism per grid cell (everything noised when the forest moved)."""
        Xq = np.asarray(X, dtype=np.float64) + 0.0
        labels, certain = self.certain(Xq)
        idx = self.guard.answer(Xq, labels, certain,
                                lambda C: np.argmax(self.forest.scores(C), axis=1))
        return self.forest.classes_[idx]


def _merge_kept(st: _Structure, node: np.ndarray, prec: np.ndarray, dom: np.ndarray,
                kept: _Pairs) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Pairs]:
    """One pair per (tree, record), the highest: a recomputed pair above a kept one
    replaces it; a kept pair above a recomputed one (impossible when every changed node
    was recomputed, but checked) wins."""
    at = _match(np.stack([st.tree[node], prec], axis=1),
                np.stack([st.tree[kept.node], kept.prec], axis=1))
    hit = np.flatnonzero(at >= 0)
    above = st.depth[node[at[hit]]] <= st.depth[kept.node[hit]]
    keep_kept = np.ones(len(kept.node), dtype=bool)
    keep_new = np.ones(len(node), dtype=bool)
    keep_kept[hit[above]] = False
    keep_new[at[hit[~above]]] = False
    return node[keep_new], prec[keep_new], dom[keep_new], kept.select(keep_kept)


def _path_keys(st: _Structure, positions: np.ndarray) -> np.ndarray:
    """(tree, heap path) rows of every node on the paths of the records at `positions`."""
    want = np.zeros(len(st.y), dtype=bool)
    want[positions[(positions >= 0) & (positions < len(st.y))]] = True
    owner = np.repeat(np.arange(len(st.kind)), np.diff(st.rec_off))  # the leaf of each
    hit = np.unique(owner[want[st.rec]])
    tree, path = st.tree[hit], st.path[hit]
    rows = []
    while len(path):
        rows.append(np.stack([tree, path], axis=1))
        up = path > 1
        tree, path = tree[up], path[up] >> 1
    return np.unique(np.concatenate(rows), axis=0) if rows else np.zeros((0, 2), np.int64)


def _match(keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Per row of `query`: the index of the equal row of `keys` (rows of two integers,
    unique), or -1."""
    keys, query = keys.astype(np.int64), query.astype(np.int64)
    out = np.full(len(query), -1, dtype=np.int64)
    if not len(keys) or not len(query):
        return out
    both = np.concatenate([keys, query])
    lo, hi = both.min(axis=0), both.max(axis=0)
    span = hi - lo + 1
    if span[0] > (1 << 62) // span[1]:  # no room for one int64 per row: compare rows
        _, inv = np.unique(both, axis=0, return_inverse=True)
        inv = inv.ravel()
        at = np.full(int(inv.max()) + 1, -1, dtype=np.int64)
        at[inv[:len(keys)]] = np.arange(len(keys))
        return at[inv[len(keys):]]
    code = (both[:, 0] - lo[0]) * span[1] + (both[:, 1] - lo[1])
    k, q = code[:len(keys)], code[len(keys):]
    order = np.argsort(k, kind="stable")
    at = np.minimum(np.searchsorted(k[order], q), len(k) - 1)
    hit = k[order][at] == q
    out[hit] = order[at[hit]]
    return out

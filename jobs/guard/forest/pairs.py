"""What the forest guard stores: the forest in compact, depth-first node ids
(:class:`ForestStructure`) and its fragile (node, record) pairs (:class:`FragilePairs`),
grown from the records' paths and kept, pruned or merged as the forest changes.
What a pair means and why the guard is sound: docs/DESIGN.md (Beyond LUCID, for DaRE forests)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from jobs.guard.forest.fragility import domain_fragile, fragile_records
from jobs.guard.forest.routing_kernels import GrownPool, Trees
from jobs.learners.dare import view as dv
from jobs.learners.dare.common import _ranges
from jobs.learners.dare.forest import DaREForest

_CHUNK_ROWS = 2_000_000  # records handed to the subtree grower at once


@dataclass
class ForestStructure:
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
    def of(cls, forest: DaREForest) -> ForestStructure:
        v = dv.view(forest, with_index=False)
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

    def kernel(self) -> Trees:
        """What the query kernels read: routing, counts, the leaves' records, labels."""
        return Trees(root=self.root, kind=self.kind, left=self.left, right=self.right,
                     attr=self.attr, thr=self.thr, cnt=self.cnt, n=self.n,
                     rec_off=self.rec_off, rec=self.rec, y=self.y)

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
    slots = dv.live_slots(forest)
    pos = np.full(len(dv.view(forest, with_index=False).y), -1, dtype=np.int64)
    pos[slots] = np.arange(len(slots))
    return pos


@dataclass
class FragilePairs:
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

    def pool(self) -> GrownPool:
        """The subtrees' nodes, as the query kernel reads them."""
        return GrownPool(**{k: getattr(self, k) for k in self.ARRAYS[3:]})

    @classmethod
    def empty(cls, C: int) -> FragilePairs:
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
               prec: np.ndarray | None = None) -> FragilePairs:
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
        return FragilePairs(node=node[keep], prec=prec[keep], root=root, leaf=self.leaf[idx],
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
    def concat(cls, parts: list[FragilePairs], C: int) -> FragilePairs:
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


def fragile_pairs(forest: DaREForest, st: ForestStructure, nodes: np.ndarray | None,
                  tally: dict[str, float] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(compact node, record position, domain override or NaN) of every record's highest
    fragile node, among `nodes` (forest ids; None: all) and, for records whose deletion
    moves a value domain, every random node on that attribute; `tally`: as
    :func:`fragile_records`."""
    pos = _positions(forest)
    done, off, slots = fragile_records(forest, nodes, tally=tally)
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
    return highest_pairs(st, node, prec, dom)


def highest_pairs(st: ForestStructure, node: np.ndarray, prec: np.ndarray, dom: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pair per (tree, record): the highest node (smallest depth; a domain pair
    first)."""
    order = np.lexsort((np.isnan(dom), st.depth[node], prec, st.tree[node]))
    node, prec, dom = node[order], prec[order], dom[order]
    first = np.ones(len(node), dtype=bool)
    first[1:] = (st.tree[node][1:] != st.tree[node][:-1]) | (prec[1:] != prec[:-1])
    return node[first], prec[first], dom[first]


def below_dropped(forest: DaREForest, st: ForestStructure, touched: np.ndarray,
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
    at = match_rows(key[first], np.stack([st.tree[d_node], d_prec], axis=1))
    top = np.where(at >= 0, st.depth[node[order[first]]][np.maximum(at, 0)], 1 << 30)
    covered = top <= st.depth[d_node]
    changed = np.zeros(len(st.kind), dtype=bool)
    changed[touched] = True
    X = dv.view(forest).X  # (attribute, slot)
    slot = dv.live_slots(forest)
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


def within_budget(st: ForestStructure, node: np.ndarray, budget_nodes: int,
                   grow_rows: float) -> np.ndarray:
    """Which pairs get their subtrees: those at nodes of at most `grow_rows` records, the
    smallest first (by the old subtree's size), while they fit the budget."""
    small = np.flatnonzero(st.n[node] <= grow_rows)
    order = small[np.argsort(st.size[node[small]], kind="stable")]
    fits = np.cumsum(st.size[node][order]) <= budget_nodes
    out = np.zeros(len(node), dtype=bool)
    out[order[fits]] = True
    return out


def grow_pairs(forest: DaREForest, st: ForestStructure, node: np.ndarray, prec: np.ndarray,
                dom: np.ndarray, budget_nodes: int, grow_rows: float,
                deadline: float = math.inf) -> tuple[FragilePairs, int]:
    """The pairs with the subtrees a deletion of their record grows at their node (for
    the pairs the budget admits; the others are worst-case pairs), and how many pairs
    the budget admits that are left worst-case because `deadline` (perf_counter) came
    first."""
    C = st.cnt.shape[1]
    exact = within_budget(st, node, budget_nodes, grow_rows)
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
    slot = dv.live_slots(forest)
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
        for idx, g in grow_with_domains(forest, st, u, rows, off.astype(np.int64),
                                         dom_x[sel]):
            parts.append(FragilePairs(u[idx], prec_x[sel][idx], g.off[:-1], g.leaf, g.attr, g.thr,
                                g.left, g.right, g.cnt, g.n))
        start = stop
    late = len(node_x) - start
    worst = FragilePairs.empty(C)
    worst = FragilePairs(node[~exact], prec[~exact], np.full(int((~exact).sum()), -1, np.int64),
                   *list(worst.arrays().values())[3:])
    return FragilePairs.concat([worst, *parts], C), late


def grow_with_domains(forest: DaREForest, st: ForestStructure, u: np.ndarray, rows: np.ndarray,
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


def merge_kept(st: ForestStructure, node: np.ndarray, prec: np.ndarray, dom: np.ndarray,
                kept: FragilePairs) -> tuple[np.ndarray, np.ndarray, np.ndarray, FragilePairs]:
    """One pair per (tree, record), the highest: a recomputed pair above a kept one
    replaces it; a kept pair above a recomputed one (impossible when every changed node
    was recomputed, but checked) wins."""
    at = match_rows(np.stack([st.tree[node], prec], axis=1),
                np.stack([st.tree[kept.node], kept.prec], axis=1))
    hit = np.flatnonzero(at >= 0)
    above = st.depth[node[at[hit]]] <= st.depth[kept.node[hit]]
    keep_kept = np.ones(len(kept.node), dtype=bool)
    keep_new = np.ones(len(node), dtype=bool)
    keep_kept[hit[above]] = False
    keep_new[at[hit[~above]]] = False
    return node[keep_new], prec[keep_new], dom[keep_new], kept.select(keep_kept)


def path_keys(st: ForestStructure, positions: np.ndarray) -> np.ndarray:
    """(tree, heap path) rows of every node on the paths of the records at `positions`."""
    want = np.zeros(len(st.y), dtype=bool)
    want[positions[(positions >= 0) & (positions < len(st.y))]] = True
    # their leaves: the node whose range of leaf records holds each of their entries
    hit = np.unique(np.searchsorted(st.rec_off, np.flatnonzero(want[st.rec]), side="right") - 1)
    tree, path = st.tree[hit], st.path[hit]
    rows = []
    while len(path):
        rows.append(np.stack([tree, path], axis=1))
        up = path > 1
        tree, path = tree[up], path[up] >> 1
    return np.unique(np.concatenate(rows), axis=0) if rows else np.zeros((0, 2), np.int64)


def match_rows(keys: np.ndarray, query: np.ndarray) -> np.ndarray:
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

"""A read-only view of a DaRE forest for code that reasons about single deletions.

The forest guard (:mod:`jobs.guard.forest.fragility`) needs what the forest's own update
code reads (nodes, each node's records, ranks and labels, greedy nodes' candidate lists as
the split search builds them) without reaching into the forest: this module hands those out
from the public fields of its state and modifies nothing.
See docs/guard.md (DaRE forests)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numba import njit
from sklearn.utils.validation import check_is_fitted

from jobs.learners.dare import builder, bundle, split_search
from jobs.learners.dare.common import _W_MSL as W_MSL
from jobs.learners.dare.common import GREEDY, LEAF, RANDOM, _h2, _ranges, score_table
from jobs.learners.dare.forest import DaREForest
from jobs.learners.dare.state import ForestState

__all__ = ["GREEDY", "LEAF", "RANDOM", "W_MSL", "Candidates", "ForestView", "Grown",
           "candidates", "grow", "live_slots", "node_records", "saved_nbytes", "view"]


@dataclass(frozen=True)
class ForestView:
    """Node arrays are indexed by the forest's node ids (only ``used`` ones are real);
    record arrays by slot (``live`` ones are records). Arrays are the forest's own:
    read them, never write."""

    n_trees: int
    n_classes: int
    msl: int  # min_samples_leaf
    k: int
    gini: bool
    root: np.ndarray
    used: np.ndarray
    kind: np.ndarray
    why: np.ndarray  # why a leaf is one (0: internal); W_MSL leaves can split after a deletion
    depth: np.ndarray
    left: np.ndarray
    right: np.ndarray
    attr: np.ndarray
    r1: np.ndarray
    r2: np.ndarray
    thr: np.ndarray
    draw: np.ndarray
    n: np.ndarray
    cnt: np.ndarray
    tree: np.ndarray
    path: np.ndarray
    rank: np.ndarray  # (features, slots)
    X: np.ndarray  # (features, slots)
    y: np.ndarray
    live: np.ndarray
    vmix: np.ndarray
    voff: np.ndarray
    node_keys: np.ndarray  # the keyed hash naming each node (priorities derive from it)
    xlogx: np.ndarray  # the entropy table (a dummy for Gini)


class Candidates(NamedTuple):
    """Per greedy node (parallel to the nodes asked for): whether it found a split, and per
    sampled attribute slot its candidate pairs in priority order (the first k are the
    ones scored): ``attr[i, s]`` (-1: no slot), ``all_pairs[i, s]`` (the list holds every
    valid pair), entries ``e_r1/e_r2/e_left[off[i, s]:off[i, s] + length[i, s]]``. A
    named tuple: compiled kernels take it as it is."""

    ok: np.ndarray
    split_attr: np.ndarray
    split_r1: np.ndarray
    attr: np.ndarray
    all_pairs: np.ndarray
    off: np.ndarray
    length: np.ndarray
    e_r1: np.ndarray
    e_r2: np.ndarray
    e_left: np.ndarray


_NO_INDEX = np.zeros(0, dtype=np.int64)


def view(forest: DaREForest, *, with_index: bool = True) -> ForestView:
    """The forest as the guard reads it; `with_index=False` leaves out the value index
    (empty `rank`, `vmix`, `voff`), so that a loaded forest does not derive it for a
    reader of its trees and records only."""
    check_is_fitted(forest)
    st = forest.state_
    nd, rec = st.nodes, st.records
    rank, vmix, voff = ((st.values.rank, st.values.vmix, st.values.voff) if with_index
                        else (_NO_INDEX,) * 3)
    keys = _h2(st.tree_keys[np.maximum(nd.tree, 0)], nd.path.astype(np.uint64))
    return ForestView(
        n_trees=st.rule.n_trees, n_classes=st.n_classes, msl=st.rule.min_samples_leaf,
        k=st.rule.k, gini=st.rule.gini, root=st.layout.root[: st.rule.n_trees].astype(np.int64),
        used=nd.used, kind=nd.kind, why=nd.why, depth=nd.depth, left=nd.left, right=nd.right,
        attr=nd.attr, r1=nd.r1, r2=nd.r2, thr=nd.thr, draw=nd.draw, n=nd.n, cnt=nd.cnt,
        tree=nd.tree, path=nd.path, rank=rank, X=rec.X, y=rec.y,
        live=rec.alive[: rec.n_slots], vmix=vmix, voff=voff,
        node_keys=keys, xlogx=score_table(st.rule.gini, int(nd.n.max(initial=0)) + 2),
    )  # fmt: skip


def node_records(forest: DaREForest, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The live records (slots) of each node, CSR (rows, off)."""
    return builder.node_rows(forest.state_, np.asarray(nodes, dtype=np.int64))


_LIVE_SLOTS: weakref.WeakKeyDictionary[DaREForest, tuple[int, dict, np.ndarray]] = \
    weakref.WeakKeyDictionary()


def live_slots(forest: DaREForest) -> np.ndarray:
    """The slot of every live record (they index the view's record arrays), in the order
    of ``forest.record_ids_``; read-only, kept until the forest changes (an update moves
    its generation, a compaction replaces its slot map): a guard update asks five
    times, 0.3 s each at 10^6 records."""
    slot = forest.state_.records.slot
    memo = _LIVE_SLOTS.get(forest)
    if memo is not None and memo[0] == forest.generation_ and memo[1] is slot:
        return memo[2]
    slots = np.array([slot[i] for i in forest.record_ids_.tolist()], dtype=np.int64)
    slots.setflags(write=False)
    _LIVE_SLOTS[forest] = (forest.generation_, slot, slots)
    return slots


def candidates(forest: DaREForest, nodes: np.ndarray, rows: np.ndarray,
               start: np.ndarray, stop: np.ndarray) -> Candidates:
    """The candidate lists of greedy `nodes` (node i's records: rows[start[i]:stop[i]]),
    as the split search builds them: the first k + buffer valid pairs of every sampled
    attribute.

    A node that keeps its lists (a cached node: the forest updates them with every
    deletion and addition, so that its splits stay those of a retrain) hands them out as
    they are: their live pairs are every valid pair below the list's priority cut-off
    (the forest inserts a pair that turns valid under it), so they ARE the first valid
    pairs the search would list, up to k + buffer of them. What the guard asks of them is
    what one more deletion leaves: at most two listed pairs turn invalid, so a slot that
    lists k + 2 live pairs (or every valid pair) still names the first k after it, and
    the decisions are those of the search's longer lists. The others (small nodes, slots
    whose deletions left fewer) run the split search on their records: after a stream of
    deletions, asking for the whole buffer sent most large nodes there."""
    st = forest.state_
    nd, cc, e, rule = st.nodes, st.caches, st.entries, st.rule
    nodes = np.asarray(nodes, dtype=np.int64)
    m = len(nodes)
    P = rule.n_sampled
    cid = nd.cid[nodes].astype(np.int64)
    kept = keeps_lists(forest, nodes)
    search = np.flatnonzero(~kept)
    slot_attr = np.full((m, P), -1, dtype=np.int64)
    allp = np.zeros((m, P), dtype=bool)
    eoff = np.zeros((m, P), dtype=np.int64)
    ln = np.zeros((m, P), dtype=np.int64)
    ok = np.ones(m, dtype=bool)
    attr = nd.attr[nodes].astype(np.int64)
    r1 = nd.r1[nodes].astype(np.int64)
    e_r1 = e_r2 = np.zeros(0, dtype=np.int64)
    e_left = np.zeros((0, st.n_classes), dtype=np.int64)
    if search.size:
        lens = (np.asarray(stop) - np.asarray(start))[search]
        sub = _ranges(np.asarray(start)[search], lens)
        soff = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        at = nodes[search]
        ok_s, attr_s, r1_s, _r2, lists = split_search.greedy_splits(
            st, nd.tree[at].astype(np.int64), nd.path[at].astype(np.int64),
            nd.n[at].astype(np.int64), nd.cnt[at].astype(np.int64), rows[sub], soff,
            np.ones(len(search), dtype=bool))
        ok[search], attr[search], r1[search] = ok_s, attr_s, r1_s
        if lists is not None:
            ct = search[lists.task]
            slot_attr[ct], allp[ct] = lists.slot_attr, lists.all_pairs
            eoff[ct], ln[ct] = lists.off, lists.length
            e_r1, e_r2 = lists.e_r1.astype(np.int64), lists.e_r2.astype(np.int64)
            e_left = lists.e_left.astype(np.int64)
    hit = np.flatnonzero(kept)
    if hit.size:
        base = len(e_r1)
        sa, al, eo, el, c_r1, c_r2, c_left = _live_lists(
            cid[hit], cc.attr, cc.off, cc.length, cc.all_pairs, e.r1, e.r2, e.left,
            rule.k + rule.buffer)
        slot_attr[hit], allp[hit], eoff[hit], ln[hit] = sa, al, eo + base, el
        e_r1 = np.concatenate([e_r1, c_r1])
        e_r2 = np.concatenate([e_r2, c_r2])
        e_left = np.concatenate([e_left, c_left])
    return Candidates(ok=ok, split_attr=attr, split_r1=r1, attr=slot_attr, all_pairs=allp,
                      off=eoff, length=ln, e_r1=e_r1, e_r2=e_r2, e_left=e_left)


def keeps_lists(forest: DaREForest, nodes: np.ndarray) -> np.ndarray:
    """Per greedy node: whether :func:`candidates` hands out its cached lists as they are
    (no split search, so no record read)."""
    st = forest.state_
    cc, rule = st.caches, st.rule
    return _kept_lists(st.nodes.cid[np.asarray(nodes, dtype=np.int64)].astype(np.int64),
                       cc.attr, cc.off, cc.length, cc.all_pairs, st.entries.r1,
                       rule.k + min(2, rule.buffer))


@njit(cache=True)
def _kept_lists(cid, c_attr, c_off, c_len, c_all, er1, need):  # pragma: no cover - compiled
    """Per node: whether it keeps lists of at least `need` live pairs per slot, or every
    valid pair (see candidates)."""
    out = np.zeros(cid.shape[0], np.bool_)
    for i in range(cid.shape[0]):
        c = cid[i]
        if c < 0:
            continue
        good = True
        for s in range(c_attr.shape[1]):
            if c_attr[c, s] < 0:
                continue
            live = 0
            for e in range(c_off[c, s], c_off[c, s] + c_len[c, s]):
                if er1[e] >= 0:
                    live += 1
            if live < need and not c_all[c, s]:
                good = False
                break
        out[i] = good
    return out


@njit(cache=True)
def _live_lists(cid, c_attr, c_off, c_len, c_all, er1, er2, eleft, KB
                ):  # pragma: no cover - compiled
    """The first KB live pairs of each slot of cached nodes `cid`, packed as
    :class:`Candidates` lays them out (slot attribute, all-flag, offset, length; entries
    r1, r2, left counts). A slot listing more than KB live pairs lists the first KB, and
    then not all of them."""
    m = cid.shape[0]
    P = c_attr.shape[1]
    C = eleft.shape[0]
    sa = np.full((m, P), -1, np.int64)
    al = np.zeros((m, P), np.bool_)
    eo = np.zeros((m, P), np.int64)
    el = np.zeros((m, P), np.int64)
    n = 0
    for i in range(m):
        for s in range(P):
            if c_attr[cid[i], s] >= 0:
                n += min(c_len[cid[i], s], KB)
    r1 = np.empty(n, np.int64)
    r2 = np.empty(n, np.int64)
    left = np.empty((n, C), np.int64)
    u = 0
    for i in range(m):
        c = cid[i]
        for s in range(P):
            a = c_attr[c, s]
            if a < 0:
                continue
            sa[i, s] = a
            eo[i, s] = u
            live = 0
            for e in range(c_off[c, s], c_off[c, s] + c_len[c, s]):
                if er1[e] < 0:
                    continue
                live += 1
                if live <= KB:
                    r1[u] = er1[e]
                    r2[u] = er2[e]
                    for cc in range(C):
                        left[u, cc] = eleft[cc, e]
                    u += 1
            el[i, s] = min(live, KB)
            al[i, s] = c_all[c, s] and live <= KB
    return sa, al, eo, el, r1[:u], r2[:u], left[:u]


@dataclass(frozen=True)
class Grown:
    """Subtrees grown by :func:`grow`, their nodes in one pool: task i's nodes are
    ``off[i]:off[i + 1]`` (its root first); ``left``/``right`` index the pool (-1 at a
    leaf), ``attr``/``thr`` route (``x <= thr`` to the left), ``cnt``/``n`` are the
    class counts (a leaf's give its probabilities)."""

    off: np.ndarray
    leaf: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    left: np.ndarray
    right: np.ndarray
    cnt: np.ndarray
    n: np.ndarray


def grow(forest: DaREForest, tree: np.ndarray, path: np.ndarray, depth: np.ndarray,
         rows: np.ndarray, off: np.ndarray, domain: tuple[int, float] | None = None) -> Grown:
    """Grow, without touching the forest, the subtree the forest would have at each task's
    node (tree, heap path, depth) if it held the records rows[off[i]:off[i + 1]]: the
    canonical subtree (every DaRE node is a function of its records), so for a node's
    records minus one this is the subtree a deletion of that one record leaves. Level by
    level, all tasks at once. `domain` (attribute, D): grow as if that attribute's
    random-node domain were D (the forest's own is put back before returning)."""
    st = forest.state_
    if domain is not None:
        a, D = domain
        dom = st.domains.dom
        saved = float(dom[a])
        dom[a] = D
        try:
            return grow(forest, tree, path, depth, rows, off)
        finally:
            dom[a] = saved
    C = st.n_classes
    ntask = len(tree)
    # nodes as they are made: (task, parent, side, leaf, attr, thr, cnt, n)
    cols: list[list[np.ndarray]] = [[] for _ in range(8)]
    made = 0
    cur_task = np.arange(ntask, dtype=np.int64)
    parent = np.full(ntask, -1, dtype=np.int64)
    side = np.zeros(ntask, dtype=np.int64)
    tree, path, depth = (np.asarray(a, dtype=np.int64) for a in (tree, path, depth))
    rows, off = np.asarray(rows, dtype=np.int64), np.asarray(off, dtype=np.int64)
    while len(cur_task):
        d = _decide_once(st, tree, path, depth, rows, off)
        ids = made + np.arange(len(cur_task))
        made += len(cur_task)
        leaf = d.kind == LEAF
        for col, val in zip(cols, (cur_task, parent, side, leaf, d.attr, d.thr, d.cnt, d.n),
                            strict=True):
            col.append(np.asarray(val))
        inner = np.flatnonzero(~leaf)
        if not inner.size:
            break
        n = np.diff(off)
        el = _ranges(off[inner], n[inner])
        owner = np.repeat(np.arange(len(inner)), n[inner])
        go = d.go_left[el]
        kids_rows, kids_n = [], []
        for s in (go, ~go):  # children: all left ones, then all right ones
            kids_rows.append(rows[el[s]])
            kids_n.append(np.bincount(owner[s], minlength=len(inner)))
        rows = np.concatenate(kids_rows)
        off = np.concatenate([[0], np.cumsum(np.concatenate(kids_n))]).astype(np.int64)
        cur_task = np.concatenate([cur_task[inner], cur_task[inner]])
        parent = np.concatenate([ids[inner], ids[inner]])
        side = np.concatenate([np.zeros(len(inner), np.int64), np.ones(len(inner), np.int64)])
        tree = np.concatenate([tree[inner], tree[inner]])
        path = np.concatenate([2 * path[inner], 2 * path[inner] + 1])
        depth = np.concatenate([depth[inner] + 1, depth[inner] + 1])
    task, par, sd, lf, at, th, cn, nn = (np.concatenate(c) for c in cols)
    order = np.argsort(task, kind="stable")  # per task, in the order made: root first
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    left = np.full(len(order), -1, dtype=np.int64)
    right = np.full(len(order), -1, dtype=np.int64)
    has = par >= 0
    left[pos[par[has & (sd == 0)]]] = pos[np.flatnonzero(has & (sd == 0))]
    right[pos[par[has & (sd == 1)]]] = pos[np.flatnonzero(has & (sd == 1))]
    toff = np.searchsorted(task[order], np.arange(ntask + 1)).astype(np.int64)
    return Grown(off=toff, leaf=lf[order], attr=np.maximum(at[order], 0).astype(np.int64),
                 thr=th[order].astype(np.float64), left=left, right=right,
                 cnt=cn[order].astype(np.int64).reshape(-1, C), n=nn[order].astype(np.int64))


class _Decided(NamedTuple):
    kind: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    cnt: np.ndarray
    n: np.ndarray
    go_left: np.ndarray


def _decide_once(st: ForestState, tree: np.ndarray, path: np.ndarray, depth: np.ndarray,
                 rows: np.ndarray, off: np.ndarray) -> _Decided:
    """The forest's decisions for the tasks' nodes, each distinct task decided once.

    Pairs at one node whose deletions move its split the same way grow children that
    are the same node with the same records (the child away from the deleted record):
    a node is a function of (tree, path, depth, records), so such tasks get the first
    one's decision. Duplicates are found by an order-free hash of the records and then
    compared row by row (a hash collision only costs the sharing)."""
    n = np.diff(off)
    ntask = len(n)
    h = np.zeros(ntask, dtype=np.uint64)
    if len(rows):
        starts = np.minimum(off[:-1], len(rows) - 1)
        h = np.add.reduceat(_h2(rows.astype(np.uint64), np.uint64(0x5BD1E995)), starts)
        h[n == 0] = 0
    key = _h2(h ^ _h2(tree.astype(np.uint64), path.astype(np.uint64)),
              (depth * (1 << 32) + n).astype(np.uint64))
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    own = np.arange(ntask)
    rep = first[inv]
    # a duplicate is the same node with the same records in the same order (children keep
    # their parent's order); anything else the hash put together decides on its own
    rep = np.where((tree == tree[rep]) & (path == path[rep]) & (depth == depth[rep])
                   & (n == n[rep]), rep, own)
    dup = np.flatnonzero(rep != own)
    if dup.size:
        owner = np.repeat(np.arange(len(dup)), n[dup])
        differs = rows[_ranges(off[dup], n[dup])] != rows[_ranges(off[rep[dup]], n[dup])]
        apart = dup[np.unique(owner[differs])]
        rep[apart] = apart
    uniq = np.flatnonzero(rep == own)
    if len(uniq) == ntask:
        d = split_search.decide(st, tree, path, depth, rows, off, np.zeros(ntask, dtype=bool))
        return _Decided(d.kind, d.attr, d.thr, d.cnt, d.n, d.go_left)
    el_u = _ranges(off[uniq], n[uniq])
    off_u = np.concatenate([[0], np.cumsum(n[uniq])]).astype(np.int64)
    d = split_search.decide(st, tree[uniq], path[uniq], depth[uniq], rows[el_u], off_u,
                            np.zeros(len(uniq), dtype=bool))
    at = np.full(ntask, -1, dtype=np.int64)
    at[uniq] = np.arange(len(uniq))
    j = at[rep]
    # element e of task i is element e of its representative
    go_left = d.go_left[_ranges(off_u[j], n)]
    return _Decided(d.kind[j], d.attr[j], d.thr[j], d.cnt[j], d.n[j], go_left)


def saved_nbytes(forest: DaREForest) -> int:
    """The size of what :meth:`DaREForest.save` writes (its arrays), in bytes."""
    st = forest.state_
    rec = st.records
    n = int(rec.n_live)
    state = sum(a.nbytes for a in bundle.state_arrays(st).values())
    return int(state + rec.X.shape[0] * n * 8 + n * 16)

"""Which records could change a DaRE node's split if they alone were deleted.

For the forest guard: each (node, record) is decided "stable" (the node's decision stands
without the record) or "fragile" (it may change, or it cannot be told), by replaying the
forest's own rules with one record removed; a record's tree then changes only at its leaf
unless it is fragile on its path. Far from a tie most records are skipped by a margin test
(:func:`_margin_holds`); tests compare every "stable" claim with an actual deletion.
See docs/guard.md (DaRE forests)."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from jobs.learners.dare import view as dv
from jobs.learners.dare.forest import DaREForest
from jobs.learners.dare.search_kernels import _TAG_THR, _sort_keys, h2, mix, score1

_S32 = np.uint64(32)
_ROW_VALUES = 16  # int32 values in a 64-byte cache line
_CHUNK_PAIRS = 1 << 25  # (node, record) pairs decided at once (their slots: 256 MiB)


def fragile_records(forest: DaREForest, nodes: np.ndarray | None = None, margin: bool = True,
                    tally: dict[str, float] | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the internal `nodes` (default: all), the records fragile at each: (nodes,
    off, slots) with the slots of node i in ``slots[off[i]:off[i + 1]]``. `margin`: skip
    the per-record rule where a node is far from a tie and decide each signature once
    (the same answer; False decides every record by the full rule, which scores the
    first k pairs after its deletion: for tests). `tally` (if given) counts
    what it cost: ``visited`` (node, record) pairs read, ``settled_pairs`` told without
    reading every record (:func:`_settled`; ``looked_up_nodes`` of them by the records of
    their near value groups, with ``looked_up_fragile`` records fragile), ``rule_runs``
    of the greedy per-record rule on the records read, ``kernel_cpu_s`` in the compiled
    kernel."""
    v = dv.view(forest)
    if nodes is None:
        nodes = np.flatnonzero(v.used)
    nodes = np.asarray(nodes, dtype=np.int64)
    # leaves stay leaves under a deletion, but for one whose candidates all left too few
    # records on a side: a pair from beyond the first k may then split it
    nodes = nodes[(v.kind[nodes] != dv.LEAF) | (v.why[nodes] == dv.W_MSL)]
    forest_in = _Forest(
        _Nodes(v.kind, v.attr, v.r1, v.thr, v.draw, v.cnt.astype(np.int64), v.node_keys),
        _Records(v.rank, _by_slot(v.rank, v.y), v.X, v.y.astype(np.int64), v.vmix, v.voff),
        _Rule(v.msl, v.k, v.gini, v.xlogx))
    settled, s_cnt, s_slots = (_settled(forest, v, nodes, forest_in, tally) if margin else
                               (np.zeros(len(nodes), bool), np.zeros(len(nodes), np.int64),
                                np.zeros(0, np.int64)))
    if tally is not None:
        tally["settled_pairs"] = tally.get("settled_pairs", 0) + int(v.n[nodes[settled]].sum())
    todo = nodes[~settled]
    # nodes a chunk at a time: their records' slots (a fit at 10^6 rows visits 4*10^8
    # pairs: 3.2 GB at once) are the kernel's largest input
    ends = np.cumsum(v.n[todo].astype(np.int64))
    cuts = np.unique(np.searchsorted(ends, np.arange(_CHUNK_PAIRS, ends[-1] if len(ends)
                                                     else 0, _CHUNK_PAIRS), side="right"))
    cuts = cuts[(cuts > 0) & (cuts < len(todo))].tolist()
    counts, slots = [], []
    for lo, hi in zip([0, *cuts], [*cuts, len(todo)], strict=True):
        cnt, fragile = _decide(forest, v, todo[lo:hi], forest_in, margin, tally)
        counts.append(cnt)
        slots.append(fragile)
    cnt = s_cnt.copy()
    cnt[~settled] = np.concatenate([np.zeros(0, np.int64), *counts])
    out = np.empty(int(cnt.sum()), np.int64)
    mine = np.repeat(settled, cnt)  # node by node, each node's slots from one source
    out[mine] = s_slots
    out[~mine] = np.concatenate([np.zeros(0, np.int64), *slots])
    return nodes, np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64), out


def _settled(forest: DaREForest, v: dv.ForestView, nodes: np.ndarray, forest_in: _Forest,
             tally: dict[str, float] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The nodes whose fragile records can be told without reading all of their records,
    as the kernel would tell them after reading every one: (decided, count, slots), per
    node whether it was decided here and how many of its records are fragile, and their
    slots, node by node in layout order.

    A random node from its children's counts (it keeps its draw unless a side empties or
    the node turns pure). A greedy node far from a tie from its class counts, candidate
    lists and value group tables: where no value group is near a listed pair and no
    class's loss leaves it pure, none; where a few groups are near, only their records
    can be, found through the forest's global value order and decided by the rule. Most
    of a large forest's big nodes (at 10^6 rows a record read is a cache miss)."""
    nt = v.n[nodes].astype(np.int64)
    cnt = v.cnt[nodes].astype(np.int64)
    count = np.zeros(len(nodes), np.int64)
    present = (cnt > 0).sum(axis=1)
    pure = ((cnt > 0) & (present[:, None] - (cnt == 1) <= 1)).any(axis=1)
    out = ((v.kind[nodes] == dv.RANDOM) & (nt - 1 >= 2 * v.msl) & (v.draw[nodes] >= 0)
           & (v.n[v.left[nodes]] > 1) & (v.n[v.right[nodes]] > 1) & ~pure)
    st = forest.state_
    g = np.flatnonzero((v.kind[nodes] == dv.GREEDY) & (nt - 1 >= 2 * v.msl) & ~pure
                       & (st.nodes.cid[nodes] >= 0))
    if st.tables_stale or not g.size:
        return out, count, np.zeros(0, np.int64)
    g = g[dv.keeps_lists(forest, nodes[g])]
    none = np.zeros(len(g), dtype=np.int64)
    cand = dv.candidates(forest, nodes[g], np.zeros(0, np.int64), none, none)
    tab = _tables(forest, nodes[g], cand, use=True)
    far = _far_from_ties(nodes[g], nt[g], forest_in.nodes, forest_in.records, cand,
                         forest_in.rule, tab)
    out[g] = far == _NONE_NEAR
    near = np.flatnonzero(far == _SOME_NEAR)
    slots = np.zeros(0, np.int64)
    if near.size:
        ix, nd = st.values, st.nodes
        where = _Where(ix.roff, ix.rstart, ix.gorder, v.live, st.layout.pos, nd.tree, nd.start,
                       nd.end)
        found, count[g], slots = _near_records(nodes[g], nt[g], near, forest_in.nodes,
                                               forest_in.records, cand, forest_in.rule, tab,
                                               where)
        out[g] |= found
        if tally is not None:
            tally["looked_up_nodes"] = tally.get("looked_up_nodes", 0) + int(found.sum())
            tally["looked_up_fragile"] = tally.get("looked_up_fragile", 0) + len(slots)
    return out, count, slots


def _decide(forest: DaREForest, v: dv.ForestView, nodes: np.ndarray, forest_in: _Forest,
            margin: bool, tally: dict[str, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of :func:`fragile_records`: per node how many records are fragile, and
    their slots."""
    rows, off = dv.node_records(forest, nodes)
    gi = np.flatnonzero(v.kind[nodes] == dv.GREEDY)
    cand = dv.candidates(forest, nodes[gi], rows, off[gi], off[gi + 1])
    slot_of = np.full(len(nodes), -1, dtype=np.int64)
    slot_of[gi] = np.arange(len(gi))
    tab = _tables(forest, nodes[gi], cand, use=margin)
    c0 = time.process_time()
    frag, cnt, runs = _fragile(nodes, rows, off, slot_of, forest_in.nodes, forest_in.records,
                               cand, forest_in.rule, margin, tab)
    if tally is not None:
        tally["visited"] = tally.get("visited", 0) + len(rows)
        tally["rule_runs"] = tally.get("rule_runs", 0) + int(runs.sum())
        tally["kernel_cpu_s"] = tally.get("kernel_cpu_s", 0.0) + time.process_time() - c0
    return cnt, rows[frag]


def _tables(forest: DaREForest, greedy: np.ndarray, cand: dv.Candidates, use: bool
            ) -> _Tables:
    """Where each greedy node's candidate slots have the forest's value group table of
    the same attribute (none when `use` is False: the full rule, for tests, counts every
    slot from its records; none while a loaded forest's tables wait for its first
    update)."""
    st = forest.state_
    off = np.zeros(cand.attr.shape, dtype=np.int64)
    length = np.zeros(cand.attr.shape, dtype=np.int64)
    cid = st.nodes.cid[greedy].astype(np.int64)
    at = np.flatnonzero(cid >= 0) if use and not st.tables_stale else np.zeros(0, np.int64)
    if at.size:
        cc = st.caches
        same = cc.attr[cid[at]] == cand.attr[at]
        off[at] = np.where(same, cc.table_off[cid[at]], 0)
        length[at] = np.where(same, cc.table_len[cid[at]], 0)
    return _Tables(off, length, st.tables.rank, st.tables.cnt)


def domain_fragile(forest: DaREForest) -> list[tuple[int, int, float]]:
    """(attribute, slot, new domain) for each record whose deletion moves a random node's
    value domain: D_a = 2**e with 2**(e-1) <= max |x_a| < 2**e over the records, so it moves
    when the record alone holds the largest |x_a| and the next largest has another e.
    Every random node on that attribute is then re-drawn, wherever it is: the record is
    fragile there. None with a fixed ``random_domain``. (The last record of a class is
    not fragile beyond its path: a class with no record scores 0 in every split.)"""
    if forest.d_rmax == 0 or forest.random_domain is not None:
        return []
    v = dv.view(forest)
    live = np.flatnonzero(v.live)
    out: list[tuple[int, int, float]] = []
    if len(live) < 2:
        return out
    absx = np.abs(v.X[:, live])
    for a in range(absx.shape[0]):
        two = np.partition(absx[a], -2)[-2:]
        top, second = float(two[1]), float(two[0])
        if top > second and _domain(top) != _domain(second):
            out.append((a, int(live[np.argmax(absx[a])]), _domain(second)))
    return out


def _by_slot(rank: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each record's value ranks and then its label in one row, where that row is one
    cache line (16 int32): a node's records are read in layout order, scattered over the
    slots, and the per-attribute arrays cost a miss per sampled attribute (at 10^6 rows
    most of a visit). A wider table keeps its per-attribute arrays (a copy would be GBs
    at 10^6 rows, and a record's sampled values would lie on several lines anyway): then
    no rows (the kernel reads `rank` and `y`)."""
    if rank.shape[0] + 1 > _ROW_VALUES:
        return np.empty((0, 0), dtype=rank.dtype)
    out = np.empty((rank.shape[1], rank.shape[0] + 1), dtype=rank.dtype)
    out[:, :-1] = rank.T
    out[:, -1] = y
    return out


def _domain(m: float) -> float:
    return 1.0 if m == 0 else math.ldexp(1.0, min(math.frexp(m)[1], 1023))


# --------------------------------------------------------------------------- the kernel

@njit(cache=True)
def _prio(nk, a, vmix, va, r):  # pragma: no cover - compiled
    """The 32-bit priority of the pair named by value rank r (= the split search's)."""
    sk = h2(nk ^ _TAG_THR, np.uint64(a))
    return np.int64(mix(sk ^ vmix[va + r]) >> _S32)


@njit(cache=True)
def _pure_without(cnt, c):  # pragma: no cover - compiled
    """(pure, label) of class counts `cnt` with one record of class c removed."""
    lab = -1
    for j in range(cnt.shape[0]):
        m = cnt[j] - (1 if j == c else 0)
        if m > 0:
            if lab >= 0:
                return False, -1
            lab = j
    return True, lab


@njit(cache=True)
def _group_pure(g_cnt, g):  # pragma: no cover - compiled
    lab = -1
    for j in range(g_cnt.shape[1]):
        if g_cnt[g, j] > 0:
            if lab >= 0:
                return False, -1
            lab = j
    return True, lab


@njit(cache=True)
def _order(vals, vbits):  # pragma: no cover - compiled
    """The positions of `vals` (non-negative, below 2**vbits) in ascending order: a radix
    sort of (value, position) keys for a large node, where a comparison sort of every
    attribute of every node on the updated paths was most of an update's time."""
    n = vals.shape[0]
    if n < 256:
        return np.argsort(vals, kind="mergesort")
    jbits = 1
    while (1 << jbits) < n:
        jbits += 1
    keys = np.empty(n, np.int64)
    for j in range(n):
        keys[j] = (vals[j] << jbits) | j
    keys = _sort_keys(keys, np.empty(n, np.int64), n, vbits + jbits)
    mask = (np.int64(1) << jbits) - 1
    out = np.empty(n, np.int64)
    for j in range(n):
        out[j] = keys[j] & mask
    return out


class _Nodes(NamedTuple):
    """The forest's nodes, as the kernels read them (by the forest's node id)."""

    kind: np.ndarray
    attr: np.ndarray
    r1: np.ndarray
    thr: np.ndarray
    draw: np.ndarray
    cnt: np.ndarray  # (nodes, classes)
    key: np.ndarray  # the keyed hash naming the node (pair priorities derive from it)


class _Records(NamedTuple):
    """The records' values (by slot): value ranks (and, for a narrow table, a row per
    record of its ranks and label: :func:`_by_slot`), raw values, labels, the value mixes
    that key pair priorities and each attribute's offset into them."""

    rank: np.ndarray  # (features, slots)
    by_slot: np.ndarray  # (slots, features + 1): ranks, then the label; or (0, 0)
    X: np.ndarray  # (features, slots)
    y: np.ndarray
    vmix: np.ndarray
    voff: np.ndarray


class _Rule(NamedTuple):
    """The forest's split rule: min_samples_leaf, pairs scored per attribute, Gini or
    entropy (with its x log x table)."""

    msl: int
    k: int
    gini: bool
    tab: np.ndarray


class _Forest(NamedTuple):
    """What the kernel reads of the forest, the same for every chunk of nodes."""

    nodes: _Nodes
    records: _Records
    rule: _Rule


class _Tables(NamedTuple):
    """The forest's value group tables of the greedy nodes of a chunk (row ci of `off` and
    `length`: node ci's slots; length 0: none to use), which the forest keeps current
    through its deletions and additions: a node's group counts without reading its
    records."""

    off: np.ndarray  # (greedy nodes, slots)
    length: np.ndarray
    rank: np.ndarray  # the forest's table pool
    cnt: np.ndarray


class _Groups(NamedTuple):
    """A greedy node's value groups per sampled attribute slot s: group of each record
    ``of[s, j]`` (where ``known[s]``: else looked up by :func:`_group_of`), their number
    ``n[s]``, value rank ``rank[s, g]`` ascending and class counts ``cnt[s, g]``; per
    listed entry q the group of its lower value ``entry[s, q]`` and its priority
    ``prio[s, q]``."""

    of: np.ndarray
    known: np.ndarray
    n: np.ndarray
    rank: np.ndarray
    cnt: np.ndarray
    entry: np.ndarray
    prio: np.ndarray
    lab: np.ndarray  # the label of each record


class _Selection(NamedTuple):
    """Work space: the first k pairs per slot after one deletion (left counts, lower
    value rank, slot, whether it is a merged pair (prev, next); for a listed pair left as
    it is, its row in the listed scores and the record's side, else -1)."""

    left: np.ndarray
    r1: np.ndarray
    slot: np.ndarray
    merged: np.ndarray
    listed: np.ndarray
    side: np.ndarray


@njit(cache=True)
def _margin_holds(ci, v, nd, cand, k, lscore):  # pragma: no cover - compiled
    """Whether no single deletion that leaves the first k listed pairs as they are can
    change greedy node v's split: the split's pair, with ANY one record removed from either
    side, still scores strictly above every other listed pair with any one record removed
    (the per-record rule then says "stable" for each such record). `lscore`: the listed
    pairs' scores with one record removed (:func:`_listed_scores`)."""
    cnt = nd.cnt[v]
    C = cnt.shape[0]
    P = cand.attr.shape[1]
    split_lo = np.inf
    others_hi = -np.inf
    found = False
    q_ = 0
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        m = cand.length[ci, s]
        if m < k and not cand.all_pairs[ci, s]:
            return False  # fewer than k known pairs: every record is "bad" anyway
        for q in range(min(k, m)):
            E = cand.off[ci, s] + q
            is_split = a == nd.attr[v] and cand.e_r1[E] == nd.r1[v]
            found = found or is_split
            for side in range(2):
                for c in range(C):
                    held = cand.e_left[E, c] if side == 0 else cnt[c] - cand.e_left[E, c]
                    if held == 0:
                        continue  # no record of class c on that side
                    sc = lscore[q_, side, c]
                    if sc == -np.inf:  # a side falls below min_samples_leaf
                        if is_split:
                            return False  # the split itself may turn invalid
                        continue
                    if is_split:
                        split_lo = min(split_lo, sc)
                    else:
                        others_hi = max(others_hi, sc)
            q_ += 1
    return found and split_lo > others_hi


@njit(cache=True, parallel=True)
def _fragile(nodes, rows, off, slot_of, nd, rec, cand, rule, use_margin, tab
             ):  # pragma: no cover - compiled
    """fragile[j] for every record rows[j] of every node (docs/guard.md, "DaRE forests"),
    and per node how many are fragile and how often the greedy per-record rule ran."""
    frag = np.zeros(rows.shape[0], np.bool_)
    cnt = np.zeros(nodes.shape[0], np.int64)
    runs = np.zeros(nodes.shape[0], np.int64)
    top = rec.rank.max() if rec.rank.size else 0
    rbits = 1
    while (np.int64(1) << rbits) <= top:
        rbits += 1
    for i in prange(nodes.shape[0]):  # nodes are independent: one thread each
        v = nodes[i]
        nt = off[i + 1] - off[i]
        if nt == 0:
            continue
        out = frag[off[i]:off[i + 1]]
        mine = rows[off[i]:off[i + 1]]
        ci = slot_of[i]
        if nd.kind[v] == 0 or nt - 1 < 2 * rule.msl:  # a leaf that may split; or turns one
            out[:] = True
        elif nd.kind[v] == 1:  # RANDOM
            _random_fragile(out, mine, v, nd, rec)
        elif (not cand.ok[ci] or cand.split_attr[ci] != nd.attr[v]
              or cand.split_r1[ci] != nd.r1[v]):
            out[:] = True  # the lists do not explain the split: assume the worst
        else:
            runs[i] = _greedy_fragile(out, mine, v, ci, nd, rec, cand, rule, use_margin,
                                      rbits, tab)
        cnt[i] = out.sum()
    return frag, cnt, runs


_NOT_FAR, _NONE_NEAR, _SOME_NEAR = 0, 1, 2


class _Where(NamedTuple):
    """Where the records are: attribute a's records with value rank q are
    ``gorder[a, rstart[roff[a] + q]:rstart[roff[a] + q + 1]]`` (live ones among them), and
    record r sits at ``pos[tree, r]`` of its tree's layout, where node v holds
    ``[start[v], end[v])``."""

    roff: np.ndarray
    rstart: np.ndarray
    gorder: np.ndarray
    live: np.ndarray
    pos: np.ndarray
    tree: np.ndarray
    start: np.ndarray
    end: np.ndarray


@njit(cache=True)
def _table_groups(ci, v, nt, nd, rec, cand, k, tab):  # pragma: no cover - compiled
    """Greedy node v's value groups (candidate lists ci, nt records) from the forest's
    tables alone (no record's group known): (whether every slot has its table, groups)."""
    C = nd.cnt.shape[1]
    P = cand.attr.shape[1]
    G = 1
    for s in range(P):
        G = max(G, tab.length[ci, s])
    g_rank = np.empty((P, G), np.int64)
    g_cnt = np.zeros((P, G, C), np.int64)
    n = np.zeros(P, np.int64)
    entry = np.empty((P, k + 16), np.int64)
    prio = np.empty((P, k + 16), np.int64)
    whole = True
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        if not _groups_of_table(s, tab.off[ci, s], tab.length[ci, s], tab, nt, g_rank, g_cnt,
                                n):
            whole = False
            break
        _list_entries(s, ci, nd.key[v], a, rec, cand, g_rank, n, entry, prio)
    return whole, _Groups(np.empty((P, 0), np.int64), np.zeros(P, np.bool_), n, g_rank,
                          g_cnt, entry, prio, np.empty(0, np.int64))


@njit(cache=True, parallel=True)
def _far_from_ties(nodes, nts, nd, rec, cand, rule, tab):  # pragma: no cover - compiled
    """Per greedy node nodes[i] (candidate lists i, nts[i] records, no class whose loss
    leaves it pure): _NONE_NEAR where it is far from a tie (the margin) and no value group
    is near a listed pair, so that no record is fragile (what :func:`_greedy_fragile`
    decides); _SOME_NEAR where some groups are; _NOT_FAR where it is not far from a tie
    or a slot has no table."""
    out = np.zeros(nodes.shape[0], np.int64)
    for ci in prange(nodes.shape[0]):
        v = nodes[ci]
        tables = True
        for s in range(cand.attr.shape[1]):
            tables = tables and (cand.attr[ci, s] < 0 or tab.length[ci, s] > 0)
        # the groups (a table of a big node's values: tens of MB) only where needed
        if not tables or not _margin_holds(ci, v, nd, cand, rule.k, _listed_scores(
                ci, nd.cnt[v], nts[ci], cand, rule)):
            continue
        whole, grp = _table_groups(ci, v, nts[ci], nd, rec, cand, rule.k, tab)
        if whole:
            out[ci] = (_SOME_NEAR if _near(ci, nd.key[v], grp, rec, cand, rule.k).any()
                       else _NONE_NEAR)
    return out


@njit(cache=True)
def _near_records(nodes, nts, todo, nd, rec, cand, rule, tab, where
                  ):  # pragma: no cover - compiled
    """For the greedy nodes nodes[todo] (far from a tie, some value groups near a listed
    pair): the records of the near groups, found through the global value order rather
    than by reading the node's records, each decided by the per-record rule (the others
    are stable: :func:`_greedy_fragile`). (found, count, slots): a node is not found
    when its groups' runs are long (a value common elsewhere) or do not add up."""
    P = cand.attr.shape[1]
    C = nd.cnt.shape[1]
    k = rule.k
    found = np.zeros(nodes.shape[0], np.bool_)
    count = np.zeros(nodes.shape[0], np.int64)
    out = np.empty(1024, np.int64)
    used = 0
    sel = _Selection(np.zeros((P * k, C), np.int64), np.zeros(P * k, np.int64),
                     np.zeros(P * k, np.int64), np.zeros(P * k, np.bool_),
                     np.zeros(P * k, np.int64), np.zeros(P * k, np.int64))
    for ci in todo:
        v = nodes[ci]
        nt = nts[ci]
        t = where.tree[v]
        _whole, grp = _table_groups(ci, v, nt, nd, rec, cand, k, tab)
        near = _near(ci, nd.key[v], grp, rec, cand, k)
        reads = 0
        for s in range(P):
            a = cand.attr[ci, s]
            for g in range(grp.n[s] if a >= 0 else 0):
                if near[s, g].any():
                    ro = where.roff[a] + grp.rank[s, g]
                    reads += where.rstart[ro + 1] - where.rstart[ro]
        if 4 * reads > nt:
            continue  # reading the node's records is cheaper
        look = np.empty(reads, np.int64)
        n_look = 0
        whole = True
        for s in range(P):
            a = cand.attr[ci, s]
            for g in range(grp.n[s] if a >= 0 else 0):
                if not near[s, g].any():
                    continue
                ro = where.roff[a] + grp.rank[s, g]
                held = 0
                for i in range(where.rstart[ro], where.rstart[ro + 1]):
                    r = where.gorder[a, i]
                    ps = where.pos[t, r]
                    if where.live[r] and where.start[v] <= ps < where.end[v]:
                        held += 1
                        if near[s, g, rec.y[r]]:
                            look[n_look] = r
                            n_look += 1
                whole = whole and held == grp.cnt[s, g].sum()
        if not whole:
            continue
        lscore = _listed_scores(ci, nd.cnt[v], nt, cand, rule)
        look = np.unique(look[:n_look])
        fragile = np.zeros(look.shape[0], np.bool_)
        for q in range(look.shape[0]):
            r = look[q]
            fragile[q] = _look_moves(-1, r, rec.y[r], v, ci, nd.key[v], grp, nd, rec, cand,
                                     rule, lscore, sel, nt)
        mine = look[fragile]
        at = np.empty(mine.shape[0], np.int64)
        for q in range(mine.shape[0]):
            at[q] = where.pos[t, mine[q]]
        mine = mine[np.argsort(at)]  # layout order, as the kernel's
        while used + mine.shape[0] > out.shape[0]:
            out = np.concatenate((out, np.empty(out.shape[0], np.int64)))
        out[used:used + mine.shape[0]] = mine
        used += mine.shape[0]
        found[ci] = True
        count[ci] = mine.shape[0]
    return found, count, out[:used]


@njit(cache=True)
def _random_fragile(out, rows, v, nd, rec):  # pragma: no cover - compiled
    """A random node keeps its draw unless a side empties or the node turns pure."""
    a = nd.attr[v]
    t = nd.thr[v]
    nt = rows.shape[0]
    nl = 0
    for j in range(nt):
        if rec.X[a, rows[j]] <= t:
            nl += 1
    for j in range(nt):
        r = rows[j]
        pure, _lab = _pure_without(nd.cnt[v], rec.y[r])
        side = nl if rec.X[a, r] <= t else nt - nl
        out[j] = pure or side == 1 or nd.draw[v] < 0


@njit(cache=True)
def _value_groups(rows, ci, nk, rec, cand, C, k, rbits, tab):  # pragma: no cover - compiled
    """The node's value groups per sampled attribute slot (:class:`_Groups`): counted in a
    table over the attribute's value ranks where the node holds at least one record per
    8 distinct values (no sort), else by sorting its values. On a wide table a slot the
    forest keeps a table for (`tab`, whose counts add up to the node's records) takes
    its groups from it and reads no record (``known`` False): where the margin holds
    most slots are never read (:func:`_greedy_fragile`)."""
    P = cand.attr.shape[1]
    nt = rows.shape[0]
    # a slot has at most as many groups as records or distinct values (few in a table)
    G = 0
    for s in range(P):
        a = cand.attr[ci, s]
        if a >= 0:
            G = max(G, min(nt, rec.voff[a + 1] - rec.voff[a]))
    of = np.empty((P, nt), np.int64)
    known = np.zeros(P, np.bool_)
    n = np.zeros(P, np.int64)
    g_rank = np.empty((P, G), np.int64)
    g_cnt = np.zeros((P, G, C), np.int64)
    entry = np.empty((P, k + 16), np.int64)
    prio = np.empty((P, k + 16), np.int64)
    lab = np.empty(nt, np.int64)
    F = rec.by_slot.shape[1] - 1  # -1: a wide table, read by attribute (_by_slot)
    every = np.empty((P if F >= 0 else 1, nt), np.int64)
    for j in range(nt):  # a narrow table: one pass over the records, one row each
        if F < 0:
            lab[j] = rec.y[rows[j]]
            continue
        row = rec.by_slot[rows[j]]
        lab[j] = row[F]
        for s in range(P):
            if cand.attr[ci, s] >= 0:
                every[s, j] = row[cand.attr[ci, s]]
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        nv = rec.voff[a + 1] - rec.voff[a]
        if F < 0 and not _groups_of_table(s, tab.off[ci, s], tab.length[ci, s], tab, nt,
                                          g_rank, g_cnt, n):
            known[s] = True
            for j in range(nt):
                every[0, j] = rec.rank[a, rows[j]]
        elif F >= 0:
            known[s] = True
        if known[s]:
            _count_groups(s, every[s if F >= 0 else 0], nt, nv, lab, rbits, of, g_rank,
                          g_cnt, n)
        _list_entries(s, ci, nk, a, rec, cand, g_rank, n, entry, prio)
    return _Groups(of, known, n, g_rank, g_cnt, entry, prio, lab)


@njit(cache=True)
def _list_entries(s, ci, nk, a, rec, cand, g_rank, n, entry, prio
                  ):  # pragma: no cover - compiled
    """Per listed entry q of slot s (attribute a): the group of its lower value
    ``entry[s, q]`` and its priority ``prio[s, q]`` (:class:`_Groups`)."""
    for q in range(cand.length[ci, s]):
        E = cand.off[ci, s] + q
        entry[s, q] = np.searchsorted(g_rank[s, :n[s]], cand.e_r1[E])
        prio[s, q] = _prio(nk, a, rec.vmix, rec.voff[a], cand.e_r1[E])


@njit(cache=True)
def _count_groups(s, vals, nt, nv, lab, rbits, of, g_rank, g_cnt, n
                  ):  # pragma: no cover - compiled
    """Slot s's groups from its records' value ranks `vals` (and each record's group)."""
    g = -1
    if nv <= 8 * nt:
        table = np.zeros(nv, np.int64)  # rank -> records, then rank -> group
        for j in range(nt):
            table[vals[j]] += 1
        for q in range(nv):
            if table[q] > 0:
                g += 1
                g_rank[s, g] = q
                table[q] = g
        for j in range(nt):
            gg = table[vals[j]]
            of[s, j] = gg
            g_cnt[s, gg, lab[j]] += 1
    else:
        order = _order(vals, rbits)
        last = -1
        for q in range(nt):
            j = order[q]
            if g < 0 or vals[j] != last:
                g += 1
                g_rank[s, g] = vals[j]
                last = vals[j]
            of[s, j] = g
            g_cnt[s, g, lab[j]] += 1
    n[s] = g + 1


@njit(cache=True)
def _groups_of_table(s, off, length, tab, nt, g_rank, g_cnt, n):  # pragma: no cover - compiled
    """Slot s's groups from the forest's table (rows off..off+length-1), if it has one
    that fits and whose counts add up to the node's nt records; False otherwise (the
    slot is then counted from its records)."""
    if length <= 0 or length > g_rank.shape[1]:
        return False
    C = g_cnt.shape[2]
    tot = 0
    g = 0
    for h in range(off, off + length):
        t = 0
        for c in range(C):
            t += tab.cnt[h, c]
        if t == 0:
            continue
        g_rank[s, g] = tab.rank[h]
        for c in range(C):
            g_cnt[s, g, c] = tab.cnt[h, c]
        tot += t
        g += 1
    if tot != nt:
        g_cnt[s, :, :] = 0
        return False
    n[s] = g
    return True


@njit(cache=True)
def _fill_groups(grp, s, rows, a, rec):  # pragma: no cover - compiled
    """Each record's group in slot s (attribute a), whose groups came from the forest's
    table: one pass over the records for the slot (one attribute's ranks at a time, as
    counting reads them: a record's slots read together were a third slower at 10^6)."""
    nt = rows.shape[0]
    nv = rec.voff[a + 1] - rec.voff[a]
    if nv <= 8 * nt:
        table = np.zeros(nv, np.int64)  # rank -> group
        for g in range(grp.n[s]):
            table[grp.rank[s, g]] = g
        for j in range(nt):
            grp.of[s, j] = table[rec.rank[a, rows[j]]]
    else:
        for j in range(nt):
            grp.of[s, j] = np.searchsorted(grp.rank[s, :grp.n[s]], rec.rank[a, rows[j]])
    grp.known[s] = True


@njit(cache=True)
def _group_of(grp, s, j, r, a, rec):  # pragma: no cover - compiled
    """The group of the node's j-th record (slot r) in slot s (attribute a)."""
    if grp.known[s]:
        return grp.of[s, j]
    return np.searchsorted(grp.rank[s, :grp.n[s]], rec.rank[a, r])


@njit(cache=True)
def _near(ci, nk, grp, rec, cand, k):  # pragma: no cover - compiled
    """Per slot, value group and label: whether deleting one record of that label from
    the group can change the first k listed pairs. At an end of one of them only if the
    group vanishes or turns pure (then a pair through it may turn invalid); a group that
    stays, impure or pure as before, keeps every listed pair valid, and the record only
    leaves its side of each (as for any other record). Elsewhere a vanishing group whose
    pair (prev, next) may rank among them, or that leaves the attribute constant."""
    P = cand.attr.shape[1]
    C = grp.cnt.shape[2]
    near = np.zeros((P, grp.rank.shape[1], C), np.bool_)
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        m = cand.length[ci, s]
        kk = min(k, m)
        ng = grp.n[s]
        for q in range(kk):
            for g in range(grp.entry[s, q], min(grp.entry[s, q] + 2, ng)):
                tot = grp.cnt[s, g].sum()
                was_pure, _lab = _group_pure(grp.cnt[s], g)
                for c in range(C):
                    if grp.cnt[s, g, c] > 0:
                        turns_pure, _lab = _pure_without(grp.cnt[s, g], c)
                        near[s, g, c] = tot == 1 or (turns_pure and not was_pure)
        for g in range(ng):
            if grp.cnt[s, g].sum() != 1:
                continue  # the group keeps records
            if ng == 2 or (0 < g < ng - 1 and (
                    m < k or kk == 0
                    or _prio(nk, a, rec.vmix, rec.voff[a], grp.rank[s, g - 1])
                    <= grp.prio[s, kk - 1])):
                # the attribute may turn constant; or (prev, next) may enter the first k
                near[s, g, :] = True
    return near


@njit(cache=True)
def _listed_scores(ci, cnt, nt, cand, rule):  # pragma: no cover - compiled
    """Per listed pair among the first k of each slot (slot by slot, in list order), its
    score with one record of class c taken from the left (side 0) or right (1); -inf
    where a side would fall below min_samples_leaf."""
    P = cand.attr.shape[1]
    C = cnt.shape[0]
    m = 0
    for s in range(P):
        if cand.attr[ci, s] >= 0:
            m += min(rule.k, cand.length[ci, s])
    out = np.full((m, 2, C), -np.inf)
    L = np.zeros((1, C), np.int64)
    R = np.zeros((1, C), np.int64)
    q_ = 0
    for s in range(P):
        if cand.attr[ci, s] < 0:
            continue
        for q in range(min(rule.k, cand.length[ci, s])):
            E = cand.off[ci, s] + q
            for side in range(2):
                for c in range(C):
                    nl = 0
                    for cc in range(C):
                        L[0, cc] = cand.e_left[E, cc]
                        R[0, cc] = cnt[cc] - cand.e_left[E, cc]
                        nl += L[0, cc]
                    if side == 0:
                        if L[0, c] == 0:
                            continue
                        L[0, c] -= 1
                        nl -= 1
                    else:
                        if R[0, c] == 0:
                            continue
                        R[0, c] -= 1
                    nr = (nt - 1) - nl
                    if nl >= rule.msl and nr >= rule.msl:
                        out[q_, side, c] = score1(L, 0, R, 0, nl, nr, rule.gini, rule.tab)
            q_ += 1
    return out


@njit(cache=True)
def _listed_moves(r, c, v, ci, nd, rec, cand, k, lscore):  # pragma: no cover - compiled
    """Whether deleting record r (class c), which leaves the listed pairs as they are,
    moves greedy node v's split: the best of the first k pairs with r taken from its
    side (the earliest on equal scores, as the split search) is not the split's."""
    P = cand.attr.shape[1]
    best = -np.inf
    b_slot = -1
    b_r1 = -1
    q_ = 0
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        x = rec.rank[a, r]
        for q in range(min(k, cand.length[ci, s])):
            E = cand.off[ci, s] + q
            sc = lscore[q_, 0 if x <= cand.e_r1[E] else 1, c]
            if sc > best:
                best = sc
                b_slot = s
                b_r1 = cand.e_r1[E]
            q_ += 1
    return b_slot < 0 or cand.attr[ci, b_slot] != nd.attr[v] or b_r1 != nd.r1[v]


@njit(cache=True)
def _signatures(ci, grp, near, cand, k, split):  # pragma: no cover - compiled
    """Per slot and value group, what the per-record rule reads of a record there: where
    the group is near for the record's label (`near[s, g, c]`), the group (``near_code``:
    ``k + 1 +`` its index among the slot's near groups), else (``far_code``) how many of
    the first k listed thresholds lie below it (which fixes its side of each); and each
    slot's number of such codes. Records of one label and the same code in every slot are
    decided alike. `split` (attribute, lower value rank) where the margin holds: the listed
    pairs a record leaves as they are then lose to the split whatever its sides, so only
    its side of the split counts (fewer signatures)."""
    P = cand.attr.shape[1]
    near_code = np.zeros((P, grp.rank.shape[1]), np.int64)
    far_code = np.zeros((P, grp.rank.shape[1]), np.int64)
    radix = np.ones(P, np.int64)
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        kk = min(k, cand.length[ci, s])
        thr = np.sort(cand.e_r1[cand.off[ci, s]:cand.off[ci, s] + kk])
        below = 0
        n_near = 0
        for g in range(grp.n[s]):  # groups ascend in rank
            while below < kk and thr[below] < grp.rank[s, g]:
                below += 1
            if near[s, g].any():
                near_code[s, g] = k + 1 + n_near
                n_near += 1
            if split[0] < 0:
                far_code[s, g] = below
            elif a == split[0] and grp.rank[s, g] > split[1]:
                far_code[s, g] = 1  # right of the split
        radix[s] = k + 1 + n_near
    return near_code, far_code, radix


@njit(cache=True)
def _memo_at(keys, key):  # pragma: no cover - compiled
    """The slot of `key` in the open-addressed table `keys` (-1: free): where it is, or
    the free slot where it goes."""
    mask = keys.shape[0] - 1
    h = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20)) & mask
    while keys[h] != key and keys[h] != -1:
        h = (h + 1) & mask
    return h


@njit(cache=True)
def _memo_grown(keys, vals):  # pragma: no cover - compiled
    """The table twice as large, with the same entries (it starts small: a node's
    records share a few hundred signatures, and a small table stays in cache)."""
    big = np.full(2 * keys.shape[0], -1, np.int64)
    big_vals = np.zeros(2 * keys.shape[0], np.bool_)
    for h in range(keys.shape[0]):
        if keys[h] != -1:
            at = _memo_at(big, keys[h])
            big[at] = keys[h]
            big_vals[at] = vals[h]
    return big, big_vals


@njit(cache=True)
def _greedy_fragile(out, rows, v, ci, nd, rec, cand, rule, use_margin, rbits, tab
                    ):  # pragma: no cover - compiled
    """out[j] for each record rows[j] of greedy node v (candidate lists ci); returns how
    often the per-record rule ran."""
    C = nd.cnt.shape[1]
    P = cand.attr.shape[1]
    k = rule.k
    nt = rows.shape[0]
    cnt = nd.cnt[v]
    nk = nd.key[v]
    sel = _Selection(np.zeros((P * k, C), np.int64), np.zeros(P * k, np.int64),
                     np.zeros(P * k, np.int64), np.zeros(P * k, np.bool_),
                     np.zeros(P * k, np.int64), np.zeros(P * k, np.int64))
    grp = _value_groups(rows, ci, nk, rec, cand, C, k, rbits, tab)
    # only records whose deletion changes the listed pairs (value groups at their ends; a
    # vanishing group whose new pair may rank among the first k) or makes the node pure
    # need the per-record rule: for the others the first k pairs stay as listed, with the
    # record taken from one side. Far from a tie (the margin) those are stable without a
    # look; near one they are scored
    # each listed pair's score with one record of class c taken from its left or right
    # side (the same integers score1 gets, so the same bits)
    lscore = _listed_scores(ci, cnt, nt, cand, rule)
    fast = use_margin and _margin_holds(ci, v, nd, cand, k, lscore)
    near = _near(ci, nk, grp, rec, cand, k)
    short = False  # a slot lists fewer than k pairs, not all: the search would look further
    for s in range(P):
        if cand.attr[ci, s] >= 0 and cand.length[ci, s] < k and not cand.all_pairs[ci, s]:
            short = True
    # the rule reads a record only through its label and its signature codes: decide each
    # (label, codes) once (ties make a few hundred of them stand for a node's records);
    # not when every record is to be decided on its own (use_margin False, for tests)
    near_code, far_code, radix = _signatures(ci, grp, near, cand, k,
                              (np.int64(nd.attr[v]), np.int64(nd.r1[v])) if fast
                              else (np.int64(-1), np.int64(-1)))
    span = float(C)
    for s in range(P):
        span *= radix[s]
    memo = use_margin and span < 2.0**62  # the keys below are exact
    keys = np.full(256 if memo else 1, -1, np.int64)
    vals = np.zeros(keys.shape[0], np.bool_)
    held = 0
    runs = 0
    pure = np.zeros(C, np.bool_)  # the node turns pure without a record of class c
    for c in range(C):
        pure[c], _lab = _pure_without(cnt, c)
    # the slots whose codes can differ between records; where the margin holds, a slot
    # of another attribute than the split's with no near group gives every record code 0
    # (leaving it out of the mixed-radix key keeps the key one-to-one): on a one-hot
    # table most slots of a large node
    # (the split's slot only keys the records that are looked at: none where no group is
    # near, and then no record is read at all)
    read = np.zeros(P, np.int64)
    n_read = 0
    anywhere = False
    for s in range(P):
        anywhere = anywhere or (cand.attr[ci, s] >= 0 and near[s, :grp.n[s]].any())
    for s in range(P):
        if cand.attr[ci, s] >= 0 and (not fast or near[s, :grp.n[s]].any() or (
                anywhere and cand.attr[ci, s] == nd.attr[v])):
            read[n_read] = s
            n_read += 1
            if not grp.known[s]:
                _fill_groups(grp, s, rows, cand.attr[ci, s], rec)
    for j in range(nt):
        r = rows[j]
        c = grp.lab[j]
        if pure[c]:
            out[j] = True
            continue
        key = c
        mult = C
        look = False
        for t in range(n_read):
            s = read[t]
            g = grp.of[s, j]
            if near[s, g, c]:
                cd = near_code[s, g]
                look = True
            else:
                cd = far_code[s, g]
            key += cd * mult
            mult *= radix[s]
        look = look or not use_margin  # for tests: the full rule decides every record
        if not look and (fast or short):
            out[j] = short
            continue
        h = -1
        if memo:
            h = _memo_at(keys, key)
            if keys[h] == key:
                out[j] = vals[h]
                continue
        runs += 1
        if look:
            out[j] = _look_moves(j, r, c, v, ci, nk, grp, nd, rec, cand, rule, lscore, sel,
                                 nt)
        else:
            out[j] = _listed_moves(r, c, v, ci, nd, rec, cand, k, lscore)
        if memo:
            keys[h] = key
            vals[h] = out[j]
            held += 1
            if 2 * held > keys.shape[0]:
                keys, vals = _memo_grown(keys, vals)
    return runs


@njit(cache=True)
def _look_moves(j, r, c, v, ci, nk, grp, nd, rec, cand, rule, lscore, sel, nt
                ):  # pragma: no cover - compiled
    """Whether deleting record r (the node's j-th, label c), which changes the listed
    pairs, moves greedy node v's split: the first k pairs of every slot after the deletion,
    scored (the earliest on equal scores wins, as the split search)."""
    C = nd.cnt.shape[1]
    bad, nsel = _select(j, r, c, ci, nk, grp, rec, cand, rule.k, sel)
    if bad:
        return True
    L = np.zeros((1, C), np.int64)
    R = np.zeros((1, C), np.int64)
    best = -np.inf
    bi = -1
    for q in range(nsel):
        if sel.listed[q] >= 0:  # the same integers, so the same score (-inf: a side
            sc = lscore[sel.listed[q], sel.side[q], c]  # under min_samples_leaf)
        else:
            nl = 0
            for cc in range(C):
                nl += sel.left[q, cc]
            nr = (nt - 1) - nl
            if nl < rule.msl or nr < rule.msl:
                continue
            for cc in range(C):
                L[0, cc] = sel.left[q, cc]
                R[0, cc] = nd.cnt[v, cc] - (1 if cc == c else 0) - sel.left[q, cc]
            sc = score1(L, 0, R, 0, nl, nr, rule.gini, rule.tab)
        if sc > best:
            best = sc
            bi = q
    return (bi < 0 or cand.attr[ci, sel.slot[bi]] != nd.attr[v]
            or sel.r1[bi] != nd.r1[v] or sel.merged[bi])


@njit(cache=True)
def _select(j, r, c, ci, nk, grp, rec, cand, k, sel):  # pragma: no cover - compiled
    """The first k pairs of every slot after deleting record r (the node's j-th, label c)
    into `sel`: (bad: could not be told, how many)."""
    P = cand.attr.shape[1]
    C = grp.cnt.shape[2]
    nsel = 0
    base = 0  # the slot's first row in the listed scores (_listed_scores' order)
    for s in range(P):
        a = cand.attr[ci, s]
        if a < 0:
            continue
        ng = grp.n[s]
        w = _group_of(grp, s, j, r, a, rec)
        alive = grp.cnt[s, w].sum() > 1  # w's group keeps records
        if not alive and ng == 2:
            return True, nsel  # the attribute turns constant: the slots shift
        has_prev = w > 0
        has_next = w + 1 < ng
        pp, lp = _group_pure(grp.cnt[s], w - 1) if has_prev else (False, -1)
        pn, ln_ = _group_pure(grp.cnt[s], w + 1) if has_next else (False, -1)
        pw, lw = _pure_without(grp.cnt[s, w], c) if alive else (True, c)
        # the new pair (prev, next) where (prev, w) was not valid before
        new_pair = False
        new_prio = np.int64(0)
        if not alive and has_prev and has_next:
            was_valid = not (pp and lp == c)  # w was {x}: pure with label c
            now_valid = not (pp and pn and lp == ln_)
            if now_valid and not was_valid:
                new_pair = True
                new_prio = _prio(nk, a, rec.vmix, rec.voff[a], grp.rank[s, w - 1])
        taken = 0
        q = 0
        m = cand.length[ci, s]
        while taken < k:
            # the next candidate: listed entry q, or the new pair if it comes first
            use_new = False
            if new_pair:
                if q < m:
                    if new_prio == grp.prio[s, q]:
                        return True, nsel  # a priority tie: order by indices
                    use_new = new_prio < grp.prio[s, q]
                elif cand.all_pairs[ci, s]:
                    use_new = True
                else:
                    return True, nsel  # beyond the known list: place unknown
            if use_new:
                for cc in range(C):  # the counts of groups 0..w-1
                    sel.left[nsel, cc] = 0
                    for g in range(w):
                        sel.left[nsel, cc] += grp.cnt[s, g, cc]
                sel.r1[nsel] = grp.rank[s, w - 1]
                sel.slot[nsel] = s
                sel.merged[nsel] = True
                sel.listed[nsel] = -1
                nsel += 1
                taken += 1
                new_pair = False
                continue
            if q >= m:
                break
            E = cand.off[ci, s] + q
            gq = grp.entry[s, q]
            q += 1
            merged = False
            if gq == w - 1:  # (prev, w)
                if alive:
                    if pp and pw and lp == lw:
                        continue  # turns invalid
                else:
                    if not has_next:
                        continue  # (prev, w) with no next: gone
                    if pp and pn and lp == ln_:
                        continue  # (prev, next) is not valid
                    merged = True
            elif gq == w:  # (w, next)
                if not alive:
                    continue  # disappears with w
                if pw and pn and lw == ln_:
                    continue  # turns invalid
            xl = rec.rank[a, r] <= cand.e_r1[E]
            sel.r1[nsel] = cand.e_r1[E]
            sel.slot[nsel] = s
            sel.merged[nsel] = merged
            sel.listed[nsel] = -1
            if not merged and q - 1 < k:  # listed as it is, among the scored first k
                sel.listed[nsel] = base + q - 1
                sel.side[nsel] = 0 if xl else 1
            else:
                for cc in range(C):
                    sel.left[nsel, cc] = cand.e_left[E, cc] - (1 if xl and cc == c else 0)
            nsel += 1
            taken += 1
        if taken < k and not cand.all_pairs[ci, s]:
            return True, nsel  # fewer than k known pairs: the search looks further
        base += min(k, cand.length[ci, s])
    return False, nsel

"""The DaRE forest's split search over many nodes at once: keyed choices, greedy and
random splits, and each node's canonical state from its records (the compiled search of
one node is :mod:`jobs.learners.dare.search_kernels`).
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jobs.learners.dare import search_kernels as sk
from jobs.learners.dare.common import (
    _INV53,
    _S11,
    _TAG_DRAW,
    _TAG_RATTR,
    _U64,
    _W_CONST,
    _W_DEPTH,
    _W_MSL,
    _W_PURE,
    _W_SMALL,
    GREEDY,
    RANDOM,
    _h2,
    _midpoint,
    _ranges,
    node_keys,
    score_table,
)
from jobs.learners.dare.state import ForestState


class CandidateLists(NamedTuple):
    """The lists of the tasks that keep them (``task``), per task and sampled attribute
    slot: attribute, all-pairs flag, cut-off, the slot's entries
    ``e_r1/e_r2/e_left[off:off + length]`` and its value group table
    ``t_rank/t_cnt[table_off:table_off + table_len]``."""

    task: np.ndarray
    slot_attr: np.ndarray
    all_pairs: np.ndarray
    cut_prio: np.ndarray
    cut_value: np.ndarray
    off: np.ndarray
    length: np.ndarray
    e_r1: np.ndarray
    e_r2: np.ndarray
    e_left: np.ndarray
    table_off: np.ndarray
    table_len: np.ndarray
    t_rank: np.ndarray
    t_cnt: np.ndarray


@dataclass
class Decisions:
    """Per task, the canonical state :func:`decide` found (parallel arrays); ``go_left``
    per record of the tasks' rows; ``lists`` of the tasks that keep them."""

    kind: np.ndarray
    why: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    r1: np.ndarray
    r2: np.ndarray
    draw: np.ndarray
    n: np.ndarray
    cnt: np.ndarray
    go_left: np.ndarray
    lists: CandidateLists | None = None

    @property
    def cached_tasks(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64) if self.lists is None else self.lists.task


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """Start of each segment of `lengths` (any shape) laid out one after the other."""
    flat = lengths.ravel()
    return (np.cumsum(flat) - flat).reshape(lengths.shape)


def greedy_splits(st: ForestState, tree: np.ndarray, path: np.ndarray, n: np.ndarray,
                  cnt: np.ndarray, rows: np.ndarray, off: np.ndarray, want_cache: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                             CandidateLists | None]:
    """Greedy split (ok, attr, r1, r2) of each task (node rows[off[i]:off[i + 1]]) and the
    lists of the tasks that found one where want_cache (compiled:
    :func:`~jobs.learners.dare.search_kernels.greedy_tasks`)."""
    wc = np.ascontiguousarray(want_cache, dtype=bool)
    res = sk.greedy_tasks(
        node_keys(st.tree_keys, tree, path), n.astype(np.int64),
        np.ascontiguousarray(cnt, dtype=np.int64), rows.astype(np.int64),
        off.astype(np.int64), wc, st.record_arrays(), st.rule,
        score_table(st.rule.gini, int(n.max(initial=0)) + 2), st.values.nvals_max,
    )  # fmt: skip
    ctask = np.flatnonzero(wc & res.ok)
    lists = None
    if ctask.size:
        ln, hl = res.length[ctask], res.table_len[ctask]
        lists = CandidateLists(
            task=ctask, slot_attr=res.slot_attr[ctask], all_pairs=res.all_pairs[ctask],
            cut_prio=res.cut_prio[ctask], cut_value=res.cut_value[ctask], off=_offsets(ln),
            length=ln, e_r1=res.e_r1, e_r2=res.e_r2, e_left=res.e_left,
            table_off=_offsets(hl), table_len=hl, t_rank=res.t_rank, t_cnt=res.t_cnt,
        )  # fmt: skip
    return res.ok, res.attr, res.r1, res.r2, lists


def _attr_order(nk: np.ndarray, tag: np.uint64, p: int) -> np.ndarray:
    h = _h2((nk ^ tag)[:, None], np.arange(p, dtype=_U64)[None, :])
    return np.argsort(h, axis=1, kind="stable")


def _first_varying(st: ForestState, nk: np.ndarray, rows: np.ndarray, off: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per task, the first attribute in its keyed random order that is not constant on
    its records (-1: none) and the [min, max] of its values there."""
    ntask = len(nk)
    p = st.n_features
    X = st.records.X
    n = off[1:] - off[:-1]
    order = _attr_order(nk, _TAG_RATTR, p)
    cur = np.zeros(ntask, dtype=np.int64)
    attr = np.full(ntask, -1, dtype=np.int64)
    lo = np.zeros(ntask)
    hi = np.zeros(ntask)
    pend = np.arange(ntask)
    while pend.size:
        a = order[pend, cur[pend]]
        el = _ranges(off[pend], n[pend])
        x = X.ravel()[np.repeat(a * X.shape[1], n[pend]) + rows[el]]
        so = np.cumsum(n[pend]) - n[pend]
        mn = np.minimum.reduceat(x, so)
        mx = np.maximum.reduceat(x, so)
        nc = mn < mx
        attr[pend[nc]] = a[nc]
        lo[pend[nc]] = mn[nc]
        hi[pend[nc]] = mx[nc]
        rest = pend[~nc]
        cur[rest] += 1
        pend = rest[cur[rest] < p]
    return attr, lo, hi


def random_splits(st: ForestState, tree: np.ndarray, path: np.ndarray, rows: np.ndarray,
                  off: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random split (ok, attr, thr, draw) of each task: first non-constant attribute in
    keyed order, first keyed draw of the attribute's stream inside [min, max) of the
    task's values."""
    ntask = len(tree)
    rule = st.rule
    nk = node_keys(st.tree_keys, tree, path)
    attr, lo, hi = _first_varying(st, nk, rows, off)
    ok = attr >= 0
    thr = np.zeros(ntask)
    draw = np.full(ntask, -1, dtype=np.int64)
    t = np.flatnonzero(ok)
    base = _h2(nk[t] ^ _TAG_DRAW, attr[t].astype(_U64))
    D = st.domains.dom[attr[t]]
    j0 = 0
    while t.size and j0 < rule.max_draws:
        J = np.arange(j0, j0 + rule.draw_chunk, dtype=_U64)
        u = (_h2(base[:, None], J[None, :]) >> _S11).astype(np.float64) * _INV53
        v = (2.0 * u - 1.0) * D[:, None]  # exact: u has 53 bits, D is a power of two
        hit = (v >= lo[t][:, None]) & (v < hi[t][:, None])
        anyh = hit.any(axis=1)
        first = hit.argmax(axis=1)
        w = np.flatnonzero(anyh)
        thr[t[w]] = v[w, first[w]]
        draw[t[w]] = j0 + first[w]
        keep = ~anyh
        t, base, D = t[keep], base[keep], D[keep]
        j0 += rule.draw_chunk
    thr[t] = lo[t]  # fallback after max_draws misses (draw stays -1)
    return ok, attr, thr, draw


def _leaf_reasons(st: ForestState, depth: np.ndarray, n: np.ndarray, cnt: np.ndarray
                  ) -> np.ndarray:
    """Why each task is a leaf before any split is searched (0: it may split)."""
    rule = st.rule
    why = np.zeros(len(n), dtype=np.int8)
    why[depth >= rule.max_depth] = _W_DEPTH
    why[(why == 0) & (n < 2 * rule.min_samples_leaf)] = _W_SMALL
    why[(why == 0) & (cnt.max(axis=1, initial=0) == n)] = _W_PURE
    return why


def _route_values(st: ForestState, d: Decisions, tasks: np.ndarray, rows: np.ndarray,
                  off: np.ndarray, by_rank: bool) -> None:
    """d.go_left of the records of `tasks`: x <= thr (random), rank <= r1 (greedy)."""
    el = _ranges(off[tasks], d.n[tasks])
    ar = np.repeat(d.attr[tasks], d.n[tasks])
    table = st.values.rank if by_rank else st.records.X
    cut = d.r1 if by_rank else d.thr
    d.go_left[el] = table.ravel()[ar * table.shape[1] + rows[el]] <= np.repeat(
        cut[tasks], d.n[tasks])


def decide(st: ForestState, tree: np.ndarray, path: np.ndarray, depth: np.ndarray,
           rows: np.ndarray, off: np.ndarray, want_cache: np.ndarray | None = None
           ) -> Decisions:
    """The canonical state of each task's node from its records (CSR rows/off); greedy
    tasks with at least cache_min records (and want_cache, where given) keep lists."""
    C = st.n_classes
    ntask = len(tree)
    n = (off[1:] - off[:-1]).astype(np.int64)
    trow = np.repeat(np.arange(ntask, dtype=np.int64), n)
    cnt = np.bincount(trow * C + st.records.y[rows], minlength=ntask * C).reshape(ntask, C)
    d = Decisions(
        kind=np.zeros(ntask, dtype=np.int8), why=_leaf_reasons(st, depth, n, cnt),
        attr=np.full(ntask, -1, dtype=np.int64), thr=np.zeros(ntask),
        r1=np.full(ntask, -1, dtype=np.int64), r2=np.full(ntask, -1, dtype=np.int64),
        draw=np.full(ntask, -1, dtype=np.int64), n=n, cnt=cnt,
        go_left=np.zeros(len(rows), dtype=bool),
    )  # fmt: skip
    cand = d.why == 0
    rnd = np.flatnonzero(cand & (depth < st.rule.d_rmax))
    grd = np.flatnonzero(cand & (depth >= st.rule.d_rmax))
    if rnd.size:
        _decide_random(st, d, rnd, tree, path, rows, off)
    if grd.size:
        _decide_greedy(st, d, grd, tree, path, rows, off, want_cache)
    return d


def _subset(rows: np.ndarray, off: np.ndarray, n: np.ndarray, tasks: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The CSR (rows, off) of `tasks` alone."""
    return rows[_ranges(off[tasks], n[tasks])], np.concatenate([[0], np.cumsum(n[tasks])])


def _decide_random(st: ForestState, d: Decisions, rnd: np.ndarray, tree: np.ndarray,
                   path: np.ndarray, rows: np.ndarray, off: np.ndarray) -> None:
    ok, a, t, j = random_splits(st, tree[rnd], path[rnd], *_subset(rows, off, d.n, rnd))
    okr = rnd[ok]
    d.why[rnd[~ok]] = _W_CONST
    d.kind[okr] = RANDOM
    d.attr[okr], d.thr[okr], d.draw[okr] = a[ok], t[ok], j[ok]
    _route_values(st, d, okr, rows, off, by_rank=False)


def _decide_greedy(st: ForestState, d: Decisions, grd: np.ndarray, tree: np.ndarray,
                   path: np.ndarray, rows: np.ndarray, off: np.ndarray,
                   want_cache: np.ndarray | None) -> None:
    wc = d.n[grd] >= st.rule.cache_min
    if want_cache is not None:
        wc &= want_cache[grd]
    ok, a, q1, q2, lists = greedy_splits(st, tree[grd], path[grd], d.n[grd], d.cnt[grd],
                                         *_subset(rows, off, d.n, grd), wc)
    okg, bad = grd[ok], grd[~ok]
    # no non-constant attribute at all -> CONST, else no split leaves msl records
    d.why[bad] = _W_MSL
    d.kind[okg] = GREEDY
    d.attr[okg], d.r1[okg], d.r2[okg] = a[ok], q1[ok], q2[ok]
    if bad.size:
        d.why[bad[_all_constant(st, rows, off, bad)]] = _W_CONST
    vals, voff = st.values.vals, st.values.voff
    d.thr[okg] = _midpoint(vals[voff[d.attr[okg]] + d.r1[okg]],
                           vals[voff[d.attr[okg]] + d.r2[okg]])
    _route_values(st, d, okg, rows, off, by_rank=True)
    if lists is not None:
        d.lists = lists._replace(task=grd[lists.task])


def _all_constant(st: ForestState, rows: np.ndarray, off: np.ndarray, tasks: np.ndarray
                  ) -> np.ndarray:
    n = off[1:] - off[:-1]
    res = np.ones(len(tasks), dtype=bool)
    el = _ranges(off[tasks], n[tasks])
    so = np.cumsum(n[tasks]) - n[tasks]
    for a in range(st.n_features):
        x = st.records.X[a, rows[el]]
        res &= np.minimum.reduceat(x, so) == np.maximum.reduceat(x, so)
    return res

"""The growable pools of a DaRE forest's state (:mod:`jobs.learners.dare.state`): nodes, cache
rows, candidate entries and value group tables. Allocated with room to spare, they grow by
doubling (entries and tables by a quarter or a half, compacting their garbage first) and
are trimmed after a fit; growing one replaces its named tuple in the state, and the kernels
see the counters in a ``ctr`` array (:func:`counters`, :func:`put_counters`).
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare import build_kernels as bk
from jobs.learners.dare.common import _ranges
from jobs.learners.dare.state import (
    CachePool,
    EntryPool,
    ForestState,
    Layout,
    NodePool,
    PoolCounts,
    TablePool,
)

#: what a fresh row of each node and cache array holds (the free lists are rebuilt)
_NODE_FILL = dict(tree=0, depth=0, path=0, kind=0, why=0, left=-1, right=-1, attr=-1, thr=0,
                  r1=-1, r2=-1, draw=-1, n=0, cnt=0, start=0, end=0, cid=-1, used=False,
                  bound=np.inf, sampled=-1)
_CACHE_FILL = dict(attr=-1, off=0, length=0, all_pairs=False, cut_prio=0, cut_value=0.0,
                   table_off=0, table_len=0)


def new_node_pool(ncap: int, n_classes: int, n_sampled: int) -> NodePool:
    """A node pool of ncap free nodes."""
    i32 = np.int32
    bound, sampled = fresh_bounds(ncap, n_sampled)
    return NodePool(
        tree=np.zeros(ncap, i32), depth=np.zeros(ncap, i32), path=np.zeros(ncap, np.int64),
        kind=np.zeros(ncap, np.int8), why=np.zeros(ncap, np.int8),
        left=np.full(ncap, -1, i32), right=np.full(ncap, -1, i32),
        attr=np.full(ncap, -1, i32), thr=np.zeros(ncap, np.float64),
        r1=np.full(ncap, -1, i32), r2=np.full(ncap, -1, i32), draw=np.full(ncap, -1, i32),
        n=np.zeros(ncap, i32), cnt=np.zeros((ncap, n_classes), i32),
        start=np.zeros(ncap, i32), end=np.zeros(ncap, i32), cid=np.full(ncap, -1, i32),
        used=np.zeros(ncap, bool), free=np.arange(ncap - 1, -1, -1, dtype=np.int64),
        bound=bound, sampled=sampled,
    )  # fmt: skip


def fresh_bounds(ncap: int, n_sampled: int) -> tuple[np.ndarray, np.ndarray]:
    """Per greedy node, what lets a deletion keep its split without re-scoring (see
    :func:`~jobs.learners.dare.delete_kernels._greedy_changed`): an upper bound on its
    other candidates' scores (+inf: unknown) and its sampled attributes. Derived state,
    not saved."""
    return np.full(ncap, np.inf), np.full((ncap, n_sampled), -1, dtype=np.int32)


def new_cache_pool(ccap: int, n_sampled: int) -> CachePool:
    """A cache table of ccap free rows (one per cached greedy node)."""
    shape = (ccap, n_sampled)
    return CachePool(
        attr=np.full(shape, -1, np.int32), off=np.zeros(shape, np.int64),
        length=np.zeros(shape, np.int32), all_pairs=np.zeros(shape, bool),
        cut_prio=np.zeros(shape, np.int64), cut_value=np.zeros(shape, np.float64),
        table_off=np.zeros(shape, np.int64), table_len=np.zeros(shape, np.int32),
        free=np.arange(ccap - 1, -1, -1, dtype=np.int64),
    )  # fmt: skip


def new_entry_pool(ecap: int, n_classes: int, n_live: int) -> EntryPool:
    """Cached candidate pairs; their left class counts are class-major (1-D gathers per
    class) and 16-bit while no node can hold 65,535 records."""
    cdt = np.uint16 if n_live < 65_535 else np.int32
    return EntryPool(r1=np.full(ecap, -1, np.int32), r2=np.full(ecap, -1, np.int32),
                     left=np.zeros((n_classes, ecap), dtype=cdt))


def new_table_pool(hcap: int, n_classes: int) -> TablePool:
    """A pool of value group tables, one segment per cached slot that keeps one
    (``caches.table_off``, ``caches.table_len``; length 0: none)."""
    return TablePool(rank=np.zeros(hcap, np.int32), cnt=np.zeros((hcap, n_classes), np.int32))


def new_layout(n_trees: int, width: int, capacity: int) -> Layout:
    return Layout(slot_at=np.full((n_trees, width), -1, dtype=np.int32),
                  pos=np.zeros((n_trees, capacity), dtype=np.int32),
                  root=np.full(n_trees, -1, dtype=np.int64))


def new_counts(nodes: NodePool, caches: CachePool) -> PoolCounts:
    return PoolCounts(free_nodes=len(nodes.free), free_caches=len(caches.free),
                      entries_used=0, entries_garbage=0, tables_used=0, tables_garbage=0)


def _resized(a: np.ndarray, cap: int, fill: object) -> np.ndarray:
    """`a` with cap rows: its rows, then rows of `fill`."""
    b = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
    b[: len(a)] = a
    return b


def _with_fresh(free: np.ndarray, n_free: int, old: int, cap: int) -> tuple[np.ndarray, int]:
    """A free list of `cap` slots: the new ids old..cap-1 (taken from the end, so the
    lowest first) below the `n_free` ids already free."""
    fresh = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
    out = np.zeros(cap, dtype=np.int64)
    out[: len(fresh)] = fresh
    out[len(fresh) : len(fresh) + n_free] = free[:n_free]
    return out, n_free + len(fresh)


# ------------------------------------------------------------------- nodes and cache rows


def _with_room(pool: NodePool | CachePool, fill: dict[str, object], n_free: int, m: int
               ) -> tuple[NodePool | CachePool, int]:
    """`pool` with at least m free rows (its capacity doubles), and its free count."""
    if n_free >= m:
        return pool, n_free
    old = len(getattr(pool, next(iter(fill))))
    cap = max(2 * old, old + m)
    grown = {name: _resized(getattr(pool, name), cap, f) for name, f in fill.items()}
    free, n_free = _with_fresh(pool.free, n_free, old, cap)
    return type(pool)(**grown, free=free), n_free


def _take(free: np.ndarray, n_free: int, m: int) -> np.ndarray:
    """The m ids a pool hands out next (the top of its free list, lowest first)."""
    return free[n_free - m : n_free][::-1].copy()


def grow_nodes(st: ForestState, m: int) -> None:
    """Make sure at least m nodes are free (the pool doubles)."""
    st.nodes, st.counts.free_nodes = _with_room(st.nodes, _NODE_FILL, st.counts.free_nodes, m)


def alloc_nodes(st: ForestState, m: int) -> np.ndarray:
    grow_nodes(st, m)
    out = _take(st.nodes.free, st.counts.free_nodes, m)
    st.counts.free_nodes -= m
    st.nodes.used[out] = True
    return out


def grow_caches(st: ForestState, m: int) -> None:
    """Make sure at least m cache rows are free (the table doubles)."""
    st.caches, st.counts.free_caches = _with_room(st.caches, _CACHE_FILL,
                                                  st.counts.free_caches, m)


def alloc_caches(st: ForestState, m: int) -> np.ndarray:
    grow_caches(st, m)
    out = _take(st.caches.free, st.counts.free_caches, m)
    st.counts.free_caches -= m
    return out


def uncache(st: ForestState, nodes: np.ndarray) -> None:
    """Release the cache rows of `nodes` (their entries and tables become garbage)."""
    cc, counts = st.caches, st.counts
    cid = st.nodes.cid[nodes]
    cid = cid[cid >= 0]
    if cid.size == 0:
        return
    counts.entries_garbage += int(cc.length[cid].sum())
    counts.tables_garbage += int(cc.table_len[cid].sum())
    cc.attr[cid] = -1
    cc.length[cid] = 0
    cc.table_len[cid] = 0
    st.nodes.cid[nodes] = -1
    need = counts.free_caches + len(cid)
    if need > len(cc.free):
        f = np.zeros(max(need, 2 * len(cc.free)), dtype=np.int64)
        f[: counts.free_caches] = cc.free[: counts.free_caches]
        st.caches = cc = cc._replace(free=f)
    cc.free[counts.free_caches : need] = cid
    counts.free_caches = need


# ----------------------------------------------------------------------------- entries


def alloc_entries(st: ForestState, m: int) -> int:
    reserve_entries(st, m)
    start = st.counts.entries_used
    st.counts.entries_used += m
    return start


def _capacity_for(st: ForestState, pool: str, m: int) -> int:
    """The capacity the segment pool `pool` ("entries" or "tables") must grow to so that
    m more rows fit (0: they fit), after compacting its garbage where that is over a
    quarter of what it uses (segments move)."""
    used = getattr(st.counts, f"{pool}_used")
    if used + m <= len(getattr(st, pool)[0]):
        return 0
    if getattr(st.counts, f"{pool}_garbage") > used // 4:
        (compact_entries if pool == "entries" else compact_tables)(st)
    used, cap = getattr(st.counts, f"{pool}_used"), len(getattr(st, pool)[0])
    if used + m <= cap:
        return 0
    return max(cap + cap // (4 if pool == "entries" else 2), used + m)


def reserve_entries(st: ForestState, m: int) -> None:
    """Make room for m more entries (may compact the pool, moving cached segments)."""
    cap = _capacity_for(st, "entries", m)
    if cap:
        used, e = st.counts.entries_used, st.entries
        st.entries = EntryPool(r1=_resized(e.r1[:used], cap, -1),
                               r2=_resized(e.r2[:used], cap, -1),
                               left=_resized(e.left[:, :used].T, cap, 0).T.copy())


def compact_entries(st: ForestState) -> None:
    """Drop freed segments and dead entries, keeping each segment's priority order."""
    cc, e, counts = st.caches, st.entries, st.counts
    cids = np.flatnonzero((cc.attr >= 0).any(axis=1))
    off = cc.off[cids].ravel()
    ln = cc.length[cids].ravel().astype(np.int64)
    idx = _ranges(off, ln)
    seg = np.repeat(np.arange(len(off)), ln)
    keep = e.r1[idx] >= 0
    idx, seg = idx[keep], seg[keep]
    newlen = np.bincount(seg, minlength=len(off)).astype(np.int64)
    newoff = np.cumsum(newlen) - newlen
    m = len(idx)
    e.r1[:m] = e.r1[idx]
    e.r2[:m] = e.r2[idx]
    e.left[:, :m] = e.left[:, idx]
    e.r1[m : counts.entries_used] = -1
    cc.off[cids] = newoff.reshape(-1, st.rule.n_sampled)
    cc.length[cids] = newlen.reshape(-1, st.rule.n_sampled)
    counts.entries_used = m
    counts.entries_garbage = 0


# ----------------------------------------------------------------------------- group tables


def reserve_tables(st: ForestState, m: int) -> None:
    """Make room for m more table entries (may compact the pool, moving segments)."""
    cap = _capacity_for(st, "tables", m)
    if cap:
        used, h = st.counts.tables_used, st.tables
        st.tables = TablePool(rank=_resized(h.rank[:used], cap, 0),
                              cnt=_resized(h.cnt[:used], cap, 0))


def compact_tables(st: ForestState) -> None:
    """Drop freed table segments (each segment keeps its value order)."""
    cc, h = st.caches, st.tables
    cids, ss = np.nonzero(cc.table_len > 0)
    ln = cc.table_len[cids, ss].astype(np.int64)
    idx = _ranges(cc.table_off[cids, ss], ln)
    m = len(idx)
    h.rank[:m] = h.rank[idx]
    h.cnt[:m] = h.cnt[idx]
    cc.table_off[cids, ss] = np.cumsum(ln) - ln
    st.counts.tables_used = m
    st.counts.tables_garbage = 0


def clear_tables(st: ForestState) -> None:
    """Empty the value group table pool (keeping its capacity, at least 1,024)."""
    st.tables = new_table_pool(max(1024, len(st.tables.rank)), st.n_classes)
    st.counts.tables_used = st.counts.tables_garbage = 0
    st.caches.table_len[:] = 0


# ----------------------------------------------------------------------------- whole state


def trim_pools(st: ForestState) -> None:
    """Release spare capacity of the node, cache, entry and table pools (after a fit)."""
    _trim_entries(st)
    _trim_tables(st)
    _trim_nodes(st)
    _trim_caches(st)


def _trim_entries(st: ForestState) -> None:
    if st.counts.entries_garbage:
        compact_entries(st)
    cap = st.counts.entries_used + max(1024, st.counts.entries_used // 16)
    e = st.entries
    if cap < len(e.r1):
        st.entries = EntryPool(r1=e.r1[:cap].copy(), r2=e.r2[:cap].copy(),
                               left=np.ascontiguousarray(e.left[:, :cap]))


def _trim_tables(st: ForestState) -> None:
    if st.counts.tables_garbage:
        compact_tables(st)
    cap = st.counts.tables_used + max(1024, st.counts.tables_used // 16)
    if cap < len(st.tables.rank):
        st.tables = TablePool(rank=st.tables.rank[:cap].copy(), cnt=st.tables.cnt[:cap].copy())


def _trim_nodes(st: ForestState) -> None:
    used = np.flatnonzero(st.nodes.used)
    top = int(used.max()) + 1 if used.size else 1
    cap = top + max(64, top // 16)
    if cap < len(st.nodes.tree):
        kept = {name: getattr(st.nodes, name)[:cap].copy() for name in _NODE_FILL}
        free = np.flatnonzero(~kept["used"])[::-1].copy()
        st.nodes = NodePool(**kept, free=free)
        st.counts.free_nodes = len(free)


def _trim_caches(st: ForestState) -> None:
    cid = st.nodes.cid[st.nodes.used]
    cid = cid[cid >= 0]
    top = int(cid.max()) + 1 if cid.size else 1
    cap = top + max(16, top // 16)
    if cap < len(st.caches.attr):
        inuse = np.zeros(len(st.caches.attr), dtype=bool)
        inuse[cid] = True
        free = np.flatnonzero(~inuse[:cap])[::-1].copy()
        st.caches = CachePool(**{name: getattr(st.caches, name)[:cap].copy()
                                 for name in _CACHE_FILL}, free=free)
        st.counts.free_caches = len(free)


def full_free_lists(st: ForestState) -> None:
    """Make the free lists long enough to take every node and cache row back (the
    kernels push freed ids onto them)."""
    n, c = st.nodes, st.caches
    if len(n.free) < len(n.tree):
        st.nodes = n._replace(free=_resized(n.free[: st.counts.free_nodes], len(n.tree), 0))
    if len(c.free) < len(c.attr):
        st.caches = c._replace(free=_resized(c.free[: st.counts.free_caches], len(c.attr), 0))


def counters(st: ForestState) -> np.ndarray:
    """The pools' counters as the kernels take them (a fresh ``ctr``)."""
    ctr = np.zeros(bk.CTR_LEN, dtype=np.int64)
    c = st.counts
    ctr[bk.CTR_NFREE] = c.free_nodes
    ctr[bk.CTR_CFREE] = c.free_caches
    ctr[bk.CTR_EUSED] = c.entries_used
    ctr[bk.CTR_EGARB] = c.entries_garbage
    ctr[bk.CTR_HUSED] = c.tables_used
    ctr[bk.CTR_HGARB] = c.tables_garbage
    return ctr


def put_counters(st: ForestState, ctr: np.ndarray) -> None:
    """Take the pools' counters back from a kernel's ``ctr``."""
    st.counts = PoolCounts(
        free_nodes=int(ctr[bk.CTR_NFREE]), free_caches=int(ctr[bk.CTR_CFREE]),
        entries_used=int(ctr[bk.CTR_EUSED]), entries_garbage=int(ctr[bk.CTR_EGARB]),
        tables_used=int(ctr[bk.CTR_HUSED]), tables_garbage=int(ctr[bk.CTR_HGARB]),
    )  # fmt: skip

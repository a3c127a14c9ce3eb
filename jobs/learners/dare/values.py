"""The value index of a DaRE forest (dense value ranks, the global value order) and the
random-node domains, both functions of the records they are derived from.
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

import math

import numpy as np

from jobs.learners.dare.common import _GOLD, _U64, GREEDY, _mix, _ranges
from jobs.learners.dare.state import Domains, ForestState, RecordStore, ValueIndex


def rerank(rec: RecordStore, old: ValueIndex | None) -> tuple[ValueIndex, list[np.ndarray] | None]:
    """Dense ranks of every slot's values per attribute, the global sorted order and the
    start of each value's run in it. With the `old` index, also per attribute the map
    old rank -> new rank (whose rank array is reused where it is large enough)."""
    p, n = rec.X.shape[0], rec.n_slots
    old_vals = None
    rank = None
    if old is not None:
        old_vals = [old.vals[old.voff[a] : old.voff[a + 1]] for a in range(p)]
        rank = old.rank if old.rank.shape[1] >= rec.capacity else None
    if rank is None:
        rank = np.zeros((p, rec.capacity), dtype=np.int32)
    vals, rstart = [], []
    gorder = np.empty((p, n), dtype=np.int32)
    for a in range(p):
        # one stable sort gives the order, the values and the ranks (np.unique and an
        # argsort of its ranks sorted twice: a third of loading a forest at 10^5 rows)
        x = rec.X[a, :n]
        order = np.argsort(x, kind="stable")
        xs = x[order]
        first = np.ones(n, dtype=bool)
        np.not_equal(xs[1:], xs[:-1], out=first[1:])
        rank[a, order] = np.cumsum(first) - 1
        vals.append(xs[first])
        gorder[a] = order
        rstart.append(np.append(np.flatnonzero(first), n).astype(np.int32))
    index = _value_index(rank, vals, gorder, rstart)
    if old_vals is None:
        return index, None
    return index, [np.searchsorted(vals[a], old_vals[a]).astype(np.int32) for a in range(p)]


def rerank_kept(rec: RecordStore, old: ValueIndex, new_slot: np.ndarray
                ) -> tuple[ValueIndex, list[np.ndarray]]:
    """What :func:`rerank` gives after slots were only dropped (`new_slot`: old slot ->
    new, -1 where dropped; `old.rank` and `old.rank_rm` already hold the kept slots'
    columns and rows, :func:`records.compact_store`), in linear
    time: the kept values keep their order, so ranks are renumbered, not sorted again,
    and the old global order, filtered, is the new one (a save compacts the store each
    time: sorting every attribute again took 1.5 s at 10^5 rows)."""
    p, n = rec.X.shape[0], rec.n_slots
    rank = old.rank
    vals, rstart, remap = [], [], []
    gorder = np.empty((p, n), dtype=np.int32)
    for a in range(p):
        cnt = np.bincount(rank[a, :n], minlength=int(old.voff[a + 1] - old.voff[a]))
        present = cnt > 0
        # np.searchsorted(new values, old values), as rerank gives it: a vanished value
        # maps to where it would be inserted
        to_new = (np.cumsum(present) - present).astype(np.int32)
        if not present.all():  # else every rank stays (most attributes, most saves)
            rank[a, :n] = to_new[rank[a, :n]]
            old.rank_rm[:n, a] = rank[a, :n]
        vals.append(old.vals[old.voff[a] : old.voff[a + 1]][present])
        slots = new_slot[old.gorder[a]]
        gorder[a] = slots[slots >= 0]
        rstart.append(_run_starts(cnt[present]))
        remap.append(to_new)
    return _value_index(rank, vals, gorder, rstart, old.rank_rm), remap


def index_of_codes(codes: list[np.ndarray], vals: list[np.ndarray], capacity: int
                   ) -> ValueIndex:
    """What :func:`rerank` gives, from each attribute's sorted values and every slot's code
    (rank) into them, in a small unsigned type (as a bundle stores the features): a
    stable sort of small integers (a radix sort) instead of one of the floats, and the
    run starts from counts."""
    p, n = len(codes), len(codes[0]) if codes else 0
    rank = np.zeros((p, capacity), dtype=np.int32)
    gorder = np.empty((p, n), dtype=np.int32)
    rstart = []
    for a, c in enumerate(codes):
        rank[a, :n] = c
        gorder[a] = np.argsort(c, kind="stable")
        rstart.append(_run_starts(np.bincount(c, minlength=len(vals[a]))))
    return _value_index(rank, vals, gorder, rstart)


def _run_starts(counts: np.ndarray) -> np.ndarray:
    """Where each value's run starts in the global order (and the end), from its count."""
    rs = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=rs[1:])
    return rs


def _value_index(rank: np.ndarray, vals: list[np.ndarray], gorder: np.ndarray,
                 rstart: list[np.ndarray], rank_rm: np.ndarray | None = None) -> ValueIndex:
    """The index of these ranks; `rank_rm`: their record-major copy, where the caller
    kept it up to date (a compaction), if of the type this index takes."""
    all_vals = np.concatenate(vals) if vals else np.zeros(0)
    nvals_max = max((len(v) for v in vals), default=1)
    # the compiled kernels read a record's ranks together: record-major, 16 bits where
    # they fit (one cache line per record on tables of up to 32 features)
    dt = np.uint16 if nvals_max <= 65_535 else np.int32
    if rank_rm is None or rank_rm.dtype != dt or rank_rm.shape != rank.shape[::-1]:
        rank_rm = np.ascontiguousarray(rank.T, dtype=dt)
    return ValueIndex(
        rank=rank, rank_rm=rank_rm, vals=all_vals,
        vmix=_mix(all_vals.view(_U64) + _GOLD),  # value half of the pair priority
        voff=np.concatenate([[0], np.cumsum([len(v) for v in vals])]).astype(np.int64),
        gorder=gorder, rstart=np.concatenate(rstart),
        roff=np.concatenate([[0], np.cumsum([len(v) + 1 for v in vals])]).astype(np.int64),
        nvals_max=nvals_max,
    )  # fmt: skip


def reindex(st: ForestState, new_slot: np.ndarray | None = None) -> None:
    """Re-rank the records (after slots were added or dropped; `new_slot`: only dropped,
    old slot -> new) and translate the ranks stored in nodes, caches and value group
    tables."""
    if new_slot is None:
        st.values, remap = rerank(st.records, st.values)
    else:
        st.values, remap = rerank_kept(st.records, st.values, new_slot)
    _remap_ranks(st, remap)


def _remap_ranks(st: ForestState, remap: list[np.ndarray]) -> None:
    flat = np.concatenate(remap)
    base = np.concatenate([[0], np.cumsum([len(m) for m in remap])])
    nd, cc, e = st.nodes, st.caches, st.entries
    g = np.flatnonzero(nd.used & (nd.kind == GREEDY))
    a = nd.attr[g].astype(np.int64)
    nd.r1[g] = flat[base[a] + nd.r1[g]]
    nd.r2[g] = flat[base[a] + nd.r2[g]]
    cids = np.flatnonzero((cc.attr >= 0).any(axis=1))
    if cids.size:
        sa = cc.attr[cids].ravel().astype(np.int64)
        ln = cc.length[cids].ravel().astype(np.int64)
        E = _ranges(cc.off[cids].ravel(), ln)
        ea = np.repeat(sa, ln)
        live = e.r1[E] >= 0
        E, ea = E[live], ea[live]
        e.r1[E] = flat[base[ea] + e.r1[E]]
        e.r2[E] = flat[base[ea] + e.r2[E]]
    cids, ss = np.nonzero(cc.table_len > 0)
    if cids.size:
        ln = cc.table_len[cids, ss].astype(np.int64)
        Hx = _ranges(cc.table_off[cids, ss], ln)
        ha = np.repeat(cc.attr[cids, ss].astype(np.int64), ln)
        st.tables.rank[Hx] = flat[base[ha] + st.tables.rank[Hx]]


def new_domains(rec: RecordStore, fixed: float | None) -> Domains:
    """The random-node domains of the live records (see :func:`update_domains`)."""
    p = rec.X.shape[0]
    dom = Domains(dom=np.ones(p, dtype=np.float64), absmax=np.zeros(p, dtype=np.float64),
                  absmax_n=np.zeros(p, dtype=np.int64), fixed=fixed)
    update_domains(dom, rec, np.arange(p))
    return dom


def domains_of_index(index: ValueIndex, fixed: float | None) -> Domains:
    """:func:`new_domains` of a store whose every slot is live (a loaded forest), from
    its value index: the largest |value| and how many hold it from the values and their
    run lengths, not from a pass over every feature of every record."""
    p = len(index.voff) - 1
    absmax = np.zeros(p, dtype=np.float64)
    absmax_n = np.zeros(p, dtype=np.int64)
    for a in range(p):
        v = np.abs(index.vals[index.voff[a] : index.voff[a + 1]])
        if v.size:
            runs = np.diff(index.rstart[index.roff[a] : index.roff[a + 1]])
            absmax[a] = v.max()
            absmax_n[a] = runs[v == absmax[a]].sum()
    return Domains(dom=_stream_domains(absmax, fixed), absmax=absmax, absmax_n=absmax_n,
                   fixed=fixed)


def _stream_domains(absmax: np.ndarray, fixed: float | None) -> np.ndarray:
    """D_a = 2**e with 2**(e-1) <= absmax_a < 2**e (e <= 1023; 1 for 0), or the fixed one."""
    if fixed is not None:
        return np.full(len(absmax), float(fixed))
    return np.array([1.0 if v == 0 else math.ldexp(1.0, min(math.frexp(v)[1], 1023))
                     for v in absmax.tolist()])


def update_domains(dom: Domains, rec: RecordStore, attrs: np.ndarray) -> np.ndarray:
    """Random-node stream domains D_a = 2**e with 2**(e-1) <= max|x_a| < 2**e over the live
    data (e <= 1023), or the fixed one. Returns the attributes whose D changed."""
    attrs = np.asarray(attrs, dtype=np.int64)
    if len(attrs) == 0:
        return attrs
    live = np.flatnonzero(rec.alive[: rec.n_slots])
    ax = np.abs(rec.X[np.ix_(attrs, live)])
    m = ax.max(axis=1) if live.size else np.zeros(len(attrs))
    dom.absmax[attrs] = m
    dom.absmax_n[attrs] = (ax == m[:, None]).sum(axis=1) if live.size else 0
    new = _stream_domains(m, dom.fixed)
    changed = attrs[new != dom.dom[attrs]]
    dom.dom[attrs] = new
    return changed

"""The record store of a DaRE forest: one slot per record ever added (features, label,
id), grown for additions and compacted before a save, so that a saved forest holds
nothing of a deleted record.
See docs/security.md (What each learner stores per record)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare.common import _S32, _TAG_THR, _U64, _h2, _mix, node_keys
from jobs.learners.dare.state import ForestState, RecordStore
from jobs.learners.dare.values import reindex


def new_store(ids: np.ndarray, X: np.ndarray, yi: np.ndarray, classes: np.ndarray) -> RecordStore:
    """The store of a fit: records (ids, X rows, label indices into `classes`), all live."""
    n, p = X.shape
    cap = max(n, 1)
    Xs = np.zeros((p, cap), dtype=np.float64)
    Xs[:, :n] = X.T
    y = np.zeros(cap, dtype=np.int32)
    y[:n] = yi
    alive = np.zeros(cap, dtype=bool)
    alive[:n] = True
    rid = np.empty(cap, dtype=object)
    rid[:n] = ids
    return RecordStore(
        X=Xs, y=y, alive=alive, ids=rid, slot={s: i for i, s in enumerate(ids.tolist())},
        n_slots=n, n_live=n, class_n=np.bincount(yi, minlength=len(classes)).astype(np.int64),
        classes=classes,
    )  # fmt: skip


def grow_store(st: ForestState, need: int) -> None:
    """Make room for `need` slots (at least doubling): the records, their positions in
    the layout and their value ranks."""
    rec = st.records
    if need <= rec.capacity:
        return
    cap = max(need, 2 * rec.capacity)
    n = rec.n_slots

    def grown(a: np.ndarray, fill: object = 0) -> np.ndarray:
        b = np.full((*a.shape[:-1], cap), fill, dtype=a.dtype)
        b[..., :n] = a[..., :n]
        return b

    rec.X, rec.y, rec.alive = grown(rec.X), grown(rec.y), grown(rec.alive)
    rec.ids = grown(rec.ids, None)
    st.layout = st.layout._replace(pos=grown(st.layout.pos))
    st.values.rank = grown(st.values.rank)


def compact_store(st: ForestState) -> None:
    """Drop the slots of deleted records, so that their features, label and id leave
    the forest (and every bundle saved from it) instead of waiting in dead slots.

    Slots are renumbered everywhere they are referenced (layout, positions, ranks); the
    value domains are re-derived from the live records, so a deleted record's value
    leaves them too, and so does a cache cut-off that still names one (see
    :func:`_forget_cutoffs`). Nothing the content hash covers changes."""
    rec = st.records
    n = rec.n_slots
    live = np.flatnonzero(rec.alive[:n])
    if len(live) == n:
        return
    m = len(live)
    new = np.full(rec.capacity, -1, dtype=np.int32)
    new[live] = np.arange(m, dtype=np.int32)
    kept = rec.alive[:n].copy()
    for table in (rec.X, st.layout.pos, st.values.rank):
        _keep_columns(table, kept, m)
    _keep_rows(st.values.rank_rm, kept, m)
    for column, gone in ((rec.y, 0), (rec.ids, None), (rec.alive, False)):
        column[:m] = column[live]
        column[m:n] = gone
    slot_at = st.layout.slot_at
    held = slot_at >= 0
    slot_at[held] = new[slot_at[held]]
    rec.n_slots = m
    rec.slot = {rid: k for k, rid in enumerate(rec.ids[:m].tolist())}
    reindex(st, new)
    _forget_cutoffs(st)
    # what freed nodes and cache slots last held is no longer anyone's state
    st.nodes.thr[~st.nodes.used] = 0.0
    unused = (st.caches.attr < 0).all(axis=1)
    st.caches.cut_prio[unused] = 0
    st.caches.cut_value[unused] = 0.0


def _keep_columns(table: np.ndarray, kept: np.ndarray, m: int) -> None:
    """Move the `m` kept columns among the first len(kept) of a (rows, slots) table to
    its front and zero the rest of those: in place, row by row (a compacted copy of a
    (features, 10^6) table was a GB of fresh pages every save)."""
    n = len(kept)
    for row in table:
        row[:m] = row[:n][kept]
    table[:, m:n] = 0


def _keep_rows(table: np.ndarray, kept: np.ndarray, m: int, chunk: int = 1 << 16) -> None:
    """:func:`_keep_columns` of a (slots, columns) table (the record-major ranks): a
    chunk of rows at a time, front to back, so a kept row never lands on one not read."""
    n, out = len(kept), 0
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        part = table[lo:hi][kept[lo:hi]]
        table[out : out + len(part)] = part
        out += len(part)
    table[m:n] = 0


def _stale_cutoffs(st: ForestState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cache row, slot, attribute) of the slots whose cut-off value no live record holds."""
    cc, val = st.caches, st.values
    cids, ss = np.nonzero((cc.attr >= 0) & ~cc.all_pairs)
    a = cc.attr[cids, ss].astype(np.int64)
    va = val.voff[a]
    nv = val.voff[a + 1] - va
    cutv = cc.cut_value[cids, ss]
    at = np.zeros(len(a), dtype=np.int64)
    for k in range(len(a)):
        at[k] = np.searchsorted(val.vals[va[k] : va[k] + nv[k]], cutv[k])
    held = (at < nv) & (val.vals[va + np.minimum(at, nv - 1)] == cutv)
    stale = np.flatnonzero(~held)
    return cids[stale], ss[stale], a[stale]


def _forget_cutoffs(st: ForestState) -> None:
    """Lower every cache cut-off whose value no live record holds to its last live pair.

    A slot's list holds every valid pair whose key (priority, v1) is at most its
    cut-off, in key order. The cut-off key keeps the value of the pair that was last
    when the cache was built, which may be a deleted record's value. Every valid pair
    up to the last live entry is in the list (it is below the old cut-off), so lowering
    the cut-off to that entry's key keeps the invariant, and with it exactness; a slot
    with no live entry gets a cut-off below every key (it is recomputed when next
    touched, as it has fewer than k pairs). A slot that holds every valid pair has no
    use for a cut-off: its own is cleared."""
    cc, nd, val = st.caches, st.nodes, st.values
    every = (cc.attr >= 0) & cc.all_pairs
    cc.cut_prio[every] = 0
    cc.cut_value[every] = 0.0
    cids, ss, a = _stale_cutoffs(st)
    if cids.size == 0:
        return
    va = val.voff[a]
    last = np.full(len(cids), -1, dtype=np.int64)
    for k in range(len(cids)):
        off = int(cc.off[cids[k], ss[k]])
        seg = st.entries.r1[off : off + int(cc.length[cids[k], ss[k]])]
        alive = np.flatnonzero(seg >= 0)
        if alive.size:
            last[k] = seg[alive[-1]]
    node = np.zeros(len(cc.attr), dtype=np.int64)
    owners = np.flatnonzero(nd.used & (nd.cid >= 0))
    node[nd.cid[owners]] = owners
    owner = node[cids]
    nk = node_keys(st.tree_keys, nd.tree[owner], nd.path[owner])
    sk = _h2(nk ^ _TAG_THR, a.astype(_U64))
    has = last >= 0
    r = np.where(has, last, 0)
    prio = (_mix(sk ^ val.vmix[va + r]) >> _S32).astype(np.int64)
    cc.cut_prio[cids, ss] = np.where(has, prio, -1)
    cc.cut_value[cids, ss] = np.where(has, val.vals[va + r], 0.0)

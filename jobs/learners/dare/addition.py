"""Adding records to a DaRE forest, exactly: every node on the new records' paths is
re-derived from its records, and the outermost nodes whose split changed are retrained.
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jobs.learners.dare import builder, pools, training
from jobs.learners.dare.common import GREEDY, LEAF, RANDOM, _midpoint, _ranges
from jobs.learners.dare.labels import insert_classes
from jobs.learners.dare.records import grow_store
from jobs.learners.dare.split_search import Decisions, decide
from jobs.learners.dare.state import ForestState
from jobs.learners.dare.values import reindex, update_domains


def add(st: ForestState, rids: np.ndarray, X: np.ndarray, labels: np.ndarray,
        stats: dict[str, Any], random_state: int) -> ForestState:
    """Learn new records (checked: new unique ids, finite features of the forest's
    width); returns the forest (a new one where a refit is cheaper: more new records
    than live ones) and fills `stats` for the report."""
    rec = st.records
    if len(rids) <= rec.n_live:
        _add_records(st, rids, X, labels, stats)
        return st
    keep = list(rec.slot)
    sl = np.array([rec.slot[i] for i in keep], dtype=np.int64)
    fresh = training.train(
        st.rule, np.concatenate([np.array(keep, dtype=object), rids]),
        np.concatenate([rec.X[:, sl].T, X]), np.concatenate([rec.classes[rec.y[sl]], labels]),
        random_state, st.domains.fixed, st.costs.policy,
    )  # fmt: skip
    stats.update(mode="refit", subtrees_retrained=st.rule.n_trees,
                 records_retrained=fresh.records.n_live)
    return fresh


def _store_records(st: ForestState, rids: np.ndarray, X: np.ndarray, labels: np.ndarray
                   ) -> np.ndarray:
    """Put the new records into fresh slots (live), re-rank the values and count their
    classes; returns the slots."""
    insert_classes(st, np.unique(labels))
    rec = st.records
    m = len(rids)
    slots = np.arange(rec.n_slots, rec.n_slots + m, dtype=np.int64)
    grow_store(st, rec.n_slots + m)
    rec.X[:, slots] = X.T
    yi = np.searchsorted(rec.classes, labels).astype(np.int32)
    rec.y[slots] = yi
    rec.ids[slots] = rids
    rec.n_slots += m
    reindex(st)
    for i, sl in zip(rids.tolist(), slots.tolist(), strict=True):
        rec.slot[i] = sl
    rec.alive[slots] = True
    rec.n_live += m
    if rec.n_live >= 65_535 and st.entries.left.dtype != np.int32:
        st.entries = st.entries._replace(left=st.entries.left.astype(np.int32))
    rec.class_n += np.bincount(yi, minlength=st.n_classes)
    return slots


def _moved_domains(st: ForestState, X: np.ndarray) -> np.ndarray:
    """The random nodes whose attribute's domain the new records move (they widen it)."""
    if st.rule.d_rmax == 0:
        return np.zeros(0, dtype=np.int64)
    dom = st.domains
    above = np.abs(X) > dom.absmax[None, :]
    dom.absmax_n += (np.abs(X) == dom.absmax[None, :]).sum(axis=0)
    moved = update_domains(dom, st.records, np.flatnonzero(above.any(axis=0)))
    if not moved.size:
        return np.zeros(0, dtype=np.int64)
    nd = st.nodes
    used = np.flatnonzero(nd.used & (nd.kind == RANDOM))
    return used[np.isin(nd.attr[used], moved)]


def _add_records(st: ForestState, rids: np.ndarray, X: np.ndarray, labels: np.ndarray,
                 stats: dict[str, Any]) -> None:
    slots = _store_records(st, rids, X, labels)
    extra = _moved_domains(st, X)
    pn, ptree, _pdepth, prec = _path_nodes(st, slots)
    _place(st, pn, ptree, prec, slots)
    C = st.n_classes
    nd = st.nodes
    u, inv = np.unique(pn, return_inverse=True)
    yi = st.records.y[slots]
    add = np.bincount(inv * C + yi[prec], minlength=len(u) * C).reshape(len(u), C)
    nd.cnt[u] += add.astype(np.int32)
    nd.n[u] += add.sum(axis=1).astype(np.int32)
    nd.bound[u] = np.inf  # re-derived below; the next deletion re-scores them
    stats["nodes_touched"] += len(u)
    # every node on the new records' paths is re-derived from its records
    u = u[np.lexsort((nd.depth[u], nd.tree[u]))]
    rows, off = builder.node_rows(st, u)
    d = decide(st, nd.tree[u].astype(np.int64), nd.path[u].astype(np.int64),
               nd.depth[u].astype(np.int64), rows, off, np.ones(len(u), dtype=bool))
    _apply_decisions(st, u, d, extra, stats)


def _apply_decisions(st: ForestState, u: np.ndarray, d: Decisions, extra: np.ndarray,
                     stats: dict[str, Any]) -> None:
    """Bring the nodes `u` (tree by tree, root first) to their decisions `d`: a node whose
    split stands keeps it (a leaf its reason, a greedy node its new upper value and lists,
    or none when it got too small); the outermost changed ones (and random nodes on a
    moved domain, `extra`) are retrained."""
    nd = st.nodes
    same = _same(st, u, d)
    lf = same & (d.kind == LEAF)
    nd.why[u[lf]] = d.why[lf]
    g = same & (d.kind == GREEDY) & (d.r2 != nd.r2[u])
    ct = d.cached_tasks
    stats["caches_recomputed"] += int(ct.size)
    # cached-ness follows the node's size; nodes that must drop their cache
    was = nd.cid[u] >= 0
    inst_sel = np.flatnonzero(same[ct])
    has_new = np.zeros(len(u), dtype=bool)
    has_new[ct] = True
    pools.uncache(st, u[was & ~has_new & same])
    roots = builder.outermost(st, np.concatenate([u[~same], extra]))
    keep = ~builder.below(st, u, roots) & ~np.isin(u, roots)
    _set_r2(st, u[g & keep], d.r2[g & keep])
    inst = keep[ct[inst_sel]]
    if d.lists is not None:
        builder.install_caches(st, u[ct[inst_sel]][inst], d.lists, inst_sel[inst])
    stats["subtrees_retrained"] += len(roots)
    stats["records_retrained"] += builder.rebuild(st, roots)[0]


def _same(st: ForestState, nodes: np.ndarray, d: Decisions) -> np.ndarray:
    """Whether each node's decision is the split it has."""
    nd = st.nodes
    kind = nd.kind[nodes]
    same = d.kind == kind
    g = kind == GREEDY
    same &= ~g | ((d.attr == nd.attr[nodes]) & (d.r1 == nd.r1[nodes]))
    rn = kind == RANDOM
    same &= ~rn | (
        (d.attr == nd.attr[nodes]) & (d.thr == nd.thr[nodes]) & (d.draw == nd.draw[nodes])
    )
    return same


def _set_r2(st: ForestState, nodes: np.ndarray, r2: np.ndarray) -> None:
    """Same split, new upper value: move the thresholds to the new midpoints."""
    if len(nodes) == 0:
        return
    nd, vals, voff = st.nodes, st.values.vals, st.values.voff
    a = nd.attr[nodes].astype(np.int64)
    nd.r2[nodes] = r2
    nd.thr[nodes] = _midpoint(vals[voff[a] + nd.r1[nodes]], vals[voff[a] + r2])


def _path_nodes(st: ForestState, slots: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Nodes on the paths of the given records in every tree: (node, tree, depth, record#),
    tree-major and root first within a tree. Greedy nodes route by rank (x <= v1),
    random nodes by value (x <= threshold)."""
    nd, X, rank = st.nodes, st.records.X, st.values.rank
    T, m = st.rule.n_trees, len(slots)
    cur = np.repeat(st.layout.root[:, None], m, axis=1)
    rec = np.broadcast_to(np.arange(m), (T, m))
    out = [cur]
    for _ in range(st.rule.max_depth):
        c0 = np.maximum(cur, 0)
        kind = np.where(cur >= 0, nd.kind[c0], LEAF)
        if not (kind != LEAF).any():
            break
        a = np.maximum(nd.attr[c0], 0).astype(np.int64)
        sl = slots[rec]
        go = np.where(
            kind == GREEDY,
            rank.ravel()[a * rank.shape[1] + sl].astype(np.int64) <= nd.r1[c0],
            X.ravel()[a * X.shape[1] + sl] <= nd.thr[c0],
        )
        cur = np.where(kind != LEAF, np.where(go, nd.left[c0], nd.right[c0]), -1)
        out.append(cur)
    P = np.stack(out, axis=2)  # (T, m, depth)
    tt, rr, dd = np.nonzero(P >= 0)
    return P[tt, rr, dd].astype(np.int64), tt, dd, rr


def _place(st: ForestState, pn: np.ndarray, ptree: np.ndarray, prec: np.ndarray,
           slots: np.ndarray) -> None:
    """Put new records into free positions of their leaves' layout ranges."""
    nd = st.nodes
    leaf = nd.kind[pn] == LEAF
    lt, ln_, lr = ptree[leaf], pn[leaf], prec[leaf]
    for _attempt in range(2):
        u, inv, cnt = np.unique(ln_, return_inverse=True, return_counts=True)
        s = nd.start[u].astype(np.int64)
        w = nd.end[u].astype(np.int64) - s
        el = _ranges(s, w)
        li = np.repeat(np.arange(len(u)), w)
        free = st.layout.slot_at[nd.tree[u][li], el] < 0
        nfree = np.bincount(li, weights=free, minlength=len(u)).astype(np.int64)
        short = nfree < cnt
        if not short.any():
            fpos = el[free]
            fo = np.cumsum(nfree) - nfree
            order = np.argsort(inv, kind="stable")
            k_in = np.arange(len(order)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            target = np.empty(len(order), dtype=np.int64)
            target[order] = fpos[fo[inv[order]] + k_in]
            st.layout.slot_at[lt, target] = slots[lr]
            st.layout.pos[lt, slots[lr]] = target
            return
        need = np.zeros(len(nd.tree), dtype=np.int64)
        np.add.at(need, ln_, 1)
        for t in np.unique(nd.tree[u[short]]).tolist():
            _relayout(st, t, need)
    raise RuntimeError("could not place new records")  # pragma: no cover


def _relayout(st: ForestState, t: int, extra: np.ndarray) -> None:
    """Re-lay tree t's records leaf by leaf, leaving room for extra[leaf] new ones."""
    nd = st.nodes
    nodes = np.flatnonzero(nd.used & (nd.tree == t))
    dep = nd.depth[nodes].astype(np.int64)
    dm = int(dep.max()) + 1
    key = (nd.path[nodes] - (np.int64(1) << dep)) << (dm - dep)
    nodes = nodes[np.lexsort((dep, key))]
    leaves = nodes[nd.kind[nodes] == LEAF]
    rows, off = builder.node_rows(st, leaves)
    cnt = np.diff(off)
    width = cnt + extra[leaves] + np.maximum(2, cnt // 8)
    total = int(width.sum())
    slot_at = st.layout.slot_at
    if total > slot_at.shape[1]:
        wider = np.full((st.rule.n_trees, max(total, slot_at.shape[1] * 5 // 4)), -1, np.int32)
        wider[:, : slot_at.shape[1]] = slot_at
        st.layout = st.layout._replace(slot_at=wider)
        slot_at = wider
    start = np.cumsum(width) - width
    slot_at[t] = -1
    q = _ranges(start, cnt)
    slot_at[t, q] = rows
    st.layout.pos[t, rows] = q
    nd.start[leaves] = start
    nd.end[leaves] = start + width
    inner = nodes[nd.kind[nodes] != LEAF]
    inner = inner[np.argsort(-nd.depth[inner], kind="stable")]
    for d in np.unique(nd.depth[inner])[::-1].tolist():
        at = inner[nd.depth[inner] == d]
        nd.start[at] = nd.start[nd.left[at]]
        nd.end[at] = nd.end[nd.right[at]]

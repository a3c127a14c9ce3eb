"""The DaRE forest's updates: deletions (exact, incremental or a refit chosen by cost),
additions, classes that appear or vanish."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jobs.learners.base import UpdateReport, check_features, ids_to_add, ids_to_delete
from jobs.learners.dare import delete_kernels as _del
from jobs.learners.dare import kernels as _kern
from jobs.learners.dare.common import (
    _GENERATIONS,
    GREEDY,
    LEAF,
    RANDOM,
    _Decisions,
    _midpoint,
    _ranges,
)


class ForestUpdates:
    """Deletion and addition of :class:`~jobs.learners.dare.forest.DaREForest`."""

    # ================================================================== neighbourhood queries

    def _rank_of(self, attr: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return self._rank.ravel()[attr * self._rank.shape[1] + slots].astype(np.int64)

    # ================================================================== deletion

    def _path_nodes(self, slots: np.ndarray):
        """Nodes on the paths of the given records in every tree: (node, tree, depth, record#),
        tree-major and root first within a tree. Greedy nodes route by rank (x <= v1),
        random nodes by value (x <= threshold)."""
        T, m = self._T, len(slots)
        cur = np.repeat(self._root[:, None], m, axis=1)
        rec = np.broadcast_to(np.arange(m), (T, m))
        out = [cur]
        for _ in range(self._maxd):
            c0 = np.maximum(cur, 0)
            kind = np.where(cur >= 0, self._n_kind[c0], LEAF)
            if not (kind != LEAF).any():
                break
            a = np.maximum(self._n_attr[c0], 0).astype(np.int64)
            sl = slots[rec]
            go = np.where(
                kind == GREEDY,
                self._rank_of(a, sl) <= self._n_r1[c0],
                self._X.ravel()[a * self._X.shape[1] + sl] <= self._n_thr[c0],
            )
            cur = np.where(kind != LEAF, np.where(go, self._n_left[c0], self._n_right[c0]), -1)
            out.append(cur)
        P = np.stack(out, axis=2)  # (T, m, depth)
        tt, rr, dd = np.nonzero(P >= 0)
        return P[tt, rr, dd].astype(np.int64), tt, dd, rr

    def _node_rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Live records of each node (CSR rows, off), from the layout ranges."""
        return _kern.layout_rows(self._samp, self._n_tree[nodes].astype(np.int64),
                                 self._n_s[nodes].astype(np.int64),
                                 self._n_e[nodes].astype(np.int64))

    def _decide_nodes(self, nodes: np.ndarray, want_cache: np.ndarray) -> _Decisions:
        rows, off = self._node_rows(nodes)
        return self._decide(
            self._n_tree[nodes].astype(np.int64), self._n_path[nodes].astype(np.int64),
            self._n_depth[nodes].astype(np.int64), rows, off, want_cache,
        )  # fmt: skip

    def _same(self, nodes: np.ndarray, d: _Decisions) -> np.ndarray:
        kind = self._n_kind[nodes]
        same = d.kind == kind
        g = kind == GREEDY
        same &= ~g | ((d.attr == self._n_attr[nodes]) & (d.r1 == self._n_r1[nodes]))
        rn = kind == RANDOM
        same &= ~rn | (
            (d.attr == self._n_attr[nodes]) & (d.thr == self._n_thr[nodes])
            & (d.draw == self._n_draw[nodes])
        )  # fmt: skip
        return same

    def _set_r2(self, nodes: np.ndarray, r2: np.ndarray) -> None:
        if len(nodes) == 0:
            return
        a = self._n_attr[nodes].astype(np.int64)
        self._n_r2[nodes] = r2
        v1 = self._vals[self._voff[a] + self._n_r1[nodes]]
        v2 = self._vals[self._voff[a] + r2]
        self._n_thr[nodes] = _midpoint(v1, v2)

    def _outermost(self, nodes: np.ndarray) -> np.ndarray:
        """Drop nodes that lie below another node of the set."""
        nodes = np.unique(nodes)
        if len(nodes) <= 1:
            return nodes
        return nodes[~self._below(nodes, nodes)]

    def _rebuild(self, nodes: np.ndarray) -> int:
        """Retrain the subtrees rooted at `nodes` from their live records (compiled: the
        old subtrees are freed, the new ones grown depth first). Returns the records; the
        build work is added to _rebuilt_work."""
        if len(nodes) == 0:
            return 0
        if not hasattr(self, "_rebuilt_work"):
            self._rebuilt_work = 0
        nodes = np.asarray(nodes, dtype=np.int64)
        width = int((self._n_e[nodes].astype(np.int64) - self._n_s[nodes]).sum())
        rows = np.empty(max(width, 1), dtype=np.int64)
        stack = np.zeros((len(nodes) + self._maxd + 4, 8), dtype=np.int64)
        ctr = self._ctr()
        N, CC, _E, _H, _R, LAY = self._pools()
        m = _kern.prepare_rebuild(nodes, N, CC, LAY, ctr, rows, stack)
        self._rebuilt_work += self._grow_subtrees(stack, ctr, rows)
        return int(m)

    def _below(self, nodes: np.ndarray, roots: np.ndarray) -> np.ndarray:
        """Whether each node lies strictly below one of the roots."""
        out = np.zeros(len(nodes), dtype=bool)
        if len(roots) == 0 or len(nodes) == 0:
            return out
        t = self._n_tree[nodes]
        dep = self._n_depth[nodes].astype(np.int64)
        pa = self._n_path[nodes]
        for rt, rd, rp in zip(self._n_tree[roots].tolist(), self._n_depth[roots].tolist(),
                              self._n_path[roots].tolist(), strict=True):
            m = (t == rt) & (dep > rd)
            out[m] |= (pa[m] >> (dep[m] - rd)) == rp
        return out

    def _resolve(self, pn, ptree, pdepth, flag, r2_nodes, r2_vals, inst_nodes, inst_d, inst_sel,
                 extra, stats, single_path: bool) -> None:
        """Apply the outcome of checking the nodes on some paths: rebuild the outermost changed
        nodes, update thresholds and install recomputed caches of unchanged nodes above them.

        single_path: pn is one root-to-leaf path per tree (a deletion), so the outermost
        changed node of a tree is simply its shallowest flagged one."""
        fl = np.flatnonzero(flag)
        if single_path:
            big = np.iinfo(np.int64).max
            first = np.full(self._T, big, dtype=np.int64)
            np.minimum.at(first, ptree[fl], pdepth[fl])
            roots = pn[fl][pdepth[fl] == first[ptree[fl]]]
            if len(extra):
                roots = self._outermost(np.concatenate([roots, extra]))

            def keep_of(nodes):
                ok = self._n_depth[nodes] < first[self._n_tree[nodes]]
                if len(extra):
                    ok &= ~self._below(nodes, roots) & ~np.isin(nodes, roots)
                return ok
        else:
            roots = self._outermost(np.concatenate([pn[fl], extra]))

            def keep_of(nodes):
                return ~self._below(nodes, roots) & ~np.isin(nodes, roots)

        if len(r2_nodes):
            keep = keep_of(r2_nodes)
            self._set_r2(r2_nodes[keep], r2_vals[keep])
        if len(inst_nodes):
            keep = keep_of(inst_nodes)
            self._install_caches(inst_nodes[keep], inst_d, inst_sel[keep])
        stats["subtrees_retrained"] += len(roots)
        stats["records_retrained"] += self._rebuild(roots)

    def _delete_apply(self, r: int, stats: dict, dirty: np.ndarray, extra: list,
                      stop: bool) -> np.ndarray:
        """Remove record r from the counts, caches and value tables of the nodes on its
        paths, WITHOUT retraining (compiled: :func:`dare_delete.delete_record`): each node
        is re-evaluated against its stored split, and a tree's walk ends at the first node
        whose canonical state now differs, or (in a batch) that is already marked dirty.
        Random nodes whose stream domain changed are appended to `extra`.

        Deferring the retraining is exact: a node's counts, caches and layout range follow
        its records, and records are routed by the stored splits, so the nodes above the
        first changed one of each path are right; that one, and every node marked dirty by
        a batch, is retrained from its live records once, at the end, which gives its
        canonical subtree whatever happened below it.

        With `stop` (a deletion on its own) returns the changed nodes; in a batch they are
        marked in `dirty`."""
        c = int(self._y[r])
        self._alive[r] = False
        self._nlive -= 1
        self._class_n[c] -= 1
        self._samp[self._tt, self._pos[:, r]] = -1
        domchg = np.zeros(self.n_features_, dtype=bool)
        if self._drmax > 0:
            at = np.flatnonzero(np.abs(self._X[:, r]) >= self._absmax)
            if at.size:  # the domain moves only when the last record at the largest |x| goes
                self._absmax_n[at] -= 1
                at = at[self._absmax_n[at] <= 0]
            if at.size:
                dom = self._update_domain(at)
                if dom.size:
                    domchg[dom] = True
                    used = np.flatnonzero(self._n_used & (self._n_kind == RANDOM))
                    extra.append(used[np.isin(self._n_attr[used], dom)])
        flagged = np.empty(self._T, dtype=np.int64)
        counts = np.zeros(2, dtype=np.int64)
        W, S, cnt, rbuf = self._work(self._cap)
        tab = self._tab(int(self._nlive) + 2)
        Pm = self._params()
        GO = (self._roff, self._rstart, self._gorder, self._alive)
        ctr = self._ctr()
        ctr[_kern.CTR_AT_NODE] = -1
        while True:
            N, CC, E, H, R, LAY = self._pools()
            m = _del.delete_record(r, c, stop, domchg, dirty, flagged, self._root, N, CC, E, H,
                                   R, LAY, GO, Pm, tab, W, S, cnt, rbuf, ctr, counts)
            if m >= 0:
                break
            # short of room at one node: make it and resume there
            keep = ctr[_kern.CTR_AT_TREE : _kern.CTR_NFLAG + 1].copy()
            need_e, need_h = int(ctr[_kern.CTR_NEED_E]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._reserve_entries(max(need_e, self._ecap // 8))
            self._reserve_tables(max(need_h, self._hcap // 8))
            ctr = self._ctr()
            ctr[_kern.CTR_AT_TREE : _kern.CTR_NFLAG + 1] = keep
        self._put_ctr(ctr)
        stats["nodes_touched"] += int(counts[_del.STAT_NODES])
        stats["caches_recomputed"] += int(counts[_del.STAT_CACHES])
        return flagged[:m]

    def _delete_slots(self, slots: list[int], stats: dict) -> None:
        """Delete records (slots) one after the other from the counts and caches, then
        retrain the outermost changed nodes once."""
        stop = len(slots) == 1
        dirty = np.zeros(1 if stop else self._ncap, dtype=bool)
        extra: list[np.ndarray] = []
        roots = np.zeros(0, dtype=np.int64)
        for r in slots:
            roots = self._delete_apply(r, stats, dirty, extra, stop)
        if not stop:
            roots = _del.outermost(self._root, dirty, self._n_kind, self._n_left, self._n_right)
        if extra:
            roots = self._outermost(np.concatenate([roots, *extra]))
        self._rebuilt_work = 0
        stats["subtrees_retrained"] += len(roots)
        stats["records_retrained"] += self._rebuild(roots)
        self._learn_costs(len(slots), self._rebuilt_work)

    # ================================================================== classes

    def _drop_empty_classes(self) -> None:
        gone = np.flatnonzero(self._class_n == 0)
        if gone.size == 0:
            return
        keep = np.flatnonzero(self._class_n > 0)
        remap = np.cumsum(self._class_n > 0) - 1
        self.classes_ = self.classes_[keep]
        self._class_n = self._class_n[keep]
        self._n_cnt = np.ascontiguousarray(self._n_cnt[:, keep])
        self._eleft = np.ascontiguousarray(self._eleft[keep])
        self._hc = np.ascontiguousarray(self._hc[:, keep])
        y = self._y[: self._nrec]
        self._y[: self._nrec] = np.where(np.isin(y, gone), 0, remap[y])

    def _insert_classes(self, labels: np.ndarray) -> None:
        new = np.union1d(self.classes_, labels)
        if len(new) == len(self.classes_):
            return
        pos = np.searchsorted(new, self.classes_)
        C = len(new)

        def widen(a: np.ndarray) -> np.ndarray:
            b = np.zeros((a.shape[0], C), dtype=a.dtype)
            b[:, pos] = a
            return b

        self._n_cnt = widen(self._n_cnt)
        self._eleft = np.ascontiguousarray(widen(self._eleft.T).T)
        self._hc = widen(self._hc)
        cn = np.zeros(C, dtype=np.int64)
        cn[pos] = self._class_n
        self._class_n = cn
        self._y[: self._nrec] = pos[self._y[: self._nrec]]
        self.classes_ = new

    # ================================================================== public updates

    def _report(self, op, rids, t0, stats) -> UpdateReport:
        self.generation_ = next(_GENERATIONS)
        return UpdateReport(
            op=op, record_ids=list(rids.tolist()), guarantee=self.guarantee,
            seconds=time.perf_counter() - t0, retrained=dict(stats),
            metrics={"n_records": float(self._nlive)},
        )  # fmt: skip

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id; the forest is then identical to a retrain without them.

        Raises :class:`UnknownRecordError` (model unchanged) when an id is not live
        (never seen, or already deleted), :class:`DuplicateRecordError` when an id is
        named twice, ``ValueError`` when every live record would be deleted."""
        self._check_fitted()
        self._ensure_tables()
        t0 = time.perf_counter()
        rids = ids_to_delete(ids, self._slot)
        if len(rids) and len(rids) >= self._nlive:
            raise ValueError("cannot delete every live record (a forest needs at least one)")
        stats = {
            "mode": "incremental", "subtrees_retrained": 0, "records_retrained": 0,
            "nodes_touched": 0, "caches_recomputed": 0,
        }  # fmt: skip
        if len(rids) == 0:
            return self._report("delete", rids, t0, stats)
        m = len(rids)
        incr, refit = self._estimate(m)
        stats.update(cost_incremental=round(incr), cost_refit=round(refit))
        # a refit learns nothing about what batches retrain: the first batch goes
        # incremental unless that is estimated at more than twice a refit, so that a
        # prior that is too high is not kept for good
        if (self._CHOOSE_BY_COST and m >= self._BATCH_MIN and self._costs["rho_batch"] is None
                and refit < incr <= 2 * refit):
            stats["measuring"] = True
        elif (incr > refit) if self._CHOOSE_BY_COST else (m > self._REFIT_FRACTION * self._nlive):
            gone = set(rids.tolist())
            keep = [i for i in self._slot if i not in gone]
            self._refit(keep)
            stats.update(mode="refit", subtrees_retrained=self._T, records_retrained=len(keep))
            return self._report("delete", rids, t0, stats)
        self._delete_slots([self._slot.pop(i) for i in rids.tolist()], stats)
        self._drop_empty_classes()
        return self._report("delete", rids, t0, stats)

    def _estimate(self, m: int) -> tuple[float, float]:
        """Estimated cost of deleting m records (incremental, refit), in units of build work
        (records x levels), so that a batch never costs more than a retrain (up to the
        estimate). Deterministic: it depends on the forest and its update history only.

        Refit: the forest's build work scaled to the records that stay. Incremental: per
        record, the nodes on its paths (_NODE_UNITS each) and a fixed part; plus the build
        work the batch retrains: one deletion retrains a share rho of the forest's work
        (measured, a running average), a batch of m the union of m such shares,
        1 - (1 - rho)^m of it, as each changed subtree is retrained once. Batches learn
        their own rho: single deletions retrain rarely but much (a near-tie high in a tree
        flips), and a batch retrains what its deletions changed in sum, so the singles'
        rho had batches of 150 at 16k records estimated at twice the work they retrained
        (and refit, which learns nothing, for good)."""
        c = self._costs
        n = max(int(self._nlive), 1)
        work = c["work"] * n / max(c["n"], 1)
        path_len = c["work"] / max(c["n"] * self._T, 1)  # nodes a record passes, per tree
        rho = next((r for r in (c[self._rho_key(m)], c["rho"]) if r is not None), self._PRIOR_RHO)
        refit = work * (n - m) / n
        per = self._T * path_len * self._NODE_UNITS + self._RECORD_UNITS
        incr = m * per + work * (1.0 - (1.0 - rho) ** m)
        return incr, refit

    def _rho_key(self, m: int) -> str:
        """Which learned share a batch of m deletions reads and updates (see _estimate)."""
        return "rho_batch" if m >= self._BATCH_MIN else "rho"

    def _learn_costs(self, m: int, work: int) -> None:
        """Fold the build work an incremental deletion of m records retrained into the
        running estimate of the share one deletion retrains."""
        c = self._costs
        total = c["work"] * max(int(self._nlive), 1) / max(c["n"], 1)
        share = min(work / max(total, 1.0), 0.999)
        rho = 1.0 - (1.0 - share) ** (1.0 / m)
        key = self._rho_key(m)
        c[key] = rho if c[key] is None else (1 - self._EMA) * c[key] + self._EMA * rho

    def _refit(self, keep_ids: list[str]) -> None:
        sl = np.array([self._slot[i] for i in keep_ids], dtype=np.int64)
        ids = np.array(keep_ids, dtype=object)
        X = self._X[:, sl].T.copy()
        y = self.classes_[self._y[sl]]
        learned = {k: self._costs[k] for k in ("rho", "rho_batch")}
        self.fit(ids, X, y)
        self._costs.update(learned)  # what deletions retrain is not forgotten by a refit

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records; the forest is then identical to a retrain with them.

        Labels never seen before are allowed (``classes_`` grows). Raises
        :class:`DuplicateRecordError` for an id already live (or named twice) and
        ``ValueError`` for a wrong shape or NaN/inf; the model is unchanged on any error."""
        self._check_fitted()
        self._ensure_tables()
        t0 = time.perf_counter()
        rids = ids_to_add(ids, self._slot)
        Xa = check_features(X, len(rids), self.n_features_)
        ya = self._check_y(y, len(rids))
        try:
            np.union1d(self.classes_, ya)
        except TypeError:
            raise ValueError(
                f"labels {ya[:5].tolist()} cannot be compared with the model's classes "
                f"{self.classes_[:5].tolist()}"
            ) from None
        stats = {
            "mode": "incremental", "subtrees_retrained": 0, "records_retrained": 0,
            "nodes_touched": 0, "caches_recomputed": 0,
        }  # fmt: skip
        m = len(rids)
        if m == 0:
            return self._report("add", rids, t0, stats)
        if m > self._nlive:
            keep = list(self._slot)
            sl = np.array([self._slot[i] for i in keep], dtype=np.int64)
            self.fit(
                np.concatenate([np.array(keep, dtype=object), rids]),
                np.concatenate([self._X[:, sl].T, Xa]),
                np.concatenate([self.classes_[self._y[sl]], ya]),
            )
            stats.update(mode="refit", subtrees_retrained=self._T, records_retrained=self._nlive)
            return self._report("add", rids, t0, stats)
        self._add_records(rids, Xa, ya, stats)
        return self._report("add", rids, t0, stats)

    def _add_records(self, rids, Xa, ya, stats) -> None:
        self._insert_classes(np.unique(ya))
        m = len(rids)
        slots = np.arange(self._nrec, self._nrec + m, dtype=np.int64)
        self._grow_store(self._nrec + m)
        self._X[:, slots] = Xa.T
        yi = np.searchsorted(self.classes_, ya).astype(np.int32)
        self._y[slots] = yi
        self._ids[slots] = rids
        self._nrec += m
        remap = self._rerank()
        self._remap_ranks(remap)
        for i, sl in zip(rids.tolist(), slots.tolist(), strict=True):
            self._slot[i] = sl
        self._alive[slots] = True
        self._nlive += m
        if self._nlive >= 65_535 and self._eleft.dtype != np.int32:
            self._eleft = self._eleft.astype(np.int32)
        self._class_n += np.bincount(yi, minlength=len(self.classes_))
        dom = np.zeros(0, dtype=np.int64)
        if self._drmax > 0:
            above = np.abs(Xa) > self._absmax[None, :]
            self._absmax_n += (np.abs(Xa) == self._absmax[None, :]).sum(axis=0)
            dom = self._update_domain(np.flatnonzero(above.any(axis=0)))
        pn, ptree, pdepth, prec = self._path_nodes(slots)
        self._place(pn, ptree, prec, slots)
        C = len(self.classes_)
        u, inv = np.unique(pn, return_inverse=True)
        add = np.bincount(inv * C + yi[prec], minlength=len(u) * C).reshape(len(u), C)
        self._n_cnt[u] += add.astype(np.int32)
        self._n_n[u] += add.sum(axis=1).astype(np.int32)
        self._n_bound[u] = np.inf  # re-derived below; the next deletion re-scores them
        stats["nodes_touched"] += len(u)
        # every node on the new records' paths is re-derived from its records
        order = np.lexsort((self._n_depth[u], self._n_tree[u]))
        u = u[order]
        ut = self._n_tree[u].astype(np.int64)
        ud = self._n_depth[u].astype(np.int64)
        d = self._decide_nodes(u, np.ones(len(u), dtype=bool))
        same = self._same(u, d)
        flag = ~same
        lf = same & (d.kind == LEAF)
        self._n_why[u[lf]] = d.why[lf]
        g = same & (d.kind == GREEDY) & (d.r2 != self._n_r2[u])
        stats["caches_recomputed"] += int(d.cache_task.size)
        # cached-ness follows the node's size; nodes that must drop their cache
        was = self._n_cid[u] >= 0
        inst_sel = np.flatnonzero(same[d.cache_task]) if d.cache_task.size else np.zeros(0, int)
        inst_nodes = u[d.cache_task[inst_sel]] if d.cache_task.size else np.zeros(0, int)
        has_new = np.zeros(len(u), dtype=bool)
        if d.cache_task.size:
            has_new[d.cache_task] = True
        self._uncache(u[was & ~has_new & same])
        extra = np.zeros(0, dtype=np.int64)
        if dom.size:
            used = np.flatnonzero(self._n_used & (self._n_kind == RANDOM))
            extra = used[np.isin(self._n_attr[used], dom)]
        self._resolve(
            u, ut, ud, flag, u[g], d.r2[g], inst_nodes, d, inst_sel, extra, stats, False
        )

    def _remap_ranks(self, remap: list[np.ndarray] | None) -> None:
        """After re-ranking, translate the ranks stored in nodes and caches."""
        if remap is None:
            return
        flat = np.concatenate(remap)
        base = np.concatenate([[0], np.cumsum([len(m) for m in remap])])
        g = np.flatnonzero(self._n_used & (self._n_kind == GREEDY))
        a = self._n_attr[g].astype(np.int64)
        self._n_r1[g] = flat[base[a] + self._n_r1[g]]
        self._n_r2[g] = flat[base[a] + self._n_r2[g]]
        cids = np.flatnonzero((self._c_attr >= 0).any(axis=1))
        if cids.size:
            sa = self._c_attr[cids].ravel().astype(np.int64)
            ln = self._c_len[cids].ravel().astype(np.int64)
            E = _ranges(self._c_off[cids].ravel(), ln)
            ea = np.repeat(sa, ln)
            live = self._er1[E] >= 0
            E, ea = E[live], ea[live]
            self._er1[E] = flat[base[ea] + self._er1[E]]
            self._er2[E] = flat[base[ea] + self._er2[E]]
        cids, ss = np.nonzero(self._c_hlen > 0)
        if cids.size:
            ln = self._c_hlen[cids, ss].astype(np.int64)
            Hx = _ranges(self._c_hoff[cids, ss], ln)
            ha = np.repeat(self._c_attr[cids, ss].astype(np.int64), ln)
            self._hr[Hx] = flat[base[ha] + self._hr[Hx]]

    def _place(self, pn, ptree, prec, slots) -> None:
        """Put new records into free positions of their leaves' layout ranges."""
        leaf = self._n_kind[pn] == LEAF
        lt, ln_, lr = ptree[leaf], pn[leaf], prec[leaf]
        for _attempt in range(2):
            u, inv, cnt = np.unique(ln_, return_inverse=True, return_counts=True)
            s = self._n_s[u].astype(np.int64)
            w = self._n_e[u].astype(np.int64) - s
            el = _ranges(s, w)
            li = np.repeat(np.arange(len(u)), w)
            free = self._samp[self._n_tree[u][li], el] < 0
            nfree = np.bincount(li, weights=free, minlength=len(u)).astype(np.int64)
            short = nfree < cnt
            if not short.any():
                fpos = el[free]
                fo = np.cumsum(nfree) - nfree
                order = np.argsort(inv, kind="stable")
                k_in = np.arange(len(order)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                target = np.empty(len(order), dtype=np.int64)
                target[order] = fpos[fo[inv[order]] + k_in]
                self._samp[lt, target] = slots[lr]
                self._pos[lt, slots[lr]] = target
                return
            need = np.zeros(self._ncap, dtype=np.int64)
            np.add.at(need, ln_, 1)
            for t in np.unique(self._n_tree[u[short]]).tolist():
                self._relayout(t, need)
        raise RuntimeError("could not place new records")  # pragma: no cover

    def _relayout(self, t: int, extra: np.ndarray) -> None:
        """Re-lay tree t's records leaf by leaf, leaving room for extra[leaf] new ones."""
        nodes = np.flatnonzero(self._n_used & (self._n_tree == t))
        dep = self._n_depth[nodes].astype(np.int64)
        dm = int(dep.max()) + 1
        key = (self._n_path[nodes] - (np.int64(1) << dep)) << (dm - dep)
        nodes = nodes[np.lexsort((dep, key))]
        leaves = nodes[self._n_kind[nodes] == LEAF]
        rows, off = self._node_rows(leaves)
        cnt = np.diff(off)
        width = cnt + extra[leaves] + np.maximum(2, cnt // 8)
        total = int(width.sum())
        if total > self._samp.shape[1]:
            samp = np.full((self._T, max(total, self._samp.shape[1] * 5 // 4)), -1, np.int32)
            samp[:, : self._samp.shape[1]] = self._samp
            self._samp = samp
        start = np.cumsum(width) - width
        self._samp[t] = -1
        q = _ranges(start, cnt)
        self._samp[t, q] = rows
        self._pos[t, rows] = q
        self._n_s[leaves] = start
        self._n_e[leaves] = start + width
        inner = nodes[self._n_kind[nodes] != LEAF]
        inner = inner[np.argsort(-self._n_depth[inner], kind="stable")]
        for d in np.unique(self._n_depth[inner])[::-1].tolist():
            nd = inner[self._n_depth[inner] == d]
            self._n_s[nd] = self._n_s[self._n_left[nd]]
            self._n_e[nd] = self._n_e[self._n_right[nd]]

"""The DaRE forest's storage: the record store, the node, cache and entry pools, the value
group tables, and the view of them the compiled kernels take."""

from __future__ import annotations

import math

import numpy as np

from jobs.learners.dare import kernels as _kern
from jobs.learners.dare.common import _GOLD, _S32, _TAG_THR, _U64, _h2, _mix, _ranges


class ForestStore:
    """Storage half of :class:`~jobs.learners.dare.forest.DaREForest` (its state lives there)."""

    # ================================================================== record store

    def _init_store(self, ids: np.ndarray, X: np.ndarray, yi: np.ndarray) -> None:
        n, p = X.shape
        self._cap = max(n, 1)
        self._nrec = n
        self._X = np.zeros((p, self._cap), dtype=np.float64)
        self._X[:, :n] = X.T
        self._y = np.zeros(self._cap, dtype=np.int32)
        self._y[:n] = yi
        self._alive = np.zeros(self._cap, dtype=bool)
        self._alive[:n] = True
        self._ids = np.empty(self._cap, dtype=object)
        self._ids[:n] = ids
        self._slot = {s: i for i, s in enumerate(ids.tolist())}
        self._nlive = n
        self._class_n = np.bincount(yi, minlength=len(self.classes_)).astype(np.int64)

    def _grow_store(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap)
        p = self._X.shape[0]
        X = np.zeros((p, cap), dtype=np.float64)
        X[:, : self._nrec] = self._X[:, : self._nrec]
        self._X = X
        for name, dt in (("_y", np.int32), ("_alive", bool)):
            a = np.zeros(cap, dtype=dt)
            a[: self._nrec] = getattr(self, name)[: self._nrec]
            setattr(self, name, a)
        ids = np.empty(cap, dtype=object)
        ids[: self._nrec] = self._ids[: self._nrec]
        self._ids = ids
        pos = np.zeros((self._T, cap), dtype=np.int32)
        pos[:, : self._nrec] = self._pos[:, : self._nrec]
        self._pos = pos
        rank = np.zeros((p, cap), dtype=np.int32)
        rank[:, : self._nrec] = self._rank[:, : self._nrec]
        self._rank = rank
        self._cap = cap

    def _compact_store(self) -> None:
        """Drop the slots of deleted records, so that their features, label and id leave
        the forest (and every bundle saved from it) instead of waiting in dead slots.

        Slots are renumbered everywhere they are referenced (layout, positions, ranks); the
        value domains are re-derived from the live records, so a deleted record's value
        leaves them too, and so does a cache cut-off that still names one (see
        :meth:`_forget_cutoffs`). Nothing the content hash covers changes."""
        n = self._nrec
        live = np.flatnonzero(self._alive[:n])
        if len(live) == n:
            return
        m = len(live)
        new = np.full(self._cap, -1, dtype=np.int32)
        new[live] = np.arange(m, dtype=np.int32)
        self._X = np.ascontiguousarray(self._X[:, live])
        self._y = self._y[live].copy()
        self._alive = np.ones(m, dtype=bool)
        self._ids = self._ids[live].copy()
        self._pos = np.ascontiguousarray(self._pos[:, live])
        self._rank = np.ascontiguousarray(self._rank[:, live])
        held = self._samp >= 0
        self._samp[held] = new[self._samp[held]]
        self._nrec = self._cap = m
        self._slot = {rid: k for k, rid in enumerate(self._ids.tolist())}
        self._remap_ranks(self._rerank())
        self._forget_cutoffs()
        # what freed nodes and cache slots last held is no longer anyone's state
        self._n_thr[~self._n_used] = 0.0
        unused = (self._c_attr < 0).all(axis=1)
        self._c_cutp[unused] = 0
        self._c_cutv[unused] = 0.0

    def _forget_cutoffs(self) -> None:
        """Lower every cache cut-off whose value no live record holds to its last live pair.

        A slot's list holds every valid pair whose key (priority, v1) is at most its
        cut-off, in key order. The cut-off key keeps the value of the pair that was last
        when the cache was built, which may be a deleted record's value. Every valid pair
        up to the last live entry is in the list (it is below the old cut-off), so lowering
        the cut-off to that entry's key keeps the invariant, and with it exactness; a slot
        with no live entry gets a cut-off below every key (it is recomputed when next
        touched, as it has fewer than k pairs). A slot that holds every valid pair has no
        use for a cut-off: its own is cleared."""
        every = (self._c_attr >= 0) & self._c_all
        self._c_cutp[every] = 0
        self._c_cutv[every] = 0.0
        cids, ss = np.nonzero((self._c_attr >= 0) & ~self._c_all)
        if cids.size == 0:
            return
        a = self._c_attr[cids, ss].astype(np.int64)
        va = self._voff[a]
        nv = self._voff[a + 1] - va
        cutv = self._c_cutv[cids, ss]
        at = np.zeros(len(a), dtype=np.int64)
        for k in range(len(a)):
            at[k] = np.searchsorted(self._vals[va[k] : va[k] + nv[k]], cutv[k])
        held = (at < nv) & (self._vals[va + np.minimum(at, nv - 1)] == cutv)
        stale = np.flatnonzero(~held)
        if stale.size == 0:
            return
        cids, ss, a, va = cids[stale], ss[stale], a[stale], va[stale]
        last = np.full(len(stale), -1, dtype=np.int64)
        for k in range(len(stale)):
            off = int(self._c_off[cids[k], ss[k]])
            seg = self._er1[off : off + int(self._c_len[cids[k], ss[k]])]
            alive = np.flatnonzero(seg >= 0)
            if alive.size:
                last[k] = seg[alive[-1]]
        node = np.zeros(self._ccap, dtype=np.int64)
        owners = np.flatnonzero(self._n_used & (self._n_cid >= 0))
        node[self._n_cid[owners]] = owners
        nd = node[cids]
        nk = self._nodekey(self._n_tree[nd], self._n_path[nd])
        sk = _h2(nk ^ _TAG_THR, a.astype(_U64))
        has = last >= 0
        r = np.where(has, last, 0)
        prio = (_mix(sk ^ self._vmix[va + r]) >> _S32).astype(np.int64)
        self._c_cutp[cids, ss] = np.where(has, prio, -1)
        self._c_cutv[cids, ss] = np.where(has, self._vals[va + r], 0.0)

    def _rerank(self) -> list[np.ndarray] | None:
        """Dense ranks of every slot's values per attribute, the global sorted order and the
        start of each value's run in it. Returns, per attribute, the map old rank -> new rank
        (None on the first call)."""
        p = self.n_features_
        n = self._nrec
        old_vals = None
        if hasattr(self, "_vals"):
            old_vals = [self._vals[self._voff[a] : self._voff[a + 1]] for a in range(p)]
        if not hasattr(self, "_rank") or self._rank.shape[1] < self._cap:
            self._rank = np.zeros((p, self._cap), dtype=np.int32)
        vals, voff = [], [0]
        gorder = np.empty((p, n), dtype=np.int32)
        rstart, roff = [], [0]
        for a in range(p):
            u, inv = np.unique(self._X[a, :n], return_inverse=True)
            self._rank[a, :n] = inv
            vals.append(u)
            voff.append(voff[-1] + len(u))
            gorder[a] = np.argsort(inv, kind="stable")
            rs = np.zeros(len(u) + 1, dtype=np.int32)
            np.cumsum(np.bincount(inv, minlength=len(u)), out=rs[1:])
            rstart.append(rs)
            roff.append(roff[-1] + len(u) + 1)
        self._vals = np.concatenate(vals) if vals else np.zeros(0)
        self._vmix = _mix(self._vals.view(_U64) + _GOLD)  # value half of the pair priority
        self._voff = np.array(voff, dtype=np.int64)
        self._gorder = gorder
        self._rstart = np.concatenate(rstart)
        self._roff = np.array(roff, dtype=np.int64)
        self._nvals_max = max((len(v) for v in vals), default=1)
        # the compiled kernels read a record's ranks together: record-major, 16 bits where
        # they fit (one cache line per record on tables of up to 32 features)
        dt = np.uint16 if self._nvals_max <= 65_535 else np.int32
        self._rank_rm = np.ascontiguousarray(self._rank.T, dtype=dt)
        if old_vals is None:
            return None
        return [np.searchsorted(vals[a], old_vals[a]).astype(np.int32) for a in range(p)]

    def _update_domain(self, attrs: np.ndarray | None = None) -> np.ndarray:
        """Random-node stream domains D_a = 2**e with 2**(e-1) <= max|x_a| < 2**e over the live
        data (e <= 1023). Returns the attributes whose D changed."""
        p = self.n_features_
        attrs = np.arange(p) if attrs is None else np.asarray(attrs, dtype=np.int64)
        if not hasattr(self, "_dom"):
            self._dom = np.ones(p, dtype=np.float64)
            self._absmax = np.zeros(p, dtype=np.float64)
        if not hasattr(self, "_absmax_n"):  # live records holding the largest |x_a|
            self._absmax_n = np.zeros(p, dtype=np.int64)
        if len(attrs) == 0:
            return attrs
        live = np.flatnonzero(self._alive[: self._nrec])
        ax = np.abs(self._X[np.ix_(attrs, live)])
        m = ax.max(axis=1) if live.size else np.zeros(len(attrs))
        self._absmax[attrs] = m
        self._absmax_n[attrs] = (ax == m[:, None]).sum(axis=1) if live.size else 0
        if self.random_domain is not None:
            dom = np.full(len(attrs), float(self.random_domain))
        else:
            dom = np.array([1.0 if v == 0 else math.ldexp(1.0, min(math.frexp(v)[1], 1023))
                            for v in m.tolist()])
        changed = attrs[dom != self._dom[attrs]]
        self._dom[attrs] = dom
        return changed

    # ================================================================== node & entry pools

    def _init_pools(self, ncap: int, ccap: int, ecap: int, scap: int) -> None:
        C, P = len(self.classes_), self._P
        self._ncap = ncap
        self._n_tree = np.zeros(ncap, dtype=np.int32)
        self._n_depth = np.zeros(ncap, dtype=np.int32)
        self._n_path = np.zeros(ncap, dtype=np.int64)
        self._n_kind = np.zeros(ncap, dtype=np.int8)
        self._n_why = np.zeros(ncap, dtype=np.int8)
        self._n_left = np.full(ncap, -1, dtype=np.int32)
        self._n_right = np.full(ncap, -1, dtype=np.int32)
        self._n_attr = np.full(ncap, -1, dtype=np.int32)
        self._n_thr = np.zeros(ncap, dtype=np.float64)
        self._n_r1 = np.full(ncap, -1, dtype=np.int32)
        self._n_r2 = np.full(ncap, -1, dtype=np.int32)
        self._n_draw = np.full(ncap, -1, dtype=np.int32)
        self._n_n = np.zeros(ncap, dtype=np.int32)
        self._n_cnt = np.zeros((ncap, C), dtype=np.int32)
        self._n_s = np.zeros(ncap, dtype=np.int32)
        self._n_e = np.zeros(ncap, dtype=np.int32)
        self._n_cid = np.full(ncap, -1, dtype=np.int32)
        self._n_used = np.zeros(ncap, dtype=bool)
        self._init_bounds(ncap)
        self._nfree = np.arange(ncap - 1, -1, -1, dtype=np.int64)
        self._nfree_n = ncap
        # cache table: one row per cached greedy node
        self._ccap = ccap
        self._c_attr = np.full((ccap, P), -1, dtype=np.int32)
        self._c_off = np.zeros((ccap, P), dtype=np.int64)
        self._c_len = np.zeros((ccap, P), dtype=np.int32)
        self._c_all = np.zeros((ccap, P), dtype=bool)
        self._c_cutp = np.zeros((ccap, P), dtype=np.int64)
        self._c_cutv = np.zeros((ccap, P), dtype=np.float64)
        self._c_hoff = np.zeros((ccap, P), dtype=np.int64)
        self._c_hlen = np.zeros((ccap, P), dtype=np.int32)
        self._cfree = np.arange(ccap - 1, -1, -1, dtype=np.int64)
        self._cfree_n = ccap
        # entry pool (cached candidate pairs)
        self._ecap = ecap
        self._er1 = np.full(ecap, -1, dtype=np.int32)
        self._er2 = np.full(ecap, -1, dtype=np.int32)
        # left class counts of cached pairs, class-major (1-D gathers per class); 16-bit while
        # no node can hold 65,535 records
        cdt = np.uint16 if self._nlive < 65_535 else np.int32
        self._eleft = np.zeros((C, ecap), dtype=cdt)
        self._eused = 0
        self._egarb = 0
        self._init_tables(max(1024, ecap // 4))
        # per-tree layout of records (leaves' instance lists are ranges of it)
        self._samp = np.full((self._T, scap), -1, dtype=np.int32)
        self._pos = np.zeros((self._T, self._cap), dtype=np.int32)
        self._root = np.full(self._T, -1, dtype=np.int64)
        self._tt = np.arange(self._T)

    _NODE_1D = (
        ("_n_tree", 0), ("_n_depth", 0), ("_n_path", 0), ("_n_kind", 0), ("_n_why", 0),
        ("_n_left", -1), ("_n_right", -1), ("_n_attr", -1), ("_n_thr", 0), ("_n_r1", -1),
        ("_n_r2", -1), ("_n_draw", -1), ("_n_n", 0), ("_n_s", 0), ("_n_e", 0),
        ("_n_cid", -1), ("_n_used", False), ("_n_bound", np.inf),
    )  # fmt: skip

    def _init_bounds(self, ncap: int) -> None:
        """Per greedy node, what lets a deletion keep its split without re-scoring (see
        :func:`dare_delete._greedy_changed`): an upper bound on its other candidates' scores
        (+inf: unknown) and its sampled attributes. Derived state, not saved."""
        self._n_bound = np.full(ncap, np.inf)
        self._n_sattr = np.full((ncap, self._P), -1, dtype=np.int32)

    def _alloc_nodes(self, m: int) -> np.ndarray:
        self._grow_nodes(m)
        out = self._nfree[self._nfree_n - m : self._nfree_n][::-1].copy()
        self._nfree_n -= m
        self._n_used[out] = True
        return out

    def _grow_nodes(self, m: int) -> None:
        """Make sure at least m nodes are free (the pool doubles)."""
        if self._nfree_n < m:
            old = self._ncap
            cap = max(2 * old, old + m)
            for name, fill in self._NODE_1D:
                a = getattr(self, name)
                b = np.full(cap, fill, dtype=a.dtype)
                b[:old] = a
                setattr(self, name, b)
            cnt = np.zeros((cap, self._n_cnt.shape[1]), dtype=np.int32)
            cnt[:old] = self._n_cnt
            self._n_cnt = cnt
            sattr = np.full((cap, self._P), -1, dtype=np.int32)
            sattr[:old] = self._n_sattr
            self._n_sattr = sattr
            self._nfree, self._nfree_n = _with_fresh(self._nfree, self._nfree_n, old, cap)
            self._ncap = cap

    def _uncache(self, nodes: np.ndarray) -> None:
        cid = self._n_cid[nodes]
        cid = cid[cid >= 0]
        if cid.size == 0:
            return
        self._egarb += int(self._c_len[cid].sum())
        self._hgarb += int(self._c_hlen[cid].sum())
        self._c_attr[cid] = -1
        self._c_len[cid] = 0
        self._c_hlen[cid] = 0
        self._n_cid[nodes] = -1
        need = self._cfree_n + len(cid)
        if need > len(self._cfree):
            f = np.zeros(max(need, 2 * len(self._cfree)), dtype=np.int64)
            f[: self._cfree_n] = self._cfree[: self._cfree_n]
            self._cfree = f
        self._cfree[self._cfree_n : need] = cid
        self._cfree_n = need

    def _alloc_caches(self, m: int) -> np.ndarray:
        self._grow_caches(m)
        out = self._cfree[self._cfree_n - m : self._cfree_n][::-1].copy()
        self._cfree_n -= m
        return out

    def _grow_caches(self, m: int) -> None:
        """Make sure at least m cache rows are free (the table doubles)."""
        if self._cfree_n < m:
            old = self._ccap
            cap = max(2 * old, old + m)
            P = self._P
            for name, fill, dt in (
                ("_c_attr", -1, np.int32), ("_c_off", 0, np.int64),
                ("_c_len", 0, np.int32), ("_c_all", False, bool),
                ("_c_cutp", 0, np.int64), ("_c_cutv", 0.0, np.float64),
                ("_c_hoff", 0, np.int64), ("_c_hlen", 0, np.int32),
            ):  # fmt: skip
                b = np.full((cap, P), fill, dtype=dt)
                b[:old] = getattr(self, name)
                setattr(self, name, b)
            self._cfree, self._cfree_n = _with_fresh(self._cfree, self._cfree_n, old, cap)
            self._ccap = cap

    def _alloc_entries(self, m: int) -> int:
        self._reserve_entries(m)
        start = self._eused
        self._eused += m
        return start

    def _reserve_entries(self, m: int) -> None:
        """Make room for m more entries (may compact the pool, moving cached segments)."""
        if self._eused + m > self._ecap:
            if self._egarb > self._eused // 4:
                self._compact_entries()
            if self._eused + m > self._ecap:
                cap = max(self._ecap + self._ecap // 4, self._eused + m)
                for name, fill in (("_er1", -1), ("_er2", -1)):
                    a = getattr(self, name)
                    b = np.full(cap, fill, dtype=a.dtype)
                    b[: self._eused] = a[: self._eused]
                    setattr(self, name, b)
                b = np.zeros((self._eleft.shape[0], cap), dtype=self._eleft.dtype)
                b[:, : self._eused] = self._eleft[:, : self._eused]
                self._eleft = b
                self._ecap = cap

    # ------------------------------------------------------------------ value group tables

    def _init_tables(self, hcap: int) -> None:
        """Pool of value group tables (rank, class counts per value of a node), one segment
        per cached slot that keeps one (``_c_hoff``, ``_c_hlen``; length 0: none)."""
        self._tables_stale = False
        self._hcap = hcap
        self._hr = np.zeros(hcap, dtype=np.int32)
        self._hc = np.zeros((hcap, len(self.classes_)), dtype=np.int32)
        self._hused = 0
        self._hgarb = 0

    def _reserve_tables(self, m: int) -> None:
        """Make room for m more table entries (may compact the pool, moving segments)."""
        if self._hused + m > self._hcap:
            if self._hgarb > self._hused // 4:
                self._compact_tables()
            if self._hused + m > self._hcap:
                cap = max(self._hcap + self._hcap // 2, self._hused + m)
                hr = np.zeros(cap, dtype=np.int32)
                hr[: self._hused] = self._hr[: self._hused]
                hc = np.zeros((cap, self._hc.shape[1]), dtype=np.int32)
                hc[: self._hused] = self._hc[: self._hused]
                self._hr, self._hc, self._hcap = hr, hc, cap

    def _compact_tables(self) -> None:
        """Drop freed table segments (each segment keeps its value order)."""
        cids, ss = np.nonzero(self._c_hlen > 0)
        ln = self._c_hlen[cids, ss].astype(np.int64)
        idx = _ranges(self._c_hoff[cids, ss], ln)
        m = len(idx)
        self._hr[:m] = self._hr[idx]
        self._hc[:m] = self._hc[idx]
        self._c_hoff[cids, ss] = np.cumsum(ln) - ln
        self._hused = m
        self._hgarb = 0

    def _rebuild_tables(self) -> None:
        """Recompute every cached slot's value group table from the node's records (a
        saved forest does not store them: they are a function of the records)."""
        self._init_tables(max(1024, self._hcap if hasattr(self, "_hcap") else 0))
        self._c_hlen[:] = 0
        nodes = np.flatnonzero(self._n_used & (self._n_cid >= 0)).astype(np.int64)
        W = self._work(self._cap)[0]
        ctr = self._ctr()
        while True:
            N, CC, _E, H, R, LAY = self._pools()
            if not _kern.node_tables(nodes, N, CC, H, R, LAY, ctr, self._HIST_RATIO, W):
                break
            at, need = int(ctr[_kern.CTR_SP]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._reserve_tables(need)
            ctr = self._ctr()
            ctr[_kern.CTR_SP] = at
        self._put_ctr(ctr)

    # ------------------------------------------------------------------ compiled kernels' view

    def _pools(self) -> tuple:
        """The arrays the compiled kernels read and write, grouped as they expect (see
        :mod:`jobs.learners.dare.kernels`): nodes, cache table, entries, group tables,
        records, layout. The free lists are made long enough to take every slot back."""
        if len(self._nfree) < self._ncap:
            f = np.zeros(self._ncap, dtype=np.int64)
            f[: self._nfree_n] = self._nfree[: self._nfree_n]
            self._nfree = f
        if len(self._cfree) < self._ccap:
            f = np.zeros(self._ccap, dtype=np.int64)
            f[: self._cfree_n] = self._cfree[: self._cfree_n]
            self._cfree = f
        N = (
            self._n_tree, self._n_depth, self._n_path, self._n_kind, self._n_why, self._n_left,
            self._n_right, self._n_attr, self._n_thr, self._n_r1, self._n_r2, self._n_draw,
            self._n_n, self._n_cnt, self._n_s, self._n_e, self._n_cid, self._n_used,
            self._nfree, self._n_bound, self._n_sattr,
        )  # fmt: skip
        CC = (
            self._c_attr, self._c_off, self._c_len, self._c_all, self._c_cutp, self._c_cutv,
            self._c_hoff, self._c_hlen, self._cfree,
        )  # fmt: skip
        E = (self._er1, self._er2, self._eleft)
        H = (self._hr, self._hc)
        R = (self._X, self._rank_rm, self._y, self._vals, self._vmix, self._voff, self._dom,
             self._tkeys)
        LAY = (self._samp, self._pos)
        return N, CC, E, H, R, LAY

    def _params(self) -> tuple:
        return (self._maxd, self._drmax, self._msl, self._P, self._k, self._BUFFER,
                self.criterion == "gini", self._CACHE_MIN, self._MAX_DRAWS, self._HIST_RATIO)

    def _ensure_tables(self) -> None:
        """A loaded forest's value group tables, built by its first update (delete and
        add call this first; fit builds its own)."""
        if self._tables_stale:
            self._rebuild_tables()

    def _ctr(self) -> np.ndarray:
        ctr = np.zeros(_kern.CTR_LEN, dtype=np.int64)
        ctr[_kern.CTR_NFREE] = self._nfree_n
        ctr[_kern.CTR_CFREE] = self._cfree_n
        ctr[_kern.CTR_EUSED] = self._eused
        ctr[_kern.CTR_EGARB] = self._egarb
        ctr[_kern.CTR_HUSED] = self._hused
        ctr[_kern.CTR_HGARB] = self._hgarb
        return ctr

    def _put_ctr(self, ctr: np.ndarray) -> None:
        self._nfree_n = int(ctr[_kern.CTR_NFREE])
        self._cfree_n = int(ctr[_kern.CTR_CFREE])
        self._eused = int(ctr[_kern.CTR_EUSED])
        self._egarb = int(ctr[_kern.CTR_EGARB])
        self._hused = int(ctr[_kern.CTR_HUSED])
        self._hgarb = int(ctr[_kern.CTR_HGARB])

    def _work(self, maxn: int) -> tuple:
        """Scratch buffers of the compiled split search for nodes of up to maxn records
        (kept between calls; not part of the model): W, S, class counts, a record buffer."""
        maxn = max(maxn, self._samp.shape[1]) if hasattr(self, "_samp") else maxn
        C = len(self.classes_)
        KB = self._k + self._BUFFER
        key = (C, self.n_features_, self._P, KB, self._HIST_RATIO)
        wk = getattr(self, "_wk", None)
        if wk is None or wk[0] != key or wk[1] < maxn or wk[2] < self._nvals_max:
            maxn = max(maxn, wk[1] if wk is not None and wk[0] == key else 0)
            W, S = _kern.make_work(maxn, self._nvals_max, self.n_features_, C, self._P, KB,
                                   self._HIST_RATIO)
            wk = (key, maxn, self._nvals_max, W, S, np.zeros(C, dtype=np.int64),
                  np.empty(max(maxn, 1), dtype=np.int64))
            self._wk = wk
        return wk[3], wk[4], wk[5], wk[6]

    def _compact_entries(self) -> None:
        """Drop freed segments and dead entries, keeping each segment's priority order."""
        cids = np.flatnonzero((self._c_attr >= 0).any(axis=1))
        P = self._P
        off = self._c_off[cids].ravel()
        ln = self._c_len[cids].ravel().astype(np.int64)
        idx = _ranges(off, ln)
        seg = np.repeat(np.arange(len(off)), ln)
        keep = self._er1[idx] >= 0
        idx, seg = idx[keep], seg[keep]
        newlen = np.bincount(seg, minlength=len(off)).astype(np.int64)
        newoff = np.cumsum(newlen) - newlen
        m = len(idx)
        self._er1[:m] = self._er1[idx]
        self._er2[:m] = self._er2[idx]
        self._eleft[:, :m] = self._eleft[:, idx]
        self._er1[m : self._eused] = -1
        self._c_off[cids] = newoff.reshape(-1, P)
        self._c_len[cids] = newlen.reshape(-1, P)
        self._eused = m
        self._egarb = 0

    def _trim_pools(self) -> None:
        """Release spare capacity of the node, cache and entry pools (after a fit)."""
        if self._egarb:
            self._compact_entries()
        cap = self._eused + max(1024, self._eused // 16)
        if cap < self._ecap:
            self._er1 = self._er1[:cap].copy()
            self._er2 = self._er2[:cap].copy()
            self._eleft = np.ascontiguousarray(self._eleft[:, :cap])
            self._ecap = cap
        if self._hgarb:
            self._compact_tables()
        cap = self._hused + max(1024, self._hused // 16)
        if cap < self._hcap:
            self._hr = self._hr[:cap].copy()
            self._hc = self._hc[:cap].copy()
            self._hcap = cap
        used = np.flatnonzero(self._n_used)
        top = int(used.max()) + 1 if used.size else 1
        cap = top + max(64, top // 16)
        if cap < self._ncap:
            for name, _fill in self._NODE_1D:
                setattr(self, name, getattr(self, name)[:cap].copy())
            self._n_cnt = self._n_cnt[:cap].copy()
            self._n_sattr = self._n_sattr[:cap].copy()
            self._nfree = np.flatnonzero(~self._n_used)[::-1].copy()
            self._nfree_n = len(self._nfree)
            self._ncap = cap
        cid = self._n_cid[used]
        cid = cid[cid >= 0]
        top = int(cid.max()) + 1 if cid.size else 1
        cap = top + max(16, top // 16)
        if cap < self._ccap:
            inuse = np.zeros(self._ccap, dtype=bool)
            inuse[cid] = True
            for name in ("_c_attr", "_c_off", "_c_len", "_c_all", "_c_cutp", "_c_cutv",
                         "_c_hoff", "_c_hlen"):
                setattr(self, name, getattr(self, name)[:cap].copy())
            self._cfree = np.flatnonzero(~inuse[:cap])[::-1].copy()
            self._cfree_n = len(self._cfree)
            self._ccap = cap


def _with_fresh(free: np.ndarray, n_free: int, old: int, cap: int) -> tuple[np.ndarray, int]:
    """A free list of `cap` slots: the new ids old..cap-1 (taken from the end, so the
    lowest first) below the `n_free` ids already free."""
    fresh = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
    out = np.zeros(cap, dtype=np.int64)
    out[: len(fresh)] = fresh
    out[len(fresh) : len(fresh) + n_free] = free[:n_free]
    return out, n_free + len(fresh)

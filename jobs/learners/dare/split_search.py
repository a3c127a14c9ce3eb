"""The DaRE forest's split search: keyed choices, greedy and random splits, building
subtrees (the kernels are in :mod:`jobs.learners.dare.kernels`)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare import kernels as _kern
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
    _XLOGX,
    GREEDY,
    RANDOM,
    _Decisions,
    _h2,
    _midpoint,
    _ranges,
    _xlogx,
)


class SplitSearch:
    """Split search of :class:`~jobs.learners.dare.forest.DaREForest`."""

    # ================================================================== keyed choices

    def _nodekey(self, tree: np.ndarray, path: np.ndarray) -> np.ndarray:
        return _h2(self._tkeys[tree], np.asarray(path).astype(_U64))

    def _attr_order(self, nk: np.ndarray, tag: np.uint64) -> np.ndarray:
        h = _h2((nk ^ tag)[:, None], self._attr_u64[None, :])
        return np.argsort(h, axis=1, kind="stable")

    # ================================================================== split kernels

    def _greedy(self, tree, path, n, cnt, rows, off, want_cache):
        """Greedy split of each task; caches (prefix of candidate pairs) where want_cache
        (compiled kernel :func:`dare_kernels.greedy_tasks`)."""
        nk = self._nodekey(tree, path)
        wc = np.ascontiguousarray(want_cache, dtype=bool)
        (ok, attr, r1, r2, slot_attr, allf, cutp, cutv, elen, e_r1, e_r2,
         e_left, hlen, h_r, h_c) = _kern.greedy_tasks(
            nk, n.astype(np.int64), np.ascontiguousarray(cnt, dtype=np.int64),
            rows.astype(np.int64), off.astype(np.int64), wc, self._rank_rm, self._y, self._vals,
            self._vmix, self._voff, self._P, self._k, self._BUFFER, self._msl,
            self.criterion == "gini", self._tab(int(n.max(initial=0)) + 2),
            self._nvals_max, self._HIST_RATIO,
        )  # fmt: skip
        ctask = np.flatnonzero(wc & ok)
        cache = None
        if ctask.size:
            ln = elen[ctask]
            eoff = (np.cumsum(ln.ravel()) - ln.ravel()).reshape(ln.shape)
            hl = hlen[ctask]
            hoff = (np.cumsum(hl.ravel()) - hl.ravel()).reshape(hl.shape)
            cache = (
                ctask, slot_attr[ctask], allf[ctask], cutp[ctask], cutv[ctask], eoff, ln,
                e_r1, e_r2, e_left, hoff, hl, h_r, h_c,
            )  # fmt: skip
        return ok, attr, r1, r2, cache

    def _tab(self, n: int) -> np.ndarray:
        """x log x table for entropy scores (a dummy for Gini)."""
        return _xlogx(n) if self.criterion == "entropy" else _XLOGX[0][:1]

    def _random(self, tree, path, rows, off):
        """Random split of each task: first non-constant attribute in keyed order, first keyed
        draw of the attribute's stream inside [min, max) of the task's values."""
        ntask = len(tree)
        p = self.n_features_
        n = off[1:] - off[:-1]
        nk = self._nodekey(tree, path)
        order = self._attr_order(nk, _TAG_RATTR)
        cur = np.zeros(ntask, dtype=np.int64)
        attr = np.full(ntask, -1, dtype=np.int64)
        lo = np.zeros(ntask)
        hi = np.zeros(ntask)
        pend = np.arange(ntask)
        while pend.size:
            a = order[pend, cur[pend]]
            el = _ranges(off[pend], n[pend])
            x = self._X.ravel()[np.repeat(a * self._X.shape[1], n[pend]) + rows[el]]
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
        ok = attr >= 0
        thr = np.zeros(ntask)
        draw = np.full(ntask, -1, dtype=np.int64)
        t = np.flatnonzero(ok)
        base = _h2(nk[t] ^ _TAG_DRAW, attr[t].astype(_U64))
        D = self._dom[attr[t]]
        j0 = 0
        while t.size and j0 < self._MAX_DRAWS:
            J = np.arange(j0, j0 + self._DRAW_CHUNK, dtype=_U64)
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
            j0 += self._DRAW_CHUNK
        thr[t] = lo[t]  # fallback after _MAX_DRAWS misses (draw stays -1)
        return ok, attr, thr, draw

    def _decide(self, tree, path, depth, rows, off, want_cache=None):
        """The canonical state of each task's node from its records (CSR rows/off)."""
        C = len(self.classes_)
        ntask = len(tree)
        n = (off[1:] - off[:-1]).astype(np.int64)
        trow = np.repeat(np.arange(ntask, dtype=np.int64), n)
        lab = self._y[rows]
        cnt = np.bincount(trow * C + lab, minlength=ntask * C).reshape(ntask, C)
        d = _Decisions()
        d.n, d.cnt = n, cnt
        why = np.zeros(ntask, dtype=np.int8)
        why[depth >= self._maxd] = _W_DEPTH
        why[(why == 0) & (n < 2 * self._msl)] = _W_SMALL
        why[(why == 0) & (cnt.max(axis=1, initial=0) == n)] = _W_PURE
        kind = np.zeros(ntask, dtype=np.int8)
        attr = np.full(ntask, -1, dtype=np.int64)
        thr = np.zeros(ntask)
        r1 = np.full(ntask, -1, dtype=np.int64)
        r2 = np.full(ntask, -1, dtype=np.int64)
        draw = np.full(ntask, -1, dtype=np.int64)
        go_left = np.zeros(len(rows), dtype=bool)
        cand = why == 0
        rnd = np.flatnonzero(cand & (depth < self._drmax))
        grd = np.flatnonzero(cand & (depth >= self._drmax))
        d.cache_task = np.zeros(0, dtype=np.int64)
        if rnd.size:
            el = _ranges(off[rnd], n[rnd])
            soff = np.concatenate([[0], np.cumsum(n[rnd])])
            ok, a, t, j = self._random(tree[rnd], path[rnd], rows[el], soff)
            okr, bad = rnd[ok], rnd[~ok]
            why[bad] = _W_CONST
            kind[okr] = RANDOM
            attr[okr], thr[okr], draw[okr] = a[ok], t[ok], j[ok]
            el = _ranges(off[okr], n[okr])
            ar = np.repeat(attr[okr], n[okr])
            go_left[el] = self._X.ravel()[ar * self._X.shape[1] + rows[el]] <= np.repeat(
                thr[okr], n[okr]
            )
        if grd.size:
            el = _ranges(off[grd], n[grd])
            soff = np.concatenate([[0], np.cumsum(n[grd])])
            if want_cache is None:
                wc = n[grd] >= self._CACHE_MIN
            else:
                wc = want_cache[grd] & (n[grd] >= self._CACHE_MIN)
            ok, a, q1, q2, cache = self._greedy(
                tree[grd], path[grd], n[grd], cnt[grd], rows[el], soff, wc
            )
            okg, bad = grd[ok], grd[~ok]
            # no non-constant attribute at all -> CONST, else no split leaves msl records
            why[bad] = _W_MSL
            kind[okg] = GREEDY
            attr[okg], r1[okg], r2[okg] = a[ok], q1[ok], q2[ok]
            if bad.size:
                why[bad[self._all_constant(rows, off, bad)]] = _W_CONST
            v1 = self._vals[self._voff[attr[okg]] + r1[okg]]
            v2 = self._vals[self._voff[attr[okg]] + r2[okg]]
            thr[okg] = _midpoint(v1, v2)
            el = _ranges(off[okg], n[okg])
            ar = np.repeat(attr[okg], n[okg])
            go_left[el] = self._rank.ravel()[ar * self._rank.shape[1] + rows[el]] <= np.repeat(
                r1[okg], n[okg]
            )
            if cache is not None:
                (ct, d.cache_slots, d.cache_all, d.cache_cutp, d.cache_cutv, d.cache_off,
                 d.cache_len, d.e_r1, d.e_r2, d.e_left, d.cache_hoff, d.cache_hlen, d.h_r,
                 d.h_c) = cache  # fmt: skip
                d.cache_task = grd[ct]
        d.kind, d.why, d.attr, d.thr, d.r1, d.r2, d.draw, d.go_left = (
            kind, why, attr, thr, r1, r2, draw, go_left
        )
        return d

    def _all_constant(self, rows, off, tasks):
        n = off[1:] - off[:-1]
        res = np.ones(len(tasks), dtype=bool)
        el = _ranges(off[tasks], n[tasks])
        so = np.cumsum(n[tasks]) - n[tasks]
        for a in range(self.n_features_):
            x = self._X[a, rows[el]]
            res &= np.minimum.reduceat(x, so) == np.maximum.reduceat(x, so)
        return res

    # ================================================================== building

    def _install_caches(self, nodes: np.ndarray, d: _Decisions, sel: np.ndarray) -> None:
        """Store the cache rows of tasks d.cache_task[sel] on `nodes` (parallel to sel)."""
        if len(nodes) == 0:
            return
        self._uncache(nodes)
        cids = self._alloc_caches(len(nodes))
        ln = d.cache_len[sel]
        eo = d.cache_off[sel]
        tot = int(ln.sum())
        start = self._alloc_entries(tot)
        src = _ranges(eo.ravel(), ln.ravel())
        dst = np.arange(start, start + tot)
        self._er1[dst] = d.e_r1[src]
        self._er2[dst] = d.e_r2[src]
        self._eleft[:, dst] = d.e_left[src].T
        newoff = start + (np.cumsum(ln.ravel()) - ln.ravel()).reshape(ln.shape)
        self._c_attr[cids] = d.cache_slots[sel]
        self._c_off[cids] = newoff
        self._c_len[cids] = ln
        self._c_all[cids] = d.cache_all[sel]
        self._c_cutp[cids] = d.cache_cutp[sel]
        self._c_cutv[cids] = d.cache_cutv[sel]
        hl = d.cache_hlen[sel]
        htot = int(hl.sum())
        self._reserve_tables(htot)
        hsrc = _ranges(d.cache_hoff[sel].ravel(), hl.ravel())
        hdst = np.arange(self._hused, self._hused + htot)
        self._hr[hdst] = d.h_r[hsrc]
        self._hc[hdst] = d.h_c[hsrc]
        self._c_hoff[cids] = self._hused + (np.cumsum(hl.ravel()) - hl.ravel()).reshape(hl.shape)
        self._c_hlen[cids] = hl
        self._hused += htot
        self._n_cid[nodes] = cids

    def _grow_subtrees(self, stack: np.ndarray, ctr: np.ndarray, rows: np.ndarray) -> int:
        """Run the compiled builder on the tasks of `stack` until it is done, growing the
        pools whenever it stops short of room (it resumes where it stopped). Returns its
        work (records x levels), the unit of the batch cost estimate."""
        sp = int(ctr[_kern.CTR_SP])
        n_max = int((stack[:sp, 7] - stack[:sp, 6]).max(initial=0))
        tab = self._tab(n_max + 2)
        W, S, cnt, _rbuf = self._work(n_max)
        Pm = self._params()
        while True:
            N, CC, E, H, R, LAY = self._pools()
            if not _kern.build_subtrees(stack, ctr, rows, N, CC, E, H, R, LAY, Pm, tab, W, S,
                                        cnt):
                break
            sp, work = int(ctr[_kern.CTR_SP]), int(ctr[_kern.CTR_WORK])
            need_e, need_h = int(ctr[_kern.CTR_NEED_E]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._grow_nodes(max(2, self._ncap // 2))
            self._grow_caches(max(1, self._ccap // 2))
            self._reserve_entries(max(need_e, self._ecap // 4))
            self._reserve_tables(max(need_h, self._hcap // 4))
            ctr = self._ctr()
            ctr[_kern.CTR_SP] = sp
            ctr[_kern.CTR_WORK] = work
        self._put_ctr(ctr)
        return int(ctr[_kern.CTR_WORK])

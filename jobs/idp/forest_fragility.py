"""Which records could change a DaRE node's split if they alone were deleted.

For the forest guard (:mod:`jobs.idp.forest_guard`). Deleting one record x from a
DaRE tree changes the counts along x's path; if no node on the path changes its
decision, the tree after the deletion has the same splits, and its only change at
any query is at x's own leaf, whose class probabilities become
``(n_c - [c = y_x]) / (n - 1)``: a closed form. Here each (node, record) is decided
"stable" (the node's decision is the same without the record) or "fragile" (it may
change, or we could not tell); a record's tree then changes only at its leaf unless
it is fragile at some node of its path, and then only below the highest such node.

The decision replays the forest's own rules (:mod:`jobs.learners.dare`) for one
record removed:

* every internal node: it becomes a leaf if ``n - 1 < 2 min_samples_leaf`` or its
  records become pure;
* random node: its draw stays the first draw inside the shrunk range iff both
  children keep a record (a node with a fallback threshold, draw -1, is fragile);
* greedy node, per sampled attribute: the candidate pairs are the first k valid
  adjacent value pairs in keyed priority order. Removing x changes the pairs only
  around x's value group w: if w keeps records, (prev, w) and (w, next) can only
  turn invalid (w turning pure with the neighbour's label); if w vanishes, (w, next)
  disappears and (prev, w) becomes (prev, next) under the same priority, which may
  turn it valid (a new candidate at that priority) or invalid. The first k pairs of
  the updated list are rescored with x's counts removed (the forest's own score
  function) and the best one, with the forest's tie-breaks, must be the node's split
  with the same upper value (else the threshold moves).

Whatever cannot be decided exactly is fragile, which is sound (the guard then
assumes the worst below that node): an attribute turning constant, a list that runs
out of known pairs before k, or a new pair whose 32-bit priority ties a listed one. A
record whose deletion moves the random nodes' value domain on an attribute is fragile
at every random node on that attribute (:func:`domain_fragile`). Tests
compare every claim of "stable" with the tree an actual deletion leaves
(``tests/idp/test_forest_guard.py``).

Far from a tie, most records need no look. Unless x's deletion changes the first k listed
pairs of some attribute (x's value group is an end of one of them, or it vanishes and the
pair that replaces it may rank among the first k) or makes the node pure, the candidates
after the deletion are the listed ones with one record of x's class taken from one side.
:func:`_margin_holds` scores every listed pair with ANY one record removed from either
side; when the split's lowest such score beats every other pair's highest, the per-record
rule would call all those records stable, and they are skipped. Only the others are
decided one by one (same answer, ``tests/idp/test_forest_guard.py``); at 16k records this
skips most of the records of the big nodes an update touches.

Leaves stay leaves under one deletion (fewer records cannot unmake purity, size,
depth or a constant attribute), except one whose scored candidates all left fewer
than ``min_samples_leaf`` records on a side: a pair from beyond the first k may
split it after a deletion, so its records are fragile there (with the default
``min_samples_leaf=1`` no such leaf exists).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from jobs.learners import dare_view as dv
from jobs.learners.dare import DaREForest
from jobs.learners.dare_kernels import _TAG_THR, _sort_keys, h2, mix, score1
from jobs.learners.dare_shared import _ranges

_S32 = np.uint64(32)


def fragile_records(forest: DaREForest, nodes: np.ndarray | None = None, margin: bool = True
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the internal `nodes` (default: all), the records fragile at each: (nodes,
    off, slots) with the slots of node i in ``slots[off[i]:off[i + 1]]``. `margin`: skip
    the per-record rule where a node is far from a tie (the same answer; False decides
    every record, for tests)."""
    v = dv.view(forest)
    if nodes is None:
        nodes = np.flatnonzero(v.used)
    nodes = np.asarray(nodes, dtype=np.int64)
    # leaves stay leaves under a deletion, but for one whose candidates all left too few
    # records on a side: a pair from beyond the first k may then split it
    nodes = nodes[(v.kind[nodes] != dv.LEAF) | (v.why[nodes] == dv.W_MSL)]
    rows, off = dv.node_records(forest, nodes)
    greedy = v.kind[nodes] == dv.GREEDY
    gi = np.flatnonzero(greedy)
    goff = np.concatenate([[0], np.cumsum(np.diff(off)[gi])]).astype(np.int64)
    grows = rows[_ranges(off[gi], np.diff(off)[gi])] if gi.size else np.zeros(0, np.int64)
    cand = dv.candidates(forest, nodes[gi], grows, goff)
    slot_of = np.full(len(nodes), -1, dtype=np.int64)
    slot_of[gi] = np.arange(len(gi))
    frag = _fragile(
        nodes, rows, off, slot_of, v.kind, v.attr, v.r1, v.r2, v.thr, v.draw,
        v.cnt.astype(np.int64), v.node_keys, v.rank, v.X, v.y.astype(np.int64), v.vmix,
        v.voff, cand.ok, cand.split_attr, cand.split_r1, cand.attr, cand.all_pairs,
        cand.off, cand.length, cand.e_r1, cand.e_r2, cand.e_left, v.msl, v.k, v.gini,
        v.xlogx, margin)  # fmt: skip
    cnt = np.add.reduceat(frag.astype(np.int64), off[:-1]) if len(rows) else np.zeros(
        len(nodes), np.int64)
    if len(rows):
        cnt[np.diff(off) == 0] = 0
    return nodes, np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64), rows[frag]


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


@njit(cache=True)
def _margin_holds(ci, v, nt, cnt, n_attr, n_r1, c_attr, c_all, c_off, c_len, e_r1, e_left,
                  msl, k, gini, tab):  # pragma: no cover - compiled
    """Whether no single deletion that leaves the first k listed pairs as they are can
    change greedy node v's split: the split's pair, with ANY one record removed from either
    side, still scores strictly above every other listed pair with any one record removed
    (the per-record rule then says "stable" for each such record)."""
    C = cnt.shape[0]
    P = c_attr.shape[1]
    L = np.zeros((1, C), np.int64)
    R = np.zeros((1, C), np.int64)
    split_lo = np.inf
    others_hi = -np.inf
    found = False
    for s in range(P):
        a = c_attr[ci, s]
        if a < 0:
            continue
        m = c_len[ci, s]
        if m < k and not c_all[ci, s]:
            return False  # fewer than k known pairs: every record is "bad" anyway
        for q in range(min(k, m)):
            E = c_off[ci, s] + q
            is_split = a == n_attr[v] and e_r1[E] == n_r1[v]
            found = found or is_split
            nl0 = 0
            for cc in range(C):
                nl0 += e_left[E, cc]
            for side in range(2):
                for c in range(C):
                    for cc in range(C):
                        L[0, cc] = e_left[E, cc]
                        R[0, cc] = cnt[cc] - e_left[E, cc]
                    nl = nl0
                    nr = (nt - nl0)
                    if side == 0:
                        if L[0, c] == 0:
                            continue
                        L[0, c] -= 1
                        nl -= 1
                    else:
                        if R[0, c] == 0:
                            continue
                        R[0, c] -= 1
                        nr -= 1
                    if nl < msl or nr < msl:
                        if is_split:
                            return False  # the split itself may turn invalid
                        continue
                    sc = score1(L, 0, R, 0, nl, nr, gini, tab)
                    if is_split:
                        split_lo = min(split_lo, sc)
                    else:
                        others_hi = max(others_hi, sc)
    return found and split_lo > others_hi


@njit(cache=True, parallel=True)
def _fragile(nodes, rows, off, slot_of, kind, n_attr, n_r1, n_r2, n_thr, n_draw, n_cnt,
             node_keys, rank, X, y, vmix, voff, c_ok, c_split_attr, c_split_r1, c_attr,
             c_all, c_off, c_len, e_r1, e_r2, e_left, msl, k, gini, tab,
             use_margin):  # pragma: no cover - compiled
    """fragile[j] for every record rows[j] of every node (see the module docstring)."""
    C = n_cnt.shape[1]
    P = c_attr.shape[1]
    frag = np.zeros(rows.shape[0], np.bool_)
    memo_size = C * (k + 1) ** P
    top = rank.max() if rank.size else 0
    rbits = 1
    while (np.int64(1) << rbits) <= top:
        rbits += 1
    if memo_size > 1 << 16:
        memo_size = 0
    for i in prange(nodes.shape[0]):  # nodes are independent: one thread each
        v = nodes[i]
        s0 = off[i]
        nt = off[i + 1] - s0
        if nt == 0:
            continue
        cnt = n_cnt[v]
        if kind[v] == 0 or nt - 1 < 2 * msl:  # a leaf that may split; or becomes a leaf
            for j in range(s0, s0 + nt):
                frag[j] = True
            continue
        if kind[v] == 1:  # RANDOM
            a = n_attr[v]
            t = n_thr[v]
            nl = 0
            for j in range(s0, s0 + nt):
                if X[a, rows[j]] <= t:
                    nl += 1
            for j in range(s0, s0 + nt):
                r = rows[j]
                pure, _lab = _pure_without(cnt, y[r])
                side = nl if X[a, r] <= t else nt - nl
                frag[j] = pure or side == 1 or n_draw[v] < 0
            continue
        ci = slot_of[i]
        if not c_ok[ci] or c_split_attr[ci] != n_attr[v] or c_split_r1[ci] != n_r1[v]:
            for j in range(s0, s0 + nt):  # the lists do not explain the split: assume worst
                frag[j] = True
            continue
        nk = node_keys[v]
        memo = np.full(memo_size, -1, np.int8)
        # per-record work space
        sel_left = np.zeros((P * k, C), np.int64)
        sel_r1 = np.zeros(P * k, np.int64)
        sel_slot = np.zeros(P * k, np.int64)
        sel_merged = np.zeros(P * k, np.bool_)
        L = np.zeros((1, C), np.int64)
        R = np.zeros((1, C), np.int64)
        cnt_after = np.zeros(C, np.int64)
        # value groups of the node's records, per sampled attribute
        grp = np.empty((P, nt), np.int64)
        ng = np.zeros(P, np.int64)
        g_rank = np.empty((P, nt), np.int64)
        g_cnt = np.zeros((P, nt, C), np.int64)
        g_pre = np.zeros((P, nt, C), np.int64)  # counts of groups 0..g
        e_g = np.empty((P, k + 16), np.int64)  # group index of each entry's lower value
        e_p = np.empty((P, k + 16), np.int64)  # each entry's priority
        for s in range(P):
            a = c_attr[ci, s]
            if a < 0:
                continue
            vals = np.empty(nt, np.int64)
            for j in range(nt):
                vals[j] = rank[a, rows[s0 + j]]
            order = _order(vals, rbits)
            g = -1
            last = -1
            for q in range(nt):
                j = order[q]
                if g < 0 or vals[j] != last:
                    g += 1
                    g_rank[s, g] = vals[j]
                    last = vals[j]
                grp[s, j] = g
                g_cnt[s, g, y[rows[s0 + j]]] += 1
            ng[s] = g + 1
            for gg in range(ng[s]):
                for cc in range(C):
                    g_pre[s, gg, cc] = g_cnt[s, gg, cc] + (g_pre[s, gg - 1, cc] if gg else 0)
            va = voff[a]
            for q in range(c_len[ci, s]):
                E = c_off[ci, s] + q
                e_g[s, q] = np.searchsorted(g_rank[s, :ng[s]], e_r1[E])
                e_p[s, q] = _prio(nk, a, vmix, va, e_r1[E])
        # far from a tie, only records whose deletion changes the listed pairs (value groups
        # at their ends; a vanishing group whose new pair may rank among the first k) or
        # makes the node pure can be fragile: the rest are stable without a look
        fast = use_margin and _margin_holds(ci, v, nt, cnt, n_attr, n_r1, c_attr, c_all,
                                            c_off, c_len, e_r1, e_left, msl, k, gini, tab)
        near = np.zeros((P, nt), np.bool_)
        if fast:
            for s in range(P):
                a = c_attr[ci, s]
                if a < 0:
                    continue
                m = c_len[ci, s]
                kk = min(k, m)
                for q in range(kk):
                    near[s, e_g[s, q]] = True
                    if e_g[s, q] + 1 < ng[s]:
                        near[s, e_g[s, q] + 1] = True
                for g in range(ng[s]):
                    if g_cnt[s, g].sum() != 1:
                        continue  # the group keeps records
                    if ng[s] == 2:
                        near[s, g] = True  # the attribute may turn constant
                    elif 0 < g < ng[s] - 1 and (
                            m < k or kk == 0
                            or _prio(nk, a, vmix, voff[a], g_rank[s, g - 1]) <= e_p[s, kk - 1]):
                        near[s, g] = True  # (prev, next) may enter the first k
        for j in range(nt):
            r = rows[s0 + j]
            c = y[r]
            pure, _lab = _pure_without(cnt, c)
            if pure:
                frag[s0 + j] = True
                continue
            if fast:
                look = False
                for s in range(P):
                    if c_attr[ci, s] >= 0 and near[s, grp[s, j]]:
                        look = True
                        break
                if not look:
                    continue
            for cc in range(C):
                cnt_after[cc] = cnt[cc] - (1 if cc == c else 0)
            bad = False
            modified = False  # the selection is not the first k listed pairs as they are
            nsel = 0
            for s in range(P):
                a = c_attr[ci, s]
                if a < 0:
                    continue
                w = grp[s, j]
                alive = g_cnt[s, w].sum() > 1  # w's group keeps records
                if not alive and ng[s] == 2:
                    bad = True  # the attribute turns constant: the slots shift
                    break
                has_prev = w > 0
                has_next = w + 1 < ng[s]
                pp, lp = _group_pure(g_cnt[s], w - 1) if has_prev else (False, -1)
                pn, ln_ = _group_pure(g_cnt[s], w + 1) if has_next else (False, -1)
                pw, lw = _pure_without(g_cnt[s, w], c) if alive else (True, c)
                # the new pair (prev, next) where (prev, w) was not valid before
                new_pair = False
                new_prio = np.int64(0)
                if not alive and has_prev and has_next:
                    was_valid = not (pp and lp == c)  # w was {x}: pure with label c
                    now_valid = not (pp and pn and lp == ln_)
                    if now_valid and not was_valid:
                        new_pair = True
                        new_prio = _prio(nk, a, vmix, voff[a], g_rank[s, w - 1])
                taken = 0
                q = 0
                m = c_len[ci, s]
                while taken < k:
                    # the next candidate: listed entry q, or the new pair if it comes first
                    use_new = False
                    if new_pair:
                        if q < m:
                            if new_prio == e_p[s, q]:
                                bad = True  # a priority tie: the order falls to indices
                                break
                            use_new = new_prio < e_p[s, q]
                        elif c_all[ci, s]:
                            use_new = True
                        else:
                            bad = True  # beyond the known list: its place is unknown
                            break
                    if use_new:
                        modified = True
                        for cc in range(C):
                            sel_left[nsel, cc] = g_pre[s, w - 1, cc]
                        sel_r1[nsel] = g_rank[s, w - 1]
                        sel_slot[nsel] = s
                        sel_merged[nsel] = True
                        nsel += 1
                        taken += 1
                        new_pair = False
                        continue
                    if q >= m:
                        break
                    E = c_off[ci, s] + q
                    gq = e_g[s, q]
                    q += 1
                    merged = False
                    if gq == w - 1:  # (prev, w)
                        if alive:
                            if pp and pw and lp == lw:
                                modified = True
                                continue  # turns invalid
                        else:
                            modified = True
                            if not has_next:
                                continue  # (prev, w) with no next: gone
                            if pp and pn and lp == ln_:
                                continue  # (prev, next) is not valid
                            merged = True
                    elif gq == w:  # (w, next)
                        if not alive:
                            modified = True
                            continue  # disappears with w
                        if pw and pn and lw == ln_:
                            modified = True
                            continue  # turns invalid
                    xl = rank[a, r] <= e_r1[E]
                    for cc in range(C):
                        sel_left[nsel, cc] = e_left[E, cc] - (1 if xl and cc == c else 0)
                    sel_r1[nsel] = e_r1[E]
                    sel_slot[nsel] = s
                    sel_merged[nsel] = merged
                    nsel += 1
                    taken += 1
                if bad:
                    break
                if taken < k and not c_all[ci, s]:
                    bad = True  # fewer than k known pairs left: the split search looks further
                    break
            if bad:
                frag[s0 + j] = True
                continue
            # records with one label and the same side of every selected threshold score
            # the same: remember the outcome per (label, sides) where nothing else moved
            code = -1
            if not modified and memo.shape[0] > 0:
                code = c
                mult = C
                for s in range(P):
                    if c_attr[ci, s] < 0:
                        continue
                    below = 0
                    for q in range(min(k, c_len[ci, s])):
                        if e_r1[c_off[ci, s] + q] < rank[c_attr[ci, s], r]:
                            below += 1
                    code += below * mult
                    mult *= k + 1
                if memo[code] >= 0:
                    frag[s0 + j] = memo[code] == 1
                    continue
            best = -np.inf
            bi = -1
            for q in range(nsel):
                nl = 0
                for cc in range(C):
                    nl += sel_left[q, cc]
                nr = (nt - 1) - nl
                if nl >= msl and nr >= msl:
                    for cc in range(C):
                        L[0, cc] = sel_left[q, cc]
                        R[0, cc] = cnt_after[cc] - sel_left[q, cc]
                    sc = score1(L, 0, R, 0, nl, nr, gini, tab)
                    if sc > best:
                        best = sc
                        bi = q
            frag[s0 + j] = (bi < 0 or c_attr[ci, sel_slot[bi]] != n_attr[v]
                            or sel_r1[bi] != n_r1[v] or sel_merged[bi])
            if code >= 0:
                memo[code] = 1 if frag[s0 + j] else 0
    return frag

"""LUCID's MILP (Eq. 3): the largest confidence of a leaking input, for N and a set S.

Encodes N exactly (big-M ReLUs), the hyper-network of S by interval layers, matching
dependencies and the logit-difference rows over S. Every bound used holds for every network
of S, so the solver's dual bound, plus :func:`serving_margin` for its tolerances and
float32 logits, is a sound bound for the set.
See docs/guard.md (How the bound is computed)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from jobs.guard.lucid.interval_bounds import (
    EPS,
    HyperNet,
    LayerBounds,
    Net64,
    affine_bounds,
    ibp,
    matched_bounds,
)
from jobs.guard.lucid.solvers import MILP, SolveResult, lp_ranges, solve

DEFAULT_SAFETY_MARGIN = 1e-4
#: the margin's relative part: HiGHS accepts rows violated by 1e-7 (LP) to 1e-6 (MIP) on
#: coefficients as large as the variables' bounds, and float32 logits round each term
#: by 6e-8 relative, summed over a layer's width: 1e-5 of the largest magnitude covers
#: both with room
RELATIVE_MARGIN = 1e-5


def _widen_hi(v: float, mag: float) -> float:
    return float(v + EPS * (1.0 + mag))


def _widen_lo(v: float, mag: float) -> float:
    return float(v - EPS * (1.0 + mag))


class _Builder:
    def __init__(self, nmax: int) -> None:
        self.nmax = nmax
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []

    def var(self, lb: float, ub: float, integer: bool = False) -> int:
        self.lb.append(float(lb))
        self.ub.append(float(ub))
        self.integer.append(bool(integer))
        if len(self.lb) > self.nmax:
            raise RuntimeError("variable budget exceeded")
        return len(self.lb) - 1

    def row(self, coef: np.ndarray, lo: float, hi: float) -> None:
        """``lo <= coef . v <= hi`` (dense coefficients over the variable budget)."""
        idx = np.flatnonzero(coef)
        if len(idx) == 0:
            return
        self.rows.append((idx, coef[idx].copy(), float(lo), float(hi)))

    def unit(self, j: int) -> np.ndarray:
        v = np.zeros(self.nmax)
        v[j] = 1.0
        return v

    def build(self, obj_col: int) -> MILP:
        n = len(self.lb)
        indptr = [0]
        indices: list[np.ndarray] = []
        data: list[np.ndarray] = []
        for idx, val, _lo, _hi in self.rows:
            indices.append(idx)
            data.append(val)
            indptr.append(indptr[-1] + len(idx))
        A = sp.csr_matrix(
            (np.concatenate(data) if data else np.zeros(0),
             np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64),
             np.asarray(indptr)),
            shape=(len(self.rows), n),
        )
        obj = np.zeros(n)
        obj[obj_col] = 1.0
        return MILP(obj, np.asarray(self.lb), np.asarray(self.ub),
                    np.asarray(self.integer, dtype=bool), A,
                    np.asarray([r[2] for r in self.rows], dtype=np.float64),
                    np.asarray([r[3] for r in self.rows], dtype=np.float64))


@dataclass
class Encoding:
    """A built MILP (or a decision made without one) and what went into it."""

    milp: MILP | None
    decided: float | None  # -inf when no network of S can flip anywhere
    beta_col: int
    x_cols: list[int]
    stats: dict = field(default_factory=dict)
    bounds: list[LayerBounds] = field(default_factory=list, repr=False)


@dataclass
class _Layer:
    """The MILP's view of a layer's outputs: N's as expressions ``E v + e`` over the
    variables v (substituted, no variables of their own where stable), N#'s as ``EH v``
    (variables or 0, never a constant), and their post-ReLU boxes."""

    E: np.ndarray
    e: np.ndarray
    EH: np.ndarray
    post_lo_n: np.ndarray
    post_hi_n: np.ndarray
    post_lo_h: np.ndarray
    post_hi_h: np.ndarray


def encode(
    net: Net64,
    hyper: HyperNet,
    c: int,
    *,
    tau: float = 0.01,
    matching: bool = True,
    output_matching: bool = True,
    n_pre: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> Encoding:
    """Build the MILP of LUCID's Eq. 3 for class ``c`` (see the module doc)."""
    d = net.weights[0].shape[1]
    C = net.weights[-1].shape[0]
    if not 0 <= c < C:
        raise ValueError(f"class {c} out of range for {C} classes")
    L = len(net.weights)
    hidden = [W.shape[0] for W in net.weights[:-1]]
    lo, hi = np.zeros(d), np.ones(d)
    B = matched_bounds(net, hyper, lo, hi, n_pre=n_pre)
    nmax = d + 1 + 4 * sum(hidden) + C
    bld = _Builder(nmax)
    x_cols = [bld.var(0.0, 1.0) for _ in range(d)]
    E = np.zeros((d, nmax))
    E[np.arange(d), x_cols] = 1.0
    layer = _Layer(E, np.zeros(d), E.copy(), lo, hi, lo, hi)
    stats = {"n_unstable_N": 0, "n_unstable_H": 0, "n_relaxed_H": 0, "n_binary": 0,
             "n_stable_N": 0, "n_stable_H": 0}
    for i in range(L - 1):
        layer = _hidden_layer(bld, stats, net, hyper, i, B[i], layer, tau, matching)
    margins = _output_margins(bld, net, c, layer)
    dprev = ((B[-2].dpost_lo, B[-2].dpost_hi) if L > 1 else (np.zeros(d), np.zeros(d)))
    flip, always = _flip_candidates(hyper, net, c, layer, margins, dprev, output_matching)
    stats["flip_candidates"] = len(flip)
    stats["always_flips"] = bool(always)
    if not always:
        if not flip:
            return Encoding(None, -math.inf, margins.beta_col, x_cols, stats, B)
        _flip_rows(bld, stats, flip)
    milp = bld.build(margins.beta_col)
    stats.update({"n_vars": milp.n_vars, "n_rows": milp.n_rows, "n_int": milp.n_int,
                  "beta_box": [margins.beta_lo, margins.beta_hi]})
    return Encoding(milp, None, margins.beta_col, x_cols, stats, B)


def _hidden_layer(bld: _Builder, stats: dict, net: Net64, hyper: HyperNet, i: int,
                  lb_i: LayerBounds, prev: _Layer, tau: float, matching: bool) -> _Layer:
    """Hidden layer ``i`` of N and of N#, and (with `matching`) the matching dependencies
    ``z + dl <= z# <= z + du`` of its neurons."""
    newE, newe = _network_relus(bld, stats, net.weights[i] @ prev.E,
                                net.weights[i] @ prev.e + net.biases[i], lb_i)
    newEH = _hyper_relus(bld, stats, hyper, i, prev.EH, lb_i, tau)
    if matching:
        for k in range(len(newe)):
            coef = newEH[k] - newE[k]
            const = -newe[k]  # z# - z = coef . v + const
            dl, du = float(lb_i.dpost_lo[k]), float(lb_i.dpost_hi[k])
            bld.row(coef, dl - const, du - const)
    return _Layer(newE, newe, newEH, *lb_i.n_post(), *lb_i.h_post())


def _network_relus(bld: _Builder, stats: dict, Z: np.ndarray, zc: np.ndarray,
                   lb_i: LayerBounds) -> tuple[np.ndarray, np.ndarray]:
    """N's ReLUs over pre-activations ``Z v + zc``: stable ones pass their expression on
    (or 0), an unstable one gets ``z in [0, u]`` and a binary."""
    h, nmax = Z.shape
    newE = np.zeros((h, nmax))
    newe = np.zeros(h)
    for k in range(h):
        lk, uk = float(lb_i.n_lo[k]), float(lb_i.n_hi[k])
        if lk >= 0:
            newE[k], newe[k] = Z[k], zc[k]
            stats["n_stable_N"] += 1
        elif uk <= 0:
            stats["n_stable_N"] += 1
        else:
            z = bld.var(0.0, uk)
            a = bld.var(0.0, 1.0, integer=True)
            stats["n_unstable_N"] += 1
            stats["n_binary"] += 1
            uz, ua = bld.unit(z), bld.unit(a)
            bld.row(Z[k] - uz, -np.inf, -zc[k])  # z >= zhat
            bld.row(uz - Z[k] - lk * ua, -np.inf, zc[k] - lk)  # z <= zhat - l (1 - a)
            bld.row(uz - uk * ua, -np.inf, 0.0)  # z <= u a
            newE[k, z] = 1.0
    return newE, newe


def _hyper_relus(bld: _Builder, stats: dict, hyper: HyperNet, i: int, EH: np.ndarray,
                 lb_i: LayerBounds, tau: float) -> np.ndarray:
    """N#'s interval layer ``i`` and its ReLUs (relaxed where the difference interval is
    at most `tau` wide)."""
    LO, loc = hyper.W_lo[i] @ EH, hyper.b_lo[i].copy()
    HI, hic = hyper.W_hi[i] @ EH, hyper.b_hi[i].copy()
    h, nmax = LO.shape
    newEH = np.zeros((h, nmax))
    for k in range(h):
        lk, uk = float(lb_i.h_lo[k]), float(lb_i.h_hi[k])
        if uk <= 0:
            stats["n_stable_H"] += 1
            continue
        if lk >= 0:
            zh = bld.var(lk, uk)
            uz = bld.unit(zh)
            bld.row(LO[k] - uz, -np.inf, -loc[k])  # z# >= lo_expr
            bld.row(uz - HI[k], -np.inf, hic[k])  # z# <= hi_expr
            stats["n_stable_H"] += 1
        else:
            zh = bld.var(0.0, uk)
            uz = bld.unit(zh)
            stats["n_unstable_H"] += 1
            bld.row(LO[k] - uz, -np.inf, -loc[k])  # z# >= lo_expr
            width = float(lb_i.dpost_hi[k] - lb_i.dpost_lo[k])
            if width <= tau:
                s = uk / (uk - lk)
                bld.row(uz - s * HI[k], -np.inf, s * (hic[k] - lk))
                stats["n_relaxed_H"] += 1
            else:
                ah = bld.var(0.0, 1.0, integer=True)
                ua = bld.unit(ah)
                stats["n_binary"] += 1
                bld.row(uz - HI[k] - lk * ua, -np.inf, hic[k] - lk)
                bld.row(uz - uk * ua, -np.inf, 0.0)
        newEH[k, zh] = 1.0
    return newEH


@dataclass
class _Margins:
    """N's logit margins ``z_c - z_c'`` (per other class c': its IBP interval and its row
    over the variables) and the objective beta with ``margin_c' >= beta``."""

    others: list[int]
    lo: list[float]
    hi: list[float]
    rows: list[tuple[np.ndarray, float]]
    beta_col: int
    beta_lo: float
    beta_hi: float


def _output_margins(bld: _Builder, net: Net64, c: int, layer: _Layer) -> _Margins:
    W, b = net.weights[-1], net.biases[-1]
    others = [k for k in range(W.shape[0]) if k != c]
    margin_lo, margin_hi, rows = [], [], []
    for c2 in others:
        Dn = W[c] - W[c2]
        dn = float(b[c] - b[c2])
        Dp, Dm = np.maximum(Dn, 0), np.minimum(Dn, 0)
        mag = float(np.abs(Dn) @ layer.post_hi_n + abs(dn))
        margin_lo.append(_widen_lo(Dp @ layer.post_lo_n + Dm @ layer.post_hi_n + dn, mag))
        margin_hi.append(_widen_hi(Dp @ layer.post_hi_n + Dm @ layer.post_lo_n + dn, mag))
        rows.append((Dn @ layer.E, float(Dn @ layer.e + dn)))
    beta_lo, beta_hi = min(margin_lo), min(margin_hi)
    beta_col = bld.var(beta_lo, beta_hi)
    ub = bld.unit(beta_col)
    for coef, const in rows:
        bld.row(coef - ub, -const, np.inf)  # margin_c2 >= beta
    return _Margins(others, margin_lo, margin_hi, rows, beta_col, beta_lo, beta_hi)


# (c2, hyper row coef, const, big M, output-matching row (coef, const, M) or None)
_Flip = tuple[int, np.ndarray, float, float, tuple[np.ndarray, float, float] | None]


def _flip_candidates(hyper: HyperNet, net: Net64, c: int, layer: _Layer, m: _Margins,
                     dprev: tuple[np.ndarray, np.ndarray], output_matching: bool
                     ) -> tuple[list[_Flip], bool]:
    """The classes c' via which some network of S may flip (and whether one flips via c'
    everywhere, so that no flip constraint is needed)."""
    W, b = net.weights[-1], net.biases[-1]
    dl_prev, du_prev = dprev
    post_lo_h, post_hi_h = layer.post_lo_h, layer.post_hi_h
    flip: list[_Flip] = []
    for j, c2 in enumerate(m.others):
        Dlo, dlo = hyper.D_lo[c, c2], float(hyper.d_lo[c, c2])
        mag = float(np.abs(Dlo) @ post_hi_h + abs(dlo))
        lhs_hi = _widen_hi(np.maximum(Dlo * post_lo_h, Dlo * post_hi_h).sum() + dlo, mag)
        lhs_lo = _widen_lo(np.minimum(Dlo * post_lo_h, Dlo * post_hi_h).sum() + dlo, mag)
        # lower bound of margin_n - margin_N over n in S (output matching)
        Dn = W[c] - W[c2]
        dn = float(b[c] - b[c2])
        A_lo, A_hi = Dlo - Dn, hyper.D_hi[c, c2] - Dn
        t2 = np.minimum.reduce([A_lo * post_lo_h, A_lo * post_hi_h,
                                A_hi * post_lo_h, A_hi * post_hi_h]).sum()
        t1 = (np.maximum(Dn, 0) @ dl_prev + np.minimum(Dn, 0) @ du_prev)
        dm = float(dlo - (b[c] - b[c2]) + t1 + t2)
        dmag = float(np.abs(Dn) @ np.maximum(np.abs(dl_prev), np.abs(du_prev))
                     + np.maximum(np.abs(A_lo), np.abs(A_hi)) @ post_hi_h + abs(dlo) + abs(dn))
        dm = _widen_lo(dm, dmag)
        md_hi = m.hi[j] + dm  # upper bound of margin_N + dm
        md_lo = m.lo[j] + dm
        if lhs_lo > 0 or (output_matching and md_lo > 0):
            continue  # no network of S flips via c2 anywhere
        if lhs_hi <= 0:
            return flip, True  # the relaxed flip via c2 holds everywhere
        md = None
        if output_matching and md_hi > 0:
            coef, const = m.rows[j]
            md = (coef, const + dm, md_hi)
        flip.append((c2, Dlo @ layer.EH, dlo, lhs_hi, md))
    return flip, False


def _flip_rows(bld: _Builder, stats: dict, flip: list[_Flip]) -> None:
    """Some network of S flips: via the one candidate, or via one of several (a binary
    alpha per candidate, ``sum alpha >= 1``)."""
    if len(flip) == 1:
        _c2, coef, const, _M, md = flip[0]
        bld.row(coef, -np.inf, -const)
        if md is not None:
            bld.row(md[0], -np.inf, -md[1])
        return
    alphas = []
    for _c2, coef, const, M, md in flip:
        al = bld.var(0.0, 1.0, integer=True)
        stats["n_binary"] += 1
        alphas.append(al)
        ua = bld.unit(al)
        bld.row(coef + M * ua, -np.inf, M - const)  # row <= M (1 - alpha)
        if md is not None:
            mcoef, mconst, Mm = md
            bld.row(mcoef + Mm * ua, -np.inf, Mm - mconst)
    s = np.zeros(bld.nmax)
    s[alphas] = 1.0
    bld.row(s, 1.0, np.inf)


def tighten_lp(net: Net64, *, time_limit: float = 30.0
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """N's pre-activation bounds over [0, 1]^d, tightened by LP (MIPVerify's "lp").

    Layer by layer: the bounds of layer m are the min / max of each neuron over
    the LP in which the earlier layers' unstable ReLUs are triangle-relaxed
    (with the already tightened bounds); each result is intersected with IBP,
    so it is never looser. Done once per network N and reused by every MILP
    (``n_pre=`` of :func:`encode`), whatever the set S and class c.
    """
    d = net.weights[0].shape[1]
    lo, hi = np.zeros(d), np.ones(d)
    pre = [(a.copy(), b.copy()) for a, b in ibp(net, lo, hi)]
    L = len(net.weights)
    hidden = [W.shape[0] for W in net.weights[:-1]]
    t0 = time.perf_counter()
    for m in range(1, L - 1):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            break
        nmax = d + 2 * sum(hidden) + 1
        bld = _Builder(nmax)
        x_cols = [bld.var(0.0, 1.0) for _ in range(d)]
        E = np.zeros((d, nmax))
        E[np.arange(d), x_cols] = 1.0
        e = np.zeros(d)
        for j in range(m):
            W, b = net.weights[j], net.biases[j]
            Z, zc = W @ E, W @ e + b
            newE, newe = np.zeros((W.shape[0], nmax)), np.zeros(W.shape[0])
            for k in range(W.shape[0]):
                lk, uk = float(pre[j][0][k]), float(pre[j][1][k])
                if lk >= 0:
                    newE[k], newe[k] = Z[k], zc[k]
                elif uk > 0:
                    z = bld.var(0.0, uk)
                    uz = bld.unit(z)
                    bld.row(Z[k] - uz, -np.inf, -zc[k])  # z >= zhat
                    s = uk / (uk - lk)
                    bld.row(uz - s * Z[k], -np.inf, s * (zc[k] - lk))  # triangle
                    newE[k, z] = 1.0
            E, e = newE, newe
        W, b = net.weights[m], net.biases[m]
        Z, zc = W @ E, W @ e + b
        lp = bld.build(0)
        lo_k, hi_k = lp_ranges(lp, Z[:, :lp.n_vars], time_limit=left)
        mag = np.abs(Z).sum(1) + np.abs(zc)
        new_lo = np.maximum(pre[m][0], lo_k + zc - EPS * (1 + mag))
        new_hi = np.minimum(pre[m][1], hi_k + zc + EPS * (1 + mag))
        pre[m] = (new_lo, new_hi)
        if m + 1 < L:
            nl, nh = affine_bounds(net.weights[m + 1], net.biases[m + 1],
                                   np.maximum(new_lo, 0.0), np.maximum(new_hi, 0.0))
            pre[m + 1] = (np.maximum(pre[m + 1][0], nl), np.minimum(pre[m + 1][1], nh))
    return pre


@dataclass
class SetBound:
    """Sound upper bound on beta*_{c,S} for one set S (safety margin included)."""

    bound: float
    dual_bound: float
    result: SolveResult | None
    stats: dict
    x: np.ndarray | None = None  # the solver's incumbent input (diagnostics only)
    margin: float = DEFAULT_SAFETY_MARGIN  # what was (or, for -inf, is owed) on top

    def record(self) -> dict:
        from jobs.guard.lucid.solvers import jsonable_float

        rec = {"bound": jsonable_float(self.bound), "dual_bound": jsonable_float(self.dual_bound),
               "margin": self.margin}
        if self.result is not None:
            rec.update(self.result.record())
        else:
            rec.update({"solver": None, "status": "decided by bounds", "time_s": 0.0})
        rec["stats"] = {k: v for k, v in self.stats.items() if k != "beta_box"}
        return rec


def bound_set(
    net: Net64,
    hyper: HyperNet,
    c: int,
    *,
    solver: str = "highs",
    time_limit: float = 60.0,
    mip_gap: float = 1e-4,
    tau: float = 0.01,
    matching: bool = True,
    output_matching: bool = True,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    threads: int = 1,
    seed: int = 0,
    n_pre: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> SetBound:
    """Solve the MILP for (N, S, c) and return the DUAL bound plus :func:`serving_margin`."""
    enc = encode(net, hyper, c, tau=tau, matching=matching, output_matching=output_matching,
                 n_pre=n_pre)
    if enc.milp is None:
        d = float(enc.decided)
        margin = serving_margin(None, d, safety_margin)
        return SetBound(d + margin if math.isfinite(d) else d, d, None, enc.stats,
                        margin=margin)
    res = solve(enc.milp, solver=solver, time_limit=time_limit, mip_gap=mip_gap,
                threads=threads, seed=seed)
    dual = res.dual_bound
    margin = serving_margin(enc.milp, dual, safety_margin)
    bound = dual + margin if math.isfinite(dual) else dual
    x = res.x[enc.x_cols] if res.x is not None else None
    return SetBound(bound, dual, res, enc.stats, x, margin)


def serving_margin(milp: MILP | None, dual: float, safety_margin: float) -> float:
    """What a dual bound gets on top (see the module doc): ``safety_margin`` plus
    ``RELATIVE_MARGIN`` times the largest finite variable bound of the MILP, or the
    bound itself, and at least 1."""
    scale = abs(dual) if math.isfinite(dual) else 0.0
    if milp is not None:
        lim = np.concatenate([milp.lb, milp.ub])
        lim = lim[np.isfinite(lim)]
        if lim.size:
            scale = max(scale, float(np.abs(lim).max()))
    return safety_margin + RELATIVE_MARGIN * max(scale, 1.0)


__all__ = ["DEFAULT_SAFETY_MARGIN", "RELATIVE_MARGIN", "Encoding", "SetBound", "bound_set",
           "encode", "serving_margin", "tighten_lp"]

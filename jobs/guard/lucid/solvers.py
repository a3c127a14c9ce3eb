"""One small MILP interface, two backends: HiGHS (``highspy``) and Gurobi (``gurobipy``).

:func:`solve` returns the solver's proven upper bound (``dual_bound``), never the
incumbent, and falls back to HiGHS when Gurobi's licence refuses the model. Never import
OR-Tools into the same process: it and highspy crash together.
See docs/guard.md (How the bound is computed)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

GUROBI_SIZE_LIMIT = 2000
_GUROBI_LICENSE_ERRORS = {10009, 10010}  # no licence / size-limited licence refused the model


@dataclass
class MILP:
    """maximise ``obj . x`` s.t. ``row_lo <= A x <= row_hi``, ``lb <= x <= ub``, ints."""

    obj: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: np.ndarray  # bool
    A: sp.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray

    @property
    def n_vars(self) -> int:
        return int(len(self.obj))

    @property
    def n_rows(self) -> int:
        return int(self.A.shape[0])

    @property
    def n_int(self) -> int:
        return int(np.count_nonzero(self.integer))

    def gurobi_rows(self) -> int:
        """Constraint count as Gurobi sees it (ranged rows become two inequalities)."""
        lo_f, hi_f = np.isfinite(self.row_lo), np.isfinite(self.row_hi)
        eq = lo_f & hi_f & (self.row_lo == self.row_hi)
        return int(np.count_nonzero(lo_f) + np.count_nonzero(hi_f) - np.count_nonzero(eq))

    def fits_gurobi_pip(self) -> bool:
        return self.n_vars <= GUROBI_SIZE_LIMIT and self.gurobi_rows() <= GUROBI_SIZE_LIMIT


@dataclass
class SolveResult:
    solver: str
    status: str
    dual_bound: float
    primal: float | None
    gap: float | None
    time_s: float
    n_vars: int
    n_rows: int
    n_int: int
    x: np.ndarray | None = field(default=None, repr=False)
    note: str = ""

    def record(self) -> dict:
        """JSON-able summary (non-finite floats as strings)."""
        d = asdict(self)
        d.pop("x")
        for k in ("dual_bound", "primal", "gap"):
            d[k] = jsonable_float(d[k])
        return d


def jsonable_float(v: float | None) -> float | str | None:
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _highspy() -> Any:
    """The HiGHS module; a clear ModuleNotFoundError where an install left it out."""
    try:
        import highspy
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "LUCID's MILP bounds need the HiGHS solver (highspy, a dependency of obliviate "
            "that this environment lacks): pip install highspy") from None
    return highspy


def gurobi_available() -> bool:
    try:
        import gurobipy  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or broken: not available
        return False
    return True


# --------------------------------------------------------------------------- HiGHS


def _solve_highs(m: MILP, time_limit: float, mip_gap: float, threads: int, seed: int
                 ) -> SolveResult:
    """HiGHS, retried on "Solve error".

    HiGHS reports "Solve error" when its (proven) optimum, mapped back through
    presolve, violates a row by ~1e-6. We do not read a bound from an errored
    run; we retry with another random seed, then without presolve, within the
    time left, and give ``+inf`` (sound) if every attempt errors.
    """
    t0 = time.perf_counter()
    attempts = [{}, {"random_seed": int(seed) + 1}, {"presolve": "off"}]
    notes = []
    res = None
    for extra in attempts:
        left = time_limit - (time.perf_counter() - t0)
        if res is not None and left <= 0:
            break
        res = _solve_highs_once(m, max(left, 1e-3), mip_gap, threads, seed, extra)
        if res.status != "Solve error":
            break
        notes.append(f"HiGHS solve error with {extra or 'defaults'}")
    assert res is not None
    res.time_s = time.perf_counter() - t0
    if notes:
        res.note = "; ".join(notes)
    return res


def _solve_highs_once(m: MILP, time_limit: float, mip_gap: float, threads: int, seed: int,
                      extra: dict) -> SolveResult:
    highspy = _highspy()

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(max(time_limit, 1e-3)))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", int(seed))
    # no "threads": HiGHS has one global scheduler per process and refuses a
    # different count once it exists (another caller may have set it)
    for k, v in extra.items():
        h.setOptionValue(k, v)
    lp = _highs_lp(m, np.asarray(m.obj, dtype=np.float64))
    lp.sense_ = highspy.ObjSense.kMaximize
    is_mip = m.n_int > 0
    if is_mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in m.integer]
    t0 = time.perf_counter()
    h.passModel(lp)
    h.run()
    elapsed = time.perf_counter() - t0
    st = h.getModelStatus()
    status = h.modelStatusToString(st)
    info = h.getInfo()
    S = highspy.HighsModelStatus
    primal: float | None = None
    x = None
    if info.primal_solution_status == 2:  # feasible
        primal = float(info.objective_function_value)
        x = np.asarray(h.getSolution().col_value, dtype=np.float64)
    if st == S.kInfeasible:
        bound = -math.inf
    elif is_mip and st in (S.kOptimal, S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit,
                           S.kInterrupt, S.kObjectiveBound, S.kObjectiveTarget):
        bound = float(info.mip_dual_bound)
        if not math.isfinite(bound) or abs(bound) >= 1e30:  # no proven bound
            bound = math.inf
    elif not is_mip and st == S.kOptimal:
        bound = float(info.objective_function_value)
    else:
        bound = math.inf
    gap = float(info.mip_gap) if is_mip and math.isfinite(float(info.mip_gap)) else None
    return SolveResult("highs", status, bound, primal, gap, elapsed, m.n_vars, m.n_rows,
                       m.n_int, x)


def lp_ranges(m: MILP, objectives: np.ndarray, *, time_limit: float = 10.0,
              rel_pad: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of each row of ``objectives`` (k, n_vars) over the LP ``m`` (HiGHS).

    Used for bound tightening: integrality is ignored (an LP relaxation), each
    optimum is widened by ``rel_pad * (1 + |value|)`` against solver
    tolerances, and an LP that does not finish optimally gives -inf / +inf.
    """
    highspy = _highspy()

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(_highs_lp(m, np.zeros(m.n_vars)))
    k = objectives.shape[0]
    lo = np.full(k, -np.inf)
    hi = np.full(k, np.inf)
    cols = np.arange(m.n_vars, dtype=np.int32)
    t0 = time.perf_counter()
    for i in range(k):
        h.changeColsCost(m.n_vars, cols, np.asarray(objectives[i], dtype=np.float64))
        for sense, out in ((highspy.ObjSense.kMinimize, lo), (highspy.ObjSense.kMaximize, hi)):
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0:
                return lo, hi
            h.setOptionValue("time_limit", float(left))
            h.changeObjectiveSense(sense)
            h.run()
            if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                v = float(h.getInfo().objective_function_value)
                pad = rel_pad * (1.0 + abs(v))
                out[i] = v - pad if sense == highspy.ObjSense.kMinimize else v + pad
    return lo, hi


# --------------------------------------------------------------------------- Gurobi


_GRB_ENV = None


def _gurobi_env():  # noqa: ANN202 - gurobipy types are optional
    global _GRB_ENV
    if _GRB_ENV is None:
        import gurobipy as gp

        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        _GRB_ENV = env
    return _GRB_ENV


class LicenceRefused(RuntimeError):
    """Gurobi's licence does not accept this model."""


def _solve_gurobi(m: MILP, time_limit: float, mip_gap: float, threads: int, seed: int,
                  mip_focus: int = 0) -> SolveResult:
    import gurobipy as gp
    from gurobipy import GRB

    try:
        env = _gurobi_env()
    except gp.GurobiError as exc:
        raise LicenceRefused(f"gurobi environment: {exc}") from exc
    model = gp.Model(env=env)
    try:
        model.Params.TimeLimit = float(max(time_limit, 1e-3))
        model.Params.MIPGap = float(mip_gap)
        model.Params.MIPFocus = int(mip_focus)  # LUCID used 3; 0 was faster on our sizes
        model.Params.Threads = int(threads)
        model.Params.Seed = int(seed)
        model.Params.DualReductions = 0  # a definite INFEASIBLE, never INF_OR_UNBD
        vtype = np.where(m.integer, GRB.INTEGER, GRB.CONTINUOUS)
        lb = np.where(np.isfinite(m.lb), m.lb, -GRB.INFINITY)
        ub = np.where(np.isfinite(m.ub), m.ub, GRB.INFINITY)
        x = model.addMVar(m.n_vars, lb=lb, ub=ub, vtype=vtype)
        A = m.A.tocsr()
        hi_rows = np.flatnonzero(np.isfinite(m.row_hi))
        lo_rows = np.flatnonzero(np.isfinite(m.row_lo))
        eq = np.isfinite(m.row_lo) & np.isfinite(m.row_hi) & (m.row_lo == m.row_hi)
        eq_rows = np.flatnonzero(eq)
        hi_rows = hi_rows[~eq[hi_rows]]
        lo_rows = lo_rows[~eq[lo_rows]]
        if len(hi_rows):
            model.addMConstr(A[hi_rows], x, "<", m.row_hi[hi_rows])
        if len(lo_rows):
            model.addMConstr(A[lo_rows], x, ">", m.row_lo[lo_rows])
        if len(eq_rows):
            model.addMConstr(A[eq_rows], x, "=", m.row_hi[eq_rows])
        model.setObjective(np.asarray(m.obj, dtype=np.float64) @ x, GRB.MAXIMIZE)
        t0 = time.perf_counter()
        try:
            model.optimize()
        except gp.GurobiError as exc:
            if exc.errno in _GUROBI_LICENSE_ERRORS:
                raise LicenceRefused(str(exc)) from exc
            raise
        elapsed = time.perf_counter() - t0
        st = model.Status
        names = {GRB.OPTIMAL: "Optimal", GRB.INFEASIBLE: "Infeasible",
                 GRB.INF_OR_UNBD: "InfeasibleOrUnbounded", GRB.UNBOUNDED: "Unbounded",
                 GRB.TIME_LIMIT: "Time limit reached", GRB.NUMERIC: "Numeric trouble",
                 GRB.INTERRUPTED: "Interrupted", GRB.SUBOPTIMAL: "Suboptimal"}
        status = names.get(st, f"status {st}")
        primal = float(model.ObjVal) if model.SolCount > 0 else None
        xs = np.asarray(x.X, dtype=np.float64) if model.SolCount > 0 else None
        if st == GRB.INFEASIBLE:
            bound = -math.inf
        elif st in (GRB.OPTIMAL, GRB.TIME_LIMIT, GRB.INTERRUPTED, GRB.SOLUTION_LIMIT,
                    GRB.NODE_LIMIT, GRB.ITERATION_LIMIT):
            if model.IsMIP:
                bound = float(model.ObjBound)
            else:
                bound = float(model.ObjVal) if st == GRB.OPTIMAL else math.inf
            if not math.isfinite(bound) or abs(bound) >= 1e30:
                bound = math.inf
        else:
            bound = math.inf
        gap = None
        if model.IsMIP and model.SolCount > 0:
            try:
                gap = float(model.MIPGap)
            except gp.GurobiError:
                gap = None
        return SolveResult("gurobi", status, bound, primal, gap, elapsed, m.n_vars,
                           m.gurobi_rows(), m.n_int, xs)
    finally:
        model.dispose()


# --------------------------------------------------------------------------- dispatch


def solve(m: MILP, *, solver: str = "highs", time_limit: float = 60.0, mip_gap: float = 1e-4,
          threads: int = 1, seed: int = 0, mip_focus: int = 0) -> SolveResult:
    """Solve ``m`` (maximisation); ``solver`` is ``"highs"``, ``"gurobi"`` or ``"auto"``.

    ``threads`` and ``mip_focus`` apply to Gurobi; HiGHS uses its process-wide
    scheduler (it refuses a thread count different from the first one used).
    """
    if solver not in ("highs", "gurobi", "auto"):
        raise ValueError(f"unknown solver {solver!r}; expected 'highs', 'gurobi' or 'auto'")
    note = ""
    if solver in ("gurobi", "auto"):
        if not gurobi_available():
            note = "gurobipy not importable (pip install 'obliviate[gurobi]'); used HiGHS"
        elif not m.fits_gurobi_pip():
            note = (f"model has {m.n_vars} variables / {m.gurobi_rows()} constraints, over "
                    f"Gurobi's size-limited licence ({GUROBI_SIZE_LIMIT}); used HiGHS")
        else:
            try:
                return _solve_gurobi(m, time_limit, mip_gap, threads, seed, mip_focus)
            except LicenceRefused as exc:
                note = f"Gurobi licence refused the model ({exc}); used HiGHS"
    res = _solve_highs(m, time_limit, mip_gap, threads, seed)
    res.note = "; ".join(v for v in (note, res.note) if v)
    return res


__all__ = ["GUROBI_SIZE_LIMIT", "MILP", "SolveResult", "gurobi_available", "jsonable_float",
           "lp_ranges", "solve"]


def _highs_lp(m: MILP, cost: np.ndarray) -> Any:
    """The model's rows, columns and bounds as a HiGHS LP (`highspy.HighsLp`) with `cost`."""
    highspy = _highspy()

    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = m.n_vars
    lp.num_row_ = m.n_rows
    lp.col_cost_ = cost
    lp.col_lower_ = np.where(np.isfinite(m.lb), m.lb, -inf).astype(np.float64)
    lp.col_upper_ = np.where(np.isfinite(m.ub), m.ub, inf).astype(np.float64)
    lp.row_lower_ = np.where(np.isfinite(m.row_lo), m.row_lo, -inf).astype(np.float64)
    lp.row_upper_ = np.where(np.isfinite(m.row_hi), m.row_hi, inf).astype(np.float64)
    A = m.A.tocsr()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data.astype(np.float64)
    return lp

"""Branch and bound over sets of LOO networks (LUCID Sec. 5.3, Alg. 1) and ``compute_bounds``.

Per class, the set with the largest bound is popped and split by k-means; a child's bound is
the minimum of its own MILP and its parent's. Anytime: the answer, the last popped set's
bound, is the maximum over the open sets, which always cover every LOO network.
See docs/guard.md (How the bound is computed)."""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jobs.guard.lucid.interval_bounds import HyperNet, Net64
from jobs.guard.lucid.milp import DEFAULT_SAFETY_MARGIN, SetBound, bound_set, tighten_lp
from jobs.guard.lucid.solvers import jsonable_float
from jobs.learners.networks.loo_training import LOOSet

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict], None]


# --------------------------------------------------------------------------- splitting


def split(params: np.ndarray, *, k_choices: Sequence[int] = (2, 4, 8), random_state: int = 0,
          n_init: int = 3, elbow: float = 0.8) -> list[np.ndarray]:
    """Partition the rows of ``params`` (k-means, L2) into groups of row positions.

    ``k`` is the smallest candidate whose k-means removes at least ``elbow`` of
    the within-cluster sum of squares that the largest candidate removes
    (relative to k = 1): a simple elbow. Candidates larger than the number of
    distinct rows are dropped. Deterministic (fixed ``random_state``).
    """
    from sklearn.cluster import KMeans

    n = params.shape[0]
    if n <= 1:
        return [np.arange(n)]
    X = params - params.mean(0, keepdims=True)
    n_distinct = len(np.unique(X, axis=0))
    if n_distinct <= 1:
        return [np.arange(n)]
    ks = sorted({k for k in k_choices if 2 <= k <= n_distinct}) or [min(2, n_distinct)]
    total = float((X ** 2).sum())
    fits = {}
    for k in ks:
        km = KMeans(n_clusters=k, n_init=n_init, random_state=random_state).fit(X)
        fits[k] = (float(km.inertia_), km.labels_)
    best_drop = total - fits[ks[-1]][0]
    chosen = ks[-1]
    for k in ks:
        if total - fits[k][0] >= elbow * best_drop:
            chosen = k
            break
    labels = fits[chosen][1]
    groups = [np.flatnonzero(labels == g) for g in range(chosen)]
    groups = [g for g in groups if len(g)]
    if len(groups) < 2:  # k-means put everything together: fall back to halves
        order = np.lexsort(X.T[::-1])
        groups = [np.sort(order[: n // 2]), np.sort(order[n // 2:])]
    return groups


# --------------------------------------------------------------------------- BaB per class


@dataclass
class ClassBound:
    """The anytime bound of one class and how it was reached."""

    c: int
    beta: float
    exact: bool  # final singleton solved to optimality without relaxation (gap final_gap)
    stop_reason: str
    root_bound: float
    n_milps: int
    sets_explored: int
    open_sets: int
    elapsed_s: float
    last_set: list = field(default_factory=list)
    milps: list[dict] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    witness: dict | None = None

    def record(self) -> dict:
        return {
            "class": self.c,
            "beta": jsonable_float(self.beta),
            "exact": self.exact,
            "stop_reason": self.stop_reason,
            "root_bound": jsonable_float(self.root_bound),
            "n_milps": self.n_milps,
            "sets_explored": self.sets_explored,
            "open_sets": self.open_sets,
            "elapsed_s": self.elapsed_s,
            "last_set": self.last_set,
            "milp_time_s": sum(float(m.get("time_s") or 0.0) for m in self.milps),
            "solvers": sorted({str(m.get("solver")) for m in self.milps if m.get("solver")}),
            "statuses": _count([str(m.get("status")) for m in self.milps]),
            "witness": self.witness,
            "milps": self.milps,
            "history": self.history,
        }


def _count(xs: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def _jsonable_ids(ids: np.ndarray) -> list:
    return [v.item() if isinstance(v, np.generic) else v for v in ids.tolist()]


@dataclass(frozen=True)
class _Settings:
    """How one class's search solves its sets (see :func:`bab_class`)."""

    c: int
    solver: str
    milp_time_limit: float
    mip_gap: float
    tau: float
    safety_margin: float
    random_state: int
    final_gap: float
    final_tau: float
    max_milps: int | None

    @property
    def needs_refine(self) -> bool:
        return self.mip_gap > self.final_gap or self.tau > self.final_tau


class _ClassSearch:
    """The branch-and-bound state of one class: the heap of sets with their bounds, the
    MILPs solved so far and their incumbents. The heap holds (-bound, seq, set, solved,
    point, refined)."""

    def __init__(self, loo: LOOSet, N: Net64, n_pre: list[tuple[np.ndarray, np.ndarray]] | None,
                 settings: _Settings, deadline: float) -> None:
        self.loo, self.N, self.n_pre, self.cfg, self.deadline = loo, N, n_pre, settings, deadline
        self.heap: list[tuple[float, int, np.ndarray, bool, bool, bool]] = []
        self.seq = 0
        self.n_milps = 0
        self.milps: list[dict] = []
        self.root_bound = math.inf
        self.incumbents: dict[int, np.ndarray] = {}
        self.closed: dict[int, bool] = {}  # seq -> solved to optimality, final settings
        self.floor = settings.safety_margin  # the largest margin owed by any set

    def out_of_budget(self) -> bool:
        return time.perf_counter() >= self.deadline or (
            self.cfg.max_milps is not None and self.n_milps >= self.cfg.max_milps)

    def solve(self, S: np.ndarray, final: bool = False) -> tuple[SetBound, bool]:
        """Bound set S (with the final gap and tau when `final`), recording the MILP."""
        cfg = self.cfg
        hyper = HyperNet.from_stack(self.loo.weights, self.loo.biases, S)
        left = max(0.0, self.deadline - time.perf_counter())
        sb = bound_set(self.N, hyper, cfg.c, solver=cfg.solver,
                       time_limit=min(cfg.milp_time_limit, left),
                       mip_gap=cfg.final_gap if final else cfg.mip_gap,
                       tau=cfg.final_tau if final else cfg.tau,
                       safety_margin=cfg.safety_margin, seed=cfg.random_state,
                       n_pre=self.n_pre)
        self.n_milps += 1
        self.floor = max(self.floor, sb.margin)
        rec = sb.record()
        rec["set_size"] = int(len(S))
        rec["final"] = final
        self.milps.append(rec)
        if sb.x is not None:
            self.incumbents[self.seq] = sb.x
        ok = sb.result is None or sb.result.status == "Optimal"
        self.closed[self.seq] = ok and (final or not cfg.needs_refine) and (
            cfg.final_tau if final else cfg.tau) == 0.0
        return sb, hyper.is_point

    def push(self, bound: float, S: np.ndarray, solved: bool, point: bool,
             refined: bool) -> None:
        heapq.heappush(self.heap, (-bound, self.seq, S, solved, point, refined))
        self.seq += 1

    def expand(self, todo: list[tuple[np.ndarray, float]]) -> None:
        """Bound each new set (capped by its parent's bound); once out of budget, push the
        rest with their parent's bound, unsolved."""
        for S, parent in todo:
            if self.out_of_budget():
                self.push(parent, S, False, False, False)
                continue
            sb, point = self.solve(S)
            if self.n_milps == 1:
                self.root_bound = sb.bound
            self.push(min(sb.bound, parent), S, True, point, not self.cfg.needs_refine)


def bab_class(
    loo: LOOSet,
    c: int,
    *,
    time_budget_s: float,
    solver: str = "highs",
    milp_time_limit: float = 60.0,
    mip_gap: float = 1e-2,
    tau: float = 0.01,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    k_choices: Sequence[int] = (2, 4, 8),
    random_state: int = 0,
    max_milps: int | None = None,
    progress: ProgressFn | None = None,
    members: Sequence[int] | None = None,
    tighten: str = "lp",
    n_pre: list[tuple[np.ndarray, np.ndarray]] | None = None,
    final_gap: float = 1e-4,
    final_tau: float = 0.0,
) -> ClassBound:
    """Branch and bound for class ``c`` (network indices ``members``, default all LOO).

    ``tighten="lp"`` tightens N's pre-activation bounds once by LP (or pass
    them as ``n_pre``); ``"none"`` uses IBP alone. A popped singleton whose
    MILP ran with ``mip_gap``/``tau`` looser than ``final_gap``/``final_tau``
    is solved again with the final settings and pushed back (refinement), so
    the last bound is the singleton's exact value up to ``final_gap``.
    """
    t0 = time.perf_counter()
    N = Net64.from_params(loo.full())
    if n_pre is None and tighten == "lp":
        n_pre = tighten_lp(N, time_limit=max(1.0, 0.1 * float(time_budget_s)))
    elif tighten not in ("lp", "none"):
        raise ValueError(f"tighten must be 'lp' or 'none', not {tighten!r}")
    everyone = np.arange(1, loo.n_networks) if members is None else np.asarray(members)
    search = _ClassSearch(loo, N, n_pre, _Settings(
        c, solver, milp_time_limit, mip_gap, tau, safety_margin, random_state, final_gap,
        final_tau, max_milps), t0 + float(time_budget_s))
    history: list[dict] = []
    todo: list[tuple[np.ndarray, float]] = [(everyone, math.inf)]
    explored = 0
    while True:
        search.expand(todo)
        todo = []
        negb, popped_seq, S, solved, point, refined = heapq.heappop(search.heap)
        beta = -negb
        explored += 1
        _report(history, progress, {
            "class": c, "bound": beta, "popped_size": int(len(S)),
            "open_sets": len(search.heap), "n_milps": search.n_milps,
            "elapsed_s": time.perf_counter() - t0})
        stop_reason, exact = _stop(search, beta, solved, point, refined, len(S), popped_seq)
        if stop_reason is not None:
            break
        if solved and (len(S) == 1 or point):  # refine: tight gap, no relaxation
            sb, _ = search.solve(S, final=True)
            search.push(min(sb.bound, beta), S, True, True, True)
        elif len(S) == 1 or point:  # not solved yet (budget ran out earlier): solve it now
            todo = [(S, beta)]
        else:
            groups = split(loo.flat_params(S), k_choices=k_choices, random_state=random_state)
            todo = [(S[g], beta) for g in groups]
    witness = None
    if stop_reason == "singleton" and popped_seq in search.incumbents:
        witness = _witness(loo, c, search.incumbents[popped_seq], S)
    # a bound below the margins (-inf: infeasible everywhere; or negative) is raised to
    # them: raising a bound is sound, and the tolerances they cover act there too
    return ClassBound(
        c=c, beta=max(beta, search.floor), exact=exact, stop_reason=stop_reason,
        root_bound=search.root_bound,
        n_milps=search.n_milps, sets_explored=explored, open_sets=len(search.heap),
        elapsed_s=time.perf_counter() - t0,
        last_set=_jsonable_ids(loo.record_ids[np.asarray(S) - 1]) if len(S) <= 16 else [],
        milps=search.milps, history=history, witness=witness,
    )


def _report(history: list[dict], progress: ProgressFn | None, event: dict) -> None:
    history.append({k: jsonable_float(v) if isinstance(v, float) else v
                    for k, v in event.items()})
    log.info("class %s: bound %.6g, popped |S|=%d, %d open, %d MILPs, %.1fs",
             event["class"], event["bound"], event["popped_size"], event["open_sets"],
             event["n_milps"], event["elapsed_s"])
    if progress is not None:
        progress(event)


def _stop(search: _ClassSearch, beta: float, solved: bool, point: bool, refined: bool,
          size: int, popped_seq: int) -> tuple[str | None, bool]:
    """Why the search stops after popping a set (None: it goes on), and whether the bound
    is then exact."""
    if beta == -math.inf:
        return "no leaking input", True
    if solved and (size == 1 or point) and refined:
        return "singleton", search.closed.get(popped_seq, False)
    if time.perf_counter() >= search.deadline:
        return "time", False
    if search.cfg.max_milps is not None and search.n_milps >= search.cfg.max_milps:
        return "max_milps", False
    return None, False


def _witness(loo: LOOSet, c: int, x: np.ndarray, S: np.ndarray) -> dict:
    """The final MILP's incumbent input, re-evaluated exactly (float64) on the real networks.

    An incumbent sits on the decision boundary of the LOO network up to solver
    tolerance; it is nudged across it (:func:`jobs.guard.lucid.falsifier.polish`). When
    ``leaking`` is true, ``x`` is a concrete leaking input, so ``n_margin`` is a
    LOWER bound on beta*_c (the incumbent is never used as the bound).
    """
    from jobs.guard.lucid.falsifier import polish

    x = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    members = np.asarray(S).tolist()
    z = loo.logits(x[None, :], [0, *members])[:, 0, :]
    m = z[:, c] - np.delete(z, c, axis=1).max(1)
    if m[1:].min() > 0.0:
        moved = polish(loo, c, x, members[int(np.argmin(m[1:]))])
        if moved is not None:
            x = moved[0]
            z = loo.logits(x[None, :], [0, *members])[:, 0, :]
            m = z[:, c] - np.delete(z, c, axis=1).max(1)
    return {"x": [float(v) for v in x], "n_margin": float(m[0]),
            "loo_margin": float(m[1:].min()), "leaking": bool(m[1:].min() <= 0.0)}


# --------------------------------------------------------------------------- all classes


@dataclass
class BoundReport:
    """Per-class sound bounds beta_c and the manifest of how they were computed."""

    beta: dict[int, float]
    per_class: dict[int, ClassBound]
    settings: dict
    loo_hash: str
    elapsed_s: float
    classes: list | None = None

    def serving_beta(self) -> dict[int, float]:
        """``max(beta_c, 0)``: the guard only compares non-negative margins, so a
        negative or ``-inf`` bound is as good as 0 and raising it is sound."""
        return {c: max(b, 0.0) for c, b in self.beta.items()}

    def manifest(self) -> dict:
        """A JSON-able record (non-finite numbers as the strings "inf" / "-inf")."""
        per = {str(c): cb.record() for c, cb in self.per_class.items()}
        n_milps = sum(cb.n_milps for cb in self.per_class.values())
        solvers = sorted({s for cb in per.values() for s in cb["solvers"]})
        return {
            "kind": "lucid-idp-bound",
            "beta": {str(c): jsonable_float(b) for c, b in self.beta.items()},
            "serving_beta": {str(c): jsonable_float(b) for c, b in self.serving_beta().items()},
            "classes": self.classes,
            "exact": {str(c): cb.exact for c, cb in self.per_class.items()},
            "loo_hash": self.loo_hash,
            "settings": self.settings,
            "solvers_used": solvers,
            "n_milps": n_milps,
            "sets_explored": sum(cb.sets_explored for cb in self.per_class.values()),
            "elapsed_s": self.elapsed_s,
            "per_class": per,
        }


def compute_bounds(
    loo_set: LOOSet,
    time_budget_s: float = 600.0,
    solver: str = "highs",
    *,
    classes: Sequence[int] | None = None,
    milp_time_limit: float = 60.0,
    mip_gap: float = 1e-2,
    tau: float = 0.01,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    k_choices: Sequence[int] = (2, 4, 8),
    random_state: int = 0,
    max_milps_per_class: int | None = None,
    tighten: str = "lp",
    progress: ProgressFn | None = None,
) -> BoundReport:
    """Sound per-class bounds beta_c for the guard (LUCID-Compute).

    ``solver``: ``"highs"`` (default), ``"gurobi"`` or ``"auto"`` (Gurobi when
    its licence accepts the model, else HiGHS). Classes run one after the
    other; each gets the budget left divided by the classes left. N's bounds
    are LP-tightened once (``tighten="lp"``) and shared by every MILP.
    """
    t0 = time.perf_counter()
    cs = list(range(loo_set.n_classes)) if classes is None else [int(c) for c in classes]
    per: dict[int, ClassBound] = {}
    n_pre = None
    if tighten == "lp":
        n_pre = tighten_lp(Net64.from_params(loo_set.full()),
                           time_limit=max(1.0, 0.05 * float(time_budget_s)))
    tighten_s = time.perf_counter() - t0
    for i, c in enumerate(cs):
        left = time_budget_s - (time.perf_counter() - t0)
        share = max(0.0, left / (len(cs) - i))
        per[c] = bab_class(loo_set, c, time_budget_s=share, solver=solver,
                           milp_time_limit=milp_time_limit, mip_gap=mip_gap, tau=tau,
                           safety_margin=safety_margin, k_choices=k_choices,
                           random_state=random_state, max_milps=max_milps_per_class,
                           progress=progress, tighten=tighten, n_pre=n_pre)
    settings = {
        "solver": solver, "time_budget_s": time_budget_s, "milp_time_limit_s": milp_time_limit,
        "mip_gap": mip_gap, "tau": tau, "safety_margin": safety_margin,
        "k_choices": list(k_choices), "random_state": random_state,
        "max_milps_per_class": max_milps_per_class, "tighten": tighten,
        "tighten_s": tighten_s,
        "n_networks": loo_set.n_networks, "loo_config": loo_set.config.to_dict(),
    }
    classes_named = None if loo_set.classes is None else [
        v.item() if isinstance(v, np.generic) else v for v in loo_set.classes.tolist()]
    return BoundReport({c: per[c].beta for c in cs}, per, settings, loo_set.content_hash(),
                       time.perf_counter() - t0, classes_named)


__all__ = ["BoundReport", "ClassBound", "bab_class", "compute_bounds", "split"]

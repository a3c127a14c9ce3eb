"""The BentoML service: guarded label-only predictions, intake, audit and model endpoints.

`POST /v1/predict` is the BentoML API; the other endpoints and the audit page are a
Starlette app mounted beside it (:mod:`service.http_api`). BentoML provides `/healthz`,
`/readyz` and `/metrics`; `__metrics__` adds the gauges read from the ledger database.
See docs/sidecar.md (Service)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from http import HTTPStatus
from typing import Any

import bentoml
import numpy as np
from bentoml.exceptions import InvalidArgument
from prometheus_client import CollectorRegistry, generate_latest
from starlette.responses import JSONResponse

from jobs.adaptive.budget import BudgetExhausted, SeedBudgets
from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.registry import Registry
from ledger.config import LedgerSettings
from ledger.raw_rows import RowError, encode_row
from ledger.transform import InputTransform
from service.http_api import AppContext, build_app
from service.middleware import BodyLimit, ErrorShape, JsonBody
from service.model_holder import ModelHolder, NoModelError
from service.route_templates import template_paths
from service.service_metrics import LedgerCollector
from service.service_settings import ServiceSettings, guard_noise_secret
from service.usage import GuardUsage

MAX_BATCH = 10_000
# The body limit of /v1/predict (checked before the body is read; 413 over it): MAX_BATCH
# rows of 30 features (breast_cancer) written at full float precision (json.dumps: at
# most 23 characters a number, ", " between) take 7.5 MB. A wider model gets fewer rows.
PREDICT_MAX_BODY_BYTES = 8 * 1_048_576
CONTEXT = AppContext()
log = logging.getLogger("obliviate.service")
# BentoML's request metrics and access log name the path; ids in paths become route
# templates before they see it (service.route_templates.template_paths)
template_paths()


def parse_instances(instances: Any, n_features: int, transform: InputTransform | None = None,
                    scaled: bool = True) -> np.ndarray:
    """Queries as an (n, d) float array in the model's input space, or InvalidArgument
    saying what is wrong.

    One row (a list of values) or a batch (a list of rows; a row may be an object keyed
    by column name, docs/tables.md). Raw features (`scaled` False, the API's default)
    are in each column's own units (categories as text): they are encoded and scaled
    by `transform`, the one stored at `ledger init`, and clipped to [0, 1]
    (the guard answers in that box; a value beyond the initial table's range counts
    as its edge). Pre-scaled features (`scaled` True) must be finite numbers in
    [0, 1] already: a value outside it means the caller forgot to scale.
    """
    if not isinstance(instances, list) or not instances:
        raise InvalidArgument("'instances' must be a non-empty list: one row of "
                              f"{n_features} numbers, or a list of such rows")
    rows = [instances] if not isinstance(instances[0], list | dict) else instances
    if len(rows) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} rows per call, got {len(rows)}")
    if not scaled and transform is not None and (
            transform.columns or any(isinstance(r, dict) for r in rows)):
        return _encoded_rows(rows, transform)
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise InvalidArgument(f"row {i} is not a list of numbers")
        if len(row) != n_features:
            raise InvalidArgument(f"row {i} has {len(row)} features; the model takes "
                                  f"{n_features} (GET /v1/schema lists them)")
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise InvalidArgument(f"row {i}, feature {j}: {_short(v)} is not a number")
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidArgument(f"row {i}, feature {j}: {v} is not finite")
            if scaled:
                if not 0 <= v <= 1:  # exact for an int of any size (float() would overflow)
                    raise InvalidArgument(
                        f"row {i}, feature {j}: {_short(v)} is outside [0, 1]; with "
                        "\"scaled\": true features must be in the model's input space "
                        "(send raw values without it)")
            elif isinstance(v, int) and v.bit_length() > 1000:  # float() would overflow
                raise InvalidArgument(f"row {i}, feature {j}: {_short(v)} is not finite")
    X = np.asarray(rows, dtype=np.float64)
    if scaled or transform is None:
        return X
    return _into_the_box(transform, X)


def _encoded_rows(rows: list[Any], transform: InputTransform) -> np.ndarray:
    """Raw rows of a table with text columns, or objects keyed by column name, in the
    model's input space (:mod:`ledger.raw_rows` encodes them; then scaled and clipped)."""
    try:
        E = np.asarray([encode_row(transform, r, f"row {i}") for i, r in enumerate(rows)],
                       dtype=np.float64)
    except RowError as exc:
        raise InvalidArgument(str(exc)) from None
    return _into_the_box(transform, E)


def _into_the_box(transform: InputTransform, X: np.ndarray) -> np.ndarray:
    """Raw (encoded) rows scaled by the stored transform and clipped to [0, 1], the
    guard's box (GuardedAnswers.answer clips so too)."""
    with np.errstate(over="ignore", invalid="ignore"):
        Z = transform.scale(X)
    Z[np.isnan(Z)] = 0.0  # unreachable for finite input; never hand NaN to the guard
    return np.clip(Z, 0.0, 1.0)


def _short(v: Any, limit: int = 40) -> str:
    """A value for an error message: never a 1 MB string or a 4,000-digit integer."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of about {int(v.bit_length() * math.log10(2)) + 1} digits"
    text = repr(v) if isinstance(v, str | int | float | bool | type(None)) else \
        type(v).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@bentoml.service(
    name="obliviate",
    workers=int(os.environ.get("OBLIVIATE_SERVICE_WORKERS", "1")),
    traffic={"timeout": 60},
)
@bentoml.asgi_app(build_app(CONTEXT), path="/")
class Obliviate:
    """One serving process: a model holder watching the registry, and the ledger."""

    def __init__(self) -> None:
        ledger_settings = LedgerSettings.from_env()
        job_settings = JobSettings.from_env()
        settings = ServiceSettings.from_env()
        guard = job_settings.choice("guard", ("on", "off"))
        self.ledger = ledger_settings.open_ledger()  # applies the database migrations
        log.info("%s", self.ledger.schema_upgrade.describe())
        self._input_transform: InputTransform | None = None
        self.registry = Registry(self.ledger.engine, job_settings.model_name, self.ledger.keys)
        self.usage = GuardUsage(self.ledger.engine)
        self.budgets = (SeedBudgets(self.ledger.engine, job_settings.model_name)
                        if job_settings.budget_policy() else None)
        self.holder = ModelHolder(self.registry, epsilon=settings.epsilon,
                                  memo_size=settings.memo_size,
                                  epsilon_budget=settings.epsilon_budget,
                                  poll_s=settings.registry_poll_s,
                                  guarded=guard == "on", usage=self.usage,
                                  budgets=self.budgets,
                                  max_unconfirmed_s=job_settings.destroy_grace_s / 2,
                                  noise_secret=guard_noise_secret(
                                      ledger_settings.hmac_key())).start()
        # a quiet ledger still gets its tail signed (TreeHeads.maybe_sign never raises)
        threading.Thread(target=self._sign_heads, name="ledger-heads", daemon=True).start()
        CONTEXT.ledger, CONTEXT.registry, CONTEXT.usage = self.ledger, self.registry, self.usage
        CONTEXT.admin_token = settings.admin_bearer_token()
        CONTEXT.status = self.holder.status
        CONTEXT.private = self.budgets is not None  # no seed-dependent field to the public
        self._ledger_metrics = CollectorRegistry(auto_describe=True)
        self._ledger_metrics.register(LedgerCollector(
            self._pending, self._unverified, self.registry.current_seq,
            self._seed_budget_spent))

    @bentoml.api(route="/v1/predict")
    def predict(self, instances: list[Any], scaled: bool = False) -> dict[str, Any]:
        """Labels only, never scores: certain answers as is, the rest noised (eps-iDP).

        `instances`: rows of raw values, arrays in column order or objects keyed by
        column name (encoded and scaled here with the transform stored at `ledger
        init`, then clipped to [0, 1]); `scaled`: true for encoded features already in
        [0, 1]. A text label's names come in `label_names`. Errors answer {"error":
        "..."} (BentoML would put a 5xx's reason in the log only: 503 and 429 are
        answered here).
        """
        try:
            serving = self.holder.serving
        except NoModelError as exc:
            return JSONResponse({"error": str(exc)}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        X = parse_instances(instances, serving.model.n_features,
                            None if scaled else self._transform(), scaled=scaled)
        try:
            labels, used, promises = self.holder.predict(X, serving)
        except BudgetExhausted as exc:  # a quota on answers, spent until fresh seeds: 429
            return JSONResponse({"error": str(exc)}, status_code=HTTPStatus.TOO_MANY_REQUESTS)
        answer = {"labels": labels.tolist(), "model_version": used.version.version,
                  "guard": used.mode if self.holder.guarded else "off",
                  # per answer: certified / noised (the guard), exact / approximate (the
                  # version's forgetting, where no guard covers it)
                  "promises": promises}
        transform = self._transform()
        if transform is not None and transform.labels:  # a text label: its names too
            answer["label_names"] = [transform.label_name(c) for c in answer["labels"]]
        return answer

    def _transform(self) -> InputTransform | None:
        """The input transform stored at `ledger init` (fixed once set: read once)."""
        if self._input_transform is None:
            self._input_transform = self.ledger.records.input_transform()
        return self._input_transform

    def __is_ready__(self) -> bool:
        return self.holder.status()["version"] is not None

    async def __metrics__(self, content: str) -> str:
        return content + generate_latest(self._ledger_metrics).decode()

    def _sign_heads(self) -> None:
        while True:
            time.sleep(1.0)
            self.ledger.heads.maybe_sign()

    def _seed_budget_spent(self) -> float:
        """Share of the current seed lineage's budget spent (0 outside private mode)."""
        cur = self.registry.current() if self.budgets is not None else None
        lineage = cur.manifest.get("seed_lineage") if cur is not None else None
        budget = self.budgets.get(lineage) if lineage else None
        return budget.spent_ratio if budget is not None else 0.0

    def _pending(self) -> int:
        counts = self.ledger.lifecycle.status_counts()
        return counts.get("received", 0) + counts.get("claimed", 0)

    def _unverified(self) -> int:
        return self.ledger.lifecycle.status_counts().get("applied", 0)


# Outermost first: the body limit before anything reads the body (every path; the mounted
# app's own are 1 MiB), a JSON body declared as JSON, then every error (BentoML's and
# Starlette's included) in the one shape.
Obliviate.add_asgi_middleware(BodyLimit, limits={"/v1/predict": PREDICT_MAX_BODY_BYTES})
Obliviate.add_asgi_middleware(JsonBody, paths=("/v1/predict",))
Obliviate.add_asgi_middleware(ErrorShape)

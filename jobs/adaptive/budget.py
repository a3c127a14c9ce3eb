"""The privacy budget of one seed lineage, kept in the ledger database.

A lineage is the run of versions sharing the seeds of one full training. Serving processes
reserve answers in blocks before publishing them, so a lineage's answers never exceed its
budget whatever the number of processes (unused reservations count as spent); exhaustion
is a row here, so a worker that crashes before the retrain with fresh seeds finds it again.
See docs/guard.md (Private prediction mode)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import BigInteger, Connection, DateTime, Engine, insert, select, update
from sqlmodel import Field, SQLModel

from jobs.adaptive.composition import answers_allowed, epsilon_spent
from ledger import migrations
from ledger.chain import utc_now


class SeedLineageRow(SQLModel, table=True):
    __tablename__ = "seed_lineages"

    name: str = Field(max_length=64, primary_key=True)  # the registry's model name
    lineage: str = Field(max_length=64, primary_key=True)  # the version that drew the seeds
    epsilon_per_answer: float
    delta: float
    epsilon_budget: float
    answers_allowed: int = Field(sa_type=BigInteger)
    answers_reserved: int = Field(sa_type=BigInteger, default=0)
    created_at: datetime = Field(sa_type=DateTime(timezone=True))
    exhausted_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


LINEAGES = SeedLineageRow.__table__


@dataclass(frozen=True)
class BudgetPolicy:
    """What every new lineage gets: eps0 per answer, and the (eps, delta) budget."""

    epsilon_per_answer: float = 0.5
    epsilon_budget: float = 10.0
    delta: float = 1e-5

    @property
    def answers_allowed(self) -> int:
        return answers_allowed(self.epsilon_budget, self.epsilon_per_answer, self.delta)


@dataclass(frozen=True)
class LineageBudget:
    lineage: str
    epsilon_per_answer: float
    delta: float
    epsilon_budget: float
    answers_allowed: int
    answers_reserved: int

    @property
    def exhausted(self) -> bool:
        return self.answers_reserved >= self.answers_allowed

    @property
    def epsilon_spent(self) -> float:
        return epsilon_spent(self.answers_reserved, self.epsilon_per_answer, self.delta)

    @property
    def spent_ratio(self) -> float:
        if self.epsilon_budget <= 0:
            return 1.0
        return min(1.0, self.epsilon_spent / self.epsilon_budget)


class BudgetExhausted(RuntimeError):
    """The seed lineage's budget allows no more answers until a retrain with fresh seeds."""


class SeedBudgets:
    """The lineages of one model name."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        migrations.ensure(engine)  # its table is in the ledger's migrations

    def open(self, conn: Connection, lineage: str, policy: BudgetPolicy) -> None:
        """Start a lineage, inside the transaction that publishes its first version."""
        conn.execute(insert(LINEAGES), {
            "name": self.name, "lineage": lineage,
            "epsilon_per_answer": policy.epsilon_per_answer, "delta": policy.delta,
            "epsilon_budget": policy.epsilon_budget,
            "answers_allowed": policy.answers_allowed, "answers_reserved": 0,
            "created_at": utc_now()})

    def get(self, lineage: str) -> LineageBudget | None:
        with self.engine.connect() as conn:
            row = conn.execute(self._select(lineage)).first()
        return None if row is None else _budget(row)

    def reserve(self, lineage: str, n: int) -> int:
        """Reserve up to `n` answers; returns how many were granted (0 when exhausted)."""
        if n <= 0:
            return 0
        with self.engine.begin() as conn:
            # PostgreSQL: lock the row; SQLite: the ledger's engines BEGIN IMMEDIATE
            query = self._select(lineage)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            if row is None:
                raise KeyError(f"{self.name}: no seed lineage {lineage!r}")
            grant = max(0, min(n, row.answers_allowed - row.answers_reserved))
            if grant:
                reserved = row.answers_reserved + grant
                values = {"answers_reserved": reserved}
                if reserved >= row.answers_allowed:
                    values["exhausted_at"] = utc_now()
                conn.execute(update(LINEAGES).where(LINEAGES.c.name == self.name,
                                                    LINEAGES.c.lineage == lineage)
                             .values(**values))
        return grant

    def _select(self, lineage: str):  # noqa: ANN202 - a SQLAlchemy Select
        return select(LINEAGES).where(LINEAGES.c.name == self.name,
                                      LINEAGES.c.lineage == lineage)


def _budget(row) -> LineageBudget:  # noqa: ANN001 - a SQLAlchemy Row
    return LineageBudget(row.lineage, row.epsilon_per_answer, row.delta, row.epsilon_budget,
                         row.answers_allowed, row.answers_reserved)

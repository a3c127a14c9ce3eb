"""Deployment settings, read from the environment with embedded defaults.

The defaults run everything on one machine: a SQLite ledger and a key file
under `.obliviate/`, a broker on localhost. Production sets
OBLIVIATE_DATABASE_URL to PostgreSQL and supplies the HMAC key as a secret.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ledger.store import Ledger

STATE_DIR = Path(".obliviate")


@dataclass(frozen=True)
class Settings:
    database_url: str = f"sqlite:///{STATE_DIR / 'ledger.db'}"
    hmac_key_hex: str | None = None
    hmac_key_file: str = str(STATE_DIR / "hmac.key")
    kafka_bootstrap: str = "127.0.0.1:9092"
    requests_topic: str = "obliviate.requests"
    dead_letter_topic: str = "obliviate.requests.dead"
    consumer_group: str = "obliviate-ledger"
    checkpoint_every: int = 1000
    # the sidecar (jobs and service read these; the ledger only stores them)
    model_name: str = "obliviate"
    learner: str = "dare"
    guard: str = "on"  # "off" serves raw labels: a benchmark baseline, not private
    evaluate: str = "off"  # "on": the worker measures each deletion's privacy (jobs.eval)
    # "private": SISA answers by noisy vote, private in the shard seeds (jobs.adaptive)
    answers: str = "guard"
    private_epsilon: float = 0.5  # eps0 of one private answer
    seed_epsilon_budget: float = 10.0  # (eps, delta) of a seed lineage's answers
    seed_delta: float = 1e-5
    admin_token: str | None = None
    admin_token_file: str = str(STATE_DIR / "admin.token")
    epsilon: float = 1.0
    epsilon_budget: float = 1000.0
    memo_size: int = 100_000
    registry_poll_s: float = 0.1
    worker_metrics_port: int = 9101
    consumer_metrics_port: int = 9102

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """OBLIVIATE_<FIELD> variables override the defaults; keyword overrides win."""
        values: dict[str, object] = {}
        for f in fields(cls):
            env = os.environ.get(f"OBLIVIATE_{f.name.upper()}")
            if env is not None:
                try:
                    values[f.name] = {"int": int, "float": float}.get(str(f.type), str)(env)
                except ValueError:
                    raise ValueError(f"OBLIVIATE_{f.name.upper()}={env!r} is not "
                                     f"a valid {f.type}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        """The setting `name`, which must be one of `options` (ValueError naming its variable)."""
        value = getattr(self, name)
        if value not in options:
            raise ValueError(f"OBLIVIATE_{name.upper()} must be one of {', '.join(options)}; "
                             f"got {value!r}")
        return value

    def hmac_key(self) -> bytes:
        """The deployment secret for record fingerprints; created on first use if embedded."""
        if self.hmac_key_hex:
            return bytes.fromhex(self.hmac_key_hex)
        return bytes.fromhex(_secret_file(self.hmac_key_file))

    def admin_bearer_token(self) -> str:
        """The token admin endpoints require; created on first use if embedded."""
        return self.admin_token or _secret_file(self.admin_token_file)

    def open_ledger(self) -> Ledger:
        if self.database_url.startswith("sqlite:///"):
            Path(self.database_url.removeprefix("sqlite:///")).parent.mkdir(
                parents=True, exist_ok=True)
        return Ledger(self.database_url, self.hmac_key(), self.checkpoint_every)


def _secret_file(path_str: str) -> str:
    """A 256-bit hex secret kept in a 0600 file, created once (racing creators agree)."""
    path = Path(path_str)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
    return path.read_text().strip()

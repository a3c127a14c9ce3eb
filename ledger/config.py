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

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """OBLIVIATE_<FIELD> variables override the defaults; keyword overrides win."""
        values: dict[str, object] = {}
        for f in fields(cls):
            env = os.environ.get(f"OBLIVIATE_{f.name.upper()}")
            if env is not None:
                values[f.name] = int(env) if f.type == "int" else env
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def hmac_key(self) -> bytes:
        """The deployment secret for record fingerprints; created on first use if embedded."""
        if self.hmac_key_hex:
            return bytes.fromhex(self.hmac_key_hex)
        path = Path(self.hmac_key_file)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
        return bytes.fromhex(path.read_text().strip())

    def open_ledger(self) -> Ledger:
        if self.database_url.startswith("sqlite:///"):
            Path(self.database_url.removeprefix("sqlite:///")).parent.mkdir(
                parents=True, exist_ok=True)
        return Ledger(self.database_url, self.hmac_key(), self.checkpoint_every)

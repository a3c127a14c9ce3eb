"""The service's deployment settings: the admin token, the guard's noise, the registry poll.

Read like every layer's (OBLIVIATE_<FIELD>, :class:`ledger.env_settings.EnvSettings`);
the model served and its guard mode are the jobs' (:mod:`jobs.orchestration.job_settings`).
See docs/operations.md (Deploying)."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ledger.config import STATE_DIR, secret_file
from ledger.env_settings import EnvSettings


@dataclass(frozen=True)
class ServiceSettings(EnvSettings):
    """How a serving process answers, and who may use its admin endpoints."""

    admin_token: str | None = None
    admin_token_file: str = str(STATE_DIR / "admin.token")
    epsilon: float = 1.0
    epsilon_budget: float = 1000.0
    memo_size: int = 100_000
    registry_poll_s: float = 0.1

    def admin_bearer_token(self) -> str:
        """The token admin endpoints require; created on first use if embedded."""
        return self.admin_token or secret_file(self.admin_token_file)


def guard_noise_secret(hmac_key: bytes) -> bytes:
    """The key of the guard's noise draws, the same in every serving process (derived
    from the deployment secret, so nothing more to distribute)."""
    return hmac.new(hmac_key, b"obliviate guard noise", hashlib.sha256).digest()

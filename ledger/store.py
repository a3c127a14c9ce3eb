"""The ledger: the source of truth for every deletion and addition request.

Every state change is an event appended to the hash chain in the transaction of the change
itself. :class:`Ledger` opens the database (migrating it) and holds one component per job
(records, intake, lifecycle, maintenance, heads, events, verifier); four verbs stay on it:
`receive`, `history`, `verify`, `close`.
See docs/ledger.md (The ledger)."""

from __future__ import annotations

from typing import Any, Literal

from ledger import migrations
from ledger.db import make_engine
from ledger.event_log import EventLog
from ledger.heads import HeadSigner
from ledger.intake import IncomingMessage, IntakeResult
from ledger.keystore import KeyStore, LedgerKeys
from ledger.ledger_verifier import LedgerVerifier
from ledger.log_check import VerifyResult
from ledger.purge_maintenance import PurgeMaintenance
from ledger.record_store import RecordStore
from ledger.request_intake import RequestIntake
from ledger.request_lifecycle import RequestLifecycle
from ledger.sealed_payloads import PayloadSealer
from ledger.signing import SigningKeys
from ledger.tree_heads import TreeHeads


class Ledger:
    """Append-only, hash-chained request ledger over SQLite or PostgreSQL."""

    def __init__(self, url: str, hmac_key: bytes, checkpoint_every: int = 1000,
                 purge_maintenance_s: float | None = None, signing_key: bytes | None = None,
                 head_interval_s: float = 60.0, public_key: bytes | None = None,
                 key_store: KeyStore | None = None) -> None:
        """`signing_key` (the Ed25519 seed, kept outside the database) signs the tree heads
        taken every `checkpoint_every` events and once events are `head_interval_s` old;
        without it the heads are plain checkpoints. `public_key` lets a ledger without
        the signing key check the heads' signatures. `key_store` keeps the keys of added
        records' payloads and of model versions (default: OBLIVIATE_KEY_STORE_DIR's).
        `purge_maintenance_s`: minimum seconds between two purge maintenance runs (None:
        the backend's default)."""
        if len(hmac_key) < 16:
            raise ValueError("the HMAC key must be at least 16 bytes")
        self.url = url
        self.engine = make_engine(url)
        self.keys = LedgerKeys(self.engine, key_store)
        # the schema is Alembic's (ledger.migrations): to head, or one SELECT once there
        self.schema_upgrade = migrations.upgrade(self.engine, self.keys.store)
        self.sealer = PayloadSealer(self.keys, hmac_key)
        self.heads = TreeHeads(self.engine, SigningKeys(
            HeadSigner(signing_key) if signing_key is not None else None, public_key),
            checkpoint_every=checkpoint_every, head_interval_s=head_interval_s)
        self.maintenance = PurgeMaintenance(self.engine, self.sealer, purge_maintenance_s)
        self.records = RecordStore(self.engine, hmac_key, self.sealer, self.heads)
        self.intake = RequestIntake(self.engine, hmac_key, self.sealer, self.records,
                                    self.heads)
        self.lifecycle = RequestLifecycle(self.engine, self.sealer, self.heads,
                                          self.maintenance)
        self.events = EventLog(self.engine, hmac_key, self.heads)
        self.verifier = LedgerVerifier(self.engine, hmac_key, self.sealer, self.keys,
                                       self.heads)

    def receive(self, value: bytes | str | dict[str, Any],
                source: Literal["kafka", "http", "cli"] = "http") -> IntakeResult:
        """Validate and record one request (the HTTP and CLI path)."""
        return self.intake.receive_batch([IncomingMessage(value, source)])[0]

    def history(self, request_id: str) -> dict[str, Any]:
        """A request, its events, and each event's inclusion proof to a published root."""
        return self.events.history(request_id)

    def verify(self) -> VerifyResult:
        """Recompute the chain, every checkpoint and signed head, every record fingerprint,
        and hold the requests and records to what the events say happened to them."""
        return self.verifier.verify()

    def close(self) -> None:
        self.engine.dispose()

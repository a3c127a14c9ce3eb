"""An added record's data, kept in the database only as ciphertext under its own key.

Database copies (WAL, archives, backups) outlive the ledger's deletion, so an addition's
features and label are sealed (AES-256-GCM, the record id as associated data) under a key
of that record alone, in the key store; purging deletes the row and destroys the key. The
key is synced before the row commits; :meth:`PayloadSealer.sweep` clears what a crash left.
See docs/security.md (Crypto-shredding)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import Connection, Engine, select

from ledger.keystore import KEY_BYTES, LedgerKeys
from ledger.tables import LOOKUP_CHUNK, RECORDS, SEALED

_NONCE_BYTES = 12
_KIND = "records"


class PayloadKeyMissing(LookupError):
    """A sealed record's key is not in the key store (destroyed, or the store is not the
    ledger's)."""


class PayloadSealer:
    """Seals and opens added records' payloads; destroys their keys on purge."""

    def __init__(self, keys: LedgerKeys, hmac_key: bytes) -> None:
        self.keys = keys
        self._hmac_key = hmac_key

    def key_name(self, record_id: str, conn: Connection | None = None) -> str:
        """The key's name: a keyed digest of the record id (no id in the key store)."""
        digest = hmac.new(self._hmac_key, b"payload-key\0" + record_id.encode(),
                          hashlib.sha256).hexdigest()[:32]
        return self.keys.name(_KIND, digest, conn=conn)

    def seal(self, conn: Connection, record_id: str, features: Sequence[float],
             label: int) -> dict[str, Any]:
        """A `sealed_payloads` row for the record; its new key is in the store already."""
        name = self.key_name(record_id, conn)
        key = self.keys.get(name)
        if key is None:
            try:
                self.keys.put(name, key := secrets.token_bytes(KEY_BYTES))
            except FileExistsError:  # a concurrent intake of the same id was first
                key = self.keys.get(name)
        nonce = os.urandom(_NONCE_BYTES)
        plain = json.dumps([list(features), int(label)]).encode()
        return {"record_id": record_id,
                "sealed": nonce + AESGCM(key).encrypt(nonce, plain, _aad(record_id))}

    def open(self, record_id: str, sealed: bytes) -> tuple[list[float], int]:
        """The record's features and label; PayloadKeyMissing once its key is destroyed."""
        key = self.keys.get(self.key_name(record_id))
        if key is None:
            raise PayloadKeyMissing(f"record {record_id!r}: its payload key is not in the key "
                                    f"store {self.keys.store!r}")
        try:
            plain = AESGCM(key).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:],
                                        _aad(record_id))
        except InvalidTag:
            raise ValueError(f"record {record_id!r}: its sealed payload does not open with "
                             "its key (altered, or another record's)") from None
        features, label = json.loads(plain)
        return features, int(label)

    def has_key(self, record_id: str) -> bool:
        return self.keys.get(self.key_name(record_id)) is not None

    def destroy(self, record_ids: Iterable[str]) -> int:
        """Destroy the keys of these records (those that have one); how many went."""
        return sum(self.keys.delete(self.key_name(r)) for r in record_ids)

    def sweep(self, engine: Engine) -> int:
        """Destroy the keys of purged added records that a crash between the purge and
        the key's destruction kept; how many there were."""
        if not self.keys.names(_KIND):
            return 0
        with engine.connect() as conn:
            purged = conn.execute(select(RECORDS.c.record_id).where(
                RECORDS.c.state == "purged", RECORDS.c.added_by.is_not(None))).scalars().all()
        return self.destroy(purged)


def sealed_rows(conn: Connection, record_ids: Sequence[str]) -> dict[str, bytes]:
    """The sealed payloads of those of `record_ids` that have one."""
    out: dict[str, bytes] = {}
    for i in range(0, len(record_ids), LOOKUP_CHUNK):
        for r in conn.execute(select(SEALED).where(
                SEALED.c.record_id.in_(record_ids[i:i + LOOKUP_CHUNK]))):
            out[r.record_id] = bytes(r.sealed)
    return out


def live_sealed(conn: Connection) -> dict[str, bytes]:
    """Sealed payloads of live records."""
    return {r.record_id: bytes(r.sealed) for r in conn.execute(
        select(SEALED).join(RECORDS, RECORDS.c.record_id == SEALED.c.record_id)
        .where(RECORDS.c.state == "live"))}


def _aad(record_id: str) -> bytes:
    return b"obliviate-record:" + record_id.encode()

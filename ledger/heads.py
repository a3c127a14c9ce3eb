"""Signed tree heads: what the ledger publishes so that a rewrite of its past shows.

A head (tree size, root, time) is signed with an Ed25519 key kept outside the database,
so whoever can edit the database can neither sign a head nor re-sign a rewritten log;
a new key comes in by a rotation, itself an event. The checking half lives in
:mod:`ledger.receipt` (it runs alone); this file adds the signer.
See docs/ledger.md (Signed tree heads)."""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.receipt import (
    HEAD_FIELDS,
    ROTATION_KIND,
    KeyChain,
    head_message,
    log_id,
    parse_public_key,
    rotation_message,
    verify_head,
)

__all__ = ["HEAD_FIELDS", "ROTATION_KIND", "HeadSigner", "KeyChain", "head_message", "log_id",
           "parse_public_key", "public_key_pem", "rotation_message", "verify_head"]


class HeadSigner:
    """Signs tree heads with the ledger's Ed25519 key (a 32-byte seed)."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("the ledger signing key must be 32 bytes (64 hex digits)")
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key: bytes = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.log_id = log_id(self.public_key)

    def sign(self, tree_size: int, root_hash: str, timestamp: str) -> dict[str, Any]:
        sig = self._key.sign(head_message(self.log_id, tree_size, root_hash, timestamp))
        return {"log_id": self.log_id, "tree_size": tree_size, "root_hash": root_hash,
                "timestamp": timestamp, "signature": sig.hex()}

    def rotation(self, new_public_key: bytes, seq: int, prev_hash: str) -> dict[str, Any]:
        """The payload of the `key_rotated` event at `seq` (after `prev_hash`) that hands
        this log over to `new_public_key`, signed with this (the retiring) key."""
        new = new_public_key.hex()
        sig = self._key.sign(rotation_message(self.log_id, new, seq, prev_hash))
        return {"from_public_key": self.public_key.hex(), "to_public_key": new,
                "to_log_id": log_id(new_public_key), "signature": sig.hex()}


def public_key_pem(public_key: bytes) -> str:
    return Ed25519PublicKey.from_public_bytes(public_key).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

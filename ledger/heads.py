"""Signed tree heads: what the ledger publishes so that a rewrite of its past shows.

A head is (tree_size, root_hash, timestamp) signed with the ledger's Ed25519 key
over a canonical encoding that also names the log: its log id, the SHA-256 of
the raw public key. The key is kept OUTSIDE the database (a key file, or
OBLIVIATE_LEDGER_SIGNING_KEY_HEX), so whoever can edit the database can neither
sign a head of their own nor re-sign the heads of a rewritten log; an auditor
who saved heads earlier checks the log against them (:mod:`ledger.audit`).

Standard library, `cryptography` and :mod:`ledger.chain` only: an auditor needs
this file, `chain.py`, `merkle.py` and `audit.py`, and no database.
"""

from __future__ import annotations

import hashlib
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.chain import canonical_json

HEAD_FORMAT = "obliviate-tree-head/v1"
HEAD_FIELDS = ("log_id", "tree_size", "root_hash", "timestamp", "signature")


def log_id(public_key: bytes) -> str:
    """The name of a log: SHA-256 of its raw 32-byte Ed25519 public key, hex."""
    return hashlib.sha256(public_key).hexdigest()


def head_message(log: str, tree_size: int, root_hash: str, timestamp: str) -> bytes:
    """The exact bytes a head's signature is over (canonical JSON, format tag first)."""
    return canonical_json({"format": HEAD_FORMAT, "log_id": log, "tree_size": tree_size,
                           "root_hash": root_hash, "timestamp": timestamp}).encode()


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


def verify_head(head: Any, public_key: bytes) -> str | None:
    """None when `head` is a well-formed head of the log of `public_key` with a valid
    signature, else why not. Never raises: heads come from untrusted parties."""
    if not isinstance(head, dict):
        return "is not a JSON object"
    missing = [f for f in HEAD_FIELDS if f not in head]
    if missing:
        return f"lacks {', '.join(missing)}"
    size, root, ts, sig = (head["tree_size"], head["root_hash"], head["timestamp"],
                           head["signature"])
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"tree_size {size!r} is not a size"
    if not (isinstance(root, str) and len(root) == 64 and _is_hex(root)):
        return "root_hash is not 32 bytes of hex"
    if not isinstance(ts, str) or not isinstance(sig, str) or not _is_hex(sig):
        return "timestamp or signature is malformed"
    expected = log_id(public_key)
    if head["log_id"] != expected:
        return (f"names log {str(head['log_id'])[:16]}..., not the log of this public key "
                f"({expected[:16]}...)")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            bytes.fromhex(sig), head_message(expected, size, root, ts))
    except (InvalidSignature, ValueError):
        return "signature does not verify with the log's public key"
    return None


def public_key_pem(public_key: bytes) -> str:
    return Ed25519PublicKey.from_public_bytes(public_key).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def parse_public_key(text: str) -> bytes:
    """A raw Ed25519 public key from 64 hex digits or a PEM block (ValueError otherwise)."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the PEM block is not an Ed25519 public key")
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if len(text) != 64 or not _is_hex(text):
        raise ValueError("a public key is 64 hex digits (or a PEM block)")
    return bytes.fromhex(text)


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True

"""Version files sealed under a per-version key (crypto-shredding).

Every file a learner or guard writes for a version is encrypted (AES-256-GCM, its name
bound in) under a key of that version alone, kept in the key store, never the database:
destroying the version destroys the key, and every copy of its files, wherever it went,
becomes unreadable. The key comes from the context (:func:`sealed_with`).
See docs/security.md (Crypto-shredding)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"OBLVSEAL1\n"
KEY_BYTES = 32
_NONCE_BYTES = 12
_KEY: ContextVar[bytes | None] = ContextVar("obliviate_sealing_key", default=None)


class SealedFileError(ValueError):
    """A sealed file read without its key, with another key, or altered."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


@contextmanager
def sealed_with(key: bytes | None) -> Iterator[None]:
    """Files written and read inside the block are sealed under `key` (None: plain)."""
    if key is not None and len(key) != KEY_BYTES:
        raise ValueError(f"a sealing key has {KEY_BYTES} bytes, not {len(key)}")
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def write_file(path: str | Path, data: bytes) -> None:
    """Write `data` to `path`, sealed when a key is in context."""
    p = Path(path)
    key = _KEY.get()
    head = b""
    if key is not None:  # written in parts: joined, a model of a GB was copied once more
        nonce = os.urandom(_NONCE_BYTES)
        head = MAGIC + nonce
        data = AESGCM(key).encrypt(nonce, data, _aad(p))
    with p.open("wb") as f:
        f.write(head)
        f.write(data)


def read_file(path: str | Path) -> bytes:
    """The contents of `path`: unsealed with the key in context, which refuses a file
    without the seal; as it is without a key (outside the registry)."""
    p = Path(path)
    blob = p.read_bytes()
    if not blob.startswith(MAGIC) and _KEY.get() is not None:
        raise SealedFileError(f"{p} is not sealed, but a version's files all are "
                              "(planted or replaced by someone without its key)")
    return _unseal(p, blob)


def unsealed(path: str | Path) -> bytes:
    """The bytes of any file in a version's directory, the seal taken off where there is
    one (a scan of everything it holds; loading uses :func:`read_file`)."""
    p = Path(path)
    return _unseal(p, p.read_bytes())


def _unseal(p: Path, blob: bytes) -> bytes:
    if not blob.startswith(MAGIC):
        return blob
    key = _KEY.get()
    if key is None:
        raise SealedFileError(f"{p} is sealed and no key was given (a destroyed version's "
                              "files stay unreadable)")
    body = memoryview(blob)[len(MAGIC):]  # a view: slicing bytes copied a GB model twice
    try:
        return AESGCM(key).decrypt(body[:_NONCE_BYTES], body[_NONCE_BYTES:], _aad(p))
    except InvalidTag:
        raise SealedFileError(f"{p} does not open with this version's key (another "
                              "version's file, or altered)") from None


def _aad(p: Path) -> bytes:
    # files are written under a temporary name and renamed: bind the final name
    name = p.name.removesuffix(".tmp")
    return b"obliviate-version-file:" + name.encode()

"""The ledger's deployment settings, read from the environment with embedded defaults.

The defaults run everything on one machine: a SQLite ledger and a key file under
`.obliviate/`, a broker on localhost. Production sets OBLIVIATE_DATABASE_URL to PostgreSQL
and supplies the HMAC key as a secret. The jobs' and the service's settings are read the
same way (:class:`ledger.env_settings.EnvSettings`).
See docs/operations.md (Deploying)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ledger.env_settings import EnvSettings
from ledger.heads import HeadSigner
from ledger.keystore import DEFAULT_DIR as DEFAULT_KEY_STORE_DIR
from ledger.keystore import DirectoryKeyStore, KeyStoreError
from ledger.signing import SigningKeyRefused
from ledger.store import Ledger

STATE_DIR = Path(".obliviate")
DEFAULT_SIGNING_KEY_FILE = str(STATE_DIR / "ledger-signing.key")


@dataclass(frozen=True)
class LedgerSettings(EnvSettings):
    """Where the ledger lives, its keys, its Kafka topics, and how often it takes heads
    and erases purged bytes."""

    database_url: str = f"sqlite:///{STATE_DIR / 'ledger.db'}"
    hmac_key_hex: str | None = None
    hmac_key_file: str = str(STATE_DIR / "hmac.key")
    kafka_bootstrap: str = "127.0.0.1:9092"
    requests_topic: str = "obliviate.requests"
    dead_letter_topic: str = "obliviate.requests.dead"
    consumer_group: str = "obliviate-ledger"
    # how long Kafka keeps a raw request (adds carry features): long enough to survive a
    # consumer outage, no longer; dead letters a little longer, for an operator to look
    requests_retention_s: float = 86_400.0
    dead_letter_retention_s: float = 259_200.0
    checkpoint_every: int = 1000
    # the Ed25519 key that signs tree heads (`ledger.heads`): kept out of the database,
    # one per deployment (every process that signs gets the same one)
    ledger_signing_key_hex: str | None = None
    ledger_signing_key_file: str = DEFAULT_SIGNING_KEY_FILE
    # the keys crypto-shredding rests on (versions' sealing keys, added records' payload
    # keys) live here, never in the database (`ledger.keystore`): a volume every process
    # of a deployment shares, backed up apart from the database or not at all
    key_store_dir: str = DEFAULT_KEY_STORE_DIR
    head_interval_s: float = 60.0  # a head once events are this old (and every checkpoint_every)
    # minimum seconds between purge maintenance runs (unset: 0 on SQLite, 600 on PostgreSQL)
    purge_maintenance_s: float | None = None
    consumer_metrics_port: int = 9102  # `obliviate consume` serves its metrics here
    # where the worker's and the consumer's metrics listen: this machine only, unless a
    # deployment's Prometheus scrapes them from elsewhere (the deploy files: 0.0.0.0)
    metrics_host: str = "127.0.0.1"
    # the signed head the last `ledger verify` passed on (`ledger.verified_head`): a file
    # of the verifying machine, where the database's writers cannot reach it
    verified_head_file: str = str(STATE_DIR / "verified-head.json")

    def topic_configs(self) -> dict[str, dict[str, str]]:
        """Retention settings of the requests and dead-letter topics, when created here."""
        return {self.requests_topic: retention_configs(self.requests_retention_s),
                self.dead_letter_topic: retention_configs(self.dead_letter_retention_s)}

    def hmac_key(self) -> bytes:
        """The deployment secret for record fingerprints; created on first use if embedded."""
        if self.hmac_key_hex:
            return bytes.fromhex(self.hmac_key_hex)
        return bytes.fromhex(secret_file(self.hmac_key_file))

    def ledger_signing_key(self) -> bytes | None:
        """The 32-byte Ed25519 seed that signs the ledger's tree heads: the hex setting,
        else the key file; None while neither exists (`open_ledger` decides whether one
        may be created). Publish its public key (`obliviate ledger key`), never this."""
        text = self.ledger_signing_key_hex
        if not text and Path(self.ledger_signing_key_file).exists():
            text = Path(self.ledger_signing_key_file).read_text().strip()
        if not text:
            return None
        return signing_seed(text, "OBLIVIATE_LEDGER_SIGNING_KEY_HEX" if
                            self.ledger_signing_key_hex else self.ledger_signing_key_file)

    def open_ledger(self, sign: bool = True) -> Ledger:
        """The ledger. With `sign` it signs heads with the deployment's one key and
        refuses to start (SigningKeyRefused) where that would make a second one: no key
        configured on a shared (non-SQLite) database, a new key for a ledger that holds
        heads already, or a key that is not the one its heads and rotations name. On such
        a database a key store must be configured too (else KeyStoreError).
        Without `sign` (verify, audit) it only checks heads with the key's public half."""
        if self.database_url.startswith("sqlite:///"):
            Path(self.database_url.removeprefix("sqlite:///")).parent.mkdir(
                parents=True, exist_ok=True)
        elif self.key_store_dir == DEFAULT_KEY_STORE_DIR:
            raise KeyStoreError(
                "no key store is configured, and the database is not SQLite: every process "
                "of a deployment must read and write one key store, so none is made here; "
                "set OBLIVIATE_KEY_STORE_DIR to the deployment's shared key store volume in "
                "every process")
        seed = self.ledger_signing_key()
        if not sign:
            return self._ledger(public_key=None if seed is None else
                                HeadSigner(seed).public_key)
        if seed is None and self.ledger_signing_key_file == DEFAULT_SIGNING_KEY_FILE \
                and not self.database_url.startswith("sqlite"):
            raise SigningKeyRefused(
                "no ledger signing key is configured, and the database is not SQLite: every "
                "process of a deployment must sign with one key, so none is created here; "
                "set OBLIVIATE_LEDGER_SIGNING_KEY_HEX (`openssl rand -hex 32`) or "
                "OBLIVIATE_LEDGER_SIGNING_KEY_FILE to the deployment's key in every process")
        ledger = self._ledger()
        try:
            if seed is None:
                held = ledger.heads.signing_log()
                if held is not None:
                    raise SigningKeyRefused(
                        f"no ledger signing key at {self.ledger_signing_key_file}, and the "
                        f"ledger holds heads signed by log {held[:16]}... already: a new key "
                        "would start a second log; point OBLIVIATE_LEDGER_SIGNING_KEY_FILE (or "
                        "_HEX) at that log's key")
                seed = key_file_seed(self.ledger_signing_key_file)
            ledger.heads.use_key(seed)
        except BaseException:
            ledger.close()
            raise
        return ledger

    def _ledger(self, public_key: bytes | None = None) -> Ledger:
        return Ledger(self.database_url, self.hmac_key(), self.checkpoint_every,
                      self.purge_maintenance_s, head_interval_s=self.head_interval_s,
                      public_key=public_key, key_store=DirectoryKeyStore(self.key_store_dir))


def retention_configs(retention_s: float) -> dict[str, str]:
    """Topic settings under which Kafka deletes a message at most ~`retention_s` after it
    was written: a segment is deleted whole, once its newest message is past retention, so
    segments roll at a tenth of it (Kafka's default roll is 7 days)."""
    ms = max(1000, round(retention_s * 1000))
    return {"cleanup.policy": "delete", "retention.ms": str(ms),
            "segment.ms": str(max(1000, ms // 10))}


def signing_seed(text: str, where: str) -> bytes:
    """A signing key's 32-byte seed from its 64 hex digits (ValueError naming `where`)."""
    try:
        seed = bytes.fromhex(text.strip())
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise ValueError(f"the ledger signing key ({where}) must be 64 hex digits (32 bytes)")
    return seed


def key_file_seed(path: str) -> bytes:
    """The signing key kept in the file `path`, created (0600) when there is none."""
    return signing_seed(secret_file(path), path)


def secret_file(path_str: str) -> str:
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

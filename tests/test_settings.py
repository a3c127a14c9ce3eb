"""Settings by layer: each layer reads its own OBLIVIATE_* variables, the same way, and the
configuration table of docs/configuration.md lists every one under the layer that reads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.orchestration.job_settings import JobSettings
from ledger.config import LedgerSettings
from ledger.env_settings import EnvSettings
from service.service_settings import ServiceSettings

CONFIGURATION = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
LAYERS: dict[str, type[EnvSettings]] = {"the ledger": LedgerSettings, "the jobs": JobSettings,
                                        "the service": ServiceSettings}
# every variable the one Settings class of before the split read: none lost, none renamed
BEFORE_THE_SPLIT = {f"OBLIVIATE_{n}" for n in (
    "DATABASE_URL", "HMAC_KEY_HEX", "HMAC_KEY_FILE", "KAFKA_BOOTSTRAP", "REQUESTS_TOPIC",
    "DEAD_LETTER_TOPIC", "CONSUMER_GROUP", "REQUESTS_RETENTION_S", "DEAD_LETTER_RETENTION_S",
    "CHECKPOINT_EVERY", "LEDGER_SIGNING_KEY_HEX", "LEDGER_SIGNING_KEY_FILE", "KEY_STORE_DIR",
    "HEAD_INTERVAL_S", "PURGE_MAINTENANCE_S", "MODEL_NAME", "LEARNER", "GUARD", "EVALUATE",
    "ANSWERS", "PRIVATE_EPSILON", "SEED_EPSILON_BUDGET", "SEED_DELTA", "ADMIN_TOKEN",
    "ADMIN_TOKEN_FILE", "EPSILON", "EPSILON_BUDGET", "MEMO_SIZE", "REGISTRY_POLL_S",
    "DESTROY_GRACE_S", "WORKER_METRICS_PORT", "CONSUMER_METRICS_PORT")}
# added since (issue 28: the model store in the state dir, metrics on localhost by default;
# issue 29: the head the last verify passed on; issue 30: a SISA network of the user's, the
# device and its memory cap)
ADDED_SINCE = {"OBLIVIATE_MODEL_STORE", "OBLIVIATE_METRICS_HOST",
               "OBLIVIATE_VERIFIED_HEAD_FILE", "OBLIVIATE_NETWORK", "OBLIVIATE_DEVICE",
               "OBLIVIATE_CUDA_MEMORY_FRACTION"}


def _table_sections() -> dict[str, set[str]]:
    """docs/configuration.md's table: its variables under each bold layer row."""
    text = CONFIGURATION.read_text()
    start = text.index("| variable | default: meaning |")
    end = text.find("\n\n", start)
    table = text[start:] if end < 0 else text[start:end]
    sections: dict[str, set[str]] = {}
    current = None
    for line in table.splitlines():
        if m := re.match(r"\| \*\*(.+?)\*\* \|", line):
            current = sections.setdefault(m.group(1), set())
        elif (m := re.match(r"\| `(OBLIVIATE_\w+)` \|", line)) and current is not None:
            current.add(m.group(1))
    return sections


def test_no_variable_is_lost_or_read_by_two_layers() -> None:
    layers = [cls.variables() for cls in LAYERS.values()]
    assert set().union(*layers) == BEFORE_THE_SPLIT | ADDED_SINCE
    assert sum(len(v) for v in layers) == len(BEFORE_THE_SPLIT | ADDED_SINCE), \
        "a variable in two layers"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_the_configuration_table_lists_each_layers_variables_under_it(layer: str) -> None:
    assert _table_sections()[layer] == LAYERS[layer].variables()


def test_every_layer_reads_its_variables_the_same_way(monkeypatch) -> None:
    monkeypatch.setenv("OBLIVIATE_CHECKPOINT_EVERY", "7")
    monkeypatch.setenv("OBLIVIATE_PURGE_MAINTENANCE_S", "auto")
    monkeypatch.setenv("OBLIVIATE_LEARNER", "sisa")
    monkeypatch.setenv("OBLIVIATE_SEED_DELTA", "1e-6")
    monkeypatch.setenv("OBLIVIATE_MEMO_SIZE", "12")
    monkeypatch.setenv("OBLIVIATE_ADMIN_TOKEN", "t0ken")
    ledger = LedgerSettings.from_env(requests_topic="mine", database_url=None)
    assert (ledger.checkpoint_every, ledger.purge_maintenance_s) == (7, None)
    assert ledger.requests_topic == "mine" and ledger.database_url == LedgerSettings.database_url
    jobs = JobSettings.from_env()
    assert (jobs.learner, jobs.seed_delta, jobs.choice("learner", ("dare", "sisa"))) == \
        ("sisa", 1e-6, "sisa")
    service = ServiceSettings.from_env()
    assert (service.memo_size, service.admin_bearer_token()) == (12, "t0ken")


def test_a_bad_value_names_its_variable(monkeypatch) -> None:
    monkeypatch.setenv("OBLIVIATE_EPSILON", "lots")
    with pytest.raises(ValueError, match="OBLIVIATE_EPSILON='lots' is not a valid float"):
        ServiceSettings.from_env()
    LedgerSettings.from_env()  # another layer's variable is not the ledger's to read
    with pytest.raises(ValueError, match="OBLIVIATE_GUARD must be one of on, off"):
        JobSettings(guard="maybe").choice("guard", ("on", "off"))

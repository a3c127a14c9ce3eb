"""One signing identity per deployment, on both databases.

Processes get their environment from the deploy files as written (`deploy/compose.yaml`,
`deploy/k8s/`), each in a working directory of its own (a container of its own), and
sign one log that verifies. A process that would bring a second key refuses to start
and says why. A key rotation is an event of the log, signed by the key it retires and
covered by that key's last head: `verify` and `audit check` (against heads saved
before it) follow it, and a head signed by a key no rotation introduced fails both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import insert, select

from ledger import audit
from ledger.chain import canonical_json, event_hash, iso, utc_now
from ledger.heads import HeadSigner, log_id
from ledger.store import Ledger
from ledger.tables import EVENTS, HEADS
from service.cli import main
from tests.conftest import HMAC_KEY, seed

# ledgers of several deployments' processes, signed and rotated
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KEY_A, KEY_B, ATTACKER = bytes(range(1, 33)), bytes(range(40, 72)), bytes(range(200, 232))
PUB_A, PUB_B = HeadSigner(KEY_A).public_key, HeadSigner(KEY_B).public_key
# what an operator fills in (deploy/env.example, the Secret's placeholders)
OPERATOR = {"POSTGRES_PASSWORD": "pw", "GRAFANA_ADMIN_PASSWORD": "pw",
            "OBLIVIATE_HMAC_KEY_HEX": "42" * 32, "OBLIVIATE_ADMIN_TOKEN": "admin-token",
            "OBLIVIATE_LEDGER_SIGNING_KEY_HEX": KEY_A.hex()}
SIGNING = ("service", "worker", "consumer")  # the processes that sign heads
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::([?-])([^}]*))?\}")


def compose_env() -> dict[str, str]:
    """The environment compose gives every signing process, its ${VAR} filled in."""
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    # less what names a worker replica (its claims' owner; one host, one network)
    envs = [{k: v for k, v in services[name]["environment"].items()
             if k != "OBLIVIATE_WORKER_NAME"} for name in SIGNING]
    assert all(e == envs[0] for e in envs), "the signing processes share one environment"

    def fill(m: re.Match) -> str:
        name, how, default = m.groups()
        if name in OPERATOR:
            return OPERATOR[name]
        assert how == "-", f"compose needs ${name}, which the operator does not give"
        return default
    return {k: _VAR.sub(fill, str(v)) for k, v in envs[0].items()}


def k8s_env() -> dict[str, str]:
    """The ConfigMap and the Secret (its placeholders replaced) every signing Deployment
    takes its environment from."""
    docs = [d for p in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs if "metadata" in d}
    for name in SIGNING:
        (container,) = by[("Deployment", f"obliviate-{name}")]["spec"]["template"]["spec"][
            "containers"]
        assert {(k, v["name"]) for e in container["envFrom"] for k, v in e.items()} == {
            ("configMapRef", "obliviate-config"), ("secretRef", "obliviate-secrets")}
    secret = by[("Secret", "obliviate-secrets")]["stringData"]
    return {**by[("ConfigMap", "obliviate-config")]["data"],
            **{k: OPERATOR.get(k, v) for k, v in secret.items()}}


def deployment(source: str, db_url: str, tmp: Path) -> dict[str, str]:
    env = compose_env() if source == "compose" else k8s_env()
    # every process mounts the deployment's one key store where the environment says
    assert env["OBLIVIATE_KEY_STORE_DIR"] == "/keys"
    assert mounts(source) == {name: {"/keys", *(["/models"] if name != "consumer" else [])}
                              for name in SIGNING}
    # the test's database, model store and key store stand in for the deployment's
    env.update(OBLIVIATE_DATABASE_URL=db_url, OBLIVIATE_MODEL_STORE=str(tmp / "models"),
               OBLIVIATE_KEY_STORE_DIR=str(tmp / "keys"))
    return env


def mounts(source: str) -> dict[str, set[str]]:
    """Where each Obliviate process of the deploy files mounts its volumes."""
    if source == "compose":
        services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
        return {n: {v.split(":")[1] for v in services[n].get("volumes", [])} for n in SIGNING}
    docs = [d for p in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]
    out = {}
    for d in docs:
        name = d.get("metadata", {}).get("name", "").removeprefix("obliviate-")
        if d.get("kind") == "Deployment" and name in SIGNING:
            (container,) = d["spec"]["template"]["spec"]["containers"]
            out[name] = {m["mountPath"] for m in container.get("volumeMounts", [])}
    return out


def obliviate(env: dict[str, str], cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m service.cli ...` as the deploy files run it, in a directory of its own."""
    cwd.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OBLIVIATE_")}
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], cwd=cwd,
                          env={**base, **env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.processes
@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_processes_of_a_deployment_sign_one_log(source: str, db_url: str, tmp_path) -> None:
    env = deployment(source, db_url, tmp_path)
    assert env["OBLIVIATE_LEDGER_SIGNING_KEY_HEX"] == KEY_A.hex()
    steps = [("a", "ledger", "init", "--dataset", "iris"), ("a", "ledger", "checkpoint"),
             ("b", "submit", json.dumps({"request_id": "q1", "op": "delete",
                                         "subject_id": "s001"})),
             ("b", "ledger", "checkpoint")]
    for where, *argv in steps:
        done = obliviate(env, tmp_path / where, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    done = obliviate(env, tmp_path / "c", "ledger", "verify")
    assert done.returncode == 0 and "ledger OK" in done.stdout, done.stderr
    heads = json.loads(obliviate(env, tmp_path / "c", "ledger", "heads").stdout)
    assert len(heads["heads"]) == 2
    assert {h["log_id"] for h in heads["heads"]} == {heads["log_id"]} == {log_id(PUB_A)}


# ---------------------------------------------------------------------------- refusals
@pytest.fixture
def cli(db_url: str, tmp_path, monkeypatch):
    """Run `obliviate` in-process as a process of its own directory, with `key`
    (hex), a key file, or no key at all."""
    for name in [k for k in os.environ if k.startswith("OBLIVIATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OBLIVIATE_DATABASE_URL", db_url)
    monkeypatch.setenv("OBLIVIATE_KEY_STORE_DIR", str(tmp_path / "keys"))
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_HEX", HMAC_KEY.hex())
    monkeypatch.setenv("OBLIVIATE_CHECKPOINT_EVERY", "5")

    def run(capsys, where: str, key: bytes | Path | None, *argv: str) -> tuple[int, str, str]:
        (tmp_path / where).mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / where)
        monkeypatch.delenv("OBLIVIATE_LEDGER_SIGNING_KEY_HEX", raising=False)
        monkeypatch.delenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", raising=False)
        if isinstance(key, bytes):
            monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_HEX", key.hex())
        elif key is not None:
            monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", str(key))
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err
    return run


def some_events(run, capsys, where: str, key, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert run(capsys, where, key, "submit", json.dumps(
            {"request_id": f"q{i}", "op": "delete", "record_ids": [f"r{i:03d}"]}))[0] == 0


def test_a_process_that_would_make_a_second_key_refuses(cli, db_url: str, capsys,
                                                        tmp_path) -> None:
    assert cli(capsys, "a", KEY_A, "ledger", "init", "--dataset", "iris")[0] == 0
    some_events(cli, capsys, "a", KEY_A, 6)
    assert cli(capsys, "a", KEY_A, "ledger", "checkpoint")[0] == 0
    # no key configured: on a shared database none is made; on SQLite none next to heads
    code, _, err = cli(capsys, "b", None, "ledger", "checkpoint")
    want = ("no ledger signing key is configured, and the database is not SQLite"
            if db_url.startswith("postgresql") else
            f"no ledger signing key at .obliviate/ledger-signing.key, and the ledger holds "
            f"heads signed by log {log_id(PUB_A)[:16]}... already")
    assert code == 2 and want in err, err
    assert not (tmp_path / "b" / ".obliviate" / "ledger-signing.key").exists()
    # another key: refused too, by every command that signs
    for argv in (("ledger", "checkpoint"), ("submit", "{}"), ("ledger", "key")):
        code, _, err = cli(capsys, "b", KEY_B, *argv)
        assert code == 2 and (f"the ledger's heads are signed by log {log_id(PUB_A)[:16]}..., "
                              f"not by this process's key (log {log_id(PUB_B)[:16]}...)"
                              in err), (argv, err)
    code, out, err = cli(capsys, "c", KEY_A, "ledger", "verify")
    assert code == 0 and "ledger OK" in out, err


# ---------------------------------------------------------------------------- rotation
def test_a_key_rotation_verifies_and_old_saved_heads_still_audit(cli, db_url: str, capsys,
                                                                 tmp_path) -> None:
    assert cli(capsys, "a", KEY_A, "ledger", "init", "--dataset", "iris")[0] == 0
    some_events(cli, capsys, "a", KEY_A, 6)
    saved = tmp_path / "saved.json"  # what an auditor kept before the rotation
    saved.write_text(cli(capsys, "a", KEY_A, "ledger", "heads")[1])
    assert json.loads(saved.read_text())["public_key"] == PUB_A.hex()
    running = Ledger(db_url, HMAC_KEY, checkpoint_every=5, signing_key=KEY_A)  # a process up

    new_key = tmp_path / "new.key"
    new_key.write_text(KEY_B.hex())
    code, out, err = cli(capsys, "a", KEY_A, "ledger", "rotate-key", "--new-key-file",
                         str(new_key))
    assert code == 0 and f"to key {PUB_B.hex()}" in out, err
    # the old key: a process holding it neither starts nor, if running, signs any more
    code, _, err = cli(capsys, "a", KEY_A, "ledger", "checkpoint")
    assert code == 2 and "was retired by the key rotation at event" in err, err
    some_events(cli, capsys, "b", new_key, 7, start=6)
    running.receive({"request_id": "late", "op": "delete", "record_ids": ["r100"]})
    assert running.heads.sign() is None
    running.close()
    assert cli(capsys, "b", new_key, "ledger", "checkpoint")[0] == 0

    heads = json.loads(cli(capsys, "b", new_key, "ledger", "heads")[1])
    [rotation] = heads["rotations"]
    seq = rotation["event"]["seq"]
    assert heads["public_key"] == PUB_B.hex()
    assert {h["log_id"] for h in heads["heads"] if h["tree_size"] <= seq} == {log_id(PUB_A)}
    assert {h["log_id"] for h in heads["heads"] if h["tree_size"] > seq} == {log_id(PUB_B)}
    assert rotation["head"]["tree_size"] == seq and rotation["head"]["log_id"] == log_id(PUB_A)
    assert all(h["public_key"] in (PUB_A.hex(), PUB_B.hex()) for h in heads["heads"])
    for key in (new_key, KEY_A):  # the current key, and the retired one
        code, out, err = cli(capsys, "c", key, "ledger", "verify")
        assert code == 0 and "ledger OK" in out, err
    # the auditor's check against the heads saved before, from the database and from files
    for pinned in (PUB_A, PUB_B):
        code, out, err = cli(capsys, "c", None, "audit", "check", "--heads", str(saved),
                             "--public-key", pinned.hex())
        assert code == 0 and "audit OK" in out, err
    events, now = tmp_path / "events.jsonl", tmp_path / "now.json"
    events.write_text(cli(capsys, "c", new_key, "ledger", "export")[1])
    now.write_text(json.dumps(heads))
    assert audit.main(["--heads", str(saved), "--current", str(now), "--events",
                       str(events)]) == 0
    # a heads document that hides the rotation: the new key's heads do not check
    hidden = {**heads, "rotations": []}
    result = audit.audit(json.loads(saved.read_text()), hidden, public_key=PUB_A)
    assert any("no key rotation introduced that key" in p for p in result.problems)


def forge_rotation(ledger: Ledger, signer: HeadSigner, new: bytes) -> int:
    """A `key_rotated` event appended behind the ledger's back (valid hash), signed by
    `signer`, with `signer`'s head over it."""
    with ledger.engine.begin() as conn:
        tail = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash)
                            .order_by(EVENTS.c.seq.desc()).limit(1)).one()
        seq, now = tail.seq + 1, iso(utc_now())
        body = canonical_json(signer.rotation(HeadSigner(new).public_key, seq, tail.hash))
        h = event_hash(seq, None, "key_rotated", body, None, now, tail.hash)
        conn.execute(insert(EVENTS), {"seq": seq, "request_id": None, "kind": "key_rotated",
                                      "payload": body, "model_version": None,
                                      "created_at": now, "prev_hash": tail.hash, "hash": h})
    return seq


def test_a_head_of_a_key_no_rotation_introduced_fails(db_url: str) -> None:
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=5, signing_key=KEY_A)
    seed(led)
    for i in range(6):
        led.receive({"request_id": f"q{i}", "op": "delete", "record_ids": [f"r{i:03d}"]})
    saved = json.loads(json.dumps(led.heads.published()))
    led.heads.rotate_key(KEY_B)
    for i in range(6, 12):
        led.receive({"request_id": f"q{i}", "op": "delete", "record_ids": [f"r{i:03d}"]})
    assert led.verify().ok, led.verify().problems
    assert audit.audit(saved, led.heads.published(), public_key=PUB_A,
                       events=led.events.export()).ok

    # an attacker's key signs a head over everything: neither verify nor audit takes it
    size = led.events.last_seq()
    head = led.events.consistency(0, size)["new_root"]
    forged = HeadSigner(ATTACKER).sign(size, head, iso(utc_now()))
    with led.engine.begin() as conn:
        conn.execute(HEADS.delete().where(HEADS.c.tree_size == size))
        conn.execute(insert(HEADS), forged)
    found = [str(p) for p in led.verify().problems]
    assert any(p.startswith(f"signed head {size}: names log") and
               "no key rotation introduced that key" in p for p in found), found
    current = {**led.heads.published(), "heads": [*led.heads.published()["heads"], forged]}
    result = audit.audit(saved, current, public_key=PUB_A, events=led.events.export())
    assert any(f"current head {size}" in p and "no key rotation introduced" in p
               for p in result.problems), result.problems

    # the retired key's signature on a head after its rotation is no better
    with led.engine.begin() as conn:
        conn.execute(HEADS.delete().where(HEADS.c.tree_size == size))
        conn.execute(insert(HEADS), HeadSigner(KEY_A).sign(size, head, iso(utc_now())))
    found = [str(p) for p in led.verify().problems]
    assert any(p.startswith(f"signed head {size}:") and "(rotated)" in p for p in found), found

    # a rotation to the attacker's key that the retiring key did not sign
    with led.engine.begin() as conn:
        conn.execute(HEADS.delete().where(HEADS.c.tree_size == size))
    seq = forge_rotation(led, HeadSigner(ATTACKER), bytes(range(90, 122)))
    found = [str(p) for p in led.verify().problems]
    assert any(p.startswith(f"signing keys: key rotation at event {seq}:") for p in found), found
    led.close()

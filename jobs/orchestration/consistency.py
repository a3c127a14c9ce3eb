"""The model registry held to the ledger: what `ledger verify` checks beyond the ledger.

The registry's tables are working state anyone with write access to the database can
edit; the ledger's events say which versions were published and destroyed, and
:func:`verify_registry` finds where the pointer, the version rows, the manifests (in the
database and beside the files) and the sealing keys disagree with them.
See docs/ledger.md (What `ledger verify` holds)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.registry import MANIFEST_FILE, POINTER, VERSIONS, Registry, manifest_sha256
from ledger.forgotten import PUBLICATIONS
from ledger.log_check import Problem
from ledger.store import Ledger
from ledger.tables import EVENTS

_ANNOUNCED_CHANGE = ("model_trained", "guard_refreshed", "seeds_rotated", "rolled_back")


def verify_registry(ledger: Ledger, registry: Registry) -> list[Problem]:
    """Where the registry's tables (for `registry.name`) disagree with the ledger's events."""
    problems: list[Problem] = []
    with ledger.engine.connect() as conn:
        announced: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
        checked: list[tuple[int, str]] = []  # (seq, version) verified where it stood
        destroyed: dict[str, tuple[int, dict[str, Any]]] = {}
        for e in conn.execution_options(yield_per=5000).execute(
                select(EVENTS.c.seq, EVENTS.c.kind, EVENTS.c.payload, EVENTS.c.model_version)
                .where(EVENTS.c.kind.in_([*PUBLICATIONS, "destroyed"]),
                       EVENTS.c.model_version.is_not(None))
                .order_by(EVENTS.c.seq)):
            try:
                payload = json.loads(e.payload)
            except ValueError:
                payload = {}  # `ledger verify` names the edited event
            if e.kind == "destroyed":
                destroyed.setdefault(e.model_version, (e.seq, payload))
            elif e.kind == "verified" and payload.get("in_place"):
                checked.append((e.seq, e.model_version))
            else:
                announced.setdefault(e.model_version, []).append((e.seq, e.kind, payload))
        rows = {r.version: r for r in conn.execute(
            select(VERSIONS).where(VERSIONS.c.name == registry.name))}
        known = set(conn.execute(select(VERSIONS.c.version)).scalars())  # of every name
        ptr = conn.execute(select(POINTER).where(POINTER.c.name == registry.name)).first()

    for version, evs in sorted(announced.items(), key=lambda kv: kv[1][0][0]):
        if version not in known:
            problems.append(Problem(f"model version {version}", f"event {evs[0][0]} "
                                    f"({evs[0][1]}) announces it, but no model version row "
                                    "exists (forged event, or row deleted)", evs[0][0]))
    for seq, version in checked:
        if not any(s < seq for s, _, _ in announced.get(version, [])):
            problems.append(Problem(f"model version {version}", f"event {seq} (verified) "
                                    "checked it where it stood, but no earlier event "
                                    "published it (forged event)", seq))
    # (seq, version) of the latest event that published a version of this name
    latest = max(((evs[-1][0], v) for v, evs in announced.items() if v in rows), default=None)
    where = f"model pointer {registry.name}"
    if ptr is None:
        if rows:
            problems.append(Problem(where, "is missing, though versions were published "
                                    "(pointer deleted)"))
    else:
        row = rows.get(ptr.version)
        if row is None:
            problems.append(Problem(where, f"names {ptr.version}, which was never published"))
        elif ptr.version not in announced:
            problems.append(Problem(where, f"names {ptr.version}, which no event announces "
                                    "(pointer edited)"))
        else:
            if latest is not None and latest[1] != ptr.version:
                problems.append(Problem(where, f"names {ptr.version}, but the latest "
                                        f"publication (event {latest[0]}) is {latest[1]} "
                                        "(pointer edited)"))
            if ptr.seq != row.seq:
                problems.append(Problem(where, f"says seq {ptr.seq}, {ptr.version} is "
                                        f"seq {row.seq}"))
            if ptr.version in destroyed or row.destroyed_at is not None:
                problems.append(Problem(where, f"names {ptr.version}, which was destroyed"))
            elif row.superseded_by_deletion is not None:
                problems.append(Problem(where, f"names {ptr.version}, which holds records "
                                        f"{row.superseded_by_deletion} removed on request"))

    keyed = registry.keyed_versions()
    for version, row in sorted(rows.items(), key=lambda kv: kv[1].seq):
        problems.extend(_check_version(registry, version, row, announced.get(version, []),
                                       destroyed.get(version), version in keyed))
    for version, (seq, _) in sorted(destroyed.items(), key=lambda kv: kv[1][0]):
        if version not in known:
            problems.append(Problem(f"model version {version}", f"event {seq} destroyed it, "
                                    "but no model version row exists (row deleted?)", seq))
    return problems


def _check_version(registry: Registry, version: str, row: Any,
                   evs: list[tuple[int, str, dict[str, Any]]],
                   destroyed: tuple[int, dict[str, Any]] | None, keyed: bool) -> list[Problem]:
    where = f"model version {version}"
    man = row.manifest if isinstance(row.manifest, dict) else {}
    out: list[Problem] = []
    if not evs:
        out.append(Problem(where, "no event announces its publication (row inserted behind "
                                  "the ledger's back)"))
    if man.get("version_seq") != row.seq or man.get("parent") != row.parent:
        out.append(Problem(where, f"manifest says seq {man.get('version_seq')!r}, parent "
                                  f"{man.get('parent')!r}; the row says {row.seq}, "
                                  f"{row.parent!r} (edited)"))
    change = man.get("change") or {}
    counts = {"applied": 0, "verified": 0}
    for seq, kind, payload in evs:
        said: dict[str, Any] = {}
        if kind in _ANNOUNCED_CHANGE:
            said = {"change": (payload.get("change"), change)}
        elif kind == "applied":
            counts["applied"] += 1
            said = {"guarantee": (payload.get("guarantee"), man.get("guarantee"))}
        elif kind == "verified":
            counts["verified"] += 1
            said = {k: (payload.get(k), change.get(k)) for k in ("guard", "exactness")}
        if "manifest_sha256" in payload:
            said["manifest_sha256"] = (payload["manifest_sha256"], manifest_sha256(man))
        bad = [k for k, (ev, mf) in said.items() if ev != mf]
        if bad:
            out.append(Problem(where, f"the manifest's {', '.join(bad)} is not what event "
                                      f"{seq} ({kind}) says (manifest edited)"))
    for kind in ("applied", "verified"):
        if counts[kind] and change.get("requests") != counts[kind]:
            out.append(Problem(where, f"the manifest says it took {change.get('requests')!r} "
                                      f"request(s); {counts[kind]} `{kind}` event(s) name it "
                                      "(manifest edited)"))
    if destroyed is not None:
        seq, payload = destroyed
        if payload.get("manifest_sha256") != manifest_sha256(man):
            out.append(Problem(where, f"its manifest's digest is not the one event {seq} "
                                      "(destroyed) recorded (manifest edited)"))
        if payload.get("content_hash") != man.get("content_hash"):
            out.append(Problem(where, f"its content hash is not the one event {seq} "
                                      "(destroyed) recorded (manifest edited)"))
        if row.destroyed_at is None:
            out.append(Problem(where, f"event {seq} destroyed it, but the row says it was not "
                                      "(destroyed_at cleared: it could be served again)"))
        if keyed:
            out.append(Problem(where, f"event {seq} destroyed it, but the key store holds "
                                      "a key for it again"))
    elif row.destroyed_at is not None:
        out.append(Problem(where, "is marked destroyed, but no `destroyed` event says so"))
    elif not keyed:
        out.append(Problem(where, "is not destroyed, but its sealing key is gone: no process "
                                  "can load it (key deleted)"))
    stored = _stored_manifest(registry, version)
    if stored is not None and stored != man:
        out.append(Problem(where, "the manifest in the database is not the one saved beside "
                                  f"its files ({MANIFEST_FILE} in the model store): edited"))
    return out


def _stored_manifest(registry: Registry, version: str) -> dict[str, Any] | None:
    """The manifest saved with the version's files; None when they are gone (destroyed)."""
    try:
        return json.loads((registry.path(version) / MANIFEST_FILE).read_text())
    except Exception:  # noqa: BLE001 - not in any model store (destroyed), or unreadable
        return None


def registry_check(ledger: Ledger) -> list[Problem]:
    """`ledger verify`'s check of the configured model name's registry."""
    model_name = JobSettings.from_env().model_name
    return verify_registry(ledger, Registry(ledger.engine, model_name, ledger.keys))

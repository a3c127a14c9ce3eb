"""What the ledger can prove about one deletion: when the data left, and what held it.

Read from the ledger's own tables, mostly its events, so an auditor can check each claim
against an inclusion proof: each purged record, the first version without it, the versions
that held it and whether they were destroyed, and the chain of exact updates to a version a
retrain from scratch checked. :func:`receipt` packs it for its subject (:mod:`ledger.receipt`).
See docs/ledger.md (What a deletion removed)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import func, select

from ledger.models import Event, TrainingRecord
from ledger.receipt import RECEIPT_FORMAT
from ledger.signing import stored_event
from ledger.store import Ledger

EVENTS = Event.__table__
RECORDS = TrainingRecord.__table__
# events that publish the version they name (the pointer moved in their transaction)
PUBLICATIONS = ("applied", "verified", "model_trained", "guard_refreshed", "seeds_rotated",
                "rolled_back")


def forgotten(ledger: Ledger, request_id: str) -> dict[str, Any]:
    """The report for deletion `request_id` (KeyError: no such request; ValueError: not a
    deletion)."""
    history = ledger.history(request_id)
    request = history["request"]
    if request is None:
        raise KeyError(f"no request {request_id!r}")
    if request["op"] != "delete":
        raise ValueError(f"{request_id!r} is an addition, not a deletion")
    by_kind = {e["kind"]: e for e in history["events"]}
    applied = by_kind.get("applied")
    verified = by_kind.get("verified")
    with ledger.engine.connect() as conn:
        records = conn.execute(
            select(RECORDS.c.record_id, RECORDS.c.record_hash, RECORDS.c.purged_at,
                   RECORDS.c.purged_by, RECORDS.c.added_by, RECORDS.c.state)
            .where(RECORDS.c.record_id.in_(request["record_ids"]))
            .order_by(RECORDS.c.record_id)).all()
        first_seen, first_seq = _versions_in_order(conn)
        destroyed = {e.model_version: e for e in conn.execute(
            select(EVENTS).where(EVENTS.c.kind == "destroyed").order_by(EVENTS.c.seq))}
        added_in = {e.request_id: e.model_version for e in conn.execute(
            select(EVENTS.c.request_id, EVENTS.c.model_version).where(
                EVENTS.c.kind == "applied",
                EVENTS.c.request_id.in_({r.added_by for r in records if r.added_by})))}
    order = {v: k for k, v in enumerate(first_seen)}
    report: dict[str, Any] = {
        "request_id": request_id, "status": request["status"],
        "subject_id": request["subject_id"],
        "records": [{"record_id": r.record_id, "fingerprint": r.record_hash,
                     "state": r.state, "purged_by": r.purged_by,
                     "purged_at": None if r.purged_at is None else r.purged_at.isoformat()}
                    for r in records],
        "first_version_without": None, "held_by": [], "exactness": None,
        "exactness_chain": None,
        "events": history["events"], "tree_head": history["tree_head"],
    }
    if applied is None or applied["model_version"] not in order:
        return report
    gone_at = applied["model_version"]
    report["first_version_without"] = {"version": gone_at, "event_seq": applied["seq"],
                                       "published_at": applied["created_at"]}
    starts = [order.get(added_in.get(r.added_by), 0) if r.added_by else 0 for r in records]
    first = min(starts, default=order[gone_at])
    held = []
    for v in first_seen[first:order[gone_at]]:
        e = destroyed.get(v)
        held.append({"version": v, "destroyed": e is not None} if e is None else {
            "version": v, "destroyed": True, "destroyed_at": e.created_at,
            "event_seq": e.seq, "manifest_sha256": _payload(e)["manifest_sha256"],
            "content_hash": _payload(e)["content_hash"]})
    report["held_by"] = held
    report["exactness_chain"] = exactness_chain(ledger, gone_at, first_seq[gone_at])
    if verified is not None:
        check = verified["payload"].get("exactness") or {}
        report["exactness"] = {"version": verified["model_version"],
                               "event_seq": verified["seq"],
                               **{k: check.get(k) for k in ("guarantee", "exact",
                                                            "served_hash", "retrained_hash")}}
    return report


def _versions_in_order(conn: Any) -> tuple[list[str], dict[str, int]]:
    """Every version any event names, in the order of its first event (and that seq)."""
    first = func.min(EVENTS.c.seq)
    rows = conn.execute(select(EVENTS.c.model_version, first).where(
        EVENTS.c.model_version.is_not(None)).group_by(EVENTS.c.model_version)
        .order_by(first)).all()
    return [r[0] for r in rows], {r[0]: r[1] for r in rows}


def exactness_chain(ledger: Ledger, version: str, since: int) -> dict[str, Any]:
    """Whether an exactness check covers `version` (first published at event `since`):
    the links from it to a version whose retrain from scratch gave the served hash, each
    an exact update of its parent or a new guard of the same learner (an approximate
    version's first link is the exact retrain that replaced it). `covered` False,
    with `why`, when no checked version covers it yet (or the chain breaks)."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(select(EVENTS.c.seq, EVENTS.c.kind, EVENTS.c.payload,
                                   EVENTS.c.model_version)
                            .where(EVENTS.c.seq >= since, EVENTS.c.kind.in_(PUBLICATIONS),
                                   EVENTS.c.model_version.is_not(None))
                            .order_by(EVENTS.c.seq)).all()
    order: list[str] = []  # versions in publication order
    published: dict[str, Any] = {}  # version -> its first publication event
    checks: dict[str, tuple[int, dict[str, Any]]] = {}  # version -> its first check
    for e in rows:
        p = _payload(e)
        if not (e.kind == "verified" and p.get("in_place")) and e.model_version not in published:
            published[e.model_version] = e
            order.append(e.model_version)
        check = p.get("exactness") or (p.get("change") or {}).get("exactness")
        if check and e.kind in ("verified", "guard_refreshed"):
            checks.setdefault(e.model_version, (e.seq, check))
    guarantee = _payload(published[version]).get("guarantee") if version in published else None
    out: dict[str, Any] = {"version": version, "guarantee": guarantee, "covered": False,
                           "links": [], "checked": None, "why": None}
    at = version
    if guarantee != "exact":
        # an approximate version (the game's) is covered by the exact retrain that
        # replaced it: a retrain from scratch on the same records, checked by hash
        e = next((published[v] for v in order if version in _replaces(published[v])), None)
        if e is None:
            out["why"] = (f"{version} is {guarantee or 'of an unknown guarantee'}, not "
                          "exact, and no exact retrain has replaced it yet")
            return out
        out["links"].append({"version": e.model_version, "parent": version,
                             "event_seq": e.seq, "kind": e.kind, "change": "exact retrain",
                             "guarantee": "exact"})
        at = e.model_version
    for nxt in [*order[order.index(at) + 1:], None]:
        if at in checks:
            seq, check = checks[at]
            if check.get("guarantee") == "exact" and check.get("exact") is True:
                out.update(covered=True, checked={
                    "version": at, "event_seq": seq, **{k: check.get(k) for k in (
                        "served_hash", "retrained_hash")}})
            else:
                out["why"] = f"the exactness check of {at} FAILED (event {seq})"
            return out
        if nxt is None:
            break
        e = published[nxt]
        p = _payload(e)
        if e.kind == "applied" and p.get("guarantee") != "exact":
            out["why"] = f"{nxt} is a {p.get('guarantee')} update of {at} (event {e.seq})"
            return out
        if e.kind not in ("applied", "verified", "guard_refreshed"):
            out["why"] = (f"{nxt} is not an update of {at} ({e.kind}, event {e.seq}): a check "
                          f"of it says nothing of {version}")
            return out
        out["links"].append({"version": nxt, "parent": at, "event_seq": e.seq, "kind": e.kind,
                             "change": "update" if e.kind == "applied" else
                             "guard (the learner unchanged)", "guarantee": "exact"})
        at = nxt
    out["why"] = (f"no checked version covers it yet: the exactness check has run on neither "
                  f"{version} nor a later exact update of it")
    return out


def _replaces(e: Any) -> list[str]:
    """The approximate versions a publication event's exact retrain replaces (none for
    any other event)."""
    p = _payload(e)
    return p.get("replaces") or (p.get("change") or {}).get("replaces") or []


def receipt(ledger: Ledger, request_id: str) -> dict[str, Any]:
    """The deletion receipt of `request_id` (:mod:`ledger.receipt`): a signed head, the
    events the report's claims rest on with their inclusion proofs, and the key rotations
    up to that head. KeyError: no such request; ValueError: not an applied deletion, or
    no signed head to prove against."""
    report = forgotten(ledger, request_id)
    first = report["first_version_without"]
    if first is None:
        raise ValueError(f"{request_id!r} is not applied yet: no version is served without "
                         "its records")
    head = ledger.heads.sign()
    if head is None:
        raise ValueError("the ledger has no signed head to prove the receipt against (no "
                         "signing key, or signing refused: see `obliviate ledger verify`)")
    own = {e["kind"]: e["seq"] for e in report["events"]
           if e["kind"] in ("received", "applied", "verified")}
    chain = report["exactness_chain"]
    seqs = {*own.values(), *(h["event_seq"] for h in report["held_by"] if h["destroyed"]),
            *(link["event_seq"] for link in chain["links"])}
    if chain["checked"]:
        seqs.add(chain["checked"]["event_seq"])
    proofs = ledger.events.inclusion_proofs(sorted(seqs), head["tree_size"])
    with ledger.engine.connect() as conn:
        events = [{**stored_event(r), "inclusion_proof": proofs[r.seq]} for r in conn.execute(
            select(EVENTS).where(EVENTS.c.seq.in_(sorted(seqs))).order_by(EVENTS.c.seq))]
    heads = ledger.heads.published(since=head["tree_size"] - 1)
    named = next((h for h in heads["heads"] if h["tree_size"] == head["tree_size"]), None)
    if named is None:
        raise ValueError(f"the head over {head['tree_size']} events is not one of this log's "
                         "(see `obliviate ledger verify`)")
    return {
        "format": RECEIPT_FORMAT, "request_id": request_id, "head": named,
        "rotations": [r for r in heads["rotations"] if r["event"]["seq"] <= head["tree_size"]],
        "events": events,
        "claims": {
            "received": own["received"], "applied": own["applied"],
            "verified": own.get("verified"), "first_version_without": first["version"],
            "held_by": [{"version": h["version"],
                         "destroyed": h["event_seq"] if h["destroyed"] else None}
                        for h in report["held_by"]],
            "exactness": {k: chain[k] for k in ("covered", "links", "why")} | {
                "checked": chain["checked"] and {k: chain["checked"][k]
                                                 for k in ("version", "event_seq")}},
        },
    }


def _payload(e: Any) -> dict[str, Any]:
    return json.loads(e.payload)


def render(report: dict[str, Any]) -> list[str]:
    """The report as lines of text (`obliviate ledger forgotten`, the demo)."""
    out = [f"request {report['request_id']} ({report['status']}), subject "
           f"{report['subject_id'] or '-'}"]
    for r in report["records"]:
        out.append(f"  record {r['record_id']}  fingerprint {r['fingerprint'][:16]}...  "
                   f"{r['state']}" + (f" at {r['purged_at']} by {r['purged_by']}"
                                      if r["purged_at"] else ""))
    first = report["first_version_without"]
    if first is None:
        return [*out, "not applied yet: every version still holds it"]
    out.append(f"first version without it: {first['version']} (published "
               f"{first['published_at']}, event {first['event_seq']})")
    held = report["held_by"]
    gone = [v for v in held if v["destroyed"]]
    waiting = [v["version"] for v in held if not v["destroyed"]]
    out.append(f"held by {len(held)} version(s): {len(gone)} destroyed, {len(waiting)} "
               "awaiting destruction (unservable since the deletion)")
    shown = gone if len(gone) <= 4 else [gone[0], None, gone[-1]]
    for v in shown:
        out.append("  ..." if v is None else
                   f"  {v['version']} destroyed at {v['destroyed_at']} (event "
                   f"{v['event_seq']}, manifest sha256 {v['manifest_sha256'][:16]}...)")
    if waiting:
        out.append(f"  awaiting: {', '.join(waiting[:4])}{' ...' if len(waiting) > 4 else ''}")
    out.extend(render_chain(report["exactness_chain"]))
    ex = report["exactness"]
    if ex is None:
        out.append("exactness: not verified yet")
    elif ex["guarantee"] == "exact":
        out.append(f"exactness of {ex['version']}: retrained from scratch, hash "
                   f"{'matches' if ex['exact'] else 'DOES NOT MATCH'} (served "
                   f"{str(ex['served_hash'])[:16]}..., retrained "
                   f"{str(ex['retrained_hash'])[:16]}...; event {ex['event_seq']})")
    else:
        out.append(f"{ex['version']} is approximate: its measured gap to a retrain is in "
                   f"event {ex['event_seq']}")
    return out


def render_chain(chain: dict[str, Any]) -> list[str]:
    """How the first version served without the records is known to be exact."""
    head = f"exactness of {chain['version']} (the first version served without it): "
    if not chain["covered"]:
        return [head + f"NOT PROVEN: {chain['why']}"]
    checked = chain["checked"]
    if not chain["links"]:
        return [head + f"retrained from scratch to the same hash itself (event "
                       f"{checked['event_seq']})"]
    return [head + f"{len(chain['links'])} exact update(s) to {checked['version']}, whose "
                   f"retrain from scratch gave the same hash (event {checked['event_seq']})",
            *(f"  {link['version']} <- {link['parent']}: {link['change']}, "
              f"{link['guarantee']} (event {link['event_seq']})" for link in chain["links"])]

"""What the ledger can prove about one deletion: when the data left, and what held it.

Everything here is read from the ledger's own tables, mostly from its events,
so an auditor can check each claim against an inclusion proof:

- each purged record: its keyed fingerprint and when its features and label left
  the record store (``training_records.purged_at``, set in the transaction of the
  ``applied`` event);
- the first version published without them: the version the deletion's
  ``applied`` event names (the registry's pointer moved in that same transaction);
- the versions that held them: every version published from the one that first
  held a record (the first version trained, or the one that applied the record's
  addition) until the first one without it; for each, whether a ``destroyed`` event
  says it is gone (version, manifest digest, content hash) or it still awaits
  destruction;
- the proof of exactness: the ``verified`` event of the deletion, which carries the
  retrain-from-scratch hash of the learner next to the served one.

Versions are opaque names to the ledger: they are ordered by their first event.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import func, select

from ledger.models import Event, TrainingRecord
from ledger.store import Ledger

EVENTS = Event.__table__
RECORDS = TrainingRecord.__table__


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
        first_seen = _versions_in_order(conn)
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
    if verified is not None:
        check = verified["payload"].get("exactness") or {}
        report["exactness"] = {"version": verified["model_version"],
                               "event_seq": verified["seq"],
                               **{k: check.get(k) for k in ("guarantee", "exact",
                                                            "served_hash", "retrained_hash")}}
    return report


def _versions_in_order(conn: Any) -> list[str]:
    """Every version any event names, in the order of its first event."""
    first = func.min(EVENTS.c.seq)
    return list(conn.execute(select(EVENTS.c.model_version).where(
        EVENTS.c.model_version.is_not(None)).group_by(EVENTS.c.model_version)
        .order_by(first)).scalars())


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

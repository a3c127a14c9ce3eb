"""`obliviate ledger show`'s summary: a request's history in aligned lines for a person.

The full document (every event's payload and inclusion proof, the signed head it is
proven against) is `ledger show --json`, which an auditor checks
(docs/ledger.md, "Checking an event without the rest of the log").
"""

from __future__ import annotations

from typing import Any


def render_history(history: dict[str, Any]) -> list[str]:
    """The request, one line per event (seq, kind, time, version, hash, proof length),
    and the tree head the proofs lead to."""
    req = history["request"]
    what = (f"subject {req['subject_id']}" if req.get("subject_id") else "") or \
        f"records {', '.join(req.get('record_ids') or []) or '-'}"
    lines = [f"request {req['request_id']}: {req['op']} {what}, {req['status']} "
             f"(from {req.get('source') or '-'}, received {req.get('received_at') or '-'})"]
    events = history.get("events") or []
    if events:
        width = max(len(e["kind"]) for e in events)
        lines.append(f"  {'seq':>6}  {'event':<{width}}  {'at':<27}  {'version':<8}  "
                     "hash              proof")
        for e in events:
            lines.append(f"  {e['seq']:>6}  {e['kind']:<{width}}  {e['created_at']:<27}  "
                         f"{e.get('model_version') or '-':<8}  {e['hash'][:16]}  "
                         f"{len(e.get('inclusion_proof') or [])} hash(es)")
    head = history.get("tree_head")
    if head:
        signed = head.get("signed")
        by = f", signed by log {signed['log_id'][:16]}..." if signed else ", not signed yet"
        lines.append(f"proven against the tree head over {head['tree_size']} events, root "
                     f"{head['root_hash'][:16]}...{by}")
    lines.append("(--json: every payload and inclusion proof, for an auditor)")
    return lines

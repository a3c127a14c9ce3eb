"""What the public sees of a model version: no seeds, and in private mode nothing seed-made.

The admin sees the whole manifest; everyone else gets :func:`version_dict` with
``full`` False, which drops what private prediction mode rests on keeping secret.
See docs/security.md (Guarantees and the tests that hold them)."""

from __future__ import annotations

from typing import Any

from jobs.orchestration.registry import ModelVersion
from ledger.chain import iso

# what the public may not see of a manifest: the seeds (private prediction mode rests on
# them staying secret) and where it was built
_PRIVATE_MANIFEST = ("seed", "built_by")
# In private prediction mode, what the public may see of a version's change and guard:
# nothing that depends on the shard seeds. Which shards an update retrained, from which
# slice, how many records they hold, how long they took and each shard's bound all tell
# which shard a deleted or added record was in (released outside the seeds' budget).
_SEEDLESS_CHANGE = ("op", "requests", "n_records", "reason", "to", "from")
_SEEDLESS_UPDATE = ("op", "n_records", "guarantee")
_SEEDLESS_GUARD = ("rule", "ready", "n_shards", "shard_bound")
_SEEDLESS_CHECK = ("guarantee", "exact")


def _public_manifest(m: dict[str, Any], private: bool) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in _PRIVATE_MANIFEST}
    out["params"] = {k: v for k, v in m.get("params", {}).items() if k != "random_state"}
    if private:
        out["guard"] = _pick(m.get("guard"), _SEEDLESS_GUARD)
        out["change"] = _seedless_change(m.get("change") or {})
    return out


def _seedless_change(change: dict[str, Any]) -> dict[str, Any]:
    out = _pick(change, _SEEDLESS_CHANGE)
    if "updates" in change:
        out["updates"] = [_pick(u, _SEEDLESS_UPDATE) for u in change["updates"]]
    if "guard" in change:
        out["guard"] = _pick(change["guard"], _SEEDLESS_GUARD)
    if "exactness" in change:
        out["exactness"] = _pick(change["exactness"], _SEEDLESS_CHECK)
    return out


def _pick(d: dict[str, Any] | None, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d[k] for k in keys if k in d} if isinstance(d, dict) else {}


def version_dict(v: ModelVersion, full: bool = False, private: bool = False
                 ) -> dict[str, Any]:
    """A version as JSON: its whole manifest if `full` (the admin), else the public part."""
    return {"version": v.version, "seq": v.seq, "parent": v.parent,
            "created_at": iso(v.created_at),
            "manifest": v.manifest if full else _public_manifest(v.manifest, private),
            "superseded_by_deletion": v.superseded_by_deletion,
            "destroyed_at": None if v.destroyed_at is None else iso(v.destroyed_at)}


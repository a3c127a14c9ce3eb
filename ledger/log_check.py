"""What `LedgerVerifier.verify` reports, and the facts it gathers from the log to hold the
working tables to. See docs/ledger.md (What `ledger verify` holds)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ledger import merkle
from ledger.chain import canonical_json, iso
from ledger.models import REQUEST_STATUSES

# request lifecycle moves `verify` accepts: (kind before, kind after)
_LIFECYCLE = frozenset({(None, "received"), ("received", "claimed"), ("claimed", "claimed"),
                        ("claimed", "applied"), ("claimed", "failed"), ("applied", "verified")})


def schema_sha256(n_features: int, classes: list[int], transform: dict[str, Any] | None) -> str:
    """The digest a `records_loaded` event gives of what a query means: the width, the
    classes and the input transform as `dataset_schema` stores them."""
    return hashlib.sha256(canonical_json({"n_features": n_features, "classes": classes,
                                          "transform": transform}).encode()).hexdigest()


@dataclass
class Problem:
    """One thing `verify` found wrong, named precisely enough to go and look."""

    where: str
    message: str
    seq: int | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class VerifyResult:
    ok: bool
    events: int
    checkpoints: int
    records: int
    problems: list[Problem] = field(default_factory=list)
    heads: int = 0  # signed tree heads
    notes: list[str] = field(default_factory=list)  # what verify could not check, and why
    # the newest signed head this verify vouches for: where `--since-verified` starts next
    verified_head: dict[str, Any] | None = None
    since: int | None = None  # an incremental verify: the verified head it started from

    @property
    def first_bad_seq(self) -> int | None:
        seqs = [p.seq for p in self.problems if p.seq is not None]
        return min(seqs) if seqs else None


class LogFacts:
    """What the events say happened to requests and records, gathered in `verify`'s one
    pass over the log, to hold the working tables to it."""

    # the kinds `see` reads: the lifecycle's and those whose payload it parses
    KINDS = frozenset(REQUEST_STATUSES) | {"received", "applied", "records_loaded", "rejected",
                                           "duplicate", "source_reset"}

    def __init__(self) -> None:
        self.kind: dict[str, str] = {}  # request -> its last lifecycle event's kind
        self.first: dict[str, int] = {}  # request -> seq of its first lifecycle event
        self.received: dict[str, int] = {}  # request -> seq of its `received` event
        self.purged: dict[str, list[tuple[str, str, int]]] = {}  # record -> (request, fp, seq)
        self.added: dict[str, tuple[str, str, int]] = {}  # record -> (request, fp, seq)
        self.loaded: dict[str, tuple[int, str, int]] = {}  # created_at -> (count, root, seq)
        self.loaded_fps: dict[str, list[bytes]] = {}  # added_at -> fingerprints (records)
        self.seen: set[str] = set()  # records check_record saw (each one a deletion lists)
        # each `records_loaded` event: (seq, schema digest or None, n_features, classes)
        self.loads: list[tuple[int, str | None, int | None, list[int]]] = []
        # (topic, partition) -> (offset, seq) of the last message an event records from it
        self.offsets: dict[tuple[str, int], tuple[int, int]] = {}
        self._loaded_at: dict[Any, list[bytes]] = {}  # loaded_fps by the stored time

    def see(self, e: Any, problems: list[Problem]) -> None:
        rid = e.request_id
        if rid and e.kind in REQUEST_STATUSES:
            before = self.kind.get(rid)
            if (before, e.kind) not in _LIFECYCLE:
                problems.append(Problem(f"event {e.seq}", f"{e.kind!r} of request {rid} cannot "
                                        f"follow {before!r} (forged, or events removed)", e.seq))
            self.kind[rid] = e.kind
            self.first.setdefault(rid, e.seq)
            if e.kind == "received":
                self.received.setdefault(rid, e.seq)
        if e.kind not in ("received", "applied", "records_loaded", "rejected", "duplicate",
                          "source_reset"):
            return
        try:
            payload = json.loads(e.payload)
            if e.kind == "received":
                for rec, fp in (payload.get("record_hashes") or {}).items():
                    self.added[rec] = (rid, fp, e.seq)
            elif e.kind == "applied":
                for rec, fp in (payload.get("purged_record_hashes") or {}).items():
                    self.purged.setdefault(rec, []).append((rid, fp, e.seq))
            elif e.kind == "records_loaded":
                self.loaded[e.created_at] = (int(payload["count"]), payload["records_root"],
                                             e.seq)
                self.loads.append((e.seq, payload.get("schema_sha256"),
                                   payload.get("n_features"), payload.get("classes") or []))
            source = payload.get("source") or {}
            if e.kind == "source_reset":  # the log started again: as if before its first
                self.offsets[(source["topic"], int(source["partition"]))] = (
                    int(payload["next_offset"]) - 1, e.seq)
            elif source.get("kind") == "kafka" and source.get("topic") is not None:
                self.offsets[(source["topic"], int(source["partition"] or 0))] = (
                    int(source["offset"]), e.seq)
        except (ValueError, TypeError, KeyError, AttributeError):
            problems.append(Problem(f"event {e.seq}", f"{e.kind!r} payload is not what the "
                                    "ledger writes", e.seq))

    def check_request(self, r: Any) -> list[Problem]:
        seq = self.received.get(r.request_id)
        if seq is None:
            return [Problem(f"request {r.request_id}", "has no `received` event: the row was "
                            "not written by intake")]
        if seq != r.received_seq:
            return [Problem(f"request {r.request_id}", f"says it was received at event "
                            f"{r.received_seq}, its `received` event is {seq}")]
        return []

    def requests_without_rows(self, rows: dict[str, str]) -> list[Problem]:
        return [Problem(f"request {rid}", f"has lifecycle events (the first is event {seq}) "
                        "but no request row (deleted?)")
                for rid, seq in sorted(self.first.items(), key=lambda kv: kv[1])
                if rid not in rows]

    def loaded_record(self, added_at: Any, record_hash: str) -> None:
        """A record `ledger init` loaded at `added_at` (no request added it): its
        fingerprint, for the root of its `records_loaded` event (`check_loaded`)."""
        fps = self._loaded_at.get(added_at)
        if fps is None:
            key = "-" if added_at is None else iso(added_at)
            fps = self._loaded_at[added_at] = self.loaded_fps.setdefault(key, [])
        fps.append(bytes.fromhex(record_hash))

    def check_record(self, rec: Any, status_of: dict[str, str]) -> list[Problem]:
        """A record's state, purge and addition against what the events say."""
        where = f"record {rec.record_id}"
        out = []
        self.seen.add(rec.record_id)
        by = self.purged.get(rec.record_id, [])
        if rec.state == "purged":
            if not by:
                out.append(Problem(where, "is purged, but no applied deletion lists it (a "
                                          "purge the log does not show)"))
            elif rec.record_hash not in {fp for _, fp, _ in by}:
                out.append(Problem(where, f"its fingerprint is not the one the deletion "
                                          f"{by[0][0]} lists for it at event {by[0][2]} "
                                          "(swapped)"))
            elif rec.purged_by not in {req for req, _, _ in by}:
                out.append(Problem(where, f"says {rec.purged_by!r} purged it, but only "
                                          f"{', '.join(sorted({q for q, _, _ in by}))} list it"))
        elif by:
            out.append(Problem(where, f"is {rec.state}, but the deletion {by[0][0]} purged it "
                                      f"(event {by[0][2]}): its data was restored"))
        if rec.added_by is None:
            self.loaded_record(rec.added_at, rec.record_hash)
            return out
        added = self.added.get(rec.record_id)
        if added is None or added[0] != rec.added_by:
            out.append(Problem(where, f"says {rec.added_by!r} added it, but that request's "
                                      "`received` event does not list it"))
            return out
        if added[1] != rec.record_hash:
            out.append(Problem(where, f"its fingerprint is not the one its addition lists "
                                      f"(event {added[2]})"))
        applied = status_of.get(rec.added_by) in ("applied", "verified")
        if applied == (rec.state == "pending"):
            out.append(Problem(where, f"is {rec.state} while its addition {rec.added_by} is "
                                      f"{status_of.get(rec.added_by)!r}"))
        return out

    def check_schema(self, row: Any, notes: list[str]) -> list[Problem]:
        """`dataset_schema` (what every query and addition means) is the one the
        `records_loaded` events committed to: an edited input transform would rescale
        them all without a trace."""
        where = "dataset_schema"
        if row is None:
            return [Problem(where, f"is missing, though event {self.loads[0][0]} loaded "
                                   "records")] if self.loads else []
        if not self.loads:
            return [Problem(where, "no `records_loaded` event announces it (inserted behind "
                                   "the ledger's back)")]
        digest = schema_sha256(row.n_features, row.classes, row.transform)
        out = []
        for i, (seq, said, n_features, classes) in enumerate(self.loads):
            if said is None:  # a load from before the digest: its width and classes only
                if n_features != row.n_features or not set(classes) <= set(row.classes) or (
                        i == 0 and sorted(classes) != sorted(row.classes)):
                    out.append(Problem(where, f"{row.n_features} features, classes "
                                              f"{row.classes}: not what event {seq} "
                                              "(records_loaded) says (edited)", seq))
                elif i == 0:
                    notes.append(f"the input transform is not covered by an event (event {seq} "
                                 "loaded the records before loads carried a schema digest)")
            elif said != digest:
                out.append(Problem(where, f"the input transform, classes or width is not "
                                          f"what event {seq} (records_loaded) committed to: "
                                          "edited, which changes what every query and "
                                          "addition means", seq))
        return out

    def check_offsets(self, rows: list[Any]) -> list[Problem]:
        """Each partition's next Kafka offset follows the last message an event records
        from it: raised, it would skip requests as redeliveries; lowered, read them again."""
        out = []
        stored = {(r.topic, r.partition): r.next_offset for r in rows}
        for (topic, partition), nxt in sorted(stored.items()):
            where = f"source offset {topic}/{partition}"
            seen = self.offsets.get((topic, partition))
            if seen is None:
                out.append(Problem(where, f"says the next offset is {nxt}, but no event "
                                          "records a message of that partition (inserted "
                                          "behind the ledger's back)"))
            elif nxt != seen[0] + 1:
                out.append(Problem(where, f"says the next offset is {nxt}, but the last "
                                          f"message recorded from it is offset {seen[0]} "
                                          f"(event {seen[1]}): edited, so messages would be "
                                          + ("skipped" if nxt > seen[0] else "taken again")))
        for (topic, partition), (offset, seq) in sorted(self.offsets.items()):
            if (topic, partition) not in stored:
                out.append(Problem(f"source offset {topic}/{partition}", f"event {seq} "
                                   f"recorded offset {offset} from it, but source_offsets "
                                   "has no row for it (deleted)", seq))
        return out

    def check_loaded(self) -> list[Problem]:
        """The records not added by a request hold the fingerprints a `records_loaded`
        event committed to (its Merkle root over them), as many as it says."""
        out = []
        for at, fps in sorted(self.loaded_fps.items()):
            ev = self.loaded.get(at)
            if ev is None:
                out.append(Problem(f"records loaded at {at}", f"{len(fps)} record(s) that no "
                                   "event announces (inserted behind the ledger's back)"))
                continue
            count, root, seq = ev
            fps.sort()
            if count != len(fps) or merkle.root([merkle.leaf_hash(f) for f in fps]).hex() != root:
                out.append(Problem(f"records loaded at {at}", f"{len(fps)} record(s) whose "
                                   f"fingerprints do not give the root event {seq} committed "
                                   f"to over {count} (records swapped, added or removed)"))
        for at, (count, _, seq) in sorted(self.loaded.items()):
            if at not in self.loaded_fps:
                out.append(Problem(f"records loaded at {at}", f"event {seq} loaded {count} "
                                   "record(s); none of them is in training_records"))
        for rec, by in sorted(self.purged.items()):
            if rec not in self.seen:
                out.append(Problem(f"record {rec}", f"the deletion {by[0][0]} purged it (event "
                                   f"{by[0][2]}), but training_records has no row for it"))
        return out

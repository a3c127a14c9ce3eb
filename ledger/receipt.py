"""A deletion receipt, checked by the data subject alone.

``python -m ledger.receipt receipt.json --key PUBKEY [--head LATER.json]`` checks a signed
head, the request's events and those its exactness rests on, each with its inclusion
proof, and the key rotations since PUBKEY. Standard library and `cryptography` only,
nothing else of this project: the check must not rest on the code it checks.
See docs/ledger.md (A receipt the data subject checks alone)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

RECEIPT_FORMAT = "obliviate-deletion-receipt/v1"
HEAD_FORMAT = "obliviate-tree-head/v1"
ROTATION_FORMAT = "obliviate-key-rotation/v1"
ROTATION_KIND = "key_rotated"
HEAD_FIELDS = ("log_id", "tree_size", "root_hash", "timestamp", "signature")


# ---------------------------------------------------------------------------- primitives
def canonical(obj: Any) -> str:
    """The ledger's one spelling of a JSON value (sorted keys, no spaces, UTF-8, no NaN)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def payload_of(event: dict[str, Any]) -> dict[str, Any]:
    """An event's payload as a dict (events carry it as the stored text, or parsed)."""
    p = event["payload"]
    return json.loads(p) if isinstance(p, str) else p


def event_hash(event: dict[str, Any]) -> str:
    """The chain hash of an event from its fields (what `ledger.chain.event_hash` gives)."""
    p = event["payload"]
    entry = canonical({"seq": event["seq"], "request_id": event["request_id"],
                       "kind": event["kind"], "payload": p if isinstance(p, str) else canonical(p),
                       "model_version": event["model_version"],
                       "created_at": event["created_at"], "prev_hash": event["prev_hash"]})
    return hashlib.sha256(entry.encode()).hexdigest()


def _leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def verify_inclusion(leaf: bytes, index: int, size: int, proof: list[bytes],
                     root: bytes) -> bool:
    """RFC 9162 2.1.3.2: `leaf` (a leaf hash) is at `index` of the tree of `size` leaves."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = _node(p, r)
            while fn and not fn & 1:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = _node(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(old: int, new: int, old_root: bytes, new_root: bytes,
                       proof: list[bytes]) -> bool:
    """RFC 9162 2.1.4.2: the tree of `new` leaves extends the tree of `old` leaves."""
    if not 0 < old <= new:
        return False
    if old == new:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = ([old_root] if old & (old - 1) == 0 else []) + list(proof)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = _node(c, fr), _node(c, sr)
            while fn and not fn & 1:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = _node(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == old_root and sr == new_root


def _hashes(values: Any) -> list[bytes] | None:
    """A proof as 32-byte hashes (None: not a list of 64-hex strings)."""
    if not isinstance(values, list) or not all(isinstance(v, str) and len(v) == 64
                                               and _is_hex(v) for v in values):
        return None
    return [bytes.fromhex(v) for v in values]


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- keys and heads
def log_id(public_key: bytes) -> str:
    """The name of a log: SHA-256 of its raw 32-byte Ed25519 public key, hex."""
    return hashlib.sha256(public_key).hexdigest()


def head_message(log: str, tree_size: int, root_hash: str, timestamp: str) -> bytes:
    """The exact bytes a head's signature is over (canonical JSON, format tag first)."""
    return canonical({"format": HEAD_FORMAT, "log_id": log, "tree_size": tree_size,
                      "root_hash": root_hash, "timestamp": timestamp}).encode()


def rotation_message(old_log: str, new_public_key: str, seq: int, prev_hash: str) -> bytes:
    """What the retiring key signs: the key that follows it, at one place of one log (the
    rotation event's seq and its predecessor's hash), so the signature moves nowhere else."""
    return canonical({"format": ROTATION_FORMAT, "log_id": old_log,
                      "new_public_key": new_public_key, "seq": seq,
                      "prev_hash": prev_hash}).encode()


def _signed_by(public_key: bytes, signature: str, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(bytes.fromhex(signature), message)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def verify_head(head: Any, public_key: bytes) -> str | None:
    """None when `head` is a well-formed head of the log of `public_key` with a valid
    signature, else why not. Never raises: heads come from untrusted parties."""
    if not isinstance(head, dict):
        return "is not a JSON object"
    missing = [f for f in HEAD_FIELDS if f not in head]
    if missing:
        return f"lacks {', '.join(missing)}"
    size, root, ts, sig = (head["tree_size"], head["root_hash"], head["timestamp"],
                           head["signature"])
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"tree_size {size!r} is not a size"
    if not (isinstance(root, str) and len(root) == 64 and _is_hex(root)):
        return "root_hash is not 32 bytes of hex"
    if not isinstance(ts, str) or not isinstance(sig, str) or not _is_hex(sig):
        return "timestamp or signature is malformed"
    expected = log_id(public_key)
    if head["log_id"] != expected:
        return (f"names log {str(head['log_id'])[:16]}..., not the log of this public key "
                f"({expected[:16]}...)")
    if not _signed_by(public_key, sig, head_message(expected, size, root, ts)):
        return "signature does not verify with the log's public key"
    return None


def parse_public_key(text: str) -> bytes:
    """A raw Ed25519 public key from 64 hex digits or a PEM block (ValueError otherwise)."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the PEM block is not an Ed25519 public key")
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if len(text) != 64 or not _is_hex(text):
        raise ValueError("a public key is 64 hex digits (or a PEM block)")
    return bytes.fromhex(text)


def key_argument(value: str) -> bytes:
    """--key / --public-key: 64 hex digits, a PEM block, or a file holding either."""
    if not value.lstrip().startswith("-----") and Path(value).is_file():
        value = Path(value).read_text()
    return parse_public_key(value)


@dataclass
class KeyChain:
    """The keys that signed one log, in order. Key i signs the heads over more than
    ends[i-1] and at most ends[i] events, ends[i] being the seq of the `key_rotated`
    event that retired it (the last key is open-ended). A rotation counts when the
    retiring key signed it (:func:`rotation_message`) and a head of that key covers it
    (a head over exactly the rotation's seq)."""

    keys: list[bytes]
    ends: list[int] = field(default_factory=list)

    @classmethod
    def follow(cls, anchor: bytes | None, rotations: list[dict[str, Any]]
               ) -> tuple[KeyChain | None, list[str]]:
        """The chain that `rotations` (records {"event", "head"}, in seq order) describe,
        and what is wrong with it. The chain starts at the first rotation's old key (or
        at `anchor` when there is none) and must hold `anchor`, the key the checker
        trusts. None when there is neither a rotation nor an anchor."""
        if not rotations:
            return (None, []) if anchor is None else (cls([anchor]), [])
        try:
            first = bytes.fromhex(payload_of(rotations[0]["event"])["from_public_key"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None, ["the first key rotation does not name the key it retires"]
        chain, problems = cls([first]), []
        for rec in rotations:
            why = chain._take(rec)
            if why:
                seq = rec.get("event", {}).get("seq") if isinstance(rec, dict) else None
                problems.append(f"key rotation at event {seq}: {why}")
                break
        if anchor is not None and anchor not in chain.keys:
            problems.append(f"the trusted public key ({anchor.hex()[:16]}...) is none of the "
                            f"keys the log's rotations lead through ("
                            f"{', '.join(k.hex()[:16] + '...' for k in chain.keys)})")
        return chain, problems

    def _take(self, rec: Any) -> str | None:
        """Append the key a rotation record introduces; why not, when it does not count."""
        try:
            ev, head = rec["event"], rec.get("head")
            p = payload_of(ev)
            seq, new = ev["seq"], p["to_public_key"]
            if ev["kind"] != ROTATION_KIND or event_hash(ev) != ev["hash"]:
                return "is not a key rotation, or does not match its hash"
            new_key = bytes.fromhex(new)
        except (KeyError, TypeError, ValueError, AttributeError):
            return "is malformed"
        old = self.keys[-1]
        if p.get("from_public_key") != old.hex():
            return (f"retires key {str(p.get('from_public_key'))[:16]}..., but the log's key "
                    f"then was {old.hex()[:16]}...")
        if len(new_key) != 32 or new_key in self.keys:
            return "names no new 32-byte key"
        if seq <= (self.ends[-1] if self.ends else 0):
            return "comes before the rotation it follows"
        if not _signed_by(old, str(p.get("signature")),
                          rotation_message(log_id(old), new, seq, ev["prev_hash"])):
            return "is not signed by the key it retires"
        why = verify_head(head, old)
        if why or head["tree_size"] != seq:
            return (f"no head of the retiring key covers it (its head over {seq} events "
                    f"{why or 'is of another size'})")
        self.keys.append(new_key)
        self.ends.append(seq)
        return None

    @property
    def current(self) -> bytes:
        return self.keys[-1]

    def log_ids(self) -> dict[str, bytes]:
        return {log_id(k): k for k in self.keys}

    def span(self, key: bytes) -> tuple[int, float]:
        """(lo, hi]: the head sizes `key` may sign."""
        i = self.keys.index(key)
        return (self.ends[i - 1] if i else 0), (self.ends[i] if i < len(self.ends)
                                                 else float("inf"))

    def key_for(self, size: int) -> bytes:
        for key in self.keys:
            lo, hi = self.span(key)
            if lo < size <= hi:
                return key
        return self.keys[0]  # a head over no events

    def check_head(self, head: Any) -> str | None:
        """None when `head` is signed by the key that signs its size, else why not."""
        size = head.get("tree_size") if isinstance(head, dict) else None
        key = self.key_for(size if isinstance(size, int) and not isinstance(size, bool) else 0)
        why = verify_head(head, key)
        if why is None:
            return None
        other = self.log_ids().get(head.get("log_id")) if isinstance(head, dict) else None
        if other is not None and other != key:
            lo, hi = self.span(other)
            return (f"{why}: that key signs heads over {lo + 1}..{hi} events only "
                    "(rotated)")
        if isinstance(head, dict) and "log_id" in head and other is None:
            return f"{why}; no key rotation introduced that key"
        return why


# ---------------------------------------------------------------------------- the receipt
@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(receipt: Any, key: bytes, later: Any = None) -> Verdict:
    """Check a receipt against the public key the subject trusts (and, given `later`, a
    consistency proof to a later head): the signatures, every event's hash and inclusion
    proof, and what the events say about the deletion."""
    out = Verdict()
    try:
        _check(receipt, key, later, out)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        out.problems.append(f"the receipt is malformed ({type(exc).__name__}: {exc})")
    return out


def _check(doc: dict[str, Any], key: bytes, later: Any, out: Verdict) -> None:
    if doc.get("format") != RECEIPT_FORMAT:
        out.problems.append(f"not a deletion receipt (format {doc.get('format')!r})")
        return
    chain, why = KeyChain.follow(key, doc.get("rotations") or [])
    out.problems.extend(why)
    head = doc["head"]
    bad = chain.check_head(head) if chain else "no key"
    if bad:
        out.problems.append(f"the receipt's head: {bad}")
    if out.problems:
        return
    size, root = head["tree_size"], bytes.fromhex(head["root_hash"])
    out.facts.append(f"head: {size} events, root {head['root_hash'][:16]}..., signed "
                     f"{head['timestamp']} by log {head['log_id'][:16]}...")
    events: dict[int, dict[str, Any]] = {}
    for ev in doc["events"]:
        proof = _hashes(ev.get("inclusion_proof"))
        h = event_hash(ev)
        if h != ev["hash"]:
            out.problems.append(f"event {ev['seq']}: its content does not match its hash")
        elif proof is None or not verify_inclusion(_leaf(bytes.fromhex(h)), ev["seq"] - 1,
                                                   size, proof, root):
            out.problems.append(f"event {ev['seq']}: not in the log the head signs "
                                "(its inclusion proof fails)")
        events[ev["seq"]] = ev
    if not out.problems:
        _check_claims(doc["request_id"], doc["claims"], events, out)
    if later is not None and not out.problems:
        _check_later(chain, head, later, out)


def _event(events: dict[int, dict[str, Any]], seq: Any, kind: str, out: Verdict,
           request_id: str | None = None) -> dict[str, Any] | None:
    ev = events.get(seq)
    if ev is None or ev["kind"] != kind or (request_id and ev["request_id"] != request_id):
        out.problems.append(f"the receipt names event {seq} as the {kind!r} event"
                            f"{' of ' + request_id if request_id else ''}, but carries no "
                            "such event")
        return None
    return ev


def _check_claims(rid: str, claims: dict[str, Any], events: dict[int, dict[str, Any]],
                  out: Verdict) -> None:
    """What the proven events say: the request, the purge, the first version without the
    records, their older versions' destruction, the chain to an exactness check."""
    received = _event(events, claims["received"], "received", out, rid)
    applied = _event(events, claims["applied"], "applied", out, rid)
    if received is None or applied is None:
        return
    asked = payload_of(received)
    purged = payload_of(applied).get("purged_record_hashes") or {}
    if asked.get("op") != "delete" or sorted(purged) != sorted(asked.get("record_ids") or []):
        out.problems.append("the `applied` event does not purge the records the deletion "
                            "named")
        return
    first = applied["model_version"]
    if first != claims["first_version_without"]:
        out.problems.append(f"the receipt says {claims['first_version_without']} is the first "
                            f"version without the records; the `applied` event says {first}")
        return
    out.facts.append(f"request {rid}: deletion of {len(purged)} record(s) received at "
                     f"{received['created_at']} (event {received['seq']}), purged and "
                     f"first served without them by {first} at {applied['created_at']} "
                     f"(event {applied['seq']})")
    for rec, fp in sorted(purged.items()):
        out.facts.append(f"  record {rec}: fingerprint {fp}")
    if claims.get("verified") is not None:
        ev = _event(events, claims["verified"], "verified", out, rid)
        if ev is not None:
            out.facts.append(f"verified on {ev['model_version']} (event {ev['seq']})")
    for held in claims["held_by"]:
        if held.get("destroyed") is None:
            out.facts.append(f"  held by {held['version']}: awaiting destruction")
            continue
        ev = _event(events, held["destroyed"], "destroyed", out)
        if ev is not None and ev["model_version"] == held["version"]:
            out.facts.append(f"  held by {held['version']}: destroyed at {ev['created_at']} "
                             f"(event {ev['seq']})")
        elif ev is not None:
            out.problems.append(f"event {ev['seq']} destroyed {ev['model_version']}, not "
                                f"{held['version']}")
    _check_exactness(first, applied, claims["exactness"], events, out)


def _check_exactness(first: str, applied: dict[str, Any], claim: dict[str, Any],
                     events: dict[int, dict[str, Any]], out: Verdict) -> None:
    """Each link a later publication of an exact update (or of a new guard only) of the
    link before, in log order, the first one the exact retrain that replaced `first` if
    that was approximate; the last one's exactness check passed."""
    if not claim.get("covered"):
        out.facts.append(f"exactness of {first}: not proven yet ({claim.get('why')})")
        return
    version, last_seq = first, applied["seq"]
    for link in claim["links"]:
        ev = events.get(link["event_seq"])
        if ev is None or ev["model_version"] != link["version"] or ev["seq"] <= last_seq \
                or link["parent"] != version:
            out.problems.append(f"the exactness chain's link to {link['version']} is not an "
                                "event of the receipt, or out of order")
            return
        p = payload_of(ev)
        if version == first and payload_of(applied).get("guarantee") != "exact":
            # an approximate version: only a retrain that names it as replaced covers it
            if first not in (p.get("replaces") or (p.get("change") or {}).get("replaces")
                             or []):
                out.problems.append(f"event {ev['seq']} does not replace the approximate "
                                    f"{first} with an exact retrain")
                return
        elif not ((ev["kind"] == "applied" and p.get("guarantee") == "exact")
                or ev["kind"] == "guard_refreshed"
                or (ev["kind"] == "verified" and not p.get("in_place"))):
            out.problems.append(f"event {ev['seq']} publishes {link['version']} by "
                                f"{ev['kind']!r}, which is no exact update")
            return
        version, last_seq = link["version"], ev["seq"]
    ev = events.get(claim["checked"]["event_seq"])
    exactness = {} if ev is None else (payload_of(ev).get("exactness")
                                       or (payload_of(ev).get("change") or {}).get("exactness")
                                       or {})
    if ev is None or ev["model_version"] != version or not (
            exactness.get("guarantee") == "exact" and exactness.get("exact") is True
            and exactness.get("served_hash") == exactness.get("retrained_hash")):
        out.problems.append(f"no passing exactness check of {version} among the receipt's "
                            "events")
        return
    out.facts.append(f"exactness of {first}: {len(claim['links'])} exact update(s) to "
                     f"{version}, retrained from scratch to the same hash "
                     f"{str(exactness['served_hash'])[:16]}... (event {ev['seq']})")


def _check_later(chain: KeyChain, head: dict[str, Any], later: dict[str, Any],
                 out: Verdict) -> None:
    """`later`: a consistency document from the receipt's tree size to a later head."""
    new = later.get("new_head")
    more, why = KeyChain.follow(chain.keys[0], later.get("rotations") or [])
    if more is None or why or not set(chain.keys) <= set(more.keys):
        out.problems.append("the later head's key rotations do not extend the receipt's: "
                            + "; ".join(why))
        return
    bad = more.check_head(new) if new else "is missing"
    if bad:
        out.problems.append(f"the later head {bad}")
        return
    proof = _hashes(later.get("proof"))
    if later.get("old_size") != head["tree_size"] or proof is None or not verify_consistency(
            head["tree_size"], new["tree_size"], bytes.fromhex(head["root_hash"]),
            bytes.fromhex(new["root_hash"]), proof):
        out.problems.append(f"the log was rewritten: the later head over {new['tree_size']} "
                            f"events does not extend the receipt's over {head['tree_size']}")
        return
    out.facts.append(f"still in the log: the head over {new['tree_size']} events signed "
                     f"{new['timestamp']} extends the receipt's")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ledger.receipt",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("receipt", help="the receipt file (`obliviate ledger receipt` output)")
    p.add_argument("--key", required=True, help="the ledger's public key: hex, PEM or a file")
    p.add_argument("--head", help="a consistency document from the receipt's tree size to a "
                                  "later head (`obliviate ledger consistency`)")
    args = p.parse_args(argv)
    try:
        key = key_argument(args.key)
        doc = json.loads(Path(args.receipt).read_text())
        later = json.loads(Path(args.head).read_text()) if args.head else None
    except (OSError, ValueError) as exc:
        print(f"receipt: error: {exc}", file=sys.stderr)
        return 2
    verdict = check(doc, key, later)
    for fact in verdict.facts:
        print(fact)
    if verdict.problems:
        print(f"receipt FAILED: {verdict.problems[0]}", file=sys.stderr)
        for problem in verdict.problems[1:10]:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print("receipt OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

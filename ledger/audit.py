"""An auditor's check of the ledger against signed heads saved earlier.

`obliviate audit check --heads SAVED.json` runs it on the configured database;
`python -m ledger.audit` runs it on files or the service's public endpoints with only
the standard library, `cryptography` and five files of this package. It checks every
head's signature (following key rotations), that the log only grew since the saved heads,
and that the events rebuild the chain and every root. See docs/ledger.md (Signed tree heads)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledger import merkle
from ledger.chain import GENESIS_HASH, canonical_json, event_hash, event_leaf
from ledger.heads import ROTATION_KIND, KeyChain, parse_public_key

Proofs = Callable[[int, int], list[bytes]]


@dataclass
class AuditResult:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    newest: dict[str, Any] | None = None
    events: int | None = None  # events read (None: no events were given)

    @property
    def ok(self) -> bool:
        return not self.problems


def heads_of(doc: Any) -> list[dict[str, Any]]:
    """The heads of a `ledger heads` document (or of a bare list of heads, or one head)."""
    if isinstance(doc, dict) and "heads" in doc:
        doc = doc["heads"]
    if isinstance(doc, dict):
        return [doc]
    if not isinstance(doc, list):
        raise ValueError("not a list of heads nor a `ledger heads` document")
    return list(doc)


def audit(saved: Any, current: Any, *, public_key: bytes | None = None,
          events: Iterable[dict[str, Any]] | None = None,
          consistency: Proofs | None = None) -> AuditResult:
    """Check the log (its current heads, proofs and events) against heads saved earlier.

    `consistency(old, new)` gives the log's consistency proof between two sizes; when
    it is None the proof is built from `events` (which must then be given).
    """
    out = AuditResult()
    problems, notes = out.problems, out.notes
    saved_heads, current_heads = heads_of(saved), heads_of(current)
    key = public_key
    if key is None:
        pinned = saved.get("public_key") if isinstance(saved, dict) else None
        if not pinned:
            problems.append("no public key: pass --public-key, or save heads as "
                            "`ledger heads` prints them (with the log's public key)")
            return out
        key = parse_public_key(pinned)
        notes.append("public key taken from the saved heads file (pin it with --public-key)")
    rotations = (current.get("rotations") if isinstance(current, dict) else None) or []
    chain, why = KeyChain.follow(key, rotations)
    problems.extend(why)
    presented = current.get("public_key") if isinstance(current, dict) else None
    if presented and presented != chain.current.hex():
        problems.append(f"the log now presents another public key ({presented[:16]}...) "
                        f"than the one its key rotations lead to from the pinned key "
                        f"({chain.current.hex()[:16]}...)")
    for label, hs in (("saved", saved_heads), ("current", current_heads)):
        for h in hs:
            why = chain.check_head(h)
            if why:
                size = h.get("tree_size") if isinstance(h, dict) else None
                problems.append(f"{label} head {size}: {why}")
    if problems:
        return out
    if not current_heads:
        problems.append("the log publishes no signed head")
        return out
    newest = max(current_heads, key=lambda h: h["tree_size"])
    out.newest = newest
    by_size: dict[int, str] = {}
    for h in current_heads:
        if by_size.setdefault(h["tree_size"], h["root_hash"]) != h["root_hash"]:
            problems.append(f"current heads {h['tree_size']}: two signed roots for one size "
                            "(a fork)")
    leaves: list[bytes] | None = None
    if events is not None:
        leaves = _check_events(events, saved_heads, current_heads, rotations,
                               consistency is None, out)
    else:
        notes.append("no events given: their chain and roots were not checked")
    if consistency is None:
        if leaves is None:
            problems.append("no consistency proofs: give the events, or a log to ask")
            return out
        held = leaves

        def consistency(old: int, new: int) -> list[bytes]:
            return merkle.consistency_proof(held[:new], old)
    _check_saved_heads(saved_heads, newest, by_size, consistency, problems)
    return out


def _check_events(events: Iterable[dict[str, Any]], saved_heads: list[dict[str, Any]],
                  current_heads: list[dict[str, Any]], rotations: list[dict[str, Any]],
                  keep: bool, out: AuditResult) -> list[bytes] | None:
    """Replay the events: every head's root rebuilt, the rotations held to the log's
    `key_rotated` events; the leaves when `keep` (to prove consistency with)."""
    problems, newest = out.problems, out.newest
    sizes = {h["tree_size"] for h in saved_heads} | {h["tree_size"] for h in current_heads}
    rotated: list[tuple[int, str]] = []
    roots, leaves, n = _replay(events, sizes, keep, problems, rotated)
    out.events = n
    if _upto(rotated, newest) != _upto([(r["event"]["seq"], r["event"]["hash"])
                                        for r in rotations], newest):
        problems.append("the key rotations the heads document lists are not the "
                        "`key_rotated` events of the log")
    for label, hs in (("saved", saved_heads), ("current", current_heads)):
        for h in hs:
            size = h["tree_size"]
            if size > n:
                problems.append(f"{label} head {size}: covers {size} events, the export "
                                f"has {n} (events removed, or an export not from event 1)")
            elif roots[size] != h["root_hash"]:
                problems.append(f"{label} head {size}: the events do not rebuild its root "
                                "(the log was rewritten)")
    if n > newest["tree_size"]:
        out.notes.append(f"events {newest['tree_size'] + 1}..{n} come after the newest signed "
                         "head: nothing checks them until the next head")
    return leaves


def _check_saved_heads(saved_heads: list[dict[str, Any]], newest: dict[str, Any],
                       by_size: dict[int, str], consistency: Proofs,
                       problems: list[str]) -> None:
    """Each saved head is a prefix of the newest current one: same root for its size,
    and a consistency proof between the two."""
    for h in sorted(saved_heads, key=lambda h: h["tree_size"]):
        old, new = h["tree_size"], newest["tree_size"]
        if by_size.get(old, h["root_hash"]) != h["root_hash"]:
            problems.append(f"saved head {old}: the log now signs another root for the same "
                            "size (a fork)")
            continue
        if old > new:
            problems.append(f"saved head {old}: covers more events than the log's newest head "
                            f"({new}): events were removed or heads dropped")
            continue
        try:
            proof = consistency(old, new)
        except (ValueError, OSError) as exc:
            problems.append(f"saved head {old}: no consistency proof to {new} ({exc})")
            continue
        if not merkle.verify_consistency(old, new, bytes.fromhex(h["root_hash"]),
                                         bytes.fromhex(newest["root_hash"]), proof):
            problems.append(f"saved head {old}: not consistent with the newest head {new} "
                            "(the log was rewritten)")


def _upto(rotations: list[tuple[int, str]], head: dict[str, Any]) -> list[tuple[int, str]]:
    return [r for r in rotations if r[0] <= head["tree_size"]]


def _replay(events: Iterable[dict[str, Any]], sizes: set[int], keep_leaves: bool,
            problems: list[str], rotated: list[tuple[int, str]]
            ) -> tuple[dict[int, str], list[bytes] | None, int]:
    """Rebuild the chain from exported events: (root at each of `sizes`, leaves, count);
    the (seq, hash) of each key rotation go to `rotated`."""
    frontier = merkle.MerkleFrontier()
    roots: dict[int, str] = {}
    if 0 in sizes:
        roots[0] = merkle.EMPTY_ROOT.hex()
    leaves: list[bytes] | None = [] if keep_leaves else None
    prev = GENESIS_HASH
    reported = 0
    for ev in events:
        seq = frontier.size + 1
        try:
            payload = ev["payload"] if isinstance(ev["payload"], str) else \
                canonical_json(ev["payload"])
            h = event_hash(ev["seq"], ev["request_id"], ev["kind"], payload,
                           ev["model_version"], ev["created_at"], ev["prev_hash"])
            why = (f"the export gives seq {ev['seq']} here (events missing or reordered)"
                   if ev["seq"] != seq
                   else "does not follow the previous event's hash" if ev["prev_hash"] != prev
                   else "content does not match its hash" if h != ev["hash"] else None)
        except (KeyError, TypeError, ValueError) as exc:
            h, why = "00" * 32, f"is malformed ({exc})"
        if why and reported < 10:
            problems.append(f"event {seq}: {why}")
            reported += 1
        if isinstance(ev, dict) and ev.get("kind") == ROTATION_KIND:
            rotated.append((seq, h))
        prev = ev.get("hash", h) if isinstance(ev, dict) else h
        leaf = event_leaf(h)
        frontier.append(leaf)
        if leaves is not None:
            leaves.append(leaf)
        if frontier.size in sizes:
            roots[frontier.size] = frontier.root().hex()
    return roots, leaves, frontier.size


# ---------------------------------------------------------------------------- sources
def read_json(path: str) -> Any:
    return json.loads(sys.stdin.read() if path == "-" else Path(path).read_text())


def read_events(path: str) -> Iterator[dict[str, Any]]:
    """Events of a `ledger export` file (JSON lines), streamed."""
    with (sys.stdin if path == "-" else open(path, encoding="utf-8")) as fh:  # noqa: SIM115
        for line in fh:
            if line.strip():
                yield json.loads(line)


def fetch_json(base_url: str, path: str, **params: Any) -> Any:
    url = base_url.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - the auditor's URL
        return json.loads(resp.read())


def http_consistency(base_url: str) -> Proofs:
    def proof(old: int, new: int) -> list[bytes]:
        doc = fetch_json(base_url, "/v1/ledger/consistency", old=old, new=new)
        return [bytes.fromhex(p) for p in doc["proof"]]
    return proof


def key_argument(value: str | None) -> bytes | None:
    """--public-key: 64 hex digits, a PEM block, or a file holding either."""
    if not value:
        return None
    if not value.lstrip().startswith("-----") and Path(value).is_file():
        value = Path(value).read_text()
    return parse_public_key(value)


def report(result: AuditResult) -> int:
    """Print the outcome; the exit code (1 naming the first problem)."""
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if result.problems:
        print(f"audit FAILED: {len(result.problems)} problem(s); first: {result.problems[0]}",
              file=sys.stderr)
        for p in result.problems[1:20]:
            print(f"  {p}", file=sys.stderr)
        return 1
    n = result.newest
    events = "" if result.events is None else f", {result.events} events rebuild it"
    print(f"audit OK: newest head {n['tree_size']} ({n['root_hash'][:16]}..., "
          f"{n['timestamp']}) is signed, extends every saved head{events}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", required=True, help="heads saved earlier (`ledger heads` output)")
    p.add_argument("--events", help="`ledger export` output (JSON lines, from event 1)")
    p.add_argument("--current", help="the log's heads now (`ledger heads` output)")
    p.add_argument("--url", help="the service: current heads and consistency proofs from "
                                 "its public endpoints")
    p.add_argument("--public-key", help="the log's public key (hex, PEM, or a file); "
                                        "default: the one in the saved heads file")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ledger.audit", description=__doc__.split(
        "\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if not (args.current or args.url):
        p.error("give --current FILE or --url URL (or use `obliviate audit check`, which "
                "reads the database)")
    current = read_json(args.current) if args.current else fetch_json(args.url,
                                                                      "/v1/ledger/heads")
    events = read_events(args.events) if args.events else None
    proofs = http_consistency(args.url) if args.url else None
    return report(audit(read_json(args.heads), current, public_key=key_argument(args.public_key),
                        events=events, consistency=proofs))


if __name__ == "__main__":
    sys.exit(main())

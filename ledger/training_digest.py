"""The Merkle root that names a model's training set: its records' keyed fingerprints,
sorted, as RFC 6962 leaves. A worker publishes one per version, and between two versions
a stream of deletions removes a few records from 10^6, so the sorted leaf hashes are kept
and the next digest only drops the records that left.
See docs/DESIGN.md (Architecture)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ledger import merkle

# the fingerprints of records not seen yet: record id -> fingerprint (KeyError if unknown)
Fetch = Callable[[list[str]], dict[str, bytes]]


class TrainingSetDigest:
    """(count, root) of a set of records. The sorted leaves of every record seen since
    the last sort are kept; a set that only lost records from them is a mask over them."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        # the records sorted last, in fingerprint order: ids, fingerprints, leaf hashes
        self._ids: list[str] = []
        self._fps: list[bytes] = []
        self._leaves: list[bytes] = []
        self._at: dict[str, int] = {}  # record id -> its place in that order

    def __call__(self, record_ids: Sequence[str]) -> tuple[int, str]:
        at = self._at
        place = np.fromiter((at.get(str(r), -1) for r in record_ids), dtype=np.int64)
        if (place < 0).any():  # a record not sorted yet: sort the set again
            self._sort(list(map(str, record_ids)))
            return self(record_ids)
        held = np.zeros(len(self._ids), dtype=bool)
        held[place] = True
        kept = np.flatnonzero(held).tolist()
        if 2 * len(kept) < len(self._ids):  # keep about one training set's worth
            self._sort([self._ids[i] for i in kept])
            kept = list(range(len(kept)))
        return len(kept), merkle.root([self._leaves[i] for i in kept]).hex()

    def _sort(self, ids: list[str]) -> None:
        """Sort the set afresh (the first digest, one after additions, or one that kept
        less than half of the records), fetching only the fingerprints not known yet."""
        known = dict(zip(self._ids, self._fps, strict=True))
        known.update(self._fetch(list({r for r in ids if r not in known})))
        self._ids = sorted(set(ids), key=known.__getitem__)
        self._fps = [known[r] for r in self._ids]
        self._leaves = [merkle.leaf_hash(f) for f in self._fps]
        self._at = {r: i for i, r in enumerate(self._ids)}

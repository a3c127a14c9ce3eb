"""The Merkle root that names a model's training set: its records' keyed fingerprints,
sorted, as RFC 6962 leaves. A worker publishes one per version, and between two versions
a stream of deletions removes a few records from 10^6, so the sorted leaf hashes are kept
and the next digest only drops the records that left.
See docs/DESIGN.md (Architecture)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ledger import merkle

# the fingerprints of records not seen yet: record id -> fingerprint (KeyError if unknown)
Fetch = Callable[[list[str]], dict[str, bytes]]


class _Sorted(NamedTuple):
    """A set of records in fingerprint order: ids, fingerprints, leaf hashes, and each
    id's place (one value, replaced whole: a digest never mixes two sorts)."""

    ids: list[str]
    fps: list[bytes]
    leaves: list[bytes]
    at: dict[str, int]


class TrainingSetDigest:
    """(count, root) of a set of records. The sorted leaves of every record seen since
    the last sort are kept; a set that only lost records from them is a mask over them."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._sorted = _Sorted([], [], [], {})

    def __call__(self, record_ids: Sequence[str]) -> tuple[int, str]:
        last = self._sorted
        place = np.fromiter((last.at.get(str(r), -1) for r in record_ids), dtype=np.int64)
        if (place < 0).any():  # a record not sorted yet: sort the set again
            last = self._sorted = self._sort(list(map(str, record_ids)), last)
            leaves = last.leaves
        else:
            held = np.zeros(len(last.ids), dtype=bool)
            held[place] = True
            kept = np.flatnonzero(held).tolist()
            if 2 * len(kept) < len(last.ids):  # keep about one training set's worth
                last = self._sorted = self._sort([last.ids[i] for i in kept], last)
                leaves = last.leaves
            else:
                leaves = [last.leaves[i] for i in kept]
        return len(leaves), merkle.root(leaves).hex()

    def _sort(self, ids: list[str], last: _Sorted) -> _Sorted:
        """The set sorted afresh (the first digest, one after additions, or one that kept
        less than half of the records), fetching only the fingerprints not known yet."""
        known = dict(zip(last.ids, last.fps, strict=True))
        known.update(self._fetch(list({r for r in ids if r not in known})))
        order = sorted(set(ids), key=known.__getitem__)
        fps = [known[r] for r in order]
        return _Sorted(order, fps, [merkle.leaf_hash(f) for f in fps],
                       {r: i for i, r in enumerate(order)})

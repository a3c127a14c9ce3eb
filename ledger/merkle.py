"""RFC 6962 / RFC 9162 Merkle tree hashing, proofs and an incremental tree head.

Exactly the RFC's hashing and split rule, so an off-the-shelf Certificate Transparency
library checks the ledger's heads and proofs; everything works on leaf hashes so the log
can stream its entries. Builders raise on a caller's bug; verifiers never raise (their
inputs are untrusted). See docs/ledger.md (Checking an event without the rest of the log)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = [
    "EMPTY_ROOT",
    "HASH_SIZE",
    "MerkleFrontier",
    "consistency_proof",
    "consistency_ranges",
    "fold",
    "inclusion_proof",
    "inclusion_ranges",
    "leaf_hash",
    "node_hash",
    "perfect_subtrees",
    "root",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
"""SHA-256 digest length; every hash accepted or produced here has exactly this length."""

_LEAF_PREFIX = b"\x00"
_NODE_PREFIX = b"\x01"
_sha256 = hashlib.sha256

EMPTY_ROOT: bytes = _sha256(b"").digest()
"""MTH({}) per RFC 6962 section 2.1: the hash of the empty string, not of a zero leaf."""


def leaf_hash(data: bytes) -> bytes:
    """Hash a log entry; the 0x00 prefix keeps leaves from being passed off as inner nodes."""
    return _sha256(_LEAF_PREFIX + bytes(data)).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """Hash two children; the 0x01 prefix is the second-preimage guard of RFC 6962."""
    return _sha256(_NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly below n (n >= 2): RFC 6962's split, not the midpoint."""
    return 1 << ((n - 1).bit_length() - 1)


def _subtree_root(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    """MTH(leaves[lo:hi]) computed level by level, so depth never touches the call stack.

    Pairing adjacent nodes and carrying an unpaired last node up unchanged builds exactly
    the RFC 6962 tree: at every level the left part is a run of perfect subtrees and the
    odd node out is always the rightmost, which the largest-power-of-two split puts alone
    on the right.
    """
    n = hi - lo
    if n <= 0:
        return EMPTY_ROOT
    if n == 1:
        return leaves[lo]
    sha = _sha256
    prefix = _NODE_PREFIX
    # First level straight from the input, without copying it into a list.
    level = [sha(prefix + leaves[i] + leaves[i + 1]).digest() for i in range(lo, hi - 1, 2)]
    if n & 1:
        level.append(leaves[hi - 1])
    while len(level) > 1:
        odd = level[-1] if len(level) & 1 else None
        it = iter(level)
        level = [sha(prefix + a + b).digest() for a, b in zip(it, it, strict=False)]
        if odd is not None:
            level.append(odd)
    return level[0]


def root(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH(D[n]) of RFC 6962 section 2.1, i.e. the tree head a checkpoint signs."""
    return _subtree_root(leaf_hashes, 0, len(leaf_hashes))


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    return value


def inclusion_ranges(index: int, tree_size: int) -> list[tuple[int, int]]:
    """The leaf ranges [lo, hi) whose roots make PATH(index, D[tree_size]) of RFC 6962
    section 2.1.1, leaf-to-root order as RFC 9162 verifiers expect.

    Walks down from the root keeping the half that holds ``index`` and records the other
    half. Each range is a perfect subtree or a right edge of one, so its root folds from
    O(log n) stored subtrees (:func:`perfect_subtrees`).
    """
    index, n = _check_int("index", index), _check_int("tree_size", tree_size)
    if n <= 0:
        raise ValueError("cannot build an inclusion proof in an empty tree")
    if not 0 <= index < n:
        raise ValueError(f"index {index} out of range for a tree of {n} leaves")
    ranges: list[tuple[int, int]] = []
    lo, hi = 0, n
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            ranges.append((lo + k, hi))
            hi = lo + k
        else:
            ranges.append((lo, lo + k))
            lo += k
    ranges.reverse()
    return ranges


def consistency_ranges(old_size: int, tree_size: int) -> list[tuple[int, int]]:
    """The leaf ranges [lo, hi) whose roots make PROOF(old_size, D[tree_size]) of RFC 6962
    section 2.1.2, in the order RFC 9162 verifiers expect.

    ``old_size`` of 0 or of the full size needs no proof (RFC 9162 section 2.1.4) and
    gives an empty list, so a caller can ask for any checkpoint pair without special cases.
    """
    m, n = _check_int("old_size", old_size), _check_int("tree_size", tree_size)
    if m < 0:
        raise ValueError(f"old_size must be non-negative, got {m}")
    if m > n:
        raise ValueError(f"old_size {m} is larger than the tree ({n} leaves)")
    if m == 0 or m == n:
        return []
    # Iterative SUBPROOF(m, D[lo:hi], b); ranges are collected root-first, then reversed.
    ranges: list[tuple[int, int]] = []
    lo, hi = 0, n
    complete = True  # RFC's b: whether D[lo:lo+m] is still the old tree's own root
    while m != hi - lo:
        k = _split(hi - lo)
        if m <= k:
            ranges.append((lo + k, hi))
            hi = lo + k
        else:
            ranges.append((lo, lo + k))
            lo += k
            m -= k
            complete = False
    if not complete:
        ranges.append((lo, hi))
    ranges.reverse()
    return ranges


def perfect_subtrees(lo: int, hi: int) -> list[tuple[int, int]]:
    """Leaves [lo, hi) as perfect subtrees (level, index), left to right (largest first):
    the subtree (L, j) holds leaves [j * 2**L, (j + 1) * 2**L).

    For every range of RFC 6962's tree (``lo`` a multiple of the power of two at or above
    ``hi - lo``, as the split makes them) MTH(D[lo:hi]) is :func:`fold` of their roots.
    """
    out: list[tuple[int, int]] = []
    while lo < hi:
        level = (hi - lo).bit_length() - 1
        if lo:
            level = min(level, (lo & -lo).bit_length() - 1)
        out.append((level, lo >> level))
        lo += 1 << level
    return out


def fold(subtree_roots: Sequence[bytes]) -> bytes:
    """The root over adjacent perfect subtrees given largest first: hashed right to left,
    as RFC 6962 carries the right edge up (EMPTY_ROOT for none)."""
    if not subtree_roots:
        return EMPTY_ROOT
    r = subtree_roots[-1]
    for h in reversed(subtree_roots[:-1]):
        r = node_hash(h, r)
    return r


def inclusion_proof(leaf_hashes: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(m, D[n]) of RFC 6962 section 2.1.1 over leaves in memory: O(n) hashing.
    (The ledger's own proofs read stored subtrees instead: :mod:`ledger.subtree_store`.)"""
    return [_subtree_root(leaf_hashes, lo, hi)
            for lo, hi in inclusion_ranges(index, len(leaf_hashes))]


def consistency_proof(leaf_hashes: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 section 2.1.2 over leaves in memory, showing the first
    ``old_size`` leaves are kept; empty for ``old_size`` 0 or the full size."""
    return [_subtree_root(leaf_hashes, lo, hi)
            for lo, hi in consistency_ranges(old_size, len(leaf_hashes))]


def _is_hash(value: object) -> bool:
    return isinstance(value, (bytes, bytearray, memoryview)) and len(value) == HASH_SIZE


def _as_hash_list(proof: object) -> list[bytes] | None:
    """Normalise an untrusted proof to a list of 32-byte ``bytes``, or None if it is not one."""
    if isinstance(proof, (bytes, bytearray, memoryview, str)):
        return None  # a single hash or a string is not a sequence of hashes
    try:
        items = list(proof)  # type: ignore[call-overload]
    except TypeError:
        return None
    if not all(_is_hash(p) for p in items):
        return None
    return [bytes(p) for p in items]


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify_inclusion(
    leaf_hash: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes
) -> bool:
    """RFC 9162 section 2.1.3.2: does ``leaf_hash`` sit at ``index`` in the tree with ``root``?

    Trust both ``tree_size`` and ``root`` only if they come from the same signed checkpoint.
    """
    if not (_is_size(index) and _is_size(tree_size) and index < tree_size):
        return False
    if not (_is_hash(leaf_hash) and _is_hash(root)):
        return False
    path = _as_hash_list(proof)
    if path is None:
        return False
    fn, sn = index, tree_size - 1
    r = bytes(leaf_hash)
    for p in path:
        if sn == 0:
            return False  # proof longer than the path to the root
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                # Right-edge node with no sibling at these levels: it is carried up as is.
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == bytes(root)


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 section 2.1.4.2: is the ``new_size`` tree an append-only extension of the old?

    Equal sizes need an empty proof and equal roots; an empty old tree is extended by
    every tree, but its root must still be ``EMPTY_ROOT`` so a bogus checkpoint is not waved
    through.
    """
    if not (_is_size(old_size) and _is_size(new_size) and old_size <= new_size):
        return False
    if not (_is_hash(old_root) and _is_hash(new_root)):
        return False
    path = _as_hash_list(proof)
    if path is None:
        return False
    old_root, new_root = bytes(old_root), bytes(new_root)
    if old_size == 0 and old_root != EMPTY_ROOT:
        return False
    if old_size == new_size:
        return not path and old_root == new_root
    if old_size == 0:
        return not path
    if not path:
        return False
    if old_size & (old_size - 1) == 0:
        # The old tree is a perfect subtree of the new one, so the proof omits its root.
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False  # proof longer than the path to the root
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root


class MerkleFrontier:
    """Incremental tree head: the roots of the perfect subtrees covering the leaves so far.

    Lets one pass over the log check every checkpoint it meets, in O(log n) memory and
    amortised O(1) hashing per append, instead of rebuilding a tree per checkpoint.
    The stack holds one root per set bit of ``size``, largest (leftmost) first.
    """

    __slots__ = ("_size", "_stack")

    def __init__(self) -> None:
        self._size = 0
        self._stack: list[bytes] = []

    @property
    def size(self) -> int:
        """Number of leaves appended so far."""
        return self._size

    def append(self, leaf_hash: bytes) -> list[bytes]:
        """Add the next leaf hash, merging equal-sized subtrees as a binary counter carries.
        Returns the roots of the subtrees this leaf completes, levels 1, 2, ... (what
        :mod:`ledger.subtree_store` stores)."""
        if not _is_hash(leaf_hash):
            raise ValueError(f"leaf_hash must be {HASH_SIZE} bytes")
        h = bytes(leaf_hash)
        stack = self._stack
        n = self._size
        completed = []
        while n & 1:
            h = node_hash(stack.pop(), h)
            completed.append(h)
            n >>= 1
        stack.append(h)
        self._size += 1
        return completed

    def root(self) -> bytes:
        """MTH of everything appended so far: fold the subtree roots right to left."""
        return fold(self._stack)

    def state(self) -> tuple[int, list[bytes]]:
        """(size, subtree roots largest first): enough to resume appending later."""
        return self._size, list(self._stack)

    @classmethod
    def from_state(cls, size: int, stack: Sequence[bytes]) -> MerkleFrontier:
        """Resume from `state()`, e.g. a stored checkpoint, without rereading the log."""
        if size < 0 or len(stack) != bin(size).count("1") or not all(map(_is_hash, stack)):
            raise ValueError(f"a frontier of size {size} needs {bin(size).count('1')} "
                             f"{HASH_SIZE}-byte subtree roots")
        f = cls()
        f._size, f._stack = size, [bytes(h) for h in stack]
        return f

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"MerkleFrontier(size={self._size})"

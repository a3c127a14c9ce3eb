"""Tests for ledger.merkle: RFC 6962 / RFC 9162 trees, proofs and the incremental tree head.

Builders are checked against a deliberately naive recursive transcription of the RFC 6962
definitions (below), and against published Certificate Transparency vectors, so a bug that
the implementation and its own verifier happen to share cannot pass unnoticed.
"""

from __future__ import annotations

import hashlib
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.merkle import (
    EMPTY_ROOT,
    MerkleFrontier,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    root,
    verify_consistency,
    verify_inclusion,
)

MAX_N = 300

# Distinct leaves, so any accepted tampering would mean a SHA-256 collision, not bad luck.
LEAVES = [leaf_hash(b"obliviate/test/%d" % i) for i in range(MAX_N + 1)]


def _h(hex_str: str) -> bytes:
    return bytes.fromhex(hex_str)


def _flip(h: bytes, byte: int = 0) -> bytes:
    return h[:byte] + bytes([h[byte] ^ 0x01]) + h[byte + 1 :]


# --- reference: RFC 6962 section 2.1 read literally, over LEAVES[lo:hi] --------------------


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


@cache
def ref_mth(lo: int, hi: int) -> bytes:
    n = hi - lo
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return LEAVES[lo]
    k = _k(n)
    return hashlib.sha256(b"\x01" + ref_mth(lo, lo + k) + ref_mth(lo + k, hi)).digest()


def ref_path(m: int, lo: int, hi: int) -> list[bytes]:
    n = hi - lo
    if n == 1:
        return []
    k = _k(n)
    if m < k:
        return ref_path(m, lo, lo + k) + [ref_mth(lo + k, hi)]
    return ref_path(m - k, lo + k, hi) + [ref_mth(lo, lo + k)]


def ref_subproof(m: int, lo: int, hi: int, b: bool) -> list[bytes]:
    n = hi - lo
    if m == n:
        return [] if b else [ref_mth(lo, hi)]
    k = _k(n)
    if m <= k:
        return ref_subproof(m, lo, lo + k, b) + [ref_mth(lo + k, hi)]
    return ref_subproof(m - k, lo + k, hi, False) + [ref_mth(lo, lo + k)]


def ref_proof(m: int, n: int) -> list[bytes]:
    return [] if m in (0, n) else ref_subproof(m, 0, n, True)


def path_shape(index: int, size: int) -> list[bool]:
    """Leaf-to-root 'is the sibling on the left' flags of PATH(index, D[size])."""
    flags = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _k(hi - lo)
        if index < lo + k:
            flags.append(False)
            hi = lo + k
        else:
            flags.append(True)
            lo += k
    return flags[::-1]


ROOTS = [ref_mth(0, n) for n in range(MAX_N + 1)]


# --- known answers ---------------------------------------------------------------------------

# transparency-dev/merkle and certificate-transparency test data (RFC 6962 trees).
CT_ENTRIES = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    bytes(range(0x50, 0x58)),
    bytes(range(0x60, 0x70)),
]
CT_LEAVES = [leaf_hash(e) for e in CT_ENTRIES]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
CT_INCLUSION = {
    (0, 8): [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (5, 8): [
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
}
CT_CONSISTENCY = {
    (2, 8): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ],
    (6, 8): [
        "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
        "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    ],
    (2, 5): [
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
    ],
}


def test_empty_root_is_sha256_of_nothing() -> None:
    assert EMPTY_ROOT.hex() == CT_ROOTS[0]
    assert root([]) == EMPTY_ROOT
    assert MerkleFrontier().root() == EMPTY_ROOT


def test_hash_prefixes() -> None:
    assert leaf_hash(b"abc") == hashlib.sha256(b"\x00abc").digest()
    a, b = leaf_hash(b"a"), leaf_hash(b"b")
    assert node_hash(a, b) == hashlib.sha256(b"\x01" + a + b).digest()
    assert node_hash(a, b) != node_hash(b, a)
    # Domain separation: a leaf whose data is two hashes is not the node over them.
    assert leaf_hash(a + b) != node_hash(a, b)


def test_single_leaf_tree() -> None:
    h = leaf_hash(b"only")
    assert root([h]) == h
    assert inclusion_proof([h], 0) == []
    assert verify_inclusion(h, 0, 1, [], h)
    assert not verify_inclusion(h, 0, 1, [], leaf_hash(b"other"))
    assert consistency_proof([h], 1) == []
    assert verify_consistency(1, 1, h, h, [])


@pytest.mark.parametrize("n", range(len(CT_ROOTS)))
def test_ct_reference_roots(n: int) -> None:
    assert root(CT_LEAVES[:n]).hex() == CT_ROOTS[n]


@pytest.mark.parametrize(("index", "size"), sorted(CT_INCLUSION))
def test_ct_reference_inclusion(index: int, size: int) -> None:
    proof = inclusion_proof(CT_LEAVES[:size], index)
    assert [p.hex() for p in proof] == CT_INCLUSION[(index, size)]
    assert verify_inclusion(CT_LEAVES[index], index, size, proof, _h(CT_ROOTS[size]))


@pytest.mark.parametrize(("old", "new"), sorted(CT_CONSISTENCY))
def test_ct_reference_consistency(old: int, new: int) -> None:
    proof = consistency_proof(CT_LEAVES[:new], old)
    assert [p.hex() for p in proof] == CT_CONSISTENCY[(old, new)]
    assert verify_consistency(old, new, _h(CT_ROOTS[old]), _h(CT_ROOTS[new]), proof)


class Rfc6962Example:
    """The 7-leaf tree drawn in RFC 6962 section 2.1.3, with the RFC's node names.

                hash
               /    \\
              k      l
             / \\    / \\
            g   h  i   j
           / \\ / \\ / \\ |
           a b c d e f d6
    """

    def __init__(self) -> None:
        self.leaves = [leaf_hash(b"d%d" % i) for i in range(7)]
        a, b, c, d, e, f, j = self.leaves
        g, h, i = node_hash(a, b), node_hash(c, d), node_hash(e, f)
        k, l_ = node_hash(g, h), node_hash(i, j)
        self.n = dict(a=a, b=b, c=c, d=d, e=e, f=f, g=g, h=h, i=i, j=j, k=k, l=l_)
        self.hash = node_hash(k, l_)

    def names(self, proof: list[bytes]) -> list[str]:
        by_hash = {v: name for name, v in self.n.items()}
        return [by_hash[p] for p in proof]


def test_rfc6962_example_root() -> None:
    ex = Rfc6962Example()
    assert root(ex.leaves) == ex.hash


@pytest.mark.parametrize(
    ("index", "names"),
    # RFC 6962 section 2.1.3: "The audit path for d0 is [b, h, l]" and so on.
    [(0, "b h l"), (3, "c g l"), (4, "f j k"), (6, "i k")],
)
def test_rfc6962_example_audit_paths(index: int, names: str) -> None:
    ex = Rfc6962Example()
    proof = inclusion_proof(ex.leaves, index)
    assert ex.names(proof) == names.split()
    assert verify_inclusion(ex.leaves[index], index, 7, proof, ex.hash)


@pytest.mark.parametrize(
    ("old", "names"),
    # RFC 6962 section 2.1.4: PROOF(3, D[7]) = [c, d, g, l], PROOF(4, D[7]) = [l],
    # PROOF(6, D[7]) = [i, j, k].
    [(3, "c d g l"), (4, "l"), (6, "i j k")],
)
def test_rfc6962_example_consistency(old: int, names: str) -> None:
    ex = Rfc6962Example()
    proof = consistency_proof(ex.leaves, old)
    assert ex.names(proof) == names.split()
    old_root = root(ex.leaves[:old])
    assert verify_consistency(old, 7, old_root, ex.hash, proof)
    assert not verify_consistency(old, 7, old_root, ex.n["k"], proof)


# --- properties: inclusion -----------------------------------------------------------------


@st.composite
def size_and_index(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(st.integers(1, MAX_N))
    return n, draw(st.integers(0, n - 1))


@settings(max_examples=150, deadline=None)
@given(size_and_index())
def test_inclusion_proof_verifies_and_tampering_fails(case: tuple[int, int]) -> None:
    n, i = case
    tree, leaf, rt = LEAVES[:n], LEAVES[i], ROOTS[n]
    proof = inclusion_proof(tree, i)
    assert proof == ref_path(i, 0, n)
    assert verify_inclusion(leaf, i, n, proof, rt)

    # Any proof element altered, dropped, duplicated, or two elements swapped.
    for pos in range(len(proof)):
        for byte in (0, 31):
            bad = list(proof)
            bad[pos] = _flip(bad[pos], byte)
            assert not verify_inclusion(leaf, i, n, bad, rt)
        assert not verify_inclusion(leaf, i, n, proof[:pos] + proof[pos + 1 :], rt)
        assert not verify_inclusion(leaf, i, n, proof[: pos + 1] + proof[pos:], rt)
        if pos + 1 < len(proof):
            swapped = list(proof)
            swapped[pos], swapped[pos + 1] = swapped[pos + 1], swapped[pos]
            assert not verify_inclusion(leaf, i, n, swapped, rt)
    assert not verify_inclusion(leaf, i, n, [*proof, LEAVES[MAX_N]], rt)

    # The leaf, the root.
    assert not verify_inclusion(_flip(leaf), i, n, proof, rt)
    assert not verify_inclusion(LEAVES[MAX_N], i, n, proof, rt)
    assert not verify_inclusion(leaf, i, n, proof, _flip(rt, 31))

    # The index: every other position, and out of range.
    for j in range(-1, n + 2):
        if j != i:
            assert not verify_inclusion(leaf, j, n, proof, rt)

    for m in range(0, MAX_N + 1):
        if m == n:
            continue
        # A checkpoint of another size (its own size and root, as a signed checkpoint
        # carries both) never accepts this proof: the path determines the tree size.
        assert not verify_inclusion(leaf, i, m, proof, ROOTS[m])
        # With the *same* root and only the size changed, RFC 9162 verification can only
        # tell sizes apart where the path shapes differ; the root does not commit to the
        # size (see test_root_alone_does_not_bind_tree_size). Exactly that, nothing more:
        expected = i < m and path_shape(i, m) == path_shape(i, n)
        assert verify_inclusion(leaf, i, m, proof, rt) == expected


# --- properties: consistency ---------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(st.integers(1, MAX_N))
def test_consistency_proof_verifies_for_every_old_size(n: int) -> None:
    tree = LEAVES[:n]
    for m in range(0, n + 1):
        proof = consistency_proof(tree, m)
        assert proof == ref_proof(m, n)
        assert verify_consistency(m, n, ROOTS[m], ROOTS[n], proof)
        if 0 < m < n:
            assert not verify_consistency(m, n, ROOTS[m], ROOTS[n], proof[:-1])
            assert not verify_consistency(m, n, ROOTS[m], ROOTS[n], [*proof, LEAVES[MAX_N]])


@st.composite
def old_and_new(draw: st.DrawFn) -> tuple[int, int]:
    n = draw(st.integers(1, MAX_N))
    return draw(st.integers(1, n)), n


@settings(max_examples=150, deadline=None)
@given(old_and_new(), st.integers(0, MAX_N), st.integers(0, MAX_N))
def test_consistency_tampering_fails(case: tuple[int, int], m2: int, n2: int) -> None:
    m, n = case
    old_root, new_root = ROOTS[m], ROOTS[n]
    proof = consistency_proof(LEAVES[:n], m)
    assert verify_consistency(m, n, old_root, new_root, proof)

    for pos in range(len(proof)):
        for byte in (0, 31):
            bad = list(proof)
            bad[pos] = _flip(bad[pos], byte)
            assert not verify_consistency(m, n, old_root, new_root, bad)
        assert not verify_consistency(m, n, old_root, new_root, proof[:pos] + proof[pos + 1 :])
        if pos + 1 < len(proof):
            swapped = list(proof)
            swapped[pos], swapped[pos + 1] = swapped[pos + 1], swapped[pos]
            assert not verify_consistency(m, n, old_root, new_root, swapped)
    assert not verify_consistency(m, n, old_root, new_root, [*proof, LEAVES[MAX_N]])

    assert not verify_consistency(m, n, _flip(old_root), new_root, proof)
    assert not verify_consistency(m, n, old_root, _flip(new_root, 31), proof)
    if m != n:
        assert not verify_consistency(m, n, new_root, new_root, proof)
        assert not verify_consistency(m, n, old_root, old_root, proof)

    # Other sizes, each with its own root as a signed checkpoint would carry: accepted
    # exactly when this proof is also the canonical proof for that pair (e.g. both empty).
    others = {(m2, n2), (m - 1, n), (m + 1, n), (m, n - 1), (m, n + 1), (m - 1, n + 1)}
    others |= {(m + 1, n - 1), (m2, n), (m, n2)}
    for a, b in sorted(others - {(m, n)}):
        if not (0 <= a <= MAX_N and 0 <= b <= MAX_N):
            continue
        expected = a <= b and proof == ref_proof(a, b)
        assert verify_consistency(a, b, ROOTS[a], ROOTS[b], proof) == expected, (a, b)


def test_root_alone_does_not_bind_tree_size() -> None:
    """Documents why checkpoints must sign (size, root) together, not the root alone.

    Both checks follow RFC 9162 to the letter and still accept: the paths have the same
    shape in trees of different sizes, and nothing in the hashes records the size.
    """
    rt4 = ROOTS[4]
    assert verify_inclusion(LEAVES[0], 0, 3, inclusion_proof(LEAVES[:4], 0), rt4)
    assert verify_consistency(2, 5, ROOTS[1], ROOTS[3], consistency_proof(LEAVES[:3], 1))


# --- the incremental tree head -------------------------------------------------------------


def test_frontier_matches_root_for_every_prefix() -> None:
    f = MerkleFrontier()
    for n in range(MAX_N + 1):
        assert f.size == len(f) == n
        assert f.root() == ROOTS[n] == root(LEAVES[:n])
        if n < MAX_N:
            f.append(LEAVES[n])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=8), max_size=80))
def test_frontier_matches_root_on_arbitrary_entries(entries: list[bytes]) -> None:
    hashes = [leaf_hash(e) for e in entries]
    f = MerkleFrontier()
    assert f.root() == root([])
    for n, h in enumerate(hashes, start=1):
        f.append(h)
        assert f.size == n
        assert f.root() == root(hashes[:n])


def test_frontier_checks_many_checkpoints_in_one_pass() -> None:
    checkpoints = {1: ROOTS[1], 2: ROOTS[2], 7: ROOTS[7], 64: ROOTS[64], 65: ROOTS[65]}
    checkpoints[MAX_N] = ROOTS[MAX_N]
    f = MerkleFrontier()
    seen = []
    for h in LEAVES[:MAX_N]:
        f.append(h)
        if f.size in checkpoints:
            assert f.root() == checkpoints[f.size]
            seen.append(f.size)
    assert seen == sorted(checkpoints)
    # A forged checkpoint is caught at its size.
    g = MerkleFrontier()
    for h in LEAVES[:7]:
        g.append(h)
    assert g.root() != ROOTS[6] and g.root() != _flip(ROOTS[7])


def test_frontier_rejects_non_hash() -> None:
    f = MerkleFrontier()
    with pytest.raises(ValueError):
        f.append(b"short")
    assert f.size == 0


# --- verifiers never raise on garbage ------------------------------------------------------

P8 = inclusion_proof(LEAVES[:8], 5)
C68 = consistency_proof(LEAVES[:8], 6)
GARBAGE_PROOFS = [None, 5, "abc", b"", LEAVES[0], [None], [b"short"], ["x" * 32], [1, 2, 3]]


@pytest.mark.parametrize(
    "args",
    [
        (LEAVES[5], 5, 8, [], ROOTS[8]),  # empty proof
        (LEAVES[5], 5, 8, P8[:-1], ROOTS[8]),  # too short
        (LEAVES[5], 5, 8, [*P8, LEAVES[0]], ROOTS[8]),  # too long
        (LEAVES[5], 5, 8, P8 * 30, ROOTS[8]),  # far too long
        (LEAVES[5], 8, 8, P8, ROOTS[8]),  # index == size
        (LEAVES[5], 9, 8, P8, ROOTS[8]),  # index > size
        (LEAVES[5], -1, 8, P8, ROOTS[8]),
        (LEAVES[0], 0, 0, [], EMPTY_ROOT),  # size 0 contains nothing
        (LEAVES[0], 0, 0, [], LEAVES[0]),
        (LEAVES[5], 5, -8, P8, ROOTS[8]),
        (LEAVES[5], 5.0, 8, P8, ROOTS[8]),
        (LEAVES[5], "5", 8, P8, ROOTS[8]),
        (LEAVES[5], None, 8, P8, ROOTS[8]),
        (LEAVES[5], 5, None, P8, ROOTS[8]),
        (LEAVES[5], 5, 2**80, P8, ROOTS[8]),
        (None, 5, 8, P8, ROOTS[8]),
        (LEAVES[5][:31], 5, 8, P8, ROOTS[8]),
        (LEAVES[5], 5, 8, P8, None),
        (LEAVES[5], 5, 8, P8, ROOTS[8] + b"\x00"),
        (LEAVES[5], 5, 8, P8, ROOTS[8].hex()),
        *[(LEAVES[5], 5, 8, g, ROOTS[8]) for g in GARBAGE_PROOFS],
    ],
)
def test_verify_inclusion_returns_false_on_garbage(args: tuple) -> None:
    assert verify_inclusion(*args) is False


@pytest.mark.parametrize(
    "args",
    [
        (6, 8, ROOTS[6], ROOTS[8], []),  # empty proof
        (6, 8, ROOTS[6], ROOTS[8], C68[:-1]),
        (6, 8, ROOTS[6], ROOTS[8], [*C68, LEAVES[0]]),
        (6, 8, ROOTS[6], ROOTS[8], C68 * 30),
        (8, 6, ROOTS[8], ROOTS[6], C68),  # old > new
        (-1, 8, ROOTS[6], ROOTS[8], C68),
        (6, -8, ROOTS[6], ROOTS[8], C68),
        (0, 8, EMPTY_ROOT, ROOTS[8], C68),  # nothing to prove from an empty tree
        (0, 8, ROOTS[1], ROOTS[8], []),  # empty tree with a non-empty root
        (0, 0, EMPTY_ROOT, ROOTS[1], []),
        (0, 0, ROOTS[1], ROOTS[1], []),  # an empty tree has exactly one root
        (8, 8, ROOTS[8], ROOTS[7], []),  # same size, different roots
        (8, 8, ROOTS[8], ROOTS[8], [LEAVES[0]]),  # same size, spurious proof
        (6.0, 8, ROOTS[6], ROOTS[8], C68),
        (6, "8", ROOTS[6], ROOTS[8], C68),
        (None, None, ROOTS[6], ROOTS[8], C68),
        (6, 2**80, ROOTS[6], ROOTS[8], C68),
        (6, 8, None, ROOTS[8], C68),
        (6, 8, ROOTS[6], ROOTS[8][:31], C68),
        (6, 8, ROOTS[6].hex(), ROOTS[8], C68),
        *[(6, 8, ROOTS[6], ROOTS[8], g) for g in GARBAGE_PROOFS],
        *[(0, 0, EMPTY_ROOT, EMPTY_ROOT, g) for g in GARBAGE_PROOFS],
    ],
)
def test_verify_consistency_returns_false_on_garbage(args: tuple) -> None:
    assert verify_consistency(*args) is False


def test_degenerate_consistency_cases_accept() -> None:
    assert verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    assert verify_consistency(0, 8, EMPTY_ROOT, ROOTS[8], [])
    assert verify_consistency(8, 8, ROOTS[8], ROOTS[8], [])
    assert consistency_proof(LEAVES[:8], 0) == []
    assert consistency_proof(LEAVES[:8], 8) == []
    assert consistency_proof([], 0) == []


def test_verifiers_accept_bytes_like_and_tuples() -> None:
    assert verify_inclusion(bytearray(LEAVES[5]), 5, 8, tuple(P8), memoryview(ROOTS[8]))
    assert verify_consistency(6, 8, bytearray(ROOTS[6]), ROOTS[8], tuple(C68))


# --- builders reject bad arguments ---------------------------------------------------------


@pytest.mark.parametrize(
    ("leaves", "index"),
    [([], 0), (LEAVES[:8], 8), (LEAVES[:8], -1), (LEAVES[:8], 100), (LEAVES[:8], 1.0)],
)
def test_inclusion_proof_rejects_bad_index(leaves: list[bytes], index: int) -> None:
    with pytest.raises(ValueError):
        inclusion_proof(leaves, index)


@pytest.mark.parametrize(
    ("leaves", "old_size"),
    [([], 1), (LEAVES[:8], 9), (LEAVES[:8], -1), (LEAVES[:8], "3"), (LEAVES[:8], None)],
)
def test_consistency_proof_rejects_bad_old_size(leaves: list[bytes], old_size: int) -> None:
    with pytest.raises(ValueError):
        consistency_proof(leaves, old_size)


# --- scale -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_million_leaves_without_recursion_limits() -> None:
    n = 1_000_003
    leaves = [hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(n)]
    rt = root(leaves)
    f = MerkleFrontier()
    for h in leaves:
        f.append(h)
    assert f.root() == rt

    i = 777_777
    proof = inclusion_proof(leaves, i)
    assert len(proof) == 20
    assert verify_inclusion(leaves[i], i, n, proof, rt)

    old = 524_289
    cproof = consistency_proof(leaves, old)
    assert verify_consistency(old, n, root(leaves[:old]), rt, cproof)


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=50))
def test_frontier_resumes_from_its_state(n: int, extra: int) -> None:
    leaves = [leaf_hash(i.to_bytes(4, "big")) for i in range(n + extra)]
    f = MerkleFrontier()
    for h in leaves[:n]:
        f.append(h)
    size, stack = f.state()
    resumed = MerkleFrontier.from_state(size, stack)
    for h in leaves[n:]:
        resumed.append(h)
    assert resumed.size == n + extra
    assert resumed.root() == root(leaves)


def test_frontier_state_is_validated() -> None:
    with pytest.raises(ValueError):
        MerkleFrontier.from_state(3, [leaf_hash(b"x")])

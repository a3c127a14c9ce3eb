"""Looking for deleted records in files: the check behind "forget means gone".

A promise that a record is gone is kept only where its bytes are gone: this scans files
(model store, database, temporary directories, logs) for a record's feature vector and
its values as float32/float64 bytes (row- and feature-major), as decimal text and as the
raw values of the user's table, and for its id where no id may remain. What it cannot
see, and why a value shared with kept records is no trace: docs/security.md (The residue scan)."""

from __future__ import annotations

import io
import math
import pickletools
import re
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from jobs import sealing
from jobs.learners.dare import bundle as dare_bundle
from jobs.orchestration.registry import Registry, VersionUnavailable

# a decimal number as Python, JSON and numpy print one
_NUMBER = re.compile(rb"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")
# shortest text that still names one value: "0.5" or "1.0" would match anything
_MIN_TEXT = 7
# a value whose bytes occur more often than this in one file names no record there
_RARE = 64
# fewest features that must line up at one distance for a record to count as found: with
# fewer, ties line up by chance (iris: 4 features of a few dozen values each, found at
# some distance in a forest that holds neither record)
_MIN_ALIGNED = 6
_WORDS = ((4, "<f4", "<u4"), (8, "<f8", "<u8"))
_HASH_BITS = 22


@dataclass(frozen=True)
class Finding:
    record_id: str
    trace: str  # what was found: "x[3:5] float32", "x[4] text", "id utf-32-le", ...
    path: str


class TraceScanner:
    """Finds traces of the `gone` records (id -> features) in files.

    `kept` holds the features of every record that may legitimately remain; their
    values are not traces. `ids`: also look for the records' ids.
    """

    def __init__(self, gone: Mapping[str, np.ndarray], kept: np.ndarray | None = None,
                 ids: bool = True, raw: Mapping[str, Sequence[Any]] | None = None,
                 kept_raw: Iterable[Sequence[Any]] = ()) -> None:
        kept = np.zeros((0, 0)) if kept is None else np.asarray(kept, np.float64)
        kept_vals = set(kept.ravel().tolist())
        columns = [np.unique(c) for c in kept.T] if kept.ndim == 2 else []
        kept_rows = {r.tobytes() for r in kept} if kept.ndim == 2 else set()
        # binary patterns by word size (4: float32, 8: float64): bytes -> (record, trace)
        self._binary: dict[int, dict[bytes, tuple[str, str]]] = {4: {}, 8: {}}
        self._text: dict[bytes, tuple[str, str]] = {}
        self._ids: dict[bytes, tuple[str, str]] = {}
        self._id_set = set(gone) if ids else set()
        for rid, x in gone.items():
            x = np.asarray(x, dtype=np.float64).ravel()
            for n, dt in ((4, "<f4"), (8, "<f8")):
                pats, name = self._binary[n], np.dtype(dt).name
                if len(x) > 2 and x.tobytes() not in kept_rows:
                    pats[x.astype(dt).tobytes()] = (rid, f"row {name}")
                for j in range(len(x) - 1):  # a pair of values kept records hold names no one
                    if x[j] not in kept_vals or x[j + 1] not in kept_vals:
                        pats[x[j:j + 2].astype(dt).tobytes()] = (rid, f"x[{j}:{j + 2}] {name}")
            for j, v in enumerate(x.tolist()):
                if v in kept_vals or (j < len(columns) and _between_two(v, columns[j])):
                    continue
                if not _simple_fraction(v):
                    self._binary[8][np.float64(v).astype("<f8").tobytes()] = (
                        rid, f"x[{j}] float64")
                for text in {repr(v), repr(float(np.float32(v)))}:
                    if len(text) >= _MIN_TEXT:
                        self._text[text.encode()] = (rid, f"x[{j}] text")
            if ids:
                self._ids[rid.encode()] = (rid, "id text")
        self._words = self._raw_patterns(raw or {}, kept_raw)
        # candidates are the windows whose first word starts some pattern (one np.isin)
        self._first = {n: np.unique(np.frombuffer(b"".join(p[:n] for p in pats),
                                                  "<u4" if n == 4 else "<u8"))
                       for n, pats in self._binary.items()}
        self._lengths = {n: sorted({len(p) // n for p in pats})
                         for n, pats in self._binary.items()}
        self._strided = _strided_searches(gone, kept)
        self._id_re = (re.compile(rb"(?<![\w.:@-])(" + b"|".join(
            re.escape(p) for p in sorted(self._ids, key=len, reverse=True)) + rb")(?![\w.:@-])")
                       if self._ids else None)

    def _raw_patterns(self, raw: Mapping[str, Sequence[Any]], kept_raw: Iterable[Sequence[Any]]
                      ) -> re.Pattern[bytes] | None:
        """Row patterns of the raw numbers; a whole-word regex of the raw values no kept
        record holds (None without any). Fills `self._word_hits` with what each names."""
        kept_rows = [list(r) for r in kept_raw]
        held = {_word(v) for r in kept_rows for v in r}
        numeric_kept = {np.asarray([v for v in r if _is_number(v)], np.float64).tobytes()
                        for r in kept_rows}
        self._word_hits: dict[bytes, tuple[str, str]] = {}
        for rid, values in raw.items():
            numbers = np.asarray([v for v in values if _is_number(v)], np.float64)
            if len(numbers) > 2 and numbers.tobytes() not in numeric_kept:
                for n, dt in ((4, "<f4"), (8, "<f8")):
                    self._binary[n][numbers.astype(dt).tobytes()] = (
                        rid, f"raw row {np.dtype(dt).name}")
            for j, v in enumerate(values):
                word = _word(v)
                if v is not None and word not in held and len(word) >= (5 if _is_number(v) else 4):
                    self._word_hits[word.encode()] = (rid, f"raw[{j}] text")
        if not self._word_hits:
            return None
        return re.compile(rb"(?<![\w.])(" + b"|".join(
            re.escape(w) for w in sorted(self._word_hits, key=len, reverse=True))
            + rb")(?![\w.])")

    def scan(self, paths: Iterable[str | Path],
             read: Callable[[Path], bytes] = Path.read_bytes) -> list[Finding]:
        """Every trace found in the files under `paths` (files or directories), each read
        with `read` (e.g. unsealing a version's files with its key)."""
        out: list[Finding] = []
        for f in _files(paths):
            try:
                blob = read(f)
            except OSError:  # vanished, or a socket: nothing to read
                continue
            out += [Finding(rid, what, str(f)) for rid, what in sorted(self.scan_bytes(blob))]
        return out

    def scan_model_store(self, registry: Registry) -> list[Finding]:
        """Traces in every version the model store still holds, read as their files' raw
        bytes and, where the version's key still exists, unsealed as well (a sealed file
        hides its contents from a byte scan, not from whoever holds the database)."""
        out = []
        for version in registry.stored_versions():
            path = registry.path(version)
            out += self.scan([path])
            try:
                key = registry.key(version)
            except VersionUnavailable:
                continue
            with sealing.sealed_with(key):
                out += self.scan([path], sealing.unsealed)
        return out

    def scan_bytes(self, blob: bytes) -> set[tuple[str, str]]:
        """Traces in one file's contents. A sealed file is ciphertext: nothing to find in
        it (:meth:`scan_model_store` scans it unsealed while its key exists)."""
        if blob.startswith(sealing.MAGIC):
            return set()
        found = self._number_hits(blob)
        if (coded := _coded_forest(blob)) is not None:  # a forest's features, as codes
            found |= self._number_hits(coded)
        if self._text:
            found.update(self._text[t] for t in set(_NUMBER.findall(blob)) if t in self._text)
        if self._words is not None:
            found.update(self._word_hits[m.group(1)] for m in self._words.finditer(blob))
        if self._id_set:
            found.update((rid, f"id {how}") for rid, how in self._id_hits(blob))
        return found

    def _number_hits(self, blob: bytes) -> set[tuple[str, str]]:
        """Traces in `blob` as float32/float64 bytes: rows, pairs, values alone, and
        features at equal distances."""
        found: set[tuple[str, str]] = set()
        buf = np.frombuffer(blob, dtype=np.uint8)
        for n, pats in self._binary.items():
            if not pats:
                continue
            for off in range(n):
                m = (len(buf) - off) // n
                if m < 1:
                    continue
                w = buf[off:off + n * m].view("<u4" if n == 4 else "<u8")
                for i in _positions(w, self._first[n]).tolist():
                    for k in self._lengths[n]:
                        hit = pats.get(w[i:i + k].tobytes()) if i + k <= m else None
                        if hit:
                            found.add(hit)
        for search in self._strided:
            found |= search.scan(buf)
        return found

    def _id_hits(self, blob: bytes) -> set[tuple[str, str]]:
        """Ids in `blob`, where text is: array and pickle strings of the archives numpy and
        torch write (read, never executed: a byte search for a short id in binary data
        would match by chance), and whole words of any other text."""
        if blob.startswith(_NPY_MAGIC):
            strings, raw = _npy_strings(blob)
            out = {(v, "in a string array") for v in strings if v in self._id_set}
            return out | (self._id_hits(raw) if raw else set())
        if blob.startswith(_ZIP_MAGIC):
            try:
                with zipfile.ZipFile(io.BytesIO(blob)) as zf:
                    parts = [(i.filename, zf.read(i)) for i in zf.infolist()]
            except (zipfile.BadZipFile, ValueError, OSError):
                parts = None
            if parts is not None:
                out = set()
                for name, data in parts:
                    if name.endswith(".pkl"):
                        out |= {(v, "in a pickle") for v in _pickle_strings(data)
                                if v in self._id_set}
                    else:
                        out |= self._id_hits(data)
                return out
        return {(m.group(1).decode(), "text") for m in self._id_re.finditer(blob)}


class _StridedSearch:
    """Records of `d` features found by their features at equal distances, in one word
    size: column-major matrices (one column length apart) and strided rows."""

    def __init__(self, rids: list[str], X: np.ndarray, kept: np.ndarray, n: int, dt: str,
                 ut: str) -> None:
        self._rids, self._n, self._ut, self._name = rids, n, ut, np.dtype(dt).name
        self._W = np.ascontiguousarray(X.astype(dt)).view(ut)  # (records, d) words
        d = X.shape[1]
        self._kept = (np.ascontiguousarray(kept.astype(dt)).view(ut)
                      if kept.ndim == 2 and kept.shape[1] == d and len(kept) else None)
        self._values = np.unique(self._W)
        self._need = max(_MIN_ALIGNED, -(-d // 2))

    def scan(self, buf: np.ndarray) -> set[tuple[str, str]]:
        """(record id, trace) of each record found in `buf` at any byte offset."""
        found: set[tuple[str, str]] = set()
        for off in range(self._n):
            m = (len(buf) - off) // self._n
            if m >= self._need:
                found |= self._scan_words(buf[off:off + self._n * m].view(self._ut))
        return found

    def _scan_words(self, w: np.ndarray) -> set[tuple[str, str]]:
        hit = _positions(w, self._values)
        if hit.size < self._need:
            return set()
        order = np.argsort(w[hit], kind="stable")
        pos = hit[order]  # where each value occurs, grouped by value
        values, first, count = np.unique(w[pos], return_index=True, return_counts=True)
        at = np.searchsorted(values, self._W).clip(max=len(values) - 1)
        occ = np.where(values[at] == self._W, count[at], 0)
        rare = (occ > 0) & (occ <= _RARE)
        found = set()
        for r in np.flatnonzero(rare.sum(1) >= self._need).tolist():
            where = [pos[first[at[r, j]]:first[at[r, j]] + occ[r, j]] if rare[r, j] else None
                     for j in range(self._W.shape[1])]
            stride = self._aligned(w, r, rare[r], occ[r], where)
            if stride:
                layout = "row" if stride == 1 else "feature-major"
                found.add((self._rids[r], f"{layout} {self._name}"))
        return found

    def _aligned(self, w: np.ndarray, r: int, rare: np.ndarray, occ: np.ndarray,
                 where: list[np.ndarray | None]) -> int:
        """The distance (in words) at which enough of record `r`'s features line up in
        `w` and no kept record explains them; 0 if there is none. Candidate distances
        come from the positions of its three rarest features."""
        feats = np.flatnonzero(rare)
        anchors = sorted(feats[np.argsort(occ[feats], kind="stable")[:3]].tolist())
        bases, strides = [], []
        for i, a in enumerate(anchors):
            for c in anchors[i + 1:]:
                diff = where[c][None, :] - where[a][:, None]
                ok = (diff > 0) & (diff % (c - a) == 0)
                s = diff[ok] // (c - a)
                strides.append(s)
                bases.append(np.broadcast_to(where[a][:, None], diff.shape)[ok] - a * s)
        cand = np.unique(np.stack([np.concatenate(bases), np.concatenate(strides)], 1), axis=0)
        if not len(cand):
            return 0
        at = cand[:, :1] + cand[:, 1:] * np.arange(self._W.shape[1])
        inside = (at >= 0) & (at < len(w))
        lined = inside & (w[at.clip(0, len(w) - 1)] == self._W[r]) & rare
        for k in np.flatnonzero(lined.sum(1) >= self._need).tolist():
            J = lined[k]
            if self._kept is None or not (self._kept[:, J] == self._W[r, J]).all(1).any():
                return int(cand[k, 1])
        return 0


def _positions(w: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where `w` holds one of the sorted, unique `values` (``np.isin`` sorts `w`, a
    file's millions of words: slow). A multiplicative hash of each word picks the few
    candidates, which a binary search then checks."""
    golden, shift = np.uint64(0x9E3779B97F4A7C15), np.uint64(64 - _HASH_BITS)
    table = np.zeros(1 << _HASH_BITS, dtype=bool)
    table[(values.astype(np.uint64) * golden) >> shift] = True
    cand = np.flatnonzero(table[(w.astype(np.uint64) * golden) >> shift])
    sub = w[cand]
    return cand[values[np.searchsorted(values, sub).clip(max=len(values) - 1)] == sub]


def _strided_searches(gone: Mapping[str, np.ndarray], kept: np.ndarray
                      ) -> list[_StridedSearch]:
    """One search per feature count and word size (records of fewer than
    `_MIN_ALIGNED` features are left to the row and value patterns)."""
    by_d: dict[int, list[str]] = {}
    for rid, x in gone.items():
        by_d.setdefault(np.asarray(x).size, []).append(rid)
    return [_StridedSearch(rids, np.array([np.asarray(gone[r], np.float64).ravel()
                                           for r in rids]), kept, n, dt, ut)
            for d, rids in by_d.items() if d >= _MIN_ALIGNED for n, dt, ut in _WORDS]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _word(v: Any) -> str:
    """A raw value as text, as a table, JSON or a log writes it (39, not 39.0)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return v.strip() if isinstance(v, str) else str(v)


def _simple_fraction(v: float) -> bool:
    """Whether `v` is p/q with q <= 10**6. A model's own numbers are such fractions too
    (class probabilities, count ratios and their differences), and so is a min-max
    scaled value of a column recorded to a few decimals: eight bytes of one of them
    match by coincidence, so only the pairs and rows above count for it."""
    return math.isclose(float(Fraction(v).limit_denominator(10**6)), v, rel_tol=1e-14,
                        abs_tol=1e-300)  # computed either way, it may be off by an ulp


def _between_two(v: float, u: np.ndarray) -> bool:
    """Whether `v` is the midpoint (as a tree computes it) of two values of sorted `u`."""
    lo = u[u < v]
    if lo.size == 0:
        return False
    at = np.clip(np.searchsorted(u, 2.0 * v - lo), 1, len(u) - 1)
    return bool(((0.5 * lo + 0.5 * u[at] == v) | (0.5 * lo + 0.5 * u[at - 1] == v)).any())


_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def _coded_forest(blob: bytes) -> bytes | None:
    """A DaRE bundle's features (feature-major float64 bytes), which its arrays hold as
    codes into each feature's values (:func:`jobs.learners.dare.bundle.coded_features`);
    None for any other file."""
    if not blob.startswith(_ZIP_MAGIC):
        return None
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            if "x_vals" not in z.files:
                return None
            X = dare_bundle.coded_features({k: z[k] for k in z.files})
    except (zipfile.BadZipFile, ValueError, OSError, KeyError):
        return None
    return None if X is None else X.tobytes()


def _npy_strings(blob: bytes) -> tuple[set[str], bytes]:
    """The strings of a .npy array, and its bytes when they may be text (a one-byte
    dtype: encoded JSON, say)."""
    try:
        arr = np.load(io.BytesIO(blob), allow_pickle=False)
    except ValueError:  # an object array: not read (it would need pickle)
        return set(), b""
    if arr.dtype.kind == "S":
        return {v.decode(errors="replace") for v in arr.ravel().tolist()}, b""
    if arr.dtype.kind == "U":
        return set(arr.ravel().tolist()), b""
    return set(), arr.tobytes() if arr.dtype.itemsize == 1 else b""


def _pickle_strings(blob: bytes) -> set[str]:
    """The str and bytes constants of a pickle, found by walking its opcodes (nothing in
    it is executed)."""
    out = set()
    try:
        for _op, arg, _pos in pickletools.genops(blob):
            if isinstance(arg, str):
                out.add(arg)
            elif isinstance(arg, bytes):
                out.add(arg.decode(errors="replace"))
    except (ValueError, EOFError):  # a truncated or not-a-pickle member: what was read counts
        pass
    return out


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
    return out

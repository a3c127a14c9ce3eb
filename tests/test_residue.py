"""The byte scan behind "forget means gone" finds what is there and nothing that is not."""

from __future__ import annotations

import json

import numpy as np
import torch

from jobs import sealing
from service.residue import TraceScanner


def _records(n: int = 6, d: int = 5, seed: int = 0) -> tuple[list[str], np.ndarray]:
    return [f"r{i:03d}" for i in range(n)], np.random.default_rng(seed).random((n, d))


def test_finds_a_record_however_it_was_written(tmp_path) -> None:
    ids, X = _records()
    np.save(tmp_path / "rows32.npy", X[:1].astype(np.float32))  # a row
    np.save(tmp_path / "cols.npy", np.asfortranarray(X[1:3].T))  # column-major: apart
    (tmp_path / "j.json").write_text(json.dumps({"features": X[3].tolist()}))
    np.savez(tmp_path / "ids.npz", ids=np.array([ids[4], "zzz"]))  # UTF-32 strings
    torch.save({"ids": [ids[5]], "w": torch.zeros(3)}, tmp_path / "state.pt")  # a pickle
    found = TraceScanner(dict(zip(ids, X, strict=True))).scan([tmp_path])
    where = {(f.record_id, f.path.rsplit("/", 1)[1]) for f in found}
    assert where == {(ids[0], "rows32.npy"), (ids[1], "cols.npy"), (ids[2], "cols.npy"),
                     (ids[3], "j.json"), (ids[4], "ids.npz"), (ids[5], "state.pt")}


def test_what_kept_records_explain_is_no_trace(tmp_path) -> None:
    ids, X = _records()
    gone, kept = X[0].copy(), X[1:].copy()
    gone[0] = kept[0, 0]  # a tie with a kept record
    gone[1] = 0.5 * kept[0, 1] + 0.5 * kept[1, 1]  # a split between two kept values
    gone[2] = 29 / 1440  # a ratio a model computes for itself
    np.save(tmp_path / "a.npy", np.array([gone[0], 1.0, gone[1], 2.0, gone[2]]))
    # short ids are small integers in UTF-32: an int32 array may hold them by chance
    np.save(tmp_path / "pos.npy", np.array([ord(c) for c in ids[0]], dtype=np.int32))
    scanner = TraceScanner({ids[0]: gone}, kept=kept)
    assert scanner.scan([tmp_path]) == []
    assert (ids[0], "x[3:5] float64") in scanner.scan_bytes(gone[3:5].tobytes())


def test_sealed_files_are_scanned_with_their_key_only(tmp_path) -> None:
    ids, X = _records()
    key = sealing.new_key()
    with sealing.sealed_with(key):
        sealing.write_file(tmp_path / "x.bin", X[0].tobytes())
    scanner = TraceScanner({ids[0]: X[0]})
    assert scanner.scan([tmp_path]) == []  # ciphertext: nothing to see
    with sealing.sealed_with(key):
        assert scanner.scan([tmp_path], sealing.read_file)

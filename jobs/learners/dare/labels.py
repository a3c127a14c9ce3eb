"""Classes that appear with an addition or vanish with a deletion: a DaRE forest's classes
are its live records' labels, as a retrain on them would have them.
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare.state import ForestState


def drop_empty_classes(st: ForestState) -> None:
    """Forget the classes no live record holds (their count columns go)."""
    rec = st.records
    gone = np.flatnonzero(rec.class_n == 0)
    if gone.size == 0:
        return
    keep = np.flatnonzero(rec.class_n > 0)
    remap = np.cumsum(rec.class_n > 0) - 1
    rec.classes = rec.classes[keep]
    rec.class_n = rec.class_n[keep]
    st.nodes = st.nodes._replace(cnt=np.ascontiguousarray(st.nodes.cnt[:, keep]))
    st.entries = st.entries._replace(left=np.ascontiguousarray(st.entries.left[keep]))
    st.tables = st.tables._replace(cnt=np.ascontiguousarray(st.tables.cnt[:, keep]))
    y = rec.y[: rec.n_slots]
    rec.y[: rec.n_slots] = np.where(np.isin(y, gone), 0, remap[y])


def insert_classes(st: ForestState, labels: np.ndarray) -> None:
    """Make room for the classes among `labels` that the forest does not know (in sorted
    order, as a retrain would number them)."""
    rec = st.records
    new = np.union1d(rec.classes, labels)
    if len(new) == len(rec.classes):
        return
    pos = np.searchsorted(new, rec.classes)
    C = len(new)

    def widen(a: np.ndarray) -> np.ndarray:
        b = np.zeros((a.shape[0], C), dtype=a.dtype)
        b[:, pos] = a
        return b

    st.nodes = st.nodes._replace(cnt=widen(st.nodes.cnt))
    st.entries = st.entries._replace(left=np.ascontiguousarray(widen(st.entries.left.T).T))
    st.tables = st.tables._replace(cnt=widen(st.tables.cnt))
    cn = np.zeros(C, dtype=np.int64)
    cn[pos] = rec.class_n
    rec.class_n = cn
    rec.y[: rec.n_slots] = pos[rec.y[: rec.n_slots]]
    rec.classes = new

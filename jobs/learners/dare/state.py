"""The DaRE forest's fitted state: one explicit object that every component takes.

:class:`ForestState` holds the record store, the value index, the random-node domains, the
pools (named tuples of arrays the compiled kernels read by field name), the per-tree layout
of records and the batch cost model. Nothing here computes (a pending index is built by
what the loader hands it).
See docs/learners.md (DaRE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from jobs.learners.dare.costs import CostModel


@dataclass(frozen=True)
class Tuning:
    """Thresholds of the implementation, not hyperparameters: they decide what a node
    keeps for updates (and so the content hash), never its split."""

    #: greedy nodes with at least this many records keep per-candidate counts
    cache_min: int = 128
    #: extra valid candidates a cached node keeps beyond its k selected ones
    buffer: int = 8
    #: random-node threshold draws per vectorised round and the cap before a fallback
    draw_chunk: int = 64
    max_draws: int = 1 << 16
    #: a cached slot keeps its node's value group table when the attribute has at most one
    #: distinct value per this many of the node's records (ties)
    hist_ratio: int = 4


class SplitRule(NamedTuple):
    """Hyperparameters and tuning as the split search and the kernels read them."""

    n_trees: int
    max_depth: int
    d_rmax: int  # nodes above this depth are random nodes
    min_samples_leaf: int
    n_sampled: int  # attributes a greedy node samples: floor(sqrt(p)), at least 1
    k: int  # valid pairs scored per attribute
    buffer: int  # extra valid pairs a cached node keeps
    gini: bool  # else entropy
    cache_min: int  # greedy nodes with at least this many records keep their lists
    max_draws: int  # random-node threshold draws before the fallback
    draw_chunk: int  # draws per vectorised round
    hist_ratio: int  # a list keeps its value group table up to one value per this many records


class NodePool(NamedTuple):
    """Every node of every tree, by node id (only ``used`` ones are real)."""

    tree: np.ndarray
    depth: np.ndarray
    path: np.ndarray  # heap path: root 1, children 2i and 2i + 1
    kind: np.ndarray  # LEAF, RANDOM, GREEDY
    why: np.ndarray  # why a leaf is one (0: internal)
    left: np.ndarray
    right: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    r1: np.ndarray  # greedy split: value ranks of the pair (v1, v2)
    r2: np.ndarray
    draw: np.ndarray  # random split: index of the keyed draw (-1: fallback)
    n: np.ndarray  # live records
    cnt: np.ndarray  # (nodes, classes) class counts
    start: np.ndarray  # the node's range of its tree's layout
    end: np.ndarray
    cid: np.ndarray  # cache row (-1: none)
    used: np.ndarray
    free: np.ndarray  # free list (the first PoolCounts.free_nodes entries)
    bound: np.ndarray  # bound on the other candidates' scores (derived, not saved)
    sampled: np.ndarray  # (nodes, n_sampled) sampled attributes (derived, not saved)


class CachePool(NamedTuple):
    """One row per cached greedy node, one column per sampled attribute slot."""

    attr: np.ndarray  # -1: no slot
    off: np.ndarray  # the slot's segment of the entry pool
    length: np.ndarray
    all_pairs: np.ndarray  # the segment holds every valid pair
    cut_prio: np.ndarray  # cut-off key (priority, v1) of the segment
    cut_value: np.ndarray
    table_off: np.ndarray  # the slot's value group table (length 0: none)
    table_len: np.ndarray
    free: np.ndarray  # free list (the first PoolCounts.free_caches entries)


class EntryPool(NamedTuple):
    """Cached candidate pairs (value ranks r1 < r2; r1 -1: dead) and their left class
    counts, class-major."""

    r1: np.ndarray
    r2: np.ndarray
    left: np.ndarray  # (classes, entries)


class TablePool(NamedTuple):
    """Value group tables: the rank and class counts of every value a node holds."""

    rank: np.ndarray
    cnt: np.ndarray  # (entries, classes)


class Layout(NamedTuple):
    """Per tree, its records laid out leaf by leaf: a node's records are a range."""

    slot_at: np.ndarray  # (trees, width): record slot at each position (-1: free)
    pos: np.ndarray  # (trees, slots): position of each record
    root: np.ndarray  # (trees,) root node


class RecordArrays(NamedTuple):
    """The records as the kernels read them."""

    X: np.ndarray  # (features, slots)
    rank: np.ndarray  # (slots, features): value ranks, record-major
    y: np.ndarray
    vals: np.ndarray  # every attribute's distinct values, ascending, concatenated
    vmix: np.ndarray  # the value half of each pair priority
    voff: np.ndarray  # attribute a's values: vals[voff[a]:voff[a + 1]]
    dom: np.ndarray  # random-node domain per attribute
    tree_keys: np.ndarray


class GlobalOrder(NamedTuple):
    """Every attribute's records in value order, with the start of each value's run."""

    roff: np.ndarray  # attribute a's runs: rstart[roff[a]:roff[a + 1]]
    rstart: np.ndarray
    gorder: np.ndarray  # (features, slots)
    alive: np.ndarray


@dataclass
class RecordStore:
    """Every record slot: features, label index, id, whether it is live."""

    X: np.ndarray  # (features, capacity)
    y: np.ndarray
    alive: np.ndarray
    ids: np.ndarray
    slot: dict[str, int]  # live record id -> slot
    n_slots: int  # slots in use, live or deleted
    n_live: int
    class_n: np.ndarray  # live records per class
    classes: np.ndarray

    @property
    def capacity(self) -> int:
        return int(self.X.shape[1])


@dataclass
class ValueIndex:
    """Dense value ranks of every slot per attribute and the global value order
    (:func:`jobs.learners.dare.values.rerank`)."""

    rank: np.ndarray  # (features, capacity)
    rank_rm: np.ndarray  # the same, record-major (16 bits where they fit)
    vals: np.ndarray
    vmix: np.ndarray
    voff: np.ndarray
    gorder: np.ndarray
    rstart: np.ndarray
    roff: np.ndarray
    nvals_max: int


@dataclass
class Domains:
    """Random-node stream domains and the live records' largest |value| per attribute."""

    dom: np.ndarray
    absmax: np.ndarray
    absmax_n: np.ndarray  # live records holding it
    fixed: float | None  # random_domain


@dataclass
class PoolCounts:
    """The pools' counters (the kernels keep them in their ``ctr`` array while running)."""

    free_nodes: int
    free_caches: int
    entries_used: int
    entries_garbage: int
    tables_used: int
    tables_garbage: int


class PendingIndex(Protocol):
    """What derives a loaded forest's value index and domains on first use."""

    vals: np.ndarray  # each feature's sorted distinct values, one after another
    voff: np.ndarray  # where each feature's values start in `vals` (and the end)

    def build(self, records: RecordStore) -> tuple[ValueIndex, Domains]: ...


@dataclass
class ForestState:
    """Everything a fitted forest is. Components read and replace its fields.

    A loaded forest derives its value index and domains on first use (`pending`):
    serving, guarding and hashing a version read the sorted values only, and at 10^6
    records the index is a third of a load."""

    rule: SplitRule
    records: RecordStore
    value_index: ValueIndex | None
    value_domains: Domains | None
    tree_keys: np.ndarray
    nodes: NodePool
    caches: CachePool
    entries: EntryPool
    tables: TablePool
    layout: Layout
    counts: PoolCounts
    costs: CostModel
    #: the value group tables serve updates only: a loaded forest builds them on its
    #: first update, so that one loaded to be served or guarded does not pay for them
    tables_stale: bool = False
    #: scratch buffers of the compiled split search (kept between calls; not the model)
    scratch: Any = None
    #: what derives `value_index` and `value_domains` while they are None
    pending: PendingIndex | None = None

    @property
    def values(self) -> ValueIndex:
        if self.value_index is None:
            self._derive()
        return self.value_index  # type: ignore[return-value]

    @values.setter
    def values(self, index: ValueIndex) -> None:
        self.value_index = index

    @property
    def domains(self) -> Domains:
        if self.value_domains is None:
            self._derive()
        return self.value_domains  # type: ignore[return-value]

    def sorted_values(self) -> tuple[np.ndarray, np.ndarray]:
        """(vals, voff) of the value index, without deriving it."""
        src = self.pending if self.value_index is None else self.value_index
        return src.vals, src.voff  # type: ignore[union-attr]

    def _derive(self) -> None:
        if self.pending is None:
            raise RuntimeError("the forest's value index is neither built nor pending")
        self.value_index, self.value_domains = self.pending.build(self.records)
        self.pending = None

    @property
    def n_features(self) -> int:
        return int(self.records.X.shape[0])

    @property
    def n_classes(self) -> int:
        return len(self.records.classes)

    def record_arrays(self) -> RecordArrays:
        rec, val = self.records, self.values
        return RecordArrays(X=rec.X, rank=val.rank_rm, y=rec.y, vals=val.vals, vmix=val.vmix,
                            voff=val.voff, dom=self.domains.dom, tree_keys=self.tree_keys)

    def global_order(self) -> GlobalOrder:
        val = self.values
        return GlobalOrder(roff=val.roff, rstart=val.rstart, gorder=val.gorder,
                           alive=self.records.alive)

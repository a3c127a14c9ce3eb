"""Leave-one-out training: the full network N and every N_{-x}, trained together.

One masked, keyed schedule ``T`` (plain SGD, keyed batches, a batch count frozen from the
full set, deleted records as tombstone keys) makes ``N_{-x}``, ``T`` on ``D`` without
``x``, the exactly unlearned model, and every network of a set bit for bit its single run
(own compiled loops on the CPU; padded, slot-independent batched kernels on CUDA).
See docs/DESIGN.md (The masked leave-one-out schedule)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from jobs.learners.keyed import prf_u64, prf_u64_many
from jobs.learners.networks.mlp_kernels import ParamLayout, flat_batches, round_up, sgd_slots
from jobs.learners.networks.torch_nets import (
    KERNELS,
    MLP,
    deterministic,
    epoch_batches,
    init_net,
    n_batches,
    resolve_device,
    torch_threads,
)

GRANULE = 32  # floats; per-slot element-wise blocks are multiples of this (docs/DESIGN.md)
WIDTH_GRANULE = 16  # floats (64 bytes); hidden widths are padded to a multiple of this
# On CUDA every network trains in a batch of exactly this many slots (padded with copies):
# cuBLAS picks its batched kernels by the batch count, and a network trained alone or in
# a chunk of another size came out with other bits (measured on an H200).
CUDA_SLOTS = 512
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LOOConfig:
    """Hyper-parameters of T (everything the trained bits depend on, besides data)."""

    n_features: int
    n_classes: int
    hidden: tuple[int, ...] = (50, 50)
    epochs: int = 30
    batch_size: int = 32
    n_batches: int = 1
    lr: float = 0.1
    weight_decay: float = 1e-5
    seed: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LOOConfig:
        d = dict(d)
        d["hidden"] = tuple(int(h) for h in d["hidden"])
        return cls(**d)


def _layout(cfg: LOOConfig) -> ParamLayout:
    """T's flat layout: hidden widths padded to WIDTH_GRANULE, blocks to GRANULE floats."""
    return ParamLayout([cfg.n_features, *cfg.hidden, cfg.n_classes], WIDTH_GRANULE, GRANULE)


def _views(layout: ParamLayout, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (M, out, in) weight and (M, out) bias views of (M, P) slots."""
    M = flat.shape[0]
    return [(flat[:, lay.w_off:lay.w_off + lay.out_pad * lay.in_pad].view(M, lay.out_pad,
                                                                          lay.in_pad),
             flat[:, lay.b_off:lay.b_off + lay.out_pad])
            for lay in layout.layers]


# --------------------------------------------------------------------------- networks


@dataclass
class MLPParams:
    """One network's float32 weights ``[(out, in)]`` and biases ``[(out,)]``."""

    weights: list[np.ndarray]
    biases: list[np.ndarray]

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> MLPParams:
        """The inverse of :func:`jobs.learners.networks.torch_nets.mlp_state` (copies, bit for
        bit)."""
        n = len(state) // 2
        return cls([state[f"net.{2 * i}.weight"].detach().cpu().numpy().copy() for i in range(n)],
                   [state[f"net.{2 * i}.bias"].detach().cpu().numpy().copy() for i in range(n)])

    def logits(self, X: np.ndarray) -> np.ndarray:
        """Logits in float64 (the real-arithmetic function the bounds talk about)."""
        a = np.asarray(X, dtype=np.float64)
        L = len(self.weights)
        for i, (W, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            a = a @ W.astype(np.float64).T + b.astype(np.float64)
            if i < L - 1:
                a = np.maximum(a, 0.0)
        return a

    def equal(self, other: MLPParams) -> bool:
        """Bitwise equality."""
        if len(self.weights) != len(other.weights):
            return False
        for a, b in zip(self.weights + self.biases, other.weights + other.biases, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
                return False
        return True

    def content_hash(self) -> str:
        h = hashlib.sha256()
        for a in self.weights + self.biases:
            h.update(repr(a.shape).encode())
            h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
        return h.hexdigest()

    def to_module(self) -> MLP:
        """A :class:`jobs.learners.networks.torch_nets.MLP` holding these weights."""
        hidden = [W.shape[0] for W in self.weights[:-1]]
        net = MLP(self.weights[0].shape[1], self.weights[-1].shape[0], hidden)
        linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for lin, W, b in zip(linears, self.weights, self.biases, strict=True):
                lin.weight.copy_(torch.from_numpy(W))
                lin.bias.copy_(torch.from_numpy(b))
        return net.eval()


# --------------------------------------------------------------------------- data + schedule


def schedule_keys(seed: int, ids: Iterable[object]) -> np.ndarray:
    """The schedule keys ``prf(seed, "loo-batch", id)`` of ``ids`` (uint64): what a
    record is to the schedule, and what a tombstone of it is given as."""
    return prf_u64_many(seed, "loo-batch", ids)


def _tombstone_keys(tombstones: Iterable[object]) -> np.ndarray:
    """Tombstones as uint64 keys; anything else (e.g. a record id) is refused."""
    keys = list(tombstones)
    for t in keys:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= int(t) < 2**64:
            raise TypeError("tombstones are uint64 schedule keys (schedule_keys(seed, ids)), "
                            f"got {t!r}")
    return np.array([int(t) for t in keys], dtype=np.uint64)


def _sorted_data(
    X: np.ndarray, y: np.ndarray, ids: np.ndarray, tombstones: Iterable[object], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows in schedule-key order, tombstones inserted as zero rows.

    Returns (X, y, keys, src): ``src[i]`` is row i's position in ``ids``, -1 for a tombstone.
    """
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    if X.ndim != 2 or len(X) != len(y) or len(y) != len(ids):
        raise ValueError("X must be (n, d) and y, ids of length n")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("record ids must be unique")
    live_keys = schedule_keys(seed, ids.tolist())
    tomb_keys = _tombstone_keys(tombstones)
    if np.isin(tomb_keys, live_keys).any():
        raise ValueError("a tombstone's key is also a live record's key (the deleted record "
                         "is back, or a 64-bit key collision)")
    keys = np.concatenate([live_keys, tomb_keys])
    if len(np.unique(keys)) != len(keys):
        raise ValueError("two records or tombstones share a 64-bit schedule key (a collision "
                         "of the keyed hash, or a repeated tombstone): the schedule needs "
                         "distinct keys")
    order = np.argsort(keys, kind="stable")
    n_tomb = len(tomb_keys)
    X = np.concatenate([X, np.zeros((n_tomb, X.shape[1]), dtype=np.float32)])
    y = np.concatenate([y, np.zeros(n_tomb, dtype=np.int64)])
    src = np.concatenate([np.arange(len(ids)), np.full(n_tomb, -1)])
    return X[order], y[order], keys[order], src[order]


def _schedule(keys: np.ndarray, seed: int, epochs: int, B: int,
              first_epoch: int = 0) -> list[list[np.ndarray]]:
    return [epoch_batches(keys, prf_u64(seed, "loo-epoch", e), B)
            for e in range(first_epoch, first_epoch + epochs)]


def _init_flat(cfg: LOOConfig, layout: ParamLayout) -> np.ndarray:
    net = init_net(MLP(cfg.n_features, cfg.n_classes, cfg.hidden), cfg.seed)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    Ws = [m.weight.detach().numpy().copy() for m in linears]
    bs = [m.bias.detach().numpy().copy() for m in linears]
    return layout.pack(Ws, bs)


# --------------------------------------------------------------------------- the kernel


def _device_schedule(schedule: list[list[np.ndarray]], n_pad_row: int,
                     device: torch.device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per batch: (padded size, rows to gather, row index or -1), on the device once for
    every chunk (a host-to-device copy per step and chunk held CUDA back)."""
    out = []
    for batches in schedule:
        for rows in batches:
            bp = round_up(len(rows), GRANULE)
            ridx = np.full(bp, -1, dtype=np.int64)
            ridx[:len(rows)] = rows
            take = np.where(ridx >= 0, ridx, n_pad_row)
            out.append((bp, torch.from_numpy(take).to(device), torch.from_numpy(ridx).to(device)))
    return out


def _train_slots(
    flat: torch.Tensor,
    excl: torch.Tensor,
    Xp: torch.Tensor,
    Yp: torch.Tensor,
    steps: list[tuple[int, torch.Tensor, torch.Tensor]],
    layout: ParamLayout,
    lr: float,
    wd: float,
) -> torch.Tensor:
    """Train the (M, P) slots in place of a copy; ``excl`` (M, k) = rows each slot skips.

    ``Xp``/``Yp`` hold the sorted rows plus one trailing all-zero row used for padding;
    ``steps`` is the schedule from :func:`_device_schedule`.
    """
    device = flat.device
    M = flat.shape[0]
    C = Yp.shape[1]
    L = len(layout.layers)
    flat = flat.clone()
    views = _views(layout, flat)
    grad = torch.zeros_like(flat)  # gaps between blocks stay exactly zero
    ones_cache: dict[int, torch.Tensor] = {}
    for bp, take, ridx_t in steps:
        xb = Xp.index_select(0, take)
        yb = Yp.index_select(0, take)
        present = (ridx_t >= 0)[None, :] & ~(ridx_t[None, :, None] == excl[:, None, :]).any(-1)
        mask = present.to(torch.float32)  # (M, bp)
        count = mask.sum(1, keepdim=True)  # exact small integers
        w = mask / count.clamp_min(1.0)
        # lr for slots with a present record, 0 (no step, no decay) otherwise
        lr_slot = (count > 0).to(torch.float32) * lr  # (M, 1): exactly lr or 0

        # forward
        a = xb.expand(M, bp, xb.shape[1])
        acts = [a]
        pres = []
        z = a
        for li, (W, bias) in enumerate(views):
            z = torch.bmm(a, W.transpose(1, 2)) + bias[:, None, :]
            if li < L - 1:
                pres.append(z)
                a = torch.relu(z)
                acts.append(a)
        # softmax over classes with explicit, position-independent sums
        m = z[..., 0:1]
        for c in range(1, C):
            m = torch.maximum(m, z[..., c:c + 1])
        e = torch.exp(z - m)
        s = e[..., 0:1]
        for c in range(1, C):
            s = s + e[..., c:c + 1]
        p = e / s
        g = (p - yb) * w[:, :, None]  # d(mean CE)/d logits, (M, bp, C)

        # backward
        ones = ones_cache.get(bp)
        if ones is None:
            ones = ones_cache[bp] = torch.ones((M, 1, bp), dtype=torch.float32, device=device)
        for li in range(L - 1, -1, -1):
            lay = layout.layers[li]
            dW = torch.bmm(g.transpose(1, 2), acts[li])  # (M, out, in)
            grad[:, lay.w_off:lay.w_off + lay.out_pad * lay.in_pad] = dW.reshape(M, -1)
            grad[:, lay.b_off:lay.b_off + lay.out_pad] = torch.bmm(ones, g)[:, 0, :]
            if li > 0:
                g = torch.bmm(g, views[li][0])  # (M, bp, in)
                g.mul_(pres[li - 1] > 0)  # ReLU'(z): exact 0/1 factors

        # SGD with weight decay, one IEEE op at a time:
        # p <- p - lr * (grad + wd * p)
        u = grad + flat * wd
        flat.sub_(u * lr_slot)
    return flat


def _run(
    cfg: LOOConfig,
    X: np.ndarray,
    y: np.ndarray,
    excl_rows: np.ndarray,
    schedule: list[list[np.ndarray]],
    *,
    device: str | torch.device,
    chunk_size: int,
    kernel: str = "compiled",
    progress: Callable[[int, int], None] | None = None,
    init: np.ndarray | None = None,
) -> np.ndarray:
    """Train one network per row of ``excl_rows`` (M, k); returns flat params (M, P).

    ``init`` (M, P): each network's starting parameters (default: the seed's)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    dev = resolve_device(device)
    layout = _layout(cfg)
    M = excl_rows.shape[0]
    if init is None:
        init = np.broadcast_to(_init_flat(cfg, layout), (M, layout.P))
    elif init.shape != (M, layout.P):
        raise ValueError(f"init must be ({M}, {layout.P}), got {init.shape}")
    out = np.empty((M, layout.P), dtype=np.float32)
    with contextlib.ExitStack() as stack:
        if dev.type == "cpu" and kernel == "compiled":  # one loop per network (mlp_kernels)
            rows, off = flat_batches([rows for batches in schedule for rows in batches])
            y64 = np.asarray(y, dtype=np.int64)

            def train(start: int, stop: int) -> np.ndarray:
                flat = np.array(init[start:stop], dtype=np.float32, order="C")
                sgd_slots(flat, np.ascontiguousarray(excl_rows[start:stop]), X, y64, rows, off,
                          layout.geom, cfg.lr, cfg.weight_decay)
                return flat
        else:
            # one thread on the CPU: the thread count changes torch's bits
            stack.enter_context(torch_threads(1 if dev.type == "cpu" else None))
            stack.enter_context(deterministic())
            stack.enter_context(torch.no_grad())
            if dev.type == "cuda":  # cuBLAS's batched kernels differ by the slot count
                chunk_size = CUDA_SLOTS
            Xt = torch.from_numpy(np.concatenate([X, np.zeros((1, X.shape[1]), np.float32)]))
            Y1 = np.zeros((len(y) + 1, cfg.n_classes), dtype=np.float32)
            Y1[np.arange(len(y)), y] = 1.0
            Xt, Yt = Xt.to(dev), torch.from_numpy(Y1).to(dev)
            steps = _device_schedule(schedule, len(y), dev)

            def train(start: int, stop: int) -> np.ndarray:
                ex, fl = excl_rows[start:stop], init[start:stop]
                if dev.type == "cuda" and len(ex) < CUDA_SLOTS:  # pad: same shapes always
                    ex = np.concatenate([ex, np.repeat(ex[:1], CUDA_SLOTS - len(ex), 0)])
                    fl = np.concatenate([fl, np.repeat(fl[:1], CUDA_SLOTS - len(fl), 0)])
                flat = torch.from_numpy(np.array(fl, dtype=np.float32, order="C")).to(dev)
                ex_t = torch.from_numpy(np.ascontiguousarray(ex)).to(dev)
                return _train_slots(flat, ex_t, Xt, Yt, steps, layout, cfg.lr,
                                    cfg.weight_decay)[:stop - start].cpu().numpy()
        for start in range(0, M, chunk_size):
            stop = min(M, start + chunk_size)
            out[start:stop] = train(start, stop)
            if progress is not None:
                progress(stop, M)
    return out


def _make_config(
    X: np.ndarray, y: np.ndarray, n_total: int, *, n_classes: int | None, hidden, epochs,
    batch_size, n_batches_, lr, weight_decay, seed,
) -> LOOConfig:
    C = int(n_classes) if n_classes is not None else int(y.max()) + 1 if len(y) else 1
    if C < 2:
        raise ValueError(f"need at least 2 classes, got {C} class{'' if C == 1 else 'es'}")
    if len(y) and (y.min() < 0 or y.max() >= C):
        raise ValueError("labels must be integers in [0, n_classes)")
    B = int(n_batches_) if n_batches_ is not None else n_batches(n_total, batch_size)
    return LOOConfig(
        n_features=int(X.shape[1]), n_classes=C, hidden=tuple(int(h) for h in hidden),
        epochs=int(epochs), batch_size=int(batch_size), n_batches=B, lr=float(lr),
        weight_decay=float(weight_decay), seed=int(seed),
    )


def _prepared(X: np.ndarray, y: np.ndarray, ids: np.ndarray, tombstones: Iterable[object],
              **hyper) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, LOOConfig]:
    """:func:`_sorted_data` and the config of T (``B`` counts the live records and
    tombstones when not given)."""
    Xs, ys, keys, src = _sorted_data(X, y, ids, tombstones, int(hyper["seed"]))
    return Xs, ys, keys, src, _make_config(Xs, ys[src >= 0], len(keys), **hyper)


# --------------------------------------------------------------------------- public API


def train_loo(
    X: np.ndarray,
    y: np.ndarray,
    ids: Sequence[object],
    *,
    n_classes: int | None = None,
    hidden: Sequence[int] = (50, 50),
    epochs: int = 30,
    batch_size: int = 32,
    lr: float = 0.1,
    weight_decay: float = 1e-5,
    seed: int = 0,
    n_batches: int | None = None,
    tombstones: Iterable[int] = (),
    device: str | torch.device = "auto",
    chunk_size: int = 512,
    kernel: str = "compiled",
    classes: Sequence[object] | None = None,
    progress: Callable[[int, int], None] | None = None,
    init: MLPParams | None = None,
) -> LOOSet:
    """Train N = T(D) and every N_{-x} = T(D \\ {x}) for x in D, batched.

    ``y`` holds class indices in ``[0, n_classes)``; ``classes`` optionally names
    them (stored, not used). ``n_batches`` defaults to ``ceil(|D| / batch_size)``
    with ``|D|`` counting tombstones, which are schedule keys of deleted records
    (:func:`schedule_keys`). ``kernel``: ``"compiled"`` trains on the CPU with
    :func:`jobs.learners.networks.mlp_kernels.sgd_slots`, ``"torch"`` with torch's batched ops
    (what sets trained before the compiled kernel need; CUDA always uses torch's).
    ``chunk_size`` networks train at a time on the CPU (memory bound; on CUDA
    always ``CUDA_SLOTS``); the result does not depend on it. ``progress(done,
    total)`` is called after each chunk. ``init``: every network's starting weights
    (default: the seed's), e.g. a user module's own initialisation.
    """
    ids_arr = np.asarray(list(ids))
    Xs, ys, keys, src, cfg = _prepared(
        X, y, ids_arr, tombstones, n_classes=n_classes, hidden=hidden, epochs=epochs,
        batch_size=batch_size, n_batches_=n_batches, lr=lr, weight_decay=weight_decay,
        seed=seed)
    tomb = src < 0
    live = np.flatnonzero(~tomb)
    live = live[np.argsort(ids_arr[src[live]], kind="stable")]  # networks in id order
    tomb_rows = np.flatnonzero(tomb)
    n = len(live)
    # row 0: the full network; row 1 + j: without live record j; every row skips tombstones
    k = 1 + len(tomb_rows)
    excl = np.full((n + 1, k), -1, dtype=np.int64)
    excl[1:, 0] = live
    excl[:, 1:] = tomb_rows[None, :]
    schedule = _schedule(keys, cfg.seed, cfg.epochs, cfg.n_batches)
    layout = _layout(cfg)
    start = None if init is None else np.broadcast_to(
        layout.pack(init.weights, init.biases), (len(excl), layout.P))
    t0 = time.perf_counter()
    flat = _run(cfg, Xs, ys, excl, schedule, device=device, chunk_size=max(1, int(chunk_size)),
                kernel=kernel, progress=progress, init=start)
    elapsed = time.perf_counter() - t0
    Ws, bs = layout.unpack(flat)
    dev = resolve_device(device)
    meta = {
        "train_seconds": elapsed,
        "device": dev.type,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel": kernel,  # on the CPU: mlp_kernels.sgd_slots or torch (one thread)
        "granule": [GRANULE, WIDTH_GRANULE],
        "tombstones": keys[tomb].tolist(),
    }
    return LOOSet(cfg, ids_arr[src[live]], Ws, bs,
                  classes=None if classes is None else np.asarray(list(classes)), meta=meta)


def train_single(
    X: np.ndarray,
    y: np.ndarray,
    ids: Sequence[object],
    *,
    exclude: object | Sequence[object] | None = None,
    n_classes: int | None = None,
    hidden: Sequence[int] = (50, 50),
    epochs: int = 30,
    batch_size: int = 32,
    lr: float = 0.1,
    weight_decay: float = 1e-5,
    seed: int = 0,
    n_batches: int | None = None,
    tombstones: Iterable[int] = (),
    device: str | torch.device = "auto",
    kernel: str = "compiled",
    init: MLPParams | None = None,
    first_epoch: int = 0,
) -> MLPParams:
    """Train ONE network of the same schedule, without the record(s) ``exclude``.

    ``exclude`` may name a record present in ``ids`` (its features are zeroed
    before training: they must not matter) or an id that is not there (a
    tombstone of its key is inserted). ``B`` counts excluded records, so with the
    same arguments this reproduces ``train_loo(...).loo(exclude)`` bit for bit
    (pass ``n_classes`` when the excluded record is not in ``ids``).

    ``init`` and ``first_epoch`` continue a run (a later stage of a sliced shard):
    training starts from ``init`` instead of the seed's weights, and its epochs are
    numbered from ``first_epoch`` (their batches are keyed by that number).
    """
    if exclude is None:
        ex_list: list[object] = []
    elif isinstance(exclude, str | bytes | int | np.integer):
        ex_list = [exclude]
    else:
        ex_list = list(exclude)
    ids_list = list(ids)
    X = np.asarray(X, dtype=np.float32).copy()
    y = np.asarray(y, dtype=np.int64).copy()
    if n_classes is None and len(y):  # as train_loo infers it: from every given label
        n_classes = int(y.max()) + 1
    present = {v: i for i, v in enumerate(ids_list)}
    excluded = np.array([present[e] for e in ex_list if e in present], dtype=np.int64)
    X[excluded] = 0.0
    y[excluded] = 0
    missing = schedule_keys(int(seed), [e for e in ex_list if e not in present])
    Xs, ys, keys, src = _sorted_data(X, y, np.asarray(ids_list), [*tombstones, *missing],
                                     int(seed))
    live_mask = (src >= 0) & ~np.isin(src, excluded)
    cfg = _make_config(Xs, ys[live_mask], len(keys), n_classes=n_classes, hidden=hidden,
                       epochs=epochs, batch_size=batch_size, n_batches_=n_batches, lr=lr,
                       weight_decay=weight_decay, seed=seed)
    skip = np.flatnonzero(~live_mask)
    excl = np.full((1, max(1, len(skip))), -1, dtype=np.int64)
    excl[0, :len(skip)] = skip
    schedule = _schedule(keys, cfg.seed, cfg.epochs, cfg.n_batches, first_epoch)
    layout = _layout(cfg)
    start = None if init is None else layout.pack(init.weights, init.biases)[None, :]
    flat = _run(cfg, Xs, ys, excl, schedule, device=device, chunk_size=1, kernel=kernel,
                init=start)
    Ws, bs = layout.unpack(flat)
    return MLPParams([W[0] for W in Ws], [b[0] for b in bs])


def train_slots(
    X: np.ndarray,
    y: np.ndarray,
    ids: Sequence[object],
    exclude: Sequence[object | None],
    *,
    init: Sequence[MLPParams | None] | None = None,
    first_epoch: int = 0,
    tombstones: Iterable[int] = (),
    device: str | torch.device = "auto",
    chunk_size: int = 512,
    kernel: str = "compiled",
    **hyper: Any,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Several networks of ONE schedule on the same records, batched like :func:`train_loo`:
    network ``m`` skips record ``exclude[m]`` (an id of ``ids``; None: none) and starts
    from ``init[m]`` (None: the seed's weights). ``hyper``: T's hyperparameters as
    :func:`train_loo` takes them (``n_classes``, ``hidden``, ``epochs``, ``batch_size``,
    ``lr``, ``weight_decay``, ``seed``, ``n_batches``; all required but ``n_batches``).
    Returns stacked weights ``[(M, out, in)]`` and biases ``[(M, out)]``.

    Why: a sliced shard's leave-one-out networks part ways at the record's slice, so
    each stage continues every network from its own checkpoint. Network ``m`` is bit for
    bit :func:`train_single` with ``exclude=exclude[m]``, ``init=init[m]`` and the same
    other arguments.
    """
    ids_arr = np.asarray(list(ids))
    hyper["n_batches_"] = hyper.pop("n_batches", None)
    Xs, ys, keys, src, cfg = _prepared(X, y, ids_arr, tombstones, **hyper)
    tomb = src < 0
    row_of = {v: i for i, v in enumerate(src.tolist()) if v >= 0}
    pos = {v: i for i, v in enumerate(ids_arr.tolist())}
    tomb_rows = np.flatnonzero(tomb)
    M = len(exclude)
    excl = np.full((M, 1 + len(tomb_rows)), -1, dtype=np.int64)
    for m, rid in enumerate(exclude):
        if rid is not None:
            if rid not in pos:
                raise KeyError(f"excluded record {rid!r} is not among the records")
            excl[m, 0] = row_of[pos[rid]]
    excl[:, 1:] = tomb_rows[None, :]
    layout = _layout(cfg)
    start = None
    if init is not None:
        if len(init) != M:
            raise ValueError(f"init names {len(init)} networks, exclude {M}")
        seed_flat = _init_flat(cfg, layout)
        start = np.stack([seed_flat if p is None else layout.pack(p.weights, p.biases)
                          for p in init])
    schedule = _schedule(keys, cfg.seed, cfg.epochs, cfg.n_batches, first_epoch)
    flat = _run(cfg, Xs, ys, excl, schedule, device=device, chunk_size=max(1, int(chunk_size)),
                kernel=kernel, init=start)
    return layout.unpack(flat)


def loo_work(n_records: int, epochs: int, widths: Sequence[int]) -> float:
    """The work of a LOO set of ``n_records`` records: ``n + 1`` networks of
    ``widths = [d, *hidden, C]`` trained for ``epochs`` on ``n`` records, in weight x
    record x epoch units (what its time on one CPU core is proportional to)."""
    params = sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:], strict=True))
    return float(n_records + 1) * n_records * epochs * params


def _jsonable_id(v: object) -> object:
    return v.item() if isinstance(v, np.generic) else v


@dataclass
class LOOSet:
    """Stacked networks: index 0 is N, index ``1 + j`` is N_{-record_ids[j]}.

    ``weights[l]`` has shape ``(M, out_l, in_l)``, ``biases[l]`` ``(M, out_l)``,
    float32, ``M = 1 + len(record_ids)``; ``record_ids`` sorted (networks in id
    order; training rows are in key order). ``meta["tombstones"]``: the schedule
    keys of the tombstones it was trained with (no deleted record's id).
    """

    config: LOOConfig
    record_ids: np.ndarray
    weights: list[np.ndarray]
    biases: list[np.ndarray]
    classes: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    # ---- shape
    @property
    def n_networks(self) -> int:
        return int(self.weights[0].shape[0])

    @property
    def n_records(self) -> int:
        return len(self.record_ids)

    @property
    def n_classes(self) -> int:
        return int(self.weights[-1].shape[1])

    def index_of(self, record_id: object) -> int:
        """Network index of N_{-record_id}."""
        pos = int(np.searchsorted(self.record_ids, record_id))
        if pos >= len(self.record_ids) or self.record_ids[pos] != record_id:
            raise KeyError(record_id)
        return pos + 1

    # ---- networks
    def network(self, i: int) -> MLPParams:
        return MLPParams([W[i].copy() for W in self.weights], [b[i].copy() for b in self.biases])

    def full(self) -> MLPParams:
        return self.network(0)

    def loo(self, record_id: object) -> MLPParams:
        return self.network(self.index_of(record_id))

    def flat_params(self, indices: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Flattened parameters ``(k, n_params)`` in float64 (for clustering)."""
        idx = np.arange(self.n_networks) if indices is None else np.asarray(indices)
        parts = [W[idx].reshape(len(idx), -1) for W in self.weights]
        parts += [b[idx] for b in self.biases]
        return np.concatenate(parts, axis=1).astype(np.float64)

    def logits(
        self, X: np.ndarray, indices: Sequence[int] | np.ndarray | None = None,
        *, max_bytes: int = 64 << 20,
    ) -> np.ndarray:
        """Logits of networks ``indices`` (default all) at ``X``: ``(k, n, C)`` float64."""
        X = np.asarray(X, dtype=np.float64)
        idx = np.arange(self.n_networks) if indices is None else np.asarray(indices)
        width = max([X.shape[1], *(W.shape[1] for W in self.weights)])
        per_net = max(1, X.shape[0] * width * 8 * 2)
        step = max(1, int(max_bytes // per_net))
        out = np.empty((len(idx), X.shape[0], self.n_classes), dtype=np.float64)
        L = len(self.weights)
        for s in range(0, len(idx), step):
            sel = idx[s:s + step]
            a = np.broadcast_to(X, (len(sel), *X.shape))
            for li, (W, b) in enumerate(zip(self.weights, self.biases, strict=True)):
                Wd = W[sel].astype(np.float64)
                a = np.matmul(a, Wd.transpose(0, 2, 1)) + b[sel].astype(np.float64)[:, None, :]
                if li < L - 1:
                    a = np.maximum(a, 0.0)
            out[s:s + step] = a
        return out

    # ---- persistence
    def content_hash(self) -> str:
        """SHA-256 over the config, record ids and every weight's bytes."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        h.update(json.dumps([_jsonable_id(v) for v in self.record_ids.tolist()]).encode())
        for a in self.weights + self.biases:
            h.update(repr(a.shape).encode())
            h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> str:
        """Write an ``.npz``; returns the content hash (stored inside too)."""
        with open(path, "wb") as fh:
            return self.write(fh)

    def write(self, fh: BinaryIO) -> str:
        """:meth:`save` to an open binary file (e.g. a buffer that is sealed afterwards)."""
        digest = self.content_hash()
        header = {
            "format": FORMAT_VERSION,
            "config": self.config.to_dict(),
            "meta": self.meta,
            "hash": digest,
            "record_ids": [_jsonable_id(v) for v in self.record_ids.tolist()],
            "classes": None if self.classes is None
            else [_jsonable_id(v) for v in self.classes.tolist()],
        }
        arrays = {f"W{i}": W for i, W in enumerate(self.weights)}
        arrays.update({f"b{i}": b for i, b in enumerate(self.biases)})
        np.savez(fh, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
        return digest

    @classmethod
    def load(cls, path: str | Path | BinaryIO, *, verify: bool = True) -> LOOSet:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes().decode())
            if header.get("format") != FORMAT_VERSION:
                raise ValueError(f"unsupported LOO set format {header.get('format')!r}")
            L = len([k for k in z.files if k.startswith("W")])
            Ws = [z[f"W{i}"] for i in range(L)]
            bs = [z[f"b{i}"] for i in range(L)]
        obj = cls(LOOConfig.from_dict(header["config"]), np.asarray(header["record_ids"]), Ws, bs,
                  classes=None if header["classes"] is None else np.asarray(header["classes"]),
                  meta=header["meta"])
        if verify and obj.content_hash() != header["hash"]:
            raise ValueError(f"{path}: content hash mismatch")
        return obj


__all__ = [
    "GRANULE",
    "WIDTH_GRANULE",
    "LOOConfig",
    "LOOSet",
    "MLPParams",
    "schedule_keys",
    "loo_work",
    "train_loo",
    "train_single",
    "train_slots",
]


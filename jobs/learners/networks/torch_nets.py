"""Small torch networks and a training loop that is a function of the SET of records.

Used by SISA, the mlp and game learners and the attackers (and by anyone reproducing one of
their networks): the seed alone initialises, rows are sorted by id, a record's batch per
epoch is a keyed hash of (seed, stage, epoch, id) mod ``B``, and kernels and shapes are the
same for the served and the checked model.
See docs/DESIGN.md (Training as a function of the SET of records)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from jobs.learners.keyed import prf_u64
from jobs.learners.networks.mlp_kernels import ParamLayout, flat_batches, train_mlp

# cuBLAS reads this when its handle is created; without it, deterministic mode
# refuses CUDA matmuls. Harmless on CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_M63 = (1 << 63) - 1
# how an MLP trains on the CPU: one compiled loop (jobs.learners.networks.mlp_kernels) or torch's
# calls; a model records which, as its bits depend on it
KERNELS = ("compiled", "torch")
# the optimisers a training stage may use (a user's network chooses; the rest use Adam)
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
# the losses a stage may minimise: cross-entropy on logits (everyone's), a label-smoothing
# value in [0, 1) (cross-entropy towards smoothed targets), or "nll" (the network outputs
# log-probabilities); the last two for a network of the user's
CROSS_ENTROPY = "cross_entropy"
LOSSES = (CROSS_ENTROPY, "nll")


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Fully connected ReLU network for tables with inputs in [0, 1]^d."""

    def __init__(self, n_features: int, n_classes: int, hidden: Sequence[int] = (64,)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = n_features
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """A small CNN for square single-channel images given as flat rows (e.g. 8x8 digits).

    conv3x3(1->c1) ReLU, conv3x3 stride 2 (c1->c2) ReLU, then a fully connected
    head with ``hidden`` widths. Stride-2 convolution instead of max-pooling:
    max-pool backward has no deterministic CUDA kernel guarantee.
    """

    def __init__(
        self,
        n_features: int,
        n_classes: int,
        hidden: Sequence[int] = (64,),
        channels: tuple[int, int] = (8, 16),
    ) -> None:
        super().__init__()
        side = math.isqrt(n_features)
        if side * side != n_features:
            raise ValueError(
                f"model='cnn' needs square single-channel images as flat rows; "
                f"{n_features} features is not a perfect square"
            )
        self.side = side
        c1, c2 = channels
        self.conv = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        out_side = (side + 1) // 2
        width = c2 * out_side * out_side
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, n_classes))
        self.head = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x.reshape(-1, 1, self.side, self.side))
        return self.head(z.flatten(1))


def build_net(kind: str, n_features: int, n_classes: int, hidden: Sequence[int]) -> nn.Module:
    """``kind`` is ``"mlp"`` or ``"cnn"``; weights are NOT initialised here (:func:`init_net`)."""
    if kind == "mlp":
        return MLP(n_features, n_classes, hidden)
    if kind == "cnn":
        return SmallCNN(n_features, n_classes, hidden)
    raise ValueError(f"unknown model {kind!r}; expected 'mlp' or 'cnn'")


@torch.no_grad()
def init_net(net: nn.Module, seed: int) -> nn.Module:
    """Initialise every Linear/Conv2d from ``seed`` alone (PyTorch's default scheme).

    Draws on a CPU generator in module order and copies the values in, so the
    initial weights are the same bits whatever device ``net`` lives on.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & _M63)
    for m in net.modules():
        if isinstance(m, nn.Linear | nn.Conv2d):
            w = torch.empty(m.weight.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
            m.weight.copy_(w)
            if m.bias is not None:
                fan_in = w[0].numel()
                bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                b = torch.empty(m.bias.shape, dtype=torch.float32)
                b.uniform_(-bound, bound, generator=g)
                m.bias.copy_(b)
    return net


# --------------------------------------------------------------------------- determinism


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels for the duration; the caller's settings are restored after."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev_cudnn


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with exactly ``n`` intra-op CPU threads (``None``: leave as is); restored after.

    CPU kernels may split a reduction differently with a different thread
    count, which changes float32 rounding: fixing the count makes the trained
    bits independent of the machine's core count and of the process's setting.
    """
    if n is None:
        yield
        return
    prev = torch.get_num_threads()
    if prev != n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        if prev != n:
            torch.set_num_threads(prev)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# --------------------------------------------------------------------------- keyed batches


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (a bijection; wraps mod 2^64)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def n_batches(n: int, batch_size: int) -> int:
    """Number of mini-batches per epoch for ``n`` records: ``max(1, ceil(n / batch_size))``."""
    return max(1, -(-int(n) // int(batch_size)))


def stage_epochs(n: int, batch_size: int, epochs: int, min_steps: int = 0) -> int:
    """Epochs of a training run on ``n`` records: ``max(epochs, ceil(min_steps / B))``.

    Why: what a network learns is set by its optimiser steps, not its epochs, and a
    shard of ``n / S`` records gets ``S`` times fewer steps per epoch; a step floor
    keeps small shards from stopping before they learn. A function of ``B`` alone
    (:func:`n_batches`), so two record counts with the same ``B`` train the same
    epochs (the LOO schedule relies on it); ``min_steps = 0`` is plain ``epochs``.
    """
    B = n_batches(n, batch_size)
    return max(int(epochs), -(-int(min_steps) // B))


def epoch_batches(record_keys: np.ndarray, salt: int, n_batch: int) -> list[np.ndarray]:
    """Split rows into ``n_batch`` keyed mini-batches for one epoch.

    ``record_keys[i]`` is a keyed 64-bit hash of row i's record id (rows sorted
    by id); ``salt`` is a keyed hash of (seed, stage, epoch). Row i goes to
    batch ``h_i mod n_batch`` with ``h_i = mix64(record_keys[i] ^ salt)``;
    within a batch rows are ordered by ``(h_i, i)``. Returns the non-empty
    batches as arrays of row indices, in batch order.
    """
    n = len(record_keys)
    if n == 0:
        return []
    h = _mix64(record_keys ^ np.uint64(salt))
    b = h % np.uint64(n_batch)
    order = np.lexsort((np.arange(n), h, b))
    counts = np.bincount(b.astype(np.int64), minlength=n_batch)
    bounds = np.cumsum(counts)[:-1]
    return [part for part in np.split(order, bounds) if len(part)]


def loss_function(loss: str | float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The batch loss ``loss`` names (see LOSSES); ValueError, in one line, for another."""
    if loss == CROSS_ENTROPY:
        return F.cross_entropy
    if loss == "nll":
        return F.nll_loss
    if (isinstance(loss, int | float) and not isinstance(loss, bool)
            and 0.0 <= float(loss) < 1.0):
        return functools.partial(F.cross_entropy, label_smoothing=float(loss))
    raise ValueError(f"loss must be {CROSS_ENTROPY!r}, 'nll' or a label-smoothing value in "
                     f"[0, 1), got {loss!r}")


def train_stage(
    net: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    record_keys: np.ndarray,
    *,
    seed: int,
    stage_key: tuple[object, ...],
    epochs: int,
    batch_size: int,
    lr: float,
    kernel: str = "compiled",
    optimizer: str = "adam",
    loss: str | float = CROSS_ENTROPY,
) -> None:
    """Train ``net`` in place for ``epochs`` epochs on rows (X, y) with keyed batches.

    ``kernel="compiled"``: an MLP on the CPU runs :func:`jobs.learners.networks.mlp_kernels.
    train_mlp` (the same update, other bits); ``"torch"``: torch's own loop everywhere
    (what models trained before the compiled kernel need to be reproduced).

    A fresh optimiser per call, Adam (or ``optimizer="sgd"``: plain SGD, for a network
    of the user's), so a stage's result depends only on the starting weights and the
    rows, never on optimiser state from earlier stages. ``stage_key`` (e.g. ``(shard,
    slice)``) and the epoch key the batch assignment. Rows must be sorted by record id.
    ``loss``: :func:`loss_function`'s. No rows: no-op.
    """
    n = int(X.shape[0])
    if n == 0 or epochs <= 0:
        return
    B = n_batches(n, batch_size)
    device = X.device
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    batch_loss = loss_function(loss)
    if (kernel == "compiled" and device.type == "cpu" and isinstance(net, MLP)
            and optimizer == "adam" and loss == CROSS_ENTROPY):
        _train_mlp_compiled(net, X, y, record_keys, seed, stage_key, epochs, B, lr)
        return
    net.train()
    opt = OPTIMIZERS[optimizer](net.parameters(), lr=lr, foreach=False)
    with deterministic():
        for epoch in range(epochs):
            salt = prf_u64(seed, "epoch", *stage_key, epoch)
            for rows in epoch_batches(record_keys, salt, B):
                idx = torch.from_numpy(rows).to(device)
                xb = X.index_select(0, idx)
                yb = y.index_select(0, idx)
                opt.zero_grad(set_to_none=True)
                batch_loss(net(xb), yb).backward()
                opt.step()
    net.eval()


@torch.no_grad()
def _train_mlp_compiled(net: MLP, X: torch.Tensor, y: torch.Tensor, record_keys: np.ndarray,
                        seed: int, stage_key: tuple[object, ...], epochs: int, B: int,
                        lr: float) -> None:
    """train_stage for an MLP on the CPU: the same batches, one compiled Adam loop
    (:mod:`jobs.learners.networks.mlp_kernels`, which says why)."""
    linears = [m for m in net.net if isinstance(m, nn.Linear)]
    layout = ParamLayout([linears[0].in_features, *(m.out_features for m in linears)])
    flat = layout.pack([m.weight.numpy() for m in linears], [m.bias.numpy() for m in linears])
    rows, off = flat_batches([
        b for epoch in range(epochs)
        for b in epoch_batches(record_keys, prf_u64(seed, "epoch", *stage_key, epoch), B)])
    train_mlp(flat, layout.geom, np.ascontiguousarray(X.numpy(), dtype=np.float32),
              y.numpy().astype(np.int64), rows, off, float(lr), 0.9, 0.999, 1e-8)
    Ws, bs = layout.unpack(flat[None])
    for m, W, b in zip(linears, Ws, bs, strict=True):
        m.weight.copy_(torch.from_numpy(W[0]))
        m.bias.copy_(torch.from_numpy(b[0]))
    net.eval()


# --------------------------------------------------------------------------- state helpers


def state_to_cpu(net: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``net``'s state dict (a checkpoint later training cannot touch)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in net.state_dict().items()}


def mlp_state(
    weights: Sequence[np.ndarray], biases: Sequence[np.ndarray]
) -> dict[str, torch.Tensor]:
    """The :class:`MLP` state dict holding these float32 weights ``[(out, in)]`` and
    biases ``[(out,)]`` (copies, bit for bit; layer ``l`` is ``net.{2 l}``)."""
    state: dict[str, torch.Tensor] = {}
    for i, (W, b) in enumerate(zip(weights, biases, strict=True)):
        state[f"net.{2 * i}.weight"] = torch.from_numpy(np.array(W, dtype=np.float32, copy=True))
        state[f"net.{2 * i}.bias"] = torch.from_numpy(np.array(b, dtype=np.float32, copy=True))
    return state


def hash_state(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of a state dict, bit for bit."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().to("cpu").contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two state dicts (NaN-safe: compares bytes)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        ta, tb = a[k].detach().cpu(), b[k].detach().cpu()
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            return False
        if ta.contiguous().numpy().tobytes() != tb.contiguous().numpy().tobytes():
            return False
    return True

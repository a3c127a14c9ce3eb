"""Training of small ReLU MLPs on the CPU, compiled: :func:`train_mlp` (Adam) for
:func:`jobs.learners.networks.torch_nets.train_stage`, :func:`sgd_slots` for the leave-one-out
schedule. The sidecar's networks are so small that a torch step is almost all per-call
overhead; one compiled loop computes torch's float32 arithmetic (other bits), and a model
records which kernel trained it so every path runs the same one.
See docs/DESIGN.md (The masked leave-one-out schedule)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit


def round_up(n: int, g: int) -> int:
    """The smallest multiple of g that is >= n, and at least g."""
    return max(g, -(-int(n) // g) * g)


class Layer(NamedTuple):
    """Where one layer lives in a flat parameter row: its true and padded widths (out,
    in) and the offsets of its weight block (out_pad x in_pad, row-major) and biases."""

    n_out: int
    n_in: int
    out_pad: int
    in_pad: int
    w_off: int
    b_off: int


# the kernels' `geom`: one record per layer, the fields of Layer
GEOM = np.dtype([(name, np.int64) for name in Layer._fields])


class Scratch(NamedTuple):
    """_gradient's buffers, sized for the widest layer and the largest batch: activations
    and pre-activations per layer, the back-propagated error, its next value, the rows."""

    act: np.ndarray
    pre: np.ndarray
    delta: np.ndarray
    back: np.ndarray
    keep: np.ndarray


class ParamLayout:
    """One network's parameters as one flat float32 row, the layout the kernels here read:
    per layer the weights (out x in, row-major) then the biases, each block starting at a
    multiple of `granule` floats, hidden widths padded to a multiple of `width_granule`
    (the padding stays zero; :mod:`jobs.learners.networks.loo_training` pads for torch's
    batched kernels). `layers` lists each :class:`Layer`; `geom` holds them as the kernels'
    structured array."""

    def __init__(self, widths: Sequence[int], width_granule: int = 1, granule: int = 1) -> None:
        true = [int(w) for w in widths]
        pad = [true[0], *(round_up(h, width_granule) for h in true[1:-1]), true[-1]]
        self.layers: list[Layer] = []
        off = 0
        for i in range(len(true) - 1):
            o_p, i_p = pad[i + 1], pad[i]
            w_off = off
            off += round_up(o_p * i_p, granule)
            b_off = off
            off += round_up(o_p, granule)
            self.layers.append(Layer(true[i + 1], true[i], o_p, i_p, w_off, b_off))
        self.P = off
        self.geom = np.array(self.layers, dtype=GEOM)

    def pack(self, weights: Sequence[np.ndarray], biases: Sequence[np.ndarray]) -> np.ndarray:
        """Unpadded weights [(out, in)] and biases [(out,)] -> one flat row (P,)."""
        flat = np.zeros(self.P, dtype=np.float32)
        for lay, W, b in zip(self.layers, weights, biases, strict=True):
            Wp = np.zeros((lay.out_pad, lay.in_pad), dtype=np.float32)
            Wp[:lay.n_out, :lay.n_in] = W
            flat[lay.w_off:lay.w_off + lay.out_pad * lay.in_pad] = Wp.ravel()
            flat[lay.b_off:lay.b_off + lay.n_out] = b
        return flat

    def unpack(self, flat: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(M, P) -> unpadded weights [(M, out, in)] and biases [(M, out)] (copies)."""
        M = flat.shape[0]
        Ws, bs = [], []
        for lay in self.layers:
            W = flat[:, lay.w_off:lay.w_off + lay.out_pad * lay.in_pad]
            W = W.reshape(M, lay.out_pad, lay.in_pad)[:, :lay.n_out, :lay.n_in]
            Ws.append(np.ascontiguousarray(W))
            bs.append(np.ascontiguousarray(flat[:, lay.b_off:lay.b_off + lay.n_out]))
        return Ws, bs


def flat_batches(batches: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Mini-batches of row indices, in training order, as the kernels take them: all rows
    in one array and each batch's start (batch i is rows[off[i]:off[i + 1]])."""
    off = np.zeros(len(batches) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(b) for b in batches])
    rows = np.concatenate(batches).astype(np.int64) if len(batches) else np.zeros(0, np.int64)
    return rows, off


@njit(cache=True)
def _gradient(p, geom, X, y, bs, scratch, grad):  # pragma: no cover - compiled
    """grad = the gradient of the mean cross-entropy over rows scratch.keep[:bs] at
    parameters p (layout `geom`, the records of :data:`GEOM`; row stride = the padded in
    width). Every inner loop runs along memory."""
    act, pre, delta, back, keep = (scratch.act, scratch.pre, scratch.delta, scratch.back,
                                   scratch.keep)
    L = geom.shape[0]
    C = geom[L - 1].n_out
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(bs):
        for j in range(X.shape[1]):
            act[0, i, j] = X[keep[i], j]
    for li in range(L):
        lay = geom[li]
        n_out, n_in, i_p, w0, b0 = lay.n_out, lay.n_in, lay.in_pad, lay.w_off, lay.b_off
        for i in range(bs):
            for o in range(n_out):
                acc = p[b0 + o]
                base = w0 + o * i_p
                for j in range(n_in):
                    acc += act[li, i, j] * p[base + j]
                pre[li, i, o] = acc
                if li < L - 1:
                    act[li + 1, i, o] = acc if acc > zero else zero
    w = one / np.float32(bs)  # d(mean CE)/d logits = (softmax - onehot) / bs
    for i in range(bs):
        mx = pre[L - 1, i, 0]
        for c in range(1, C):
            if pre[L - 1, i, c] > mx:
                mx = pre[L - 1, i, c]
        tot = zero
        for c in range(C):
            e = np.float32(math.exp(pre[L - 1, i, c] - mx))
            delta[i, c] = e
            tot += e
        for c in range(C):
            delta[i, c] = delta[i, c] / tot
        delta[i, y[keep[i]]] -= one
        for c in range(C):
            delta[i, c] *= w
    for li in range(L - 1, -1, -1):
        lay = geom[li]
        n_out, n_in, i_p, w0, b0 = lay.n_out, lay.n_in, lay.in_pad, lay.w_off, lay.b_off
        for o in range(n_out):
            grad[b0 + o] = zero
            base = w0 + o * i_p
            for j in range(n_in):
                grad[base + j] = zero
        for i in range(bs):
            for o in range(n_out):
                d = delta[i, o]
                grad[b0 + o] += d
                base = w0 + o * i_p
                for j in range(n_in):
                    grad[base + j] += d * act[li, i, j]
        if li > 0:  # ReLU passes the gradient where its input was > 0
            for i in range(bs):
                for j in range(n_in):
                    back[i, j] = zero
                for o in range(n_out):
                    d = delta[i, o]
                    base = w0 + o * i_p
                    for j in range(n_in):
                        back[i, j] += d * p[base + j]
                for j in range(n_in):
                    delta[i, j] = back[i, j] if pre[li - 1, i, j] > zero else zero


@njit(cache=True)
def _scratch(geom, X, batch_off):  # pragma: no cover - compiled
    """The buffers of _gradient for these layers and batches."""
    L = geom.shape[0]
    width = X.shape[1]
    for li in range(L):
        width = max(width, geom[li].n_out)
    bmax = 1
    for i in range(batch_off.shape[0] - 1):
        bmax = max(bmax, batch_off[i + 1] - batch_off[i])
    return Scratch(np.zeros((L + 1, bmax, width), np.float32),
                   np.zeros((L, bmax, width), np.float32), np.zeros((bmax, width), np.float32),
                   np.zeros((bmax, width), np.float32), np.empty(bmax, np.int64))


@njit(cache=True)
def train_mlp(flat, geom, X, y, rows, batch_off, lr, beta1, beta2, eps
              ):  # pragma: no cover - compiled
    """Adam on the MLP whose parameters are `flat` (layout `geom`, as for _gradient), in
    place: one step per mini-batch rows[batch_off[i]:batch_off[i + 1]] (non-empty)."""
    scratch = _scratch(geom, X, batch_off)
    grad = np.zeros(flat.shape[0], np.float32)
    m1 = np.zeros(flat.shape[0], np.float32)
    m2 = np.zeros(flat.shape[0], np.float32)
    one = np.float32(1.0)
    b1 = np.float32(beta1)
    b2 = np.float32(beta2)
    t = 0  # Adam's step count: one per non-empty batch
    for step in range(batch_off.shape[0] - 1):
        bs = batch_off[step + 1] - batch_off[step]
        if bs == 0:
            continue
        t += 1
        for i in range(bs):
            scratch.keep[i] = rows[batch_off[step] + i]
        _gradient(flat, geom, X, y, bs, scratch, grad)
        bc1 = one - np.float32(beta1 ** t)
        bc2 = np.float32(math.sqrt(1.0 - beta2 ** t))
        size = np.float32(lr) / bc1
        for q in range(flat.shape[0]):
            g = grad[q]
            m1[q] = b1 * m1[q] + (one - b1) * g
            m2[q] = b2 * m2[q] + (one - b2) * g * g
            flat[q] -= size * m1[q] / (np.float32(math.sqrt(m2[q])) / bc2 + np.float32(eps))


@njit(cache=True)
def sgd_slots(flat, excl, X, y, rows, batch_off, geom, lr, wd):  # pragma: no cover - compiled
    """The leave-one-out schedule's SGD (:mod:`jobs.learners.networks.loo_training`) for M
    networks, in place: flat (M, P) float32 in that module's padded layout (`geom`, as for
    _gradient); network m skips the rows excl[m] (-1: none). Per batch: the mean
    cross-entropy over the rows it keeps and ``p <- p - lr (g + wd p)``; a batch that keeps
    no row is no step (no decay either).

    Each network is trained on its own, by the same loops whatever M is, so a network of
    a LOO set is the same bits as the one network trained alone (``train_single``). The
    padding is never read or written: it stays zero, as the layout requires.
    """
    scratch = _scratch(geom, X, batch_off)
    keep = scratch.keep
    grad = np.zeros(flat.shape[1], np.float32)
    f_lr = np.float32(lr)
    f_wd = np.float32(wd)
    for m in range(flat.shape[0]):
        p = flat[m]
        for step in range(batch_off.shape[0] - 1):
            bs = 0
            for q in range(batch_off[step], batch_off[step + 1]):
                r = rows[q]
                skip = False
                for e in range(excl.shape[1]):
                    if excl[m, e] == r:
                        skip = True
                        break
                if not skip:
                    keep[bs] = r
                    bs += 1
            if bs == 0:
                continue
            _gradient(p, geom, X, y, bs, scratch, grad)
            for li in range(geom.shape[0]):
                lay = geom[li]
                n_out, n_in, i_p, w0, b0 = lay.n_out, lay.n_in, lay.in_pad, lay.w_off, lay.b_off
                for o in range(n_out):
                    p[b0 + o] -= (grad[b0 + o] + p[b0 + o] * f_wd) * f_lr
                    base = w0 + o * i_p
                    for j in range(n_in):
                        p[base + j] -= (grad[base + j] + p[base + j] * f_wd) * f_lr

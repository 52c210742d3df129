"""Quantizer pipelines: every weight quantizer of the accuracy chapter, as composable steps.

A *matrix quantizer* maps one weight ``W`` (out x in) and, when the pipeline is calibrated, the
second moment of its inputs ``H = E[x x^T]`` (in x in) to a :class:`Quantized` (the
dequantized weight and the bits it takes to store). Pipelines are matrix quantizers built
from smaller ones:

* :func:`rtn` round-to-nearest, asymmetric, per group (fp16 scale and min, as GGUF Q4_1);
* :func:`kmeans` scalar k-means per output channel (K = 2**bits, fp16 codebook per row),
  optionally importance-weighted by diag(H) (activation-aware calibration);
* :func:`awq` the AWQ recipe around any quantizer: per-input-channel scale search, then clip
  search (Lin et al. 2023);
* :func:`incoherent` randomized Hadamard rotation of both sides around any quantizer
  (QuIP#, Tseng et al. 2024), so the function is unchanged before quantization;
* :func:`gptq` Hessian error feedback with optional act-order (Frantar et al. 2022), with an
  RTN-group or a k-means-codebook quantizer inside;
* :func:`hqq` the `hqq` package's quantizer, the peer.

Every error that a calibrated step minimises is the layer's output error on the calibration
inputs, ``||X (W - W_hat)^T||^2 / n = tr(E H E^T)``, which H gives exactly without storing X.

:func:`quantize` applies a scheme of the registry :data:`SCHEMES` to every ``nn.Linear`` of
the decoder layers of a Llama-architecture causal LM, in place (fake quantization: weights
are replaced by their dequantized values, in their own dtype). Calibrated schemes run layer
by layer as GPTQ does: the inputs of layer l+1 are computed with layer l already quantized.
:func:`compare` is the measuring run of the chapter: reference, every scheme, the peer,
each with its perplexity.
"""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.util
import json
import math
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from . import ppl as _ppl


class SchemeError(ValueError):
    """An unknown scheme name, an unknown option, or options that do not fit the model."""


@dataclass
class Quantized:
    W_hat: torch.Tensor  # dequantized weight, float32, same shape as W
    bits: int  # storage including codebooks, scales, zeros and per-channel scales


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor | None) -> torch.Tensor:
    """Per-row ||x (w - w_hat)||^2 averaged over calibration inputs (plain squared error without H)."""
    E = (W - W_hat).float()
    if H is None:
        return (E * E).sum(1)
    return ((E @ H) * E).sum(1)


def _fp16(t: torch.Tensor) -> torch.Tensor:
    # Scales, mins and codebooks are stored as fp16: quantize them too, or the PPL flatters us.
    return t.half().float()


# --------------------------------------------------------------------------- round to nearest


def _check_group(in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise SchemeError(f"group_size={group_size} does not divide in_features={in_features}")


def _rtn_grid(Wg: torch.Tensor, bits: int, ratio: float | torch.Tensor = 1.0):
    lo = Wg.amin(-1, keepdim=True) * ratio
    hi = Wg.amax(-1, keepdim=True) * ratio
    d = _fp16(((hi - lo) / (2**bits - 1)).clamp_min(1e-8))
    return d, _fp16(lo)


def _rtn_apply(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round((w - m) / d), 0, 2**bits - 1) * d + m


def rtn(W: torch.Tensor, H: torch.Tensor | None = None, *, bits: int = 4, group_size: int = 128, ratio=1.0) -> Quantized:
    """Asymmetric round-to-nearest per group of ``group_size`` inputs: w = q*d + m, fp16 d and m."""
    out, n = W.shape
    _check_group(n, group_size)
    Wg = W.float().reshape(out, n // group_size, group_size)
    if torch.is_tensor(ratio):
        ratio = ratio.reshape(out, n // group_size, 1)
    d, m = _rtn_grid(Wg, bits, ratio)
    W_hat = _rtn_apply(Wg, d, m, bits).reshape(out, n)
    return Quantized(W_hat, W.numel() * bits + out * (n // group_size) * 32)


# --------------------------------------------------------------------------- k-means codebooks


def kmeans(
    W: torch.Tensor,
    H: torch.Tensor | None = None,
    *,
    bits: int = 4,
    weighted: bool = False,
    iters: int = 25,
    seed: int = 0,
) -> Quantized:
    """Scalar k-means per output channel, K = 2**bits, fp16 codebook of K entries per row.

    weighted: importance-weighted (activation-aware) k-means, importance of input i = E[x_i^2]
    = H[i, i], so the centroids serve the weights whose inputs are large.
    """
    from .kmeans import kmeans_rows

    K = 2**bits
    imp = None
    if weighted:
        if H is None:
            raise SchemeError("activation-aware k-means needs calibration statistics (H)")
        imp = torch.diagonal(H).clamp_min(0)
    codes, cb = kmeans_rows(W.float(), K, iters=iters, seed=seed, importance=imp)[:2]
    W_hat = _fp16(cb).gather(1, codes.long())
    return Quantized(W_hat, W.numel() * bits + W.shape[0] * K * 16)


def refit_codebook(W: torch.Tensor, codes: torch.Tensor, K: int, H: torch.Tensor, rows_per_chunk: int = 256) -> torch.Tensor:
    """Least-squares centroids for fixed codes: argmin_c ||(w - c[codes]) X||^2 per row (GPTVQ's update)."""
    out, n = W.shape
    cb = torch.empty(out, K)
    ridge = 1e-6 * torch.diagonal(H).mean()
    for r0 in range(0, out, rows_per_chunk):
        A = torch.nn.functional.one_hot(codes[r0 : r0 + rows_per_chunk].long(), K).float()  # r, n, K
        AtH = torch.einsum("rik,ij->rkj", A, H)
        M = AtH @ A + ridge * torch.eye(K)
        b = (AtH @ W[r0 : r0 + rows_per_chunk, :, None].float())[..., 0]
        cb[r0 : r0 + rows_per_chunk] = torch.linalg.solve(M, b)
    return cb


# --------------------------------------------------------------------------- AWQ


def awq(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    inner: Callable[..., Quantized],
    n_grid: int = 20,
    clip: bool = True,
    clip_grid: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5),
    group_size: int | None = None,
    search_inner: Callable[..., Quantized] | None = None,
) -> Quantized:
    """AWQ around ``inner``: W_hat = Q(W diag(s)) diag(s)^-1, s = a^alpha, a = RMS of each input.

    alpha is searched on a grid of n_grid values in [0, 1) for the least output error (AWQ uses
    mean |x|; H gives the RMS, which ranks channels the same way on LLM activations). The 1/s
    folds into the RMSNorm before q/k/v and gate/up; where it cannot (o_proj, down_proj) it is
    one fp16 per input channel, and we count those 16 bits per input channel for every matrix.
    Then, with clip, each (row, group) of the scaled weight is clipped to ratio x its range,
    the ratio picked per (row, group) on ``clip_grid`` for the least output error
    (group_size None: the whole row, for codebook quantizers). search_inner (default inner)
    is a cheaper quantizer used only while searching.
    """
    if H is None:
        raise SchemeError("AWQ scale search needs calibration statistics (H)")
    search_inner = search_inner or inner
    W = W.float()
    a = torch.diagonal(H).clamp_min(0).sqrt().clamp_min(1e-8)
    best = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = a**alpha
        s = s / (s.max() * s.min()).sqrt()
        Hs = H / (s[:, None] * s[None, :])
        W_hat = search_inner(W * s, Hs).W_hat / s
        err = float(output_error(W, W_hat, H).sum())
        if best is None or err < best[0]:
            best = (err, s)
    s = best[1]
    Ws, Hs = W * s, H / (s[:, None] * s[None, :])
    q = _clip_search(Ws, Hs, inner, clip_grid, group_size) if clip else inner(Ws, Hs)
    return Quantized(q.W_hat / s, q.bits + 16 * W.shape[1])


def _clip_search(W, H, inner, grid, group_size):
    out, n = W.shape
    g = group_size or n
    _check_group(n, g)
    G = n // g
    Hb = torch.stack([H[j * g : (j + 1) * g, j * g : (j + 1) * g] for j in range(G)])  # block-diagonal part
    lo = W.reshape(out, G, g).amin(-1, keepdim=True)
    hi = W.reshape(out, G, g).amax(-1, keepdim=True)
    best_err, best_W, bits = None, None, None
    for r in grid:
        Wc = torch.minimum(torch.maximum(W.reshape(out, G, g), lo * r), hi * r).reshape(out, n)
        q = inner(Wc, H)
        E = (W - q.W_hat).reshape(out, G, g)
        err = torch.einsum("rgi,gij,rgj->rg", E, Hb, E)  # AWQ's clip loss: each group's own output
        if best_err is None:
            best_err, best_W, bits = err, q.W_hat.reshape(out, G, g).clone(), q.bits
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_W = torch.where(better[..., None], q.W_hat.reshape(out, G, g), best_W)
    return Quantized(best_W.reshape(out, n), bits)


# --------------------------------------------------------------------------- incoherence processing


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, int(q**0.5) + 1))


def _paley(q: int) -> torch.Tensor:
    # Paley I: q prime, q = 3 mod 4 -> a Hadamard matrix of order q + 1.
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if x in residues else -1.0 for x in range(1, q)])
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    S = torch.zeros(q + 1, q + 1)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = chi[idx]
    return S + torch.eye(q + 1)


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I): Sylvester 2^k, or Paley (q+1) x 2^k; None if neither fits."""
    if _is_pow2(n):
        m, base = n, torch.ones(1, 1)
    else:
        base = None
        for k in range(0, n.bit_length()):
            if n % (1 << k) == 0 and n >> k > 2:
                q = (n >> k) - 1
                if q % 4 == 3 and _is_prime(q):
                    base, m = _paley(q), 1 << k
                    break
        if base is None:
            return None
    H2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    Hs = torch.ones(1, 1)
    while Hs.shape[0] < m:
        Hs = torch.kron(Hs, H2)
    return torch.kron(base, Hs)


def random_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal U = H diag(random signs) / sqrt(n), the randomized Hadamard transform of QuIP#.

    For orders with no Hadamard matrix here (n = 2^k m, m not a Paley order) the odd factor is
    a random orthogonal matrix (QuIP's Kronecker construction): still orthogonal, still incoherent.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    Hd = hadamard(n)
    if Hd is None:
        k = (n & -n).bit_length() - 1
        m = n >> k
        Qm, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
        Hd = torch.kron(Qm.float() * math.sqrt(m), hadamard(1 << k))
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return (Hd * signs[None, :] / math.sqrt(n)).float()


def incoherent(W: torch.Tensor, H: torch.Tensor | None = None, *, inner: Callable[..., Quantized], seed: int = 0) -> Quantized:
    """Quantize V W U^T (U, V randomized Hadamard on inputs and outputs), return V^T Q(.) U.

    The rotated layer computes (V W U^T)(U x) = V W x, so before quantization the model's
    function is unchanged; rotating spreads outlier weights over a row and outlier input
    channels over all inputs. At run time U x and V^T y are fast Hadamard transforms (signs
    regenerated from the seed: no bits stored). H rotates with the inputs: U H U^T.
    """
    out, n = W.shape
    U, V = random_rotation(n, seed), random_rotation(out, seed + 1)
    Wr = V @ W.float() @ U.T
    Hr = U @ H @ U.T if H is not None else None
    q = inner(Wr, Hr)
    return Quantized(V.T @ q.W_hat @ U, q.bits)


# --------------------------------------------------------------------------- GPTQ


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    quantizer: str = "rtn",
    bits: int = 4,
    group_size: int = 128,
    act_order: bool = True,
    damp: float = 0.01,
    blocksize: int = 128,
    kmeans_iters: int = 25,
    refit: bool = True,
    seed: int = 0,
) -> Quantized:
    """GPTQ: quantize column by column, pushing each column's error onto the columns not yet done.

    quantizer "rtn": asymmetric RTN per group of group_size inputs; with act_order the group of
    a column is fixed by its original index and its grid is computed from the weights before
    GPTQ (static groups), so a kernel needs no reordering table. quantizer "kmeans": a per-row
    codebook of K = 2**bits fp16 entries from importance-weighted k-means (importance diag H),
    each column rounded to its row's nearest entry; with refit the entries are then solved by
    least squares for the codes GPTQ chose (GPTVQ's codebook update).
    """
    if H is None:
        raise SchemeError("GPTQ needs calibration statistics (H)")
    if quantizer not in ("rtn", "kmeans"):
        raise SchemeError(f"GPTQ quantizer must be 'rtn' or 'kmeans', got {quantizer!r}")
    W = W.float().clone()
    out, n = W.shape
    H = H.float().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    W_orig, H_obj = W.clone(), H.clone()

    maxq = 2**bits - 1
    if quantizer == "rtn":
        _check_group(n, group_size)
        blocksize = group_size * max(1, blocksize // group_size)
        if act_order:
            d_all, m_all = _rtn_grid(W.reshape(out, n // group_size, group_size), bits)
            d_all, m_all = d_all[..., 0], m_all[..., 0]  # out, groups
        bits_total = W.numel() * bits + out * (n // group_size) * 32
    else:
        from .kmeans import kmeans_rows

        K = 2**bits
        _, cb = kmeans_rows(W, K, iters=kmeans_iters, seed=seed, importance=torch.diagonal(H).clamp_min(0))[:2]
        cb = _fp16(cb)
        codes = torch.empty(out, n, dtype=torch.long)
        bits_total = W.numel() * bits + out * K * 16

    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else torch.arange(n)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diagonal(H).mean() * torch.eye(n)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    Q = torch.zeros_like(W)
    for i1 in range(0, n, blocksize):
        i2 = min(i1 + blocksize, n)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            w = W1[:, i]
            if quantizer == "rtn":
                if act_order:
                    d, m = d_all[:, col // group_size], m_all[:, col // group_size]
                elif col % group_size == 0:
                    # The group's grid from its current weights, earlier errors already pushed in.
                    d, m = _rtn_grid(W1[:, i : i + group_size], bits)
                    d, m = d[:, 0], m[:, 0]
                q = torch.clamp(torch.round((w - m) / d), 0, maxq) * d + m
            else:
                c = (w[:, None] - cb).abs().argmin(1)
                codes[:, col] = c
                q = cb.gather(1, c[:, None])[:, 0]
            Q[:, i1 + i] = q
            err = (w - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    Q = Q[:, torch.argsort(perm)]
    if quantizer == "kmeans" and refit:
        Q_refit = _fp16(refit_codebook(W_orig, codes, K, H_obj)).gather(1, codes)
        # Least squares is optimal for the float codebook; after fp16 rounding keep whichever is better per row.
        better = output_error(W_orig, Q_refit, H_obj) < output_error(W_orig, Q, H_obj)
        Q = torch.where(better[:, None], Q_refit, Q)
    return Quantized(Q, bits_total)

"""Randomized Hadamard rotations of a layer's inputs (QuIP#'s incoherence processing), and the served transform.

A rotated layer stores Q(W U^T), the codebook weight fitted to the layer rotated by an orthogonal U, and
computes Q(W U^T) (U x) ~ W x: one transform of the activation before the unchanged codebook GEMV, nothing
after it (the accuracy chapter's runs j and k: rotating the inputs alone did as well as both sides). The
rotation spreads the inputs' outlier channels over every input, which is what a 2-bit codebook fitted to
the layer's input statistics gains from (NOTES, session 60).

Two constructions of U share this module:

* :func:`random_rotation` (dense, the accuracy pipelines' fake-quantized ``incoherent`` schemes):
  H diag(s) / sqrt(n), H a Hadamard matrix of order n where one is known here (Sylvester, or Paley times
  Sylvester with the smallest Paley order), else a random orthogonal odd factor times Sylvester.
* :class:`Rotation` (served, :func:`factors`): U = kron(B, H_p) diag(s) / sqrt(n) with p the largest power
  of two dividing n and B of order m = n / p, which is odd: 1, else a random orthogonal matrix times
  sqrt(m) (QuIP's Kronecker construction; no Hadamard matrix has an odd order above 1; m is 1 at 4096 and 8192
  inputs, 43 at 11008, 7 at 14336 and 28672). The kernel applies it as kron(B', H_p') with runs of p' at most
  256 (:func:`launch_factors`, B' = kron(B, H_f)): a block a run forms its m' = n / p' terms an output densely,
  then the run's fast Walsh-Hadamard transform. The two constructions agree wherever they pick the same B
  (every power of two); at SmolLM2's 576 = 72 x 8 the dense one takes Paley's 72, the served one 9 x 64.

Nothing is stored: B and the signs s come back from (n, seed), so a rotated layer costs no bits.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import cuda, float32, int32

from .gemv import (INLINE, SIM, _as_kernel_array, float2_to_half2, half2_to_float2, launch_hooks, programmatic, require_gpu, u32,
                   warp_sum_f32, with_shared_limit)


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
    gen = _generator(n, seed)
    Hd = hadamard(n)
    if Hd is None:
        p = n & -n
        Hd = torch.kron(_odd_factor(n // p, gen), hadamard(p))
    return (Hd * _signs(n, gen)[None, :] / math.sqrt(n)).float()


# Both constructions draw from one generator a (n, seed), the odd factor first where there is one, then the signs.
def _generator(n: int, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + n)


def _odd_factor(m: int, gen: torch.Generator) -> torch.Tensor:
    """A random orthogonal matrix of order m times sqrt(m), float32 (QuIP's Kronecker construction)."""
    Q, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    return Q.float().contiguous() * math.sqrt(m)


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1


def factors(n: int, seed: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The served rotation of order ``n`` as (B (m, m) float32 with B B^T = m I, p, signs (n,) of +-1):
    U = kron(B, H_p) diag(signs) / sqrt(n), p the largest power of two dividing n."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2 or n % 2:
        raise ValueError(f"a rotated layer needs an even number of inputs, got {n!r}")
    p = n & -n
    m = n // p
    gen = _generator(n, seed)
    B = torch.ones(1, 1) if m == 1 else _odd_factor(m, gen)  # m is odd: no Hadamard matrix of that order exists
    return B, p, _signs(n, gen)


def fwht(v: torch.Tensor) -> torch.Tensor:
    """v @ H_p along the last axis (Sylvester's H_p, p = v.shape[-1] a power of two), by butterflies."""
    p = v.shape[-1]
    if not _is_pow2(p):
        raise ValueError(f"the fast Walsh-Hadamard transform takes a power of two, got {p}")
    h = 1
    while h < p:
        w = v.reshape(*v.shape[:-1], p // (2 * h), 2, h)
        v = torch.stack((w[..., 0, :] + w[..., 1, :], w[..., 0, :] - w[..., 1, :]), dim=-2).reshape(v.shape)
        h *= 2
    return v


NT = 32 if SIM else 1024  # threads of a block (the simulator runs each as a Python thread)
NW = NT // 32  # its warps (a module constant: numba sizes shared arrays from literals and globals only)
PRES = ("", "rms", "silu")  # what the kernel computes before the rotation (the decode step's pre-operations)
RUN = 64 if SIM else 256  # the longest run of the transform a block takes (at most 2 NT: a pair of outputs a thread)
SHARED_BYTES = 4 * 2 * NT  # a launch's dynamic shared memory: a run's S partial sums, S p = 2 NT fp32 (:func:`_runs_layout`)


def launch_factors(B: torch.Tensor, p: int) -> tuple[torch.Tensor, int]:
    """(B', p') with kron(B, H_p) = kron(B', H_p'), p' = min(p, RUN): Sylvester's H_p is kron(H_f, H_p'), so
    B' = kron(B, H_f), a matrix of order m f with entries B's times +-1. The kernel takes a block a run of p': more
    blocks and a shorter transform each, for B' products of m f terms an output (NOTES, session 63)."""
    f = max(1, p // RUN)
    return (torch.kron(B, hadamard(f)) if f > 1 else B).float().contiguous(), p // f


def _runs_layout(p: int, m: int) -> tuple[int, int]:
    """(S, TI) of the kernel: S threads share a pair of a run's outputs (each takes every S-th of its m terms; their
    partial sums meet in shared memory) and each has TI terms."""
    if p > 2 * NT:
        raise ValueError(f"a run of {p} has more output pairs than a block has threads ({NT})")
    S = NT // (p // 2)
    return S, -(-m // S)


_kernels: dict = {}


def rotate_kernel(n: int, p: int, m: int, pre: str = ""):
    """The kernel of the served rotation y = pre(x) U^T of order n = m p, U = kron(B, H_p) diag(s) / sqrt(n)
    (p at most :data:`RUN`: :func:`launch_factors`); grid (rows, m), block (r, j) writes run j of row r.

    ``pre`` (the fused decode step's operations on the GEMV's input, :mod:`trapetum.step`): "rms" rotates
    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w; "silu" takes x as the (rows, 2n) gate/up output and rotates
    silu(gate) * up. Either costs one more pass over values the block loads anyway.

    The two factors of U commute, kron(B, H_p) = (B x I_p)(I_m x H_p) = (I_m x H_p)(B x I_p), so block j reads the
    whole row but forms only run j of (B x I_p) diag(s) pre(x), m terms an output, then transforms that run by H_p
    in shared memory. Version 4 transformed the whole row in every block (one block a row at 4096 inputs, 16 at
    11008, each with a share of the B product); version 5 split rows of m > 1 this way (NOTES, session 63).
    """
    if pre not in PRES:
        raise ValueError(f"pre must be one of {PRES}, got {pre!r}")
    key = (n, p, m, pre)
    if key in _kernels:
        return _kernels[key]
    LP = p.bit_length() - 1  # log2 p
    rms, silu = pre == "rms", pre == "silu"
    half, P2 = n // 2, p // 2  # word pairs a row, output pairs a run
    S, TI = _runs_layout(p, m)
    TG = min(TI, 8)  # terms whose loads are in flight together
    wait, _ = launch_hooks()  # it reads its predecessor's output from the first load (its exit releases)

    # forceinline: a local array passed to a device function that is not inlined lives in local memory
    @cuda.jit(device=True, **INLINE)
    def load_pair(x, w, signs, B, r, j, i, u, xa, xb, wa, sa, sb, ba, k):
        xa[k] = x[r, u]
        if silu:
            xb[k] = x[r, u + u32(half)]
        if rms:
            wa[k] = w[u]
        sa[k], sb[k] = signs[u32(2) * u], signs[u32(2) * u + u32(1)]
        ba[k] = B[j, i]

    @cuda.jit(device=True, **INLINE)
    def pre_pair(xa, xb, wa, k):
        # (a, b, their squares before the norm's weight: the RMS sums those)
        a, b = half2_to_float2(xa[k])
        if silu:
            c, d = half2_to_float2(xb[k])
            a, b = a / (float32(1) + math.exp(-a)) * c, b / (float32(1) + math.exp(-b)) * d
        sq = float32(0)
        if rms:
            sq = a * a + b * b
            c, d = half2_to_float2(wa[k])
            a, b = a * c, b * d
        return a, b, sq

    @cuda.jit(**({} if SIM else {"launch_bounds": (NT,)}))
    def kernel(x, y, signs, B, scale, w, eps):
        # x (rows, n / 2, or n for silu), y (rows, n / 2) int32: fp16 pairs; signs (n,), B (m, m) fp32; w (n / 2,)
        # int32: the norm's fp16 weight pairs (rms); scale, eps float32; dynamic shared memory: S x p fp32.
        # Every index is 32-bit (u32): with numba's default 64-bit integers version 3 ran 1,225 instructions a warp
        # for a 4096-point row, its integer pipe 78 % busy on the block's one SM (ncu, NOTES session 62).
        wait()
        s = cuda.shared.array(0, float32)
        red = cuda.shared.array(NW, float32)
        r, j, t = u32(cuda.blockIdx.x), u32(cuda.blockIdx.y), u32(cuda.threadIdx.x)
        part, c = t // u32(P2), t % u32(P2)  # thread (c, part) takes terms i = part, part + S, ... of output pair c
        # Its words i P2 + c of the row: the S threads of a pair read its m words once and the block reads the whole
        # row once (so it also sums the row's squares). The loads of TG terms first, then their use (all 14 terms' at
        # 28672 inputs spilled at the 64 registers of a 1,024-thread block).
        xa = cuda.local.array(TG, int32)
        xb = cuda.local.array(TG, int32)
        wa = cuda.local.array(TG, int32)
        sa = cuda.local.array(TG, float32)
        sb = cuda.local.array(TG, float32)
        ba = cuda.local.array(TG, float32)
        ss = va = vb = float32(0)
        for k0 in range(0, TI, TG):
            for k in range(TG):
                i = part + u32((k0 + k) * S)
                if i < u32(m):
                    load_pair(x, w, signs, B, r, j, i, i * u32(P2) + c, xa, xb, wa, sa, sb, ba, k)
            for k in range(TG):
                if part + u32((k0 + k) * S) < u32(m):
                    a, b, q = pre_pair(xa, xb, wa, k)
                    ss += q
                    va += ba[k] * sa[k] * a
                    vb += ba[k] * sb[k] * b
        s[part * u32(p) + u32(2) * c], s[part * u32(p) + u32(2) * c + u32(1)] = va, vb
        sc = scale
        if rms:  # the block read the whole row: its sum of squares is the row's; a warp's sum, then the warps'
            ss = warp_sum_f32(ss)
            if t % u32(32) == u32(0):
                red[t // u32(32)] = ss
            cuda.syncthreads()
            tot = float32(0)
            for k in range(NW):
                tot += red[k]
            sc = scale / math.sqrt(tot / float32(n) + eps)
        cuda.syncthreads()
        if S > 1:  # the S partial sums of each value into the first (only its own thread reads a column)
            q = t
            while q < u32(p):
                v = s[q]
                for k in range(1, S):
                    v += s[u32(k * p) + q]
                s[q] = v
                q += u32(NT)
            cuda.syncthreads()
        # H_p on the run, two stages a pass (radix 4: four values a thread, a barrier a pass), indices by shifts and
        # masks: the first version's // and % by the stage's stride were 64-bit divisions (NOTES, session 61).
        for st in range(0, LP - 1, 2):
            h = u32(1 << st)
            q = t
            while q < u32(p // 4):
                i = ((q >> u32(st)) << u32(st + 2)) + (q & (h - u32(1)))
                e0, e1, e2, e3 = s[i], s[i + h], s[i + u32(2) * h], s[i + u32(3) * h]
                a0, a1, a2, a3 = e0 + e1, e0 - e1, e2 + e3, e2 - e3
                s[i], s[i + h], s[i + u32(2) * h], s[i + u32(3) * h] = a0 + a2, a1 + a3, a0 - a2, a1 - a3
                q += u32(NT)
            cuda.syncthreads()
        if LP % 2:  # an odd number of stages: the last, stride p / 2, radix 2
            q = t
            while q < u32(P2):
                a, b = s[q], s[q + u32(P2)]
                s[q], s[q + u32(P2)] = a + b, a - b
                q += u32(NT)
            cuda.syncthreads()
        q = t
        while q < u32(P2):
            y[r, j * u32(P2) + q] = float2_to_half2(s[u32(2) * q] * sc, s[u32(2) * q + u32(1)] * sc)
            q += u32(NT)

    _kernels[key] = kernel
    return kernel


class Rotation:
    """The served rotation U of a layer's ``n`` inputs (:func:`factors` of ``seed``): ``rot(x)`` is x U^T
    along the last axis. fp16 CUDA inputs run one numba.cuda launch on torch's current stream (capturable
    in a CUDA graph), fp32 arithmetic in shared memory; any other input runs the same transform in torch."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed
        self.B, self.p, self.signs = factors(n, seed)
        self.m = n // self.p
        self._dev: dict = {}  # device -> [signs, launch_factors B' and p', {pre: the kernel with its shared memory limit raised}] there

    def matrix(self, dtype=torch.float64) -> torch.Tensor:
        """U, dense (n, n): for checks and for fitting the weight, W U^T."""
        U = torch.kron(self.B.double(), hadamard(self.p).double()) * self.signs.double()[None, :] / math.sqrt(self.n)
        return U.to(dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x U^T in torch (float32 arithmetic, x's dtype back)."""
        self._check(x)
        v = x.float() * self.signs.to(x.device)
        v = fwht(v.reshape(*x.shape[:-1], self.m, self.p))
        v = torch.einsum("ik,...kp->...ip", self.B.to(x.device), v) if self.m > 1 else v
        return (v.reshape(x.shape) / math.sqrt(self.n)).to(x.dtype)

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"a rotation takes a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1:] != (self.n,):
            raise ValueError(f"this rotation takes (..., {self.n}) inputs, got {tuple(x.shape)}")

    def __call__(self, x: torch.Tensor, simulate: bool = False) -> torch.Tensor:
        self._check(x)
        if x.dtype != torch.float16 or not (x.is_cuda or (SIM and simulate)):
            return self.reference(x)
        if x.is_cuda:
            require_gpu()
        x2 = x.reshape(-1, self.n)
        if not x2.is_contiguous() or x2.data_ptr() % 4:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        y = torch.empty_like(x2)
        if x2.shape[0]:
            self.launcher(x2, y)()
        return y.view(x.shape)

    def launcher(self, x2: torch.Tensor, y: torch.Tensor, pre: str = "", norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, after_kernel: bool = False):
        """A launch of y = pre(x2) U^T on contiguous fp16 buffers (x2 (rows, n), or (rows, 2 n) gate/up for
        ``pre="silu"``; ``norm_weight`` (n,) fp16 for "rms"), for a graph to record (build it outside capture).
        ``after_kernel``: the launch always follows a kernel in its stream (:func:`trapetum.gemv.programmatic`)."""
        if pre not in PRES:
            raise ValueError(f"pre must be one of {PRES}, got {pre!r}")
        width = 2 * self.n if pre == "silu" else self.n
        for name, t, cols in (("x", x2, width), ("y", y, self.n)):
            if t.dtype != torch.float16 or t.dim() != 2 or t.shape[1] != cols or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float16 (rows, {cols}) tensor, got {tuple(t.shape)} {t.dtype}")
        if x2.shape[0] != y.shape[0] or x2.device != y.device:
            raise ValueError("x and y must have the same rows and device")
        if pre == "rms" and (norm_weight is None or norm_weight.shape != (self.n,) or norm_weight.dtype != torch.float16
                             or not norm_weight.is_contiguous()):
            raise ValueError(f"pre='rms' needs the norm's contiguous float16 ({self.n},) weight")
        dev = x2.device
        if dev not in self._dev:
            Bk, pk = launch_factors(self.B, self.p)
            self._dev[dev] = [self.signs.to(dev).contiguous(), Bk.to(dev), pk, {}]
        signs, B, pk, kernels = self._dev[dev]
        mk = self.n // pk
        # w is read for "rms" only; else any read-only tensor (the simulator copies every argument back after a launch)
        wt = (norm_weight if pre == "rms" else signs).view(torch.int32)
        args = ([_as_kernel_array(t) for t in (x2.view(torch.int32), y.view(torch.int32), signs, B)]
                + [np.float32(1 / math.sqrt(self.n)), _as_kernel_array(wt), np.float32(eps)])  # fp32 scalars: no fp64 in the kernel
        nbytes = SHARED_BYTES
        if pre not in kernels:  # once a device: the driver calls that raise the shared memory limit stay out of later calls
            kernels[pre] = with_shared_limit(rotate_kernel(self.n, pk, mk, pre), args, nbytes + 4 * NW)
        kernel, grid = kernels[pre], (x2.shape[0], mk)

        def launch():
            stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            with programmatic(after_kernel):
                kernel[grid, NT, stream, nbytes](*args)

        return launch


# -- the residual stream rotated (QuaRot's folding) ------------------------------------------------
STREAM_READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # read RMSNorm(h): take Q on their inputs
STREAM_WRITERS = ("o_proj", "down_proj")  # add into h: take Q on their outputs
ONLINE = ("down_proj",)  # inputs neither in the stream nor foldable (silu(gate) * up): a served rotation before the kernel


def rotates_at_run_time(name: str, rotate) -> bool:
    """Whether decoder projection ``name`` rotates its inputs before its kernel under ``quantize_model``'s ``rotate``:
    every one for True; for "stream" the :data:`ONLINE` ones, whose inputs are not the (offline-rotated) stream."""
    return rotate is True or (rotate == "stream" and name.rpartition(".")[2] in ONLINE)


@torch.no_grad()
def rotate_residual(model, seed: int = 0) -> dict:
    """Rewrite a Llama-architecture model in place into the same function with its residual stream rotated
    (QuaRot, Ashkboos et al. 2024): h -> Q h for Q the served rotation of the hidden size (:class:`Rotation`).

    RMSNorm without its weight commutes with an orthogonal Q (the mean square is the same), so each norm's
    weight is folded into the layers that read it (W diag(g), the norm's weight then 1) and
    * the embedding becomes E Q^T, every reader of the stream (q/k/v, gate/up, the LM head) W Q^T;
    * every writer into it (o_proj, down_proj, and their biases) Q W;
    * each value head's outputs are rotated by the head size's own Q_h and o_proj's inputs by Q_h^T, head
      by head (one Q_h for every head, so grouped-query attention keeps it: a query head's output mixes its
      value head's rows, already rotated).
    So the rotated layers' codes are fitted to weights whose inputs are already rotated, and only down_proj's
    input (silu(gate) * up, not in the stream) needs a rotation at run time: one launch a layer where
    ``quantize_model(..., rotate=True)`` needs one for each of its four inputs (NOTES, session 62).
    A tied LM head is untied (it now differs from the embedding). Arithmetic in float64, stored in each
    weight's own dtype. Returns {"seed", "hidden", "head_dim"}, also kept as ``model.trapetum_stream_rotation``.
    """
    from torch import nn

    from .pipelines import decoder_layers

    layers = decoder_layers(model)
    cfg = model.config
    n = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or n // cfg.num_attention_heads
    for i, layer in enumerate(layers):
        for k in STREAM_READERS + STREAM_WRITERS:
            lin = getattr(layer.self_attn if k[0] in "qkvo" else layer.mlp, k, None)
            if type(lin) is not nn.Linear:
                raise ValueError(f"rotate_residual takes a Llama-architecture model of nn.Linear projections, before "
                                 f"quantization; layer {i}'s {k} is {type(lin).__name__}")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _check_rms(norm, f"layer {i}'s")
    _check_rms(model.model.norm, "final")
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not nn.Linear or type(emb) is not nn.Embedding:
        raise ValueError("rotate_residual takes an nn.Embedding token embedding and an nn.Linear LM head (rotate before quantizing)")
    if head.weight is emb.weight:  # the head will be E diag(g) Q^T and the embedding E Q^T: no longer one tensor
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
        cfg.tie_word_embeddings = False
    dev = emb.weight.device
    Q = Rotation(n, seed).matrix().to(dev)
    Qh = Rotation(hd, seed).matrix().to(dev) if hd % 2 == 0 else None

    def put(p, v):
        p.copy_(v.to(p.dtype))

    def read(lin, norm):  # W diag(g) Q^T
        put(lin.weight, (lin.weight.double() * norm.weight.double()[None, :]) @ Q.T)

    def write(lin, heads_in=False):  # Q W (Q_h^T on each head's inputs)
        W = lin.weight.double()
        if heads_in and Qh is not None:
            W = (W.reshape(n, -1, hd) @ Qh.T).reshape(n, -1)
        put(lin.weight, Q @ W)
        if lin.bias is not None:
            put(lin.bias, Q @ lin.bias.double())

    for layer in layers:
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj):
            read(lin, layer.input_layernorm)
        if Qh is not None:  # each value head's rows by Q_h (after the input side: the two commute)
            put(at.v_proj.weight, (Qh @ at.v_proj.weight.double().reshape(-1, hd, n)).reshape(-1, n))
            if at.v_proj.bias is not None:
                put(at.v_proj.bias, (Qh @ at.v_proj.bias.double().reshape(-1, hd, 1)).reshape(-1))
        write(at.o_proj, heads_in=True)
        for lin in (mlp.gate_proj, mlp.up_proj):
            read(lin, layer.post_attention_layernorm)
        write(mlp.down_proj)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.fill_(1)
    read(head, model.model.norm)
    model.model.norm.weight.fill_(1)
    put(emb.weight, emb.weight.double() @ Q.T)
    info = {"seed": seed, "hidden": n, "head_dim": hd if Qh is not None else None}
    model.trapetum_stream_rotation = info
    return info


def _check_rms(norm, where) -> None:
    # LayerNorm subtracts the mean, which no rotation keeps; an RMSNorm with a bias would need it rotated too
    w = getattr(norm, "weight", None)
    if "RMSNorm" not in type(norm).__name__ or w is None or w.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise ValueError(f"rotate_residual needs RMSNorm (weight only) norms; the {where} norm is {type(norm).__name__}")

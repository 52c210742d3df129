"""The fused step's last launch: the greedy token of the logits, recorded, and the next step's input.

Why one kernel: after the LM head the step spent ~19 us of a 7B token in six small torch launches
(the argmax's reduction 9.7 us, the token's index_copy, the tok and h copies, the embedding gather,
two counter adds; the profile in data/_runs/fused-step-profile-7b-k16-31ca8b1-h100.json). One block
here loads the logits row in 16-byte loads (a 32000-token row: four a thread, all issued before the
first is used), reduces it by warp shuffles, writes the token to ``tokens[i]`` and ``tok``, advances ``pos`` and ``i``, and copies
the token's embedding row into the step's hidden state, so the next step starts at its first GEMV.

The order is torch.argmax's: the largest value, NaN above every number, the first index on a tie.
"""
from __future__ import annotations

import math

import torch
from numba import cuda, float32, int32

from .gemv import SIM, _as_kernel_array, better, half2_to_float2, load16, launch_hooks, programmatic, warp_argmax

NT = 128 if SIM else 1024  # threads of the one block (the simulator runs each as a Python thread)
LOADS = 4  # 16-byte loads a thread keeps in flight: a 32000-token vocabulary is one round of them
_kernels: dict = {}


def greedy_kernel(V: int, embed: bool):
    """The kernel for a vocabulary of ``V`` logits; with ``embed`` it also gathers the token's row."""
    key = (V, embed)
    if key in _kernels:
        return _kernels[key]
    NCH = V // 8  # 16-byte chunks of eight logits; the last V % 8 logits are read one by one
    NW = NT // 32
    WL = 4 * LOADS  # words a thread holds (a literal size for numba's local array)
    wait, _ = launch_hooks()  # everything it reads is the LM head's output or the step's state (its exit releases)

    @cuda.jit(**({} if SIM else {"launch_bounds": (NT,)}))
    def kernel(logits, l32, tokens, tok, pos, i, table, h):
        # logits (1, V) fp16 and l32, its first 8 NCH values as int32 pairs; tokens (n,), tok, pos, i (1,)
        # int64; table (V, hidden / 2) and h (1, hidden / 2): the fp16 embedding and hidden state as pairs.
        wait()
        t = cuda.threadIdx.x
        bv = float32(-math.inf)
        bi = int32(V)
        w = cuda.local.array(WL, int32)
        c0 = 0
        while c0 < NCH:
            for u in range(LOADS):
                c = min(c0 + t + u * NT, NCH - 1)
                w[4 * u], w[4 * u + 1], w[4 * u + 2], w[4 * u + 3] = load16(l32, 4 * c)
            for u in range(LOADS):
                c = c0 + t + u * NT
                if c < NCH:
                    for k in range(4):
                        a, b = half2_to_float2(w[4 * u + k])
                        if better(a, 8 * c + 2 * k, bv, bi):
                            bv, bi = a, int32(8 * c + 2 * k)
                        if better(b, 8 * c + 2 * k + 1, bv, bi):
                            bv, bi = b, int32(8 * c + 2 * k + 1)
            c0 += LOADS * NT
        if t < V - 8 * NCH:
            a = float32(logits[0, 8 * NCH + t])
            if better(a, 8 * NCH + t, bv, bi):
                bv, bi = a, int32(8 * NCH + t)
        bv, bi = warp_argmax(bv, bi)
        sv = cuda.shared.array(NW, float32)
        si = cuda.shared.array(NW, int32)
        won = cuda.shared.array(1, int32)
        if t % 32 == 0:
            sv[t // 32], si[t // 32] = bv, bi
        cuda.syncthreads()
        if t < 32:
            bv = sv[t] if t < NW else float32(-math.inf)
            bi = si[t] if t < NW else int32(V)
            bv, bi = warp_argmax(bv, bi)
            if t == 0:
                won[0] = bi
                k = i[0]
                if k < tokens.shape[0]:
                    tokens[k] = bi
                tok[0] = bi
                pos[0] += 1
                i[0] = k + 1
        if embed:
            cuda.syncthreads()
            r = won[0]
            for d in range(t, h.shape[1], NT):
                h[0, d] = table[r, d]

    _kernels[key] = kernel
    return kernel


class Greedy:
    """``launch()`` = the greedy token of ``logits`` (1, V) fp16 into ``tokens[i]`` and ``tok``, ``pos``
    and ``i`` advanced, and, given an fp16 ``embedding`` weight (V, hidden), the token's row into ``h``
    (1, hidden). Every tensor is a static buffer of the step, read on the device at launch."""

    def __init__(self, logits, tokens, tok, pos, i, embedding: torch.Tensor | None = None, h: torch.Tensor | None = None,
                 after_kernel: bool = False):
        V = logits.shape[-1]
        if logits.dim() != 2 or logits.shape[0] != 1 or logits.dtype != torch.float16 or not logits.is_contiguous():
            raise ValueError(f"logits must be a contiguous float16 (1, V) tensor, got {tuple(logits.shape)} {logits.dtype}")
        for name, b in (("tokens", tokens), ("tok", tok), ("pos", pos), ("i", i)):
            if b.dtype != torch.int64 or not b.is_contiguous():
                raise ValueError(f"{name} must be a contiguous int64 tensor")
        if tok.numel() != 1 or pos.numel() != 1 or i.numel() != 1:
            raise ValueError("tok, pos and i must have one element each")
        embed = embedding is not None
        if embed:
            if h is None or embedding.dtype != torch.float16 or h.dtype != torch.float16 or h.dim() != 2 or h.shape[0] != 1:
                raise ValueError("the embedding gather needs an fp16 (V, hidden) weight and an fp16 (1, hidden) h")
            if embedding.shape != (V, h.shape[1]) or h.shape[1] % 2 or not (embedding.is_contiguous() and h.is_contiguous()):
                raise ValueError(f"the embedding must be a contiguous ({V}, {h.shape[1]}) weight with an even hidden size; "
                                 f"got {tuple(embedding.shape)}")
            table, hh = embedding.view(torch.int32), h.view(torch.int32)
        else:
            table = hh = logits  # unused; read-only, as the simulator copies every argument back after a launch
        if logits.data_ptr() % 16:
            raise ValueError("logits must be 16-byte aligned (the kernel reads them in 16-byte loads)")
        self.kernel = greedy_kernel(V, embed)
        l32 = logits[0, :8 * (V // 8)].view(torch.int32) if V >= 8 else logits.new_zeros(8).view(torch.int32)
        self.args = [_as_kernel_array(b) for b in (logits, l32, tokens, tok.view(1), pos.view(1), i.view(1), table, hh)]
        self.device = logits.device
        self.after_kernel = after_kernel  # always after a kernel (the LM head's): may start while it runs

    def __call__(self) -> None:
        stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)
        with programmatic(self.after_kernel):
            self.kernel[1, NT, stream](*self.args)

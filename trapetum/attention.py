"""Decode attention in one numba.cuda launch: rotary, the KV-cache write and attention of one new
token (flash-decoding's split over the context, finished by the last block of each head).

Why a kernel of our own: in a compiled transformers step the attention of a 7B layer is cuDNN's
SDPA (4.9 us) plus inductor kernels for rotary, the cache writes and SDPA's input preparation,
~4 launches of 1.2-2.8 us, while the layer's four codebook GEMVs take ~65 us (NOTES "Fused
projections"). One launch does all of it.

Layout (one layer): ``qkv`` (1, (H + 2 Hkv) D) fp16, the fused projection's output (q heads,
then k, then v); caches ``kc``/``vc`` (Hkv, T, D) fp16; ``inv_freq`` (D/2,) and the attention
scaling of the model's own rotary module (transformers' ``rotary_emb``: its rope type's frequencies),
the angles taken in fp32 as transformers does;
``pos`` (1,) int64 on the device, the new token's position, so a CUDA graph replays every token.

Grid (H, splits): block (h, s) of D threads takes context positions [s C, s C + C) of query
head h, C = D / 4: four threads a position for the scores (a quarter row each, every load issued
before the first is used), and for P V four groups of D / 4 threads, a thread four dims of every
fourth position. Blocks past the context return at once. The new token's k and v are used from
shared memory by the block that covers it (and written to the cache by the first query head of
its group), so no block reads a cache row another block of the launch writes. Each block leaves
(o, max, sum) in a workspace; the last of a head's blocks merges them (a counter it resets, as
the GEMVs' K-split finish does), so a head takes at most D splits: a context of D^2 / 4 tokens.
Reductions run in warp 0 by shuffles where a warp holds a block's positions (32 <= D <= 128: one
barrier each, not 2 log2 C), else through shared memory (D = 16, the simulator tests' small heads, and
D = 256). Its time is a chain of dependent memory round trips, not bytes (NOTES, session 19).
"""
from __future__ import annotations

import math

import torch
from numba import cuda, float32, int32

from .gemv import (SIM, _as_kernel_array, float2_to_half2, half2_to_float2, last_to_finish, load16, load_cg, launch_hooks,
                   programmatic, require_gpu, warp_max_f32, warp_sum_f32)

_kernels: dict = {}
MERGE = 16  # split partials a thread of the merge keeps in flight (a 7B layer at 512 tokens has 17 splits)


def attention_kernel(D: int, group: int):
    """The kernel for head dimension ``D`` (a power of two, 16..256) and ``group`` query heads a KV head."""
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {D}")
    key = (D, group)
    if key in _kernels:
        return _kernels[key]
    half = D // 2
    quarter = D // 4  # dims a thread takes of a score's row, and threads a row in P V
    eighth = D // 8  # fp16 pairs of a quarter row
    C = D // 4  # positions a block: four threads a position
    VW = (C // 4) * 2  # V words a thread loads: two a position of its group (a literal size for numba)
    # Scores and the merge's statistics reduce in warp 0 by shuffles (one barrier, not ~2 log2 C) when
    # a warp holds every position of a block (C <= 32) and the block has a whole warp (D >= 32).
    WARP = 32 <= D and C <= 32
    NS = max(D // 32, 1)  # splits a lane of warp 0 takes in the merge (a head has at most D)
    VEC = eighth % 4 == 0  # a quarter row of K in 16-byte loads
    wait, release = launch_hooks()

    @cuda.jit(device=True)
    def rope(v, other, t, f, rscale, p):
        # transformers' Llama rotary at position p: angle p * inv_freq[t mod D/2] in fp32, dims t < D/2
        # pair with t + D/2 negated (rotate_half); rscale is the rope type's attention scaling.
        ang = float32(p) * f
        return (v * math.cos(ang) + (-other if t < half else other) * math.sin(ang)) * rscale

    @cuda.jit(device=True)
    def dot2(qs, d, w):
        a, b = half2_to_float2(w)
        return qs[d] * a + qs[d + 1] * b

    @cuda.jit(device=True)
    def block_reduce(red, t, v, is_max, width):
        # max or sum of v over threads 0..width-1 (a power of two), on every thread.
        if t < width:
            red[t] = v
        cuda.syncthreads()
        k = width // 2
        while k > 0:
            if t < k:
                red[t] = max(red[t], red[t + k]) if is_max else red[t] + red[t + k]
            cuda.syncthreads()
            k //= 2
        r = red[0]
        cuda.syncthreads()
        return r

    @cuda.jit
    def kernel(qkv, kc32, vc32, inv_freq, rscale, pos, out, ws, counters, scale):
        # kc32 / vc32: int32 views of the (Hkv, T, D) fp16 caches. Every load that does not need the
        # position is issued with it, and K and V rows together: the kernel is a chain of memory round
        # trips (position + q/k/v, K + V, partials + counter, merge), not of bytes.
        h = cuda.blockIdx.x
        s = cuda.blockIdx.y
        t = cuda.threadIdx.x
        H = cuda.gridDim.x
        kvh = h // group
        Hkv = H // group
        qb, kb, vb = h * D, (H + kvh) * D, (H + Hkv + kvh) * D
        tp = t + half if t < half else t - half
        f = inv_freq[t - half if t >= half else t]
        # The position and the cached rows were written two or more launches back (the previous
        # token), so they load before the wait for this launch's predecessor, which writes qkv.
        p = int32(pos[0])
        nsplit = (p + C) // C  # context p + 1 positions, C a block
        if s >= nsplit:
            return
        qs = cuda.shared.array(D, float32)
        kn = cuda.shared.array(D, float32)
        vn = cuda.shared.array(D, float32)
        sp = cuda.shared.array(D, float32)  # score partials: four threads a position
        pr = cuda.shared.array(C, float32)
        red = cuda.shared.array(D, float32)
        po = cuda.shared.array((4, D), float32)  # P V partials of the four position groups
        last = cuda.shared.array(1, int32)
        st = cuda.shared.array(2, float32)  # a warp reduction's results, for the whole block

        # Scores: position j0 + t // 4, a quarter of its row a thread. P V: four groups of D / 4
        # threads, group g every fourth position, a thread four dims (two fp16 pairs: a group reads a
        # row coalesced). Both sets of rows load now, from rows clamped into the cache (a row past the
        # context is masked, never used); the new token's row is written below and read from shared.
        T = kc32.shape[1]
        j0 = s * C
        jq = t // 4
        d0 = (t - jq * 4) * quarter
        j = j0 + jq
        krow = kc32[kvh, min(j, T - 1)]
        kw = cuda.local.array(eighth, int32)
        if VEC:
            for w in range(eighth // 4):
                kw[4 * w], kw[4 * w + 1], kw[4 * w + 2], kw[4 * w + 3] = load16(krow, d0 // 2 + 4 * w)
        else:
            for w in range(eighth):
                kw[w] = krow[d0 // 2 + w]
        g = t // quarter
        c = t - g * quarter
        vw = cuda.local.array(VW, int32)
        for u in range(C // 4):
            jj = min(j0 + g + 4 * u, T - 1)
            vw[2 * u] = vc32[kvh, jj, 2 * c]
            vw[2 * u + 1] = vc32[kvh, jj, 2 * c + 1]
        wait()
        q0, q1 = float32(qkv[0, qb + t]), float32(qkv[0, qb + tp])
        k0, k1 = float32(qkv[0, kb + t]), float32(qkv[0, kb + tp])
        v0 = float32(qkv[0, vb + t])

        rs = float32(rscale)
        qs[t] = rope(q0, q1, t, f, rs, p) * float32(scale)
        last_split = s == nsplit - 1
        if last_split:
            kn[t] = rope(k0, k1, t, f, rs, p)
            vn[t] = v0
        cuda.syncthreads()
        if last_split and h % group == 0 and t < half:
            kc32[kvh, p, t] = float2_to_half2(kn[2 * t], kn[2 * t + 1])
            vc32[kvh, p, t] = float2_to_half2(vn[2 * t], vn[2 * t + 1])

        acc = float32(0.0)
        if j == p:
            for d in range(quarter):
                acc += qs[d0 + d] * kn[d0 + d]
        else:
            for w in range(eighth):
                acc += dot2(qs, d0 + 2 * w, kw[w])
        sp[t] = acc
        cuda.syncthreads()
        if WARP:
            if t < 32:
                score = float32(-math.inf)
                if t < C and j0 + t <= p:
                    score = sp[4 * t] + sp[4 * t + 1] + sp[4 * t + 2] + sp[4 * t + 3]
                m = warp_max_f32(score)
                e = float32(0.0) if t >= C or j0 + t > p else math.exp(score - m)
                l_sum = warp_sum_f32(e)
                if t < C:
                    pr[t] = e
                if t == 0:
                    st[0], st[1] = m, l_sum
            cuda.syncthreads()
            m, l_sum = st[0], st[1]
        else:
            score = float32(-math.inf)
            if t < C and j0 + t <= p:
                score = sp[4 * t] + sp[4 * t + 1] + sp[4 * t + 2] + sp[4 * t + 3]
            m = block_reduce(red, t, score, True, C)
            e = float32(0.0) if t >= C or j0 + t > p else math.exp(score - m)
            if t < C:
                pr[t] = e
            l_sum = block_reduce(red, t, e, False, C)  # also the barrier that publishes pr

        n = min(C, p + 1 - j0)
        o0 = o1 = o2 = o3 = float32(0.0)
        for u in range(C // 4):
            ii = g + 4 * u
            a0, a1 = half2_to_float2(vw[2 * u])
            a2, a3 = half2_to_float2(vw[2 * u + 1])
            if j0 + ii == p:
                a0, a1, a2, a3 = vn[4 * c], vn[4 * c + 1], vn[4 * c + 2], vn[4 * c + 3]
            valid = ii < n  # selects, not a branch: a stale row past the context must not reach o
            pe = pr[ii] if valid else float32(0.0)
            o0 += pe * (a0 if valid else float32(0.0))
            o1 += pe * (a1 if valid else float32(0.0))
            o2 += pe * (a2 if valid else float32(0.0))
            o3 += pe * (a3 if valid else float32(0.0))
        release()  # the next launch may start placing its blocks: what is left is this one's merge
        po[g, 4 * c], po[g, 4 * c + 1], po[g, 4 * c + 2], po[g, 4 * c + 3] = o0, o1, o2, o3
        cuda.syncthreads()
        o = po[0, t] + po[1, t] + po[2, t] + po[3, t]
        if nsplit == 1:
            out[0, qb + t] = o / l_sum
            return
        ws[h, s, t] = o
        if t == 0:
            ws[h, s, D] = m
            ws[h, s, D + 1] = l_sum
        if last_to_finish(counters, h, nsplit, last, t):
            # Merge: each split's (max, sum) by one thread and this thread's dim of the first MERGE
            # splits, all loaded at once; later splits MERGE at a time.
            ov = cuda.local.array(MERGE, float32)
            if WARP:
                # Warp 0 takes the (max, sum) of splits lane, lane + 32, ...; shuffles reduce them.
                ml = cuda.local.array(NS, float32)
                ll = cuda.local.array(NS, float32)
                if t < 32:
                    for k in range(NS):
                        ml[k] = load_cg(ws, h, min(t + 32 * k, nsplit - 1), D)
                        ll[k] = load_cg(ws, h, min(t + 32 * k, nsplit - 1), D + 1)
                for u in range(MERGE):
                    ov[u] = load_cg(ws, h, min(u, nsplit - 1), t)
                if t < 32:
                    mx = float32(-math.inf)
                    for k in range(NS):
                        if t + 32 * k < nsplit:
                            mx = max(mx, ml[k])
                    mx = warp_max_f32(mx)
                    dp = float32(0.0)
                    for k in range(NS):
                        if t + 32 * k < nsplit:
                            fi = math.exp(ml[k] - mx)
                            sp[t + 32 * k] = fi
                            dp += fi * ll[k]
                    dp = warp_sum_f32(dp)
                    if t == 0:
                        st[0] = dp
                cuda.syncthreads()
                den = st[0]
            else:
                mi = load_cg(ws, h, min(t, nsplit - 1), D)
                li = load_cg(ws, h, min(t, nsplit - 1), D + 1)
                for u in range(MERGE):
                    ov[u] = load_cg(ws, h, min(u, nsplit - 1), t)
                mi = mi if t < nsplit else float32(-math.inf)
                mx = block_reduce(red, t, mi, True, D)
                fi = math.exp(mi - mx) if t < nsplit else float32(0.0)
                den = block_reduce(red, t, fi * (li if t < nsplit else float32(0.0)), False, D)
                if t < nsplit:
                    sp[t] = fi
                cuda.syncthreads()
            num = float32(0.0)
            for u in range(MERGE):
                num += (sp[u] * ov[u]) if u < nsplit else float32(0.0)
            i = MERGE
            while i < nsplit:
                for u in range(MERGE):
                    k = min(i + u, nsplit - 1)
                    ov[u] = load_cg(ws, h, k, t)
                for u in range(MERGE):
                    num += (sp[min(i + u, D - 1)] * ov[u]) if i + u < nsplit else float32(0.0)
                i += MERGE
            out[0, qb + t] = num / den

    _kernels[key] = kernel
    return kernel


class DecodeAttention:
    """Attention of one new token for a Llama-architecture layer stack (all layers share the
    buffers' shapes): ``bind(layer, qkv, out)`` gives a zero-argument launcher for a CUDA graph.

    ``k_cache``/``v_cache``: (layers, Hkv, T, D) fp16, owned here; ``pos``: the step's (1,) or
    (1, 1) int64 position tensor, read on the device at launch.
    """

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, max_len: int,
                 inv_freq: torch.Tensor, pos: torch.Tensor, device, scale: float | None = None, rope_scaling: float = 1.0):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(f"inv_freq must have head_dim / 2 = {head_dim // 2} entries, got {tuple(inv_freq.shape)}")
        if pos.dtype != torch.int64 or pos.numel() != 1:
            raise ValueError("pos must be a one-element int64 tensor")
        device = torch.device(device)
        if device.type != "cuda" and not SIM:
            require_gpu()
        self.H, self.Hkv, self.D, self.T = n_heads, n_kv_heads, head_dim, max_len
        self.kernel = attention_kernel(head_dim, n_heads // n_kv_heads)
        self.scale = float(head_dim ** -0.5 if scale is None else scale)
        self.k_cache = torch.zeros(n_layers, n_kv_heads, max_len, head_dim, dtype=torch.float16, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.inv_freq = inv_freq.float().contiguous().to(device)
        self.rope_scaling = float(rope_scaling)
        self.pos = pos
        self.splits = -(-max_len // (head_dim // 4))
        if self.splits > head_dim:
            raise ValueError(f"max_len={max_len} needs {self.splits} context splits; the merge takes at most head_dim={head_dim}")
        self.ws = torch.empty(n_heads, self.splits, head_dim + 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(n_heads, dtype=torch.int32, device=device)

    def bind(self, layer: int, qkv: torch.Tensor, out: torch.Tensor, after_kernel: bool = False):
        """``after_kernel``: the launcher always follows a kernel in its stream (the q/k/v GEMV), so
        it may start while that kernel runs and load the cache rows meanwhile (:class:`trapetum.gemv.programmatic`)."""
        width = (self.H + 2 * self.Hkv) * self.D
        if qkv.shape != (1, width) or qkv.dtype != torch.float16 or not qkv.is_contiguous():
            raise ValueError(f"qkv must be a contiguous float16 (1, {width}) tensor, got {tuple(qkv.shape)} {qkv.dtype}")
        if out.shape != (1, self.H * self.D) or out.dtype != torch.float16 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float16 (1, {self.H * self.D}) tensor")
        kc, vc = self.k_cache[layer].view(torch.int32), self.v_cache[layer].view(torch.int32)
        arrays = [_as_kernel_array(t) for t in (qkv, kc, vc, self.inv_freq)]
        arrays += [self.rope_scaling] + [_as_kernel_array(t) for t in (self.pos.view(1), out, self.ws, self.counters)]
        grid, dev = (self.H, self.splits), self.k_cache.device

        def launch():
            stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            with programmatic(after_kernel):
                self.kernel[grid, self.D, stream](*arrays, self.scale)

        return launch


def rotate(t: torch.Tensor, inv_freq: torch.Tensor, p: int, scaling: float = 1.0) -> torch.Tensor:
    """float64 rotary of ``t`` (..., D) at position ``p``: transformers' Llama math (angles p x inv_freq
    taken in fp32, rotate_half pairing), as the kernel does it."""
    D = t.shape[-1]
    ang = float(p) * inv_freq.float().cpu()
    cos, sin = (torch.cat([f(ang), f(ang)]).double() * scaling for f in (torch.cos, torch.sin))
    rot = torch.cat([-t[..., D // 2:], t[..., :D // 2]], dim=-1)
    return t * cos + rot * sin


def reference(qkv: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor, inv_freq: torch.Tensor, p: int,
              n_heads: int, n_kv_heads: int, scale: float | None = None, scaling: float = 1.0) -> torch.Tensor:
    """float64 attention of the token at position ``p`` over the ``p`` cached positions and itself
    (transformers' Llama math): returns (H * D,)."""
    D = k_past.shape[-1]
    x = qkv.double().cpu().view(-1)
    q = x[:n_heads * D].view(n_heads, D)
    k = x[n_heads * D:(n_heads + n_kv_heads) * D].view(n_kv_heads, D)
    v = x[(n_heads + n_kv_heads) * D:].view(n_kv_heads, D)
    K = torch.cat([k_past[:, :p].double().cpu(), rotate(k, inv_freq, p, scaling)[:, None]], dim=1)  # (Hkv, p+1, D)
    V = torch.cat([v_past[:, :p].double().cpu(), v[:, None]], dim=1)
    g = n_heads // n_kv_heads
    K, V = K.repeat_interleave(g, 0), V.repeat_interleave(g, 0)
    att = torch.softmax((rotate(q, inv_freq, p, scaling)[:, None] * K).sum(-1) * (D ** -0.5 if scale is None else scale), dim=-1)
    return (att[..., None] * V).sum(1).reshape(-1)

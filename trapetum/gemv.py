"""Fused lookup-table GEMV kernels in numba.cuda: y = x @ W.T with W stored as codes + codebooks.

Design ("a lane owns a row"), chosen so that every step is bandwidth-friendly and needs no
warp shuffle (which the CUDA simulator lacks):

* rows come in blocks of 32; lane l of every warp in a thread block owns row rb*32 + l;
* the codes are pre-tiled (:func:`trapetum.codebook.tile`) so a warp's 16-byte-a-lane load of
  one chunk is 512 contiguous bytes;
* the block's 32 codebooks sit in shared memory as fp32 in a [k][lane] layout: a warp's 32
  lookups hit 32 different banks whatever the codes are;
* the block's slice of x sits in shared memory as fp32, read as broadcasts;
* the warps of a block split the chunks of the block's K-slice; partial sums meet in shared
  memory; K-slices of different blocks (``ksplit``) meet in an fp32 workspace, summed by the
  last block to finish (an atomic counter it resets, so the launch replays in a CUDA graph).

Variants share every device function; they differ only in how many bytes a lane loads at once
(``wide``) or, for the naive kernel, in not using the tiled layout at all.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

if not hasattr(np, "row_stack"):  # numba-cuda 0.30.4 still calls np.row_stack, gone in numpy 2.5
    np.row_stack = np.vstack
# numba must not synchronize on torch tensors: every launch names torch's stream itself.
os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

import torch  # noqa: E402
from numba import config as _nb_config  # noqa: E402
from numba import cuda, float32, int32, int64, uint16, uint32  # noqa: E402

from .codebook import CHUNK_BYTES, ROW_BLOCK, CodebookTensor, check_rows, codes_per_byte, tile, untile  # noqa: E402
from .tuning import PlanCache  # noqa: E402

SIM = bool(_nb_config.ENABLE_CUDASIM)
u32, i32 = uint32, int32  # short names for the kernels' explicitly 32-bit arithmetic (pair_table_builder)
MAX_FUSED_BATCH = 16
SMEM_BUDGET = 48 * 1024  # static + dynamic shared memory a block may use without opt-in


class NoGPUError(RuntimeError):
    """Raised when a kernel is asked to run on a machine with no CUDA GPU."""


# -- shared device functions -----------------------------------------------------------------
_sim_warps: dict = {}
_sim_warps_lock = threading.Lock()


def _sim_warp(key) -> tuple:
    """The simulator's rendezvous of one warp (a 32-thread barrier, two sets of 32 slots, each lane's
    call count), made on first use."""
    with _sim_warps_lock:
        if key not in _sim_warps:
            _sim_warps[key] = (threading.Barrier(32, timeout=120), ([None] * 32, [None] * 32), [0] * 32)
        return _sim_warps[key]


def _sim_exchange(key, lane, value) -> list:
    """Every lane's ``value`` in one warp-wide call, lane order.

    The simulator runs each CUDA thread as a Python thread, so the warp's 32 threads meet at a
    barrier and then each reads every lane's value. Slots alternate between two sets, so one
    barrier a call suffices: a lane cannot write a set again before every lane has passed the next
    barrier, i.e. finished reading it."""
    bar, slots, calls = _sim_warp(key)
    buf = slots[calls[lane] % 2]
    calls[lane] += 1
    buf[lane] = value
    bar.wait()
    return list(buf)


def _sim_fragments(key, lane, frag) -> np.ndarray:
    """Every lane's fp16-pair fragments of one warp-wide mma call, as (32, len(frag), 2) float64."""
    f = np.array(_sim_exchange(key, lane, frag), dtype=np.int64).astype(np.int32).view(np.float16).astype(np.float64)
    return f.reshape(32, len(frag), 2)


@cuda.jit(device=True)
def better(v, i, bv, bi) -> bool:
    """Whether (v, i) ranks before (bv, bi) in torch.argmax's order: the larger value, NaN above
    every number, the smaller index on a tie."""
    if v != v:
        return bv == bv or i < bi
    return v > bv or (v == bv and i < bi)


if SIM:

    @cuda.jit(device=True)
    def load16(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def load_cg(a, i, j, k):
        return a[i, j, k]

    @cuda.jit(device=True)
    def load_cg2(a, i, j, k):
        return a[i, j, k], a[i, j, k + 1]

    @cuda.jit(device=True)
    def load_cg4(a, i, j, k):
        return a[i, j, k], a[i, j, k + 1], a[i, j, k + 2], a[i, j, k + 3]

    @cuda.jit(device=True)
    def sload4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def load_byte_offset(a, off):
        return a[off // a.itemsize]

    @cuda.jit(device=True)
    def store_byte_offset(a, off, v):
        a[off // a.itemsize] = v

    @cuda.jit(device=True)
    def shared_address(a):
        return np.uint32(0)  # the simulator's addresses are byte offsets into the array itself

    @cuda.jit(device=True)
    def load_shared_u16(a, addr):
        return a[addr // 2]

    @cuda.jit(device=True)
    def load_shared_v4(a, addr):
        i = addr // 4
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @cuda.jit(device=True)
    def load_half_byte_offset(a, off):
        if a.itemsize == 4:  # a table of fp16 pairs in 32-bit words (little-endian: the first in the low half)
            o = int(off)
            h = ((int(a[o // 4]) & 0xFFFFFFFF) >> (16 * ((o // 2) & 1))) & 0xFFFF
        else:
            h = a[off // 2]
        return np.float32(np.array([h], dtype=np.uint16).view(np.float16)[0])

    @cuda.jit(device=True)
    def half_sum4(a, o0, o1, o2, o3):
        h = [np.float16(load_half_byte_offset(a, o)) for o in (o0, o1, o2, o3)]  # (exact: fp16 values)
        return np.float32(((h[0] + h[1]) + h[2]) + h[3])

    @cuda.jit(device=True)
    def store_half(a, i, v):
        a[i] = np.array([v], dtype=np.float32).astype(np.float16).view(np.uint16)[0]

    @cuda.jit(device=True)
    def silu(v):
        return np.float32(v / (1.0 + math.exp(-float(v)))) if v > -80 else np.float32(0.0) * v

    @cuda.jit(device=True)
    def float_bits(f):
        return np.array([f], dtype=np.float32).view(np.uint32)[0]

    @cuda.jit(device=True)
    def bits_float(u):
        return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def warp_max_u32(v):
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32)
        return np.uint32(max(int(u) for u in _sim_exchange(key, lane, int(v) & 0xFFFFFFFF)))

    @cuda.jit(device=True)
    def warp_sum_f32(v):
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32)
        return np.float32(sum(float(u) for u in _sim_exchange(key, lane, float(v))))

    @cuda.jit(device=True)
    def warp_xor_f32(v, k):
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32)
        return np.float32(_sim_exchange(key, lane, float(v))[lane ^ int(k)])

    @cuda.jit(device=True)
    def warp_max_f32(v):
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32)
        return np.float32(max(float(u) for u in _sim_exchange(key, lane, float(v))))

    @cuda.jit(device=True)
    def warp_argmax(v, i):
        lane = cuda.threadIdx.x % 32
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32)
        bv, bi = float(v), int(i)
        for ov, oi in _sim_exchange(key, lane, (float(v), int(i))):
            if better(ov, oi, bv, bi):
                bv, bi = ov, oi
        return np.float32(bv), bi

    def _sim_half2(w):  # a 32-bit word as its two fp16 values
        return np.array([w]).astype(np.int32).view(np.float16)

    @cuda.jit(device=True)
    def half2_to_float2(w):
        h = _sim_half2(w)
        return np.float32(h[0]), np.float32(h[1])

    @cuda.jit(device=True)
    def float2_to_half2(lo, hi):
        return np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.int32)[0]

    @cuda.jit(device=True)
    def hadd2_to_float2(a, b):
        h = _sim_half2(a) + _sim_half2(b)
        return np.float32(h[0]), np.float32(h[1])

    @cuda.jit(device=True)
    def store16(a, i, v0, v1, v2, v3):
        a[i], a[i + 1], a[i + 2], a[i + 3] = v0, v1, v2, v3

    load16_stream = load16

    @cuda.jit(device=True)
    def load_stream(a, i):
        return a[i]

    @cuda.jit(device=True)
    def copy16_async(dst, di, src, si):
        dst[di], dst[di + 1], dst[di + 2], dst[di + 3] = src[si], src[si + 1], src[si + 2], src[si + 3]

    @cuda.jit(device=True)
    def async_wait_all():
        pass

    @cuda.jit(device=True)
    def count_acq_rel(counters, i):
        return cuda.atomic.add(counters, i, 1)

    @cuda.jit(device=True)
    def load_acquire(counters, i):
        return counters[i]

    SPIN_LIMIT_S = 300.0  # a simulated wait on blocks that never come fails after this, instead of hanging

    @cuda.jit(device=True)
    def spin_pause(k):
        # k: the waiting loop's count. The simulator's blocks are Python threads: let the others run.
        time.sleep(1e-3)
        if k * 1e-3 > SPIN_LIMIT_S:
            raise RuntimeError(f"a block waited over {SPIN_LIMIT_S:.0f} s for the other K-slices of its row-group: in the simulator "
                               "a spread finish runs only under tests/sim_scheduler.concurrent_grid(), which runs a "
                               "launch's blocks at once (it otherwise runs them one after another)")

    @cuda.jit(device=True)
    def await_predecessor():
        pass  # the simulator runs launches one after another

    _sim_clock = itertools.count(1)

    @cuda.jit(device=True)
    def global_timer_lo():
        return np.uint32(next(_sim_clock) & 0x7FFFFFFF)  # a logical clock: the simulator's blocks take seconds

    @cuda.jit(device=True)
    def sm_id():
        return np.uint32(0)

    @cuda.jit(device=True)
    def release_dependents():
        pass

    # The simulator runs a grid's blocks one after another, so a barrier across blocks cannot run
    # there: kernels take their cluster paths only on a GPU (see ClusterBounds).
    @cuda.jit(device=True)
    def cluster_sync():
        raise NotImplementedError("thread block clusters do not run in the CUDA simulator")

    @cuda.jit(device=True)
    def load_cluster_f32(a, i, rank):
        raise NotImplementedError("thread block clusters do not run in the CUDA simulator")

    @cuda.jit(device=True)
    def prmt(a, b, sel):
        x = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
        r = 0
        for k in range(4):
            r |= ((x >> (8 * ((int(sel) >> (4 * k)) & 7))) & 0xFF) << (8 * k)
        return np.uint32(r)

    @cuda.jit(device=True)
    def mma_m16n8k8(a0, a1, b0):
        # A warp-wide operation in a simulator that runs each CUDA thread as a Python thread: see
        # _sim_fragments. Lane (g, t)'s part of D (the hardware's fragment layout: see the GPU version).
        lane = cuda.threadIdx.x % 32
        f = _sim_fragments((cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32), lane, (a0, a1, b0))
        A = np.zeros((16, 8))
        Bm = np.zeros((8, 8))
        for src in range(32):
            g, t = src // 4, src % 4
            A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2], Bm[2 * t:2 * t + 2, g] = f[src]
        g, t = lane // 4, lane % 4
        d = (A[[g, g, g + 8, g + 8]] * Bm[:, [2 * t, 2 * t + 1, 2 * t, 2 * t + 1]].T).sum(axis=1)
        return np.float32(d[0]), np.float32(d[1]), np.float32(d[2]), np.float32(d[3])

    @cuda.jit(device=True)
    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # As mma_m16n8k8; the accumulators a lane holds are the D elements it gets back.
        lane = cuda.threadIdx.x % 32
        f = _sim_fragments((cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x // 32), lane, (a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 16))
        Bm = np.zeros((16, 8))
        for src in range(32):
            g, t = src // 4, src % 4
            A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = f[src, 0], f[src, 1]
            A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = f[src, 2], f[src, 3]
            Bm[2 * t:2 * t + 2, g], Bm[2 * t + 8:2 * t + 10, g] = f[src, 4], f[src, 5]
        g, t = lane // 4, lane % 4
        d = (A[[g, g, g + 8, g + 8]] * Bm[:, [2 * t, 2 * t + 1, 2 * t, 2 * t + 1]].T).sum(axis=1)
        d += np.array([c0, c1, c2, c3], dtype=np.float64)
        return np.float32(d[0]), np.float32(d[1]), np.float32(d[2]), np.float32(d[3])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    def _load4(context, builder, sig, ptr):
        """The 4-tuple ``sig`` returns from one 16-byte load at ``ptr`` (a pointer to its element
        type, in any address space): numba has no vector load."""
        ety = context.get_data_type(sig.args[0].dtype)
        vty = ir.VectorType(ety, 4)
        vec = builder.load(builder.bitcast(ptr, vty.as_pointer(ptr.type.addrspace)), align=16)
        vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), k)) for k in range(4)]
        return context.make_tuple(builder, sig.return_type, vals)

    @intrinsic
    def load16(typingctx, arr, idx):
        """Four 32-bit elements from one aligned 128-bit load (ld.v4)."""
        sig = types.UniTuple(arr.dtype, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            aty, _ = sig.args
            ary = context.make_array(aty)(context, builder, value=args[0])
            return _load4(context, builder, sig, cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False))

        return sig, codegen

    def _u32(builder, v):
        """An integer value as i32 (truncated or zero-extended): what PTX's .u32 / .b32 operands take."""
        i32 = ir.IntType(32)
        return builder.trunc(v, i32) if v.type.width > 32 else builder.zext(v, i32) if v.type.width < 32 else v

    def _shared_u32(builder, ptr):
        """The 32-bit shared-window address of a generic pointer into shared memory (cvta.to.shared)."""
        i8 = ir.IntType(8)
        return builder.ptrtoint(builder.addrspacecast(builder.bitcast(ptr, i8.as_pointer()), i8.as_pointer(3)), ir.IntType(32))

    def _byte_pointer(context, builder, aty, arr, off, ety):
        """A pointer of element type ``ety`` to byte offset ``off`` of array ``arr``."""
        ary = context.make_array(aty)(context, builder, value=arr)
        i8p = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        return builder.bitcast(builder.gep(i8p, [builder.zext(off, ir.IntType(64))]), ety.as_pointer())

    @intrinsic
    def store_byte_offset(typingctx, arr, off, v):
        """arr's element at byte offset ``off`` = v, as :func:`load_byte_offset` (32-bit offset arithmetic: an
        index makes numba's 64-bit element arithmetic, which ptxas kept in loops)."""
        sig = types.none(arr, off, v)

        def codegen(context, builder, sig, args):
            ety = context.get_data_type(sig.args[0].dtype)
            val = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
            builder.store(val, _byte_pointer(context, builder, sig.args[0], args[0], args[1], ety), align=context.get_abi_sizeof(ety))
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_byte_offset(typingctx, arr, off):
        """arr's element at byte offset ``off``: lets ptxas fold the address into one LDS [R+UR]."""
        sig = arr.dtype(arr, off)

        def codegen(context, builder, sig, args):
            ety = context.get_data_type(sig.args[0].dtype)
            return builder.load(_byte_pointer(context, builder, sig.args[0], *args, ety), align=context.get_abi_sizeof(ety))

        return sig, codegen

    @intrinsic
    def shared_address(typingctx, arr):
        """The 32-bit shared-window address of a shared array's first element (cvta.to.shared)."""
        sig = types.uint32(arr)

        def codegen(context, builder, sig, args):
            return _shared_u32(builder, context.make_array(sig.args[0])(context, builder, value=args[0]).data)

        return sig, codegen

    @intrinsic
    def load_shared_u16(typingctx, arr, addr):
        """The uint16 at shared address ``addr`` (from :func:`shared_address`; ``arr``, the array it
        points into, types the simulator's version). A 32-bit address is what LDS takes: an offset
        or'd into an aligned one then needs no add (a generic pointer costs an IMAD a load)."""
        sig = types.uint16(arr, addr)

        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[1], ir.IntType(16).as_pointer(3))
            return builder.load(ptr, align=2)

        return sig, codegen

    @intrinsic
    def load_shared_v4(typingctx, arr, addr):
        """Four 32-bit words from one 16-byte load at shared address ``addr`` (as load_shared_u16):
        an address kept with the shared base already in it, so the loop adds none."""
        sig = types.UniTuple(arr.dtype, 4)(arr, addr)

        def codegen(context, builder, sig, args):
            ety = context.get_data_type(sig.args[0].dtype)
            return _load4(context, builder, sig, builder.inttoptr(args[1], ety.as_pointer(3)))

        return sig, codegen

    @intrinsic
    def load_half_byte_offset(typingctx, arr, off):
        """The fp16 value at byte offset ``off`` of ``arr`` (an fp16 table kept as uint16), as fp32."""
        sig = types.float32(arr, off)

        def codegen(context, builder, sig, args):
            h = builder.load(_byte_pointer(context, builder, sig.args[0], *args, ir.HalfType()), align=2)
            return builder.fpext(h, ir.FloatType())

        return sig, codegen

    @intrinsic
    def half_sum4(typingctx, arr, o0, o1, o2, o3):
        """((h0 + h1) + h2) + h3 in fp16, h_i the fp16 value at byte offset o_i of ``arr``, as fp32: four
        lookups cost three fp16 adds and one conversion, where each widened to fp32 cost four conversions
        and three fp32 adds (ptxas, sm_90: the 70B gate_up build's loop 1443 -> 1251 instructions). In
        pairs, (h0 + h1) + (h2 + h3), ptxas packed them into half2 by two more PRMT a word (1315). The
        caller keeps |h_i| below 2**13, so no sum leaves fp16's range."""
        sig = types.float32(arr, o0, o1, o2, o3)

        def codegen(context, builder, sig, args):
            h = [builder.load(_byte_pointer(context, builder, sig.args[0], args[0], o, ir.HalfType()), align=2) for o in args[1:]]
            return builder.fpext(builder.fadd(builder.fadd(builder.fadd(h[0], h[1]), h[2]), h[3]), ir.FloatType())

        return sig, codegen

    @intrinsic
    def store_half(typingctx, arr, idx, v):
        """arr[idx] = fp16(v), for a uint16 array holding fp16 bits (numba stores no fp16 scalars)."""
        sig = types.none(arr, idx, v)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ary = context.make_array(aty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
            h = builder.fptrunc(args[2], ir.HalfType()) if args[2].type != ir.HalfType() else args[2]
            builder.store(builder.bitcast(h, ir.IntType(16)), ptr, align=2)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def warp_max_u32(typingctx, v):
        """The largest of the 32 lanes' ``v`` (unsigned), on every lane: one ``redux.sync.max.u32``
        (sm_80+). Warp-wide: all 32 lanes call it together."""
        sig = types.uint32(v)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r", side_effect=True)
            return builder.call(asm, [_u32(builder, args[0])])

        return sig, codegen

    def _as_half2(builder, v):
        """A 32-bit (or wider, truncated) integer as LLVM <2 x half>."""
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.VectorType(ir.HalfType(), 2))

    def _half2_to_floats(context, builder, sig, h2):
        f = [builder.fpext(builder.extract_element(h2, ir.Constant(ir.IntType(32), k)), ir.FloatType()) for k in range(2)]
        return context.make_tuple(builder, sig.return_type, f)

    @intrinsic
    def half2_to_float2(typingctx, w):
        """The two fp16 values packed in a 32-bit word (low half first), as fp32."""
        sig = types.UniTuple(types.float32, 2)(w)

        def codegen(context, builder, sig, args):
            return _half2_to_floats(context, builder, sig, _as_half2(builder, args[0]))

        return sig, codegen

    @intrinsic
    def hadd2_to_float2(typingctx, a, b):
        """fp16(a + b) of two words of packed fp16 pairs, as fp32: one ``add.f16x2`` and two conversions,
        where converting both first and adding in fp32 costs four conversions and two adds. The sum is
        rounded to fp16 once, as a dequantized fp16 weight is."""
        sig = types.UniTuple(types.float32, 2)(a, b)

        def codegen(context, builder, sig, args):
            return _half2_to_floats(context, builder, sig, builder.fadd(*(_as_half2(builder, v) for v in args)))

        return sig, codegen

    @cuda.jit(device=True, forceinline=True)
    def silu(v):
        """v * sigmoid(v) in fp32 from ex2.approx and div.approx (~4 instructions; libdevice's exact
        expf and IEEE division cost the fused SiLU + add kernels 0.9-1.6 us of a 15 us launch, NOTES,
        session 46): a few ulp of fp32, far below the fp16 rounding that follows. exp(-v) = inf
        gives v * 0 = -0, as silu tends to."""
        return libdevice.fast_fdividef(v, float32(1.0) + libdevice.fast_expf(-v))

    @intrinsic
    def float_bits(typingctx, f):
        """The bits of an fp32 value, as uint32 (a positive float's order is its bits' order)."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    @intrinsic
    def bits_float(typingctx, u):
        """The fp32 value of 32 bits (uint32 or int32)."""
        sig = types.float32(u)

        def codegen(context, builder, sig, args):
            x = args[0]
            x = builder.trunc(x, ir.IntType(32)) if x.type.width > 32 else x
            return builder.bitcast(x, ir.FloatType())

        return sig, codegen

    @intrinsic
    def float2_to_half2(typingctx, lo, hi):
        """Two fp32 values rounded to fp16 and packed in a 32-bit word (``lo`` in the low half)."""
        sig = types.int32(lo, hi)

        def codegen(context, builder, sig, args):
            h2 = ir.Constant(ir.VectorType(ir.HalfType(), 2), None)
            for k, v in enumerate(args):
                h2 = builder.insert_element(h2, builder.fptrunc(v, ir.HalfType()), ir.Constant(ir.IntType(32), k))
            return builder.bitcast(h2, ir.IntType(32))

        return sig, codegen

    @intrinsic
    def mma_m16n8k8(typingctx, a0, a1, b0):
        """D (16 x 8, fp32) = A (16 x 8, fp16, row-major) x B (8 x 8, fp16, column-major) on the
        tensor cores, from zero (PTX ``mma.sync.m16n8k8``; numba has no tensor-core API). A warp-wide
        operation: all 32 lanes call it together. Lane l (g = l / 4, t = l % 4) holds A[g][2t..2t+1]
        in ``a0``, A[g + 8][2t..2t+1] in ``a1`` and B[2t..2t+1][g] in ``b0`` (fp16 pairs, low half
        first), and gets D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]. Products of fp16
        values are exact in fp32."""
        sig = types.UniTuple(types.float32, 4)(a0, a1, b0)

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32, i32, i32, f32])
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5}, {$6}, "
                                     "{$7, $7, $7, $7};", "=f,=f,=f,=f,r,r,r,f", side_effect=False)
            ins = [builder.trunc(v, i32) if v.type.width > 32 else builder.sext(v, i32) if v.type.width < 32 else v for v in args]
            d = builder.call(asm, [*ins, ir.Constant(f32, 0.0)])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, k) for k in range(4)])

        return sig, codegen

    @intrinsic
    def load16_stream(typingctx, arr, idx):
        """As :func:`load16` from global memory, for data read exactly once: the read-only path
        without an L1 allocation (``ld.global.nc.L1::no_allocate.v4``), as the CUDA C++ kernels' ld_stream."""
        sig = types.UniTuple(arr.dtype, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            aty, _ = sig.args
            ary = context.make_array(aty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
            i32, i64 = ir.IntType(32), ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64]),
                               "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side_effect=True)
            v = builder.call(asm, [builder.ptrtoint(ptr, i64)])
            ety = context.get_data_type(aty.dtype)
            vals = [builder.extract_value(v, k) for k in range(4)]
            if ety != i32:
                vals = [builder.bitcast(x, ety) for x in vals]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    @intrinsic
    def load_stream(typingctx, arr, idx):
        """One 32-bit element, read once: ``ld.global.nc.L1::no_allocate.u32`` (see load16_stream)."""
        sig = arr.dtype(arr, idx)

        def codegen(context, builder, sig, args):
            aty, _ = sig.args
            ary = context.make_array(aty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
            i32, i64 = ir.IntType(32), ir.IntType(64)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i64]), "ld.global.nc.L1::no_allocate.u32 $0, [$1];", "=r,l", side_effect=True)
            v = builder.call(asm, [builder.ptrtoint(ptr, i64)])
            ety = context.get_data_type(aty.dtype)
            return v if ety == i32 else builder.bitcast(v, ety)

        return sig, codegen

    def _load_cg_vector(n):
        def load(typingctx, arr, i, j, k):
            """a[i, j, k .. k + n - 1] of a float32 array, written by other blocks of this launch: one
            aligned ``ld.global.cg.v<n>.f32`` past L1 (as :func:`load_cg`), n values a load in flight."""
            if arr.dtype != types.float32:
                return None
            sig = types.UniTuple(types.float32, n)(arr, i, j, k)

            def codegen(context, builder, sig, args):
                aty = sig.args[0]
                ary = context.make_array(aty)(context, builder, value=args[0])
                idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
                ptr = cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)
                f32, i64 = ir.FloatType(), ir.IntType(64)
                regs = ", ".join(f"${q}" for q in range(n))
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * n), [i64]),
                                   f"ld.global.cg.v{n}.f32 {{{regs}}}, [${n}];", ",".join(["=f"] * n) + ",l", side_effect=True)
                v = builder.call(asm, [builder.ptrtoint(ptr, i64)])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(v, q) for q in range(n)])

            return sig, codegen

        load.__name__ = f"load_cg{n}"
        return intrinsic(load)

    load_cg2, load_cg4 = _load_cg_vector(2), _load_cg_vector(4)

    @intrinsic
    def copy16_async(typingctx, dst, di, src, si):
        """dst[di:di + 4] (shared) = src[si:si + 4] (global), 16 aligned bytes, as one ``cp.async.ca``
        (through L1: the blocks on an SM read the same x; .cg, past L1, cost the mma kernel ~1 us at batch 2):
        the copy holds no register while it flies, so a thread can have all of its copies in flight
        at once. Visible to this thread after :func:`async_wait_all`, to the block after a barrier."""
        sig = types.none(dst, di, src, si)

        def codegen(context, builder, sig, args):
            dty, _, sty, _ = sig.args
            dp = cgutils.get_item_pointer(context, builder, dty, context.make_array(dty)(context, builder, value=args[0]),
                                          [args[1]], wraparound=False)
            sp = cgutils.get_item_pointer(context, builder, sty, context.make_array(sty)(context, builder, value=args[2]),
                                          [args[3]], wraparound=False)
            i32, i64 = ir.IntType(32), ir.IntType(64)
            dsh = _shared_u32(builder, dp)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.ca.shared.global [$0], [g], 16; }",
                               "r,l,~{memory}", side_effect=True)
            builder.call(asm, [dsh, builder.ptrtoint(sp, i64)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def async_wait_all(typingctx):
        """Wait for this thread's :func:`copy16_async` copies (``cp.async.wait_all``)."""
        sig = types.none()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    def _counter_op(ptx, doc):
        """An int32 counter's PTX operation ``ptx`` (``$0``: the value read, ``$1``: the address) as an intrinsic
        ``f(counters, i)``; a memory clobber, so the compiler moves no load or store across it."""

        def op(typingctx, counters, i):
            sig = types.int32(counters, i)

            def codegen(context, builder, sig, args):
                aty, _ = sig.args
                ptr = cgutils.get_item_pointer(context, builder, aty, context.make_array(aty)(context, builder, value=args[0]),
                                               [args[1]], wraparound=False)
                i32, i64 = ir.IntType(32), ir.IntType(64)
                asm = ir.InlineAsm(ir.FunctionType(i32, [i64]), ptx, "=r,l,~{memory}", side_effect=True)
                return builder.call(asm, [builder.ptrtoint(ptr, i64)])

            return sig, codegen

        op.__doc__ = doc
        return intrinsic(op)

    count_acq_rel = _counter_op(
        "atom.acq_rel.gpu.add.u32 $0, [$1], 1;",
        """counters[i] += 1 as ``atom.acq_rel.gpu`` (returns the old count): the release makes the
        partials this block wrote before its barrier visible with the count (cumulativity through
        bar.sync, as CUTLASS's split-K semaphore relies on), the acquire makes the other blocks' visible
        to the block that counts last. One thread's atomic instead of a sequentially consistent fence
        (``membar.gl``, MEMBAR.SC.GPU) in every thread.""")

    load_acquire = _counter_op(
        "ld.acquire.gpu.u32 $0, [$1];",
        """counters[i] read with ``ld.acquire.gpu``: what the blocks that counted it wrote before their release
        is visible to this thread (and, through the barrier after it, to its block) once it sees their counts.""")

    @intrinsic
    def _nanosleep(typingctx, ns):
        sig = types.void(ns)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), "nanosleep.u32 $0;", "r", side_effect=True)
            builder.call(asm, [_u32(builder, args[0])])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True)
    def spin_pause(k):
        # A short sleep between polls: the SM's other warps (none here: one block an SM) and the L2 are spared
        # a read every few cycles; the wake-up costs up to ~2 x the time asked.
        _nanosleep(int32(64))

    def _special_register(name, doc):
        @intrinsic
        def fn(typingctx):
            sig = types.uint32()

            def codegen(context, builder, sig, args):
                # volatile: two reads of %globaltimer must not be merged or moved across the work they time
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), f"mov.u32 $0, {name};", "=r,~{memory}", side_effect=True)
                return builder.call(asm, [])

            return sig, codegen
        fn.__doc__ = doc
        return fn

    global_timer_lo = _special_register("%globaltimer_lo", """The low 32 bits of the GPU's nanosecond clock, the same on every SM
        (unlike clock64): block timelines across SMs. Wraps every ~4.3 s; take differences as uint32.""")
    sm_id = _special_register("%smid", "The SM this thread runs on.")

    def _griddep(doc, instr):
        @intrinsic
        def fn(typingctx):
            sig = types.none()

            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), instr, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen
        fn.__doc__ = doc
        return fn

    await_predecessor = _griddep(
        """Programmatic dependent launch (sm_90): wait until the grid this launch depends on has finished
        and its writes are visible. A no-op in a launch made without the attribute (see :func:`programmatic`).
        Before it a kernel may read only what does not change between launches (weights) or what was
        written two or more launches back.""", "griddepcontrol.wait;")
    release_dependents = _griddep(
        """Let the next programmatic launch start its blocks once every block of this one has called this
        or exited. Called after the wait (so the next launch never runs beside an unfinished launch two
        back) and late, after a kernel's main loop: dependents launched early took SM room from the
        running grid and placed their own blocks unevenly (session 49: 2.6 % slower a 7B token).""",
        "griddepcontrol.launch_dependents;")

    @intrinsic
    def cluster_sync(typingctx):
        """A barrier of every thread of every block of this thread block cluster: arrive with
        release, wait with acquire, so shared-memory writes before it are visible to the cluster's
        other blocks (:func:`load_cluster_f32`) after it."""
        sig = types.none()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                               "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_cluster_f32(typingctx, arr, idx, rank):
        """arr[idx] (a float32 array in shared memory) of block ``rank`` of this thread block
        cluster: distributed shared memory (``mapa``, ``ld.shared::cluster``)."""
        sig = types.float32(arr, idx, rank)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ptr = cgutils.get_item_pointer(context, builder, aty, context.make_array(aty)(context, builder, value=args[0]),
                                           [args[1]], wraparound=False)
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [i32, i32]),
                               "{ .reg .u32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.f32 $0, [ra]; }",
                               "=f,r,r,~{memory}", side_effect=True)
            return builder.call(asm, [_shared_u32(builder, ptr), _u32(builder, args[2])])

        return sig, codegen

    @intrinsic
    def store16(typingctx, arr, idx, v0, v1, v2, v3):
        """arr[idx:idx + 4] = v0..v3 as one aligned 128-bit store (st.v4)."""
        sig = types.none(arr, idx, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ary = context.make_array(aty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
            ety = context.get_data_type(aty.dtype)
            vec = ir.Constant(ir.VectorType(ety, 4), None)
            for k, v in enumerate(args[2:]):
                v = builder.trunc(v, ety) if v.type.width > ety.width else builder.zext(v, ety) if v.type.width < ety.width else v
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), k))
            builder.store(vec, builder.bitcast(ptr, ir.VectorType(ety, 4).as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def prmt(typingctx, a, b, sel):
        """PTX ``prmt.b32`` (CUDA's __byte_perm): byte k of the result is byte (sel >> 4k) & 7 of the
        8-byte value b:a. One instruction where shifts and masks take two or three."""
        sig = types.uint32(a, b, sel)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            ins = [_u32(builder, v) for v in args]
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", side_effect=False)
            return builder.call(asm, ins)

        return sig, codegen

    @intrinsic
    def mma_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A (16 x 16, fp16, row-major) x B (16 x 8, fp16, column-major) + C, fp32 (PTX
        ``mma.sync.m16n8k16``). Warp-wide. Lane l (g = l / 4, t = l % 4) holds A[g][2t..2t+1] in
        ``a0``, A[g + 8][2t..2t+1] in ``a1``, A[g][2t+8..2t+9] in ``a2``, A[g + 8][2t+8..2t+9] in ``a3``,
        B[2t..2t+1][g] in ``b0``, B[2t+8..2t+9][g] in ``b1``, and C/D[g][2t], [g][2t + 1], [g + 8][2t],
        [g + 8][2t + 1] in c0..c3 / the result."""
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                                     "{$8, $9}, {$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=False)
            ins = [_u32(builder, v) for v in args[:6]]
            cs = [builder.fptrunc(v, f32) if v.type != f32 else v for v in args[6:]]
            d = builder.call(asm, [*ins, *cs])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, k) for k in range(4)])

        return sig, codegen

    # The same 128-bit load serves shared memory: NVVM infers the address space (ld.shared.v4).
    sload4 = load16

    @cuda.jit(device=True)
    def load_cg(a, i, j, k):
        # Written by other blocks in this launch: bypass L1, which is not coherent across SMs.
        return cuda.ldcg(a, (int64(i), int64(j), int64(k)))

    @cuda.jit(device=True)
    def warp_sum_f32(v):
        """The sum of the 32 lanes' ``v``, on every lane (butterfly shuffles; all lanes call it)."""
        k = 16
        while k > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, k)
            k >>= 1
        return v

    @cuda.jit(device=True)
    def warp_xor_f32(v, k):
        """Lane ``lane ^ k``'s ``v`` (all lanes call it)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, k)

    @cuda.jit(device=True)
    def warp_max_f32(v):
        """The max of the 32 lanes' ``v``, on every lane (all lanes call it)."""
        k = 16
        while k > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, k))
            k >>= 1
        return v

    @cuda.jit(device=True)
    def warp_argmax(v, i):
        """The (value, index) of the 32 lanes' pairs that :func:`better` ranks first, on every lane."""
        k = 16
        while k > 0:
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, v, k)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, i, k)
            if better(ov, oi, v, i):
                v, i = ov, oi
            k >>= 1
        return v, i


INLINE = {} if SIM else {"forceinline": True}  # cuda.jit options of device functions that must inline


# An fp16 table entry is kept below 2**15 by a power-of-two factor (additive and residual table kernels):
# 2**(14 - FP16_HEADROOM) bounds |x| times a codebook entry's L1 norm before any scaling is needed.
FP16_HEADROOM = 29


def codebook_exponent(codebooks: torch.Tensor) -> int:
    """The least e with every codebook entry's L1 norm below 2**e: with max |x| below 2**(x_e - 14),
    every table entry is below 2**(e + x_e - 14), which an fp16 table scales under 2**15."""
    l1 = float(codebooks.float().abs().sum(-1).max())
    return math.frexp(l1)[1] if l1 > 0 else 0


@cuda.jit(device=True, **INLINE)
def half2_abs_bits(hx, w):
    """max(hx, the bits of |h| for both fp16 halves h of the word w): larger fp16 magnitudes have larger bits."""
    u = uint32(w)
    return max(hx, max(u & uint32(0x7FFF), (u >> uint32(16)) & uint32(0x7FFF)))


@cuda.jit(device=True, **INLINE)
def fp16_table_scale(hx, cbexp, headroom):
    """(2**s, 2**-s) for an fp16 table: s = the biased exponent of the warp's largest |x| (``hx``, from
    :func:`half2_abs_bits` over the lane's x fragments) + ``cbexp`` (:func:`codebook_exponent`) - ``headroom``,
    or (1, 1) where s <= 0. Warp-wide: all 32 lanes call it together."""
    s = int32(warp_max_u32(hx) >> uint32(10)) + int32(cbexp) - int32(headroom)
    up = float32(1.0)
    down = float32(1.0)
    if s > 0:
        up = float32(int64(1) << int64(s))
        down = float32(1.0) / up
    return up, down


def mma_table_tile(NT: int, BG: int, PS: int, half: bool = False):
    """The tensor-core table builds' shared step (residual and additive kernels): one M-tile of 16
    table entries (A fragments ``a0``, ``a1``) times the ``NT`` N-tiles of x (B fragments ``bx``),
    stored at ``tab[base + c * PS + e]`` for table column c < ``BG`` and entry e (the lane's ``e``
    and ``e + 8``). Lane (g, t) holds columns 2t and 2t + 1 of D (see :func:`mma_m16n8k8`); ``PS``
    is the padded table row, so the 4 columns of a store fall 8 banks apart. fp32 entries, or with
    ``half`` fp16 entries times ``f`` (a power of two that keeps them finite; ``tab`` is then a
    uint16 array). All 32 lanes of the warp must call it together."""

    @cuda.jit(device=True, **INLINE)
    def put(tab, o, v, f):
        if half:
            store_half(tab, o, v * f)
        else:
            tab[o] = v

    @cuda.jit(device=True, **INLINE)
    def tile(tab, base, e, t, a0, a1, bx, f):
        for n in range(NT):
            d0, d1, d2, d3 = mma_m16n8k8(a0, a1, bx[n])
            c = uint32(8 * n) + uint32(2) * t
            o = base + c * uint32(PS) + e
            if c < uint32(BG):
                put(tab, o, d0, f)
                put(tab, o + uint32(8), d2, f)
            if c + uint32(1) < uint32(BG):
                put(tab, o + uint32(PS), d1, f)
                put(tab, o + uint32(PS + 8), d3, f)

    return tile


class ClusterBounds(tuple):
    """``launch_bounds`` for ``cuda.jit`` that also fix the kernel's thread block cluster shape,
    ``cluster`` = (x, y, z) blocks: numba-cuda 0.30 has no cluster launch, so :func:`_annotate_clusters`
    adds the NVVM annotations ``cluster_dim_{x,y,z}`` (ptxas: ``.reqnctapercluster``), and a plain
    launch then runs the grid as clusters (each grid dimension a multiple of the cluster's)."""

    def __new__(cls, bounds, cluster):
        obj = super().__new__(cls, bounds)
        obj.cluster = tuple(cluster)
        return obj


def _annotate_clusters():
    from numba.cuda.cudadrv import nvvm
    from numba.cuda import cgutils as _cg
    from llvmlite import ir as _ir

    original = nvvm.set_launch_bounds
    if getattr(original, "clusters", False):
        return

    def set_launch_bounds(kernel, launch_bounds):
        original(kernel, tuple(launch_bounds) if isinstance(launch_bounds, ClusterBounds) else launch_bounds)
        if isinstance(launch_bounds, ClusterBounds):
            md = _cg.get_or_insert_named_metadata(kernel.module, "nvvm.annotations")
            for axis, n in zip("xyz", launch_bounds.cluster):
                md.add(kernel.module.add_metadata([kernel, _ir.MetaDataString(kernel.module, f"cluster_dim_{axis}"),
                                                   _ir.Constant(_ir.IntType(32), n)]))

    set_launch_bounds.clusters = True
    nvvm.set_launch_bounds = set_launch_bounds


if not SIM:
    _annotate_clusters()


# -- programmatic dependent launch -------------------------------------------------------------
# In a CUDA graph each kernel of a decode step starts only after the one before it has finished and
# flushed: its blocks' launch and their first DRAM round trip (the codes) sit in the gap. On sm_90 a
# launch with the programmatic-stream-serialization attribute may start while its predecessor runs;
# its blocks load what does not depend on it (codes, codebooks; attention's cache rows) and wait in
# ``await_predecessor`` for the rest. numba-cuda 0.30 launches through cuda.core's LaunchConfig
# with no way to pass the attribute, so launches made under :func:`programmatic` get it from here.
_programmatic = [False]
_pdl_supported: list = []


@cuda.jit(device=True, **INLINE)
def _no_wait():
    pass


def programmatic_kernels() -> bool:
    """Whether kernels built now wait on a programmatic predecessor: a GPU of compute capability
    9.0 or later, whose numba launches can carry the attribute (cuda.core's LaunchConfig takes it).
    The simulator runs launches one after another."""
    if SIM:
        return False
    if not _pdl_supported:
        ok = torch.cuda.is_available() and cuda.is_available() and cuda.get_current_device().compute_capability >= (9, 0)
        if ok:
            from numba.cuda import dispatcher

            try:
                dispatcher.LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
            except TypeError:
                ok = False
            else:
                _install_programmatic(dispatcher)
        _pdl_supported.append(ok)
    return _pdl_supported[0]


def launch_hooks():
    """(wait, release): the device functions a kernel calls where it starts to need its
    predecessor's results (:func:`await_predecessor`) and where its dependents may start launching
    (:func:`release_dependents`), where kernels can be launched programmatically; else no-ops."""
    if SIM or programmatic_kernels():
        return await_predecessor, release_dependents
    return _no_wait, _no_wait


def _install_programmatic(dispatcher) -> None:
    core = dispatcher.LaunchConfig
    if getattr(core, "trapetum", False):
        return

    def launch_config(*args, **kw):
        if _programmatic[0]:
            kw["programmatic_stream_serialization"] = True
        return core(*args, **kw)

    launch_config.trapetum = True
    dispatcher.LaunchConfig = launch_config


class programmatic:
    """``with programmatic(on): kernel[...](...)``: the launch may overlap the stream's previous
    kernel (programmatic dependent launch) when ``on`` and :func:`programmatic_kernels`. Only for a
    kernel that calls :func:`launch_hooks`' wait before it reads what its predecessor writes, and
    after a kernel (not a copy) in the stream."""

    def __init__(self, on: bool = True):
        self.on = bool(on) and programmatic_kernels()

    def __enter__(self):
        self.prev, _programmatic[0] = _programmatic[0], self.on
        return self

    def __exit__(self, *exc):
        _programmatic[0] = self.prev
        return False


@cuda.jit(device=True, **INLINE)
def last_to_finish(counters, idx, nsplit, last, tid) -> bool:
    """Whether this block is the last of the ``nsplit`` K-slices of output group ``idx`` to finish.

    Every thread of the block must call it (it holds two barriers). Counter ``idx`` counts finished
    K-slices: thread 0 counts once the block's partials are written (the barrier), with release and
    acquire semantics (:func:`count_acq_rel`). The last block resets it to 0 here (every other block
    has already counted, so nothing reads it again in this launch) so the launch replays in a CUDA
    graph. ``last``: a 1-element shared int32 array.
    """
    cuda.syncthreads()
    if tid == 0:
        last[0] = 1 if count_acq_rel(counters, idx) == nsplit - 1 else 0
        if last[0] == 1:
            counters[idx] = 0
    cuda.syncthreads()
    return last[0] == 1


@cuda.jit(device=True, **INLINE)
def arrive_and_wait(counters, idx, n, tid):
    """Count this block in at counter ``idx`` and wait until ``n`` blocks have: afterwards what those blocks
    wrote before they arrived is visible to every thread of this block. Every thread of the block must call
    it (barriers). Only for grids whose blocks all run at once (one wave): a block waiting on a block that
    has no SM to start on waits forever. :func:`depart` resets the counter."""
    cuda.syncthreads()
    if tid == 0:
        count_acq_rel(counters, idx)
        k = 0
        while load_acquire(counters, idx) < n:
            k += 1
            spin_pause(k)
    cuda.syncthreads()


@cuda.jit(device=True, **INLINE)
def depart(counters, idx, out, n, tid):
    """After :func:`arrive_and_wait` at ``idx``: count out at counter ``out``; the last of the ``n`` blocks
    out resets both counters (every block's thread 0 has stopped reading ``idx``), so the launch replays in a
    CUDA graph. No barrier: only thread 0 reads the counters."""
    if tid == 0:
        if count_acq_rel(counters, out) == n - 1:
            counters[idx] = 0
            counters[out] = 0


@cuda.jit(device=True, **INLINE)
def _load8(ws, sp, last, b, row):
    """ws[sp .. sp + 7, b, row], issued together; slices past ``last`` read ``last`` again."""
    return (load_cg(ws, min(sp, last), b, row), load_cg(ws, min(sp + 1, last), b, row),
            load_cg(ws, min(sp + 2, last), b, row), load_cg(ws, min(sp + 3, last), b, row),
            load_cg(ws, min(sp + 4, last), b, row), load_cg(ws, min(sp + 5, last), b, row),
            load_cg(ws, min(sp + 6, last), b, row), load_cg(ws, min(sp + 7, last), b, row))


@cuda.jit(device=True, **INLINE)
def _sum8(v, n):
    """The first ``n`` (at most 8; none where n <= 0) of the eight values ``v``, in _load8's order."""
    v0, v1, v2, v3, v4, v5, v6, v7 = v
    if n >= 8:
        return ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
    t = float32(0.0)
    for k in range(7):  # a constant trip count: unrolled, so v[k] is a register, not a local array
        if k < n:
            t += v[k]
    return t


@cuda.jit(device=True, **INLINE)
def _load8_whole(ws, sp, b, row):
    """ws[sp .. sp + 7, b, row], issued together, where all eight slices exist (no clamping)."""
    return (load_cg(ws, sp, b, row), load_cg(ws, sp + 1, b, row), load_cg(ws, sp + 2, b, row), load_cg(ws, sp + 3, b, row),
            load_cg(ws, sp + 4, b, row), load_cg(ws, sp + 5, b, row), load_cg(ws, sp + 6, b, row), load_cg(ws, sp + 7, b, row))


@cuda.jit(device=True, **INLINE)
def sum_splits(ws, nsplit, b, row):
    """The ``nsplit`` K-slice partials ws[:, b, row]: the last block sums them on the launch's critical
    path, so each serialized L2 round trip adds to its time. Up to 32 loads are in flight at a time.
    Whole groups of 32 slices load unclamped; the rest (1..31) is loaded at once, 8, 16 or 32 loads,
    with the slices past the last reading it again, their values not added. A K-split of 22 (11008
    inputs in the chunk kernel) waits for one round trip, where 16 at a time waited for two. Clamping
    every load's index, whole groups too (5602353), tripled the table kernel's finish in instructions
    a row and made its 4-bit launches 3-20 % slower on the H200 (NOTES "Session 58")."""
    v = float32(0.0)
    last = nsplit - 1
    sp = 0
    while sp + 32 <= nsplit:
        a, c = _load8_whole(ws, sp, b, row), _load8_whole(ws, sp + 8, b, row)
        d, e = _load8_whole(ws, sp + 16, b, row), _load8_whole(ws, sp + 24, b, row)
        v += (_sum8(a, 8) + _sum8(c, 8)) + (_sum8(d, 8) + _sum8(e, 8))
        sp += 32
    if sp < nsplit:
        n = nsplit - sp
        a = _load8(ws, sp, last, b, row)
        if n > 16:
            c, d, e = _load8(ws, sp + 8, last, b, row), _load8(ws, sp + 16, last, b, row), _load8(ws, sp + 24, last, b, row)
            v += (_sum8(a, 8) + _sum8(c, 8)) + (_sum8(d, min(n - 16, 8)) + _sum8(e, min(n - 24, 8)))
        elif n > 8:
            v += _sum8(a, 8) + _sum8(_load8(ws, sp + 8, last, b, row), n - 8)
        else:
            v += _sum8(a, n)
    return v


_summers: dict = {}


def rows_summer(FW: int):
    """A device function ``(ws, nsplit, b, row, out)``: out[0 .. FW-1] = ws[:, b, row .. row + FW - 1]
    summed over the ``nsplit`` K-slices, for a finishing block whose threads own FW adjacent rows.
    FW = 2 or 4 (one row a thread is :func:`sum_splits`): a slice's rows are one 8- or 16-byte load (``row``
    a multiple of FW, ws's rows padded to it), 16 slices in flight (32 or 64 registers of loads), where FW
    rows one at a time waited for FW times the round trips (16 for 56 slices x 4 rows: the 70B down
    projection's finish, 1024 rows a block of 256 threads). 32 slices at 2 rows took 8 warps, tiles of 16,
    rms from 80 registers to 114, a block an SM fewer: 13B qkv +2.3 us (NOTES "Session 56")."""
    if FW in _summers:
        return _summers[FW]
    if FW not in (2, 4):
        raise ValueError(f"a finishing thread sums 2 or 4 adjacent rows with wide loads, got {FW}")
    S = 16
    NV = S * FW  # (a local array's size must be one constant)
    load = load_cg4 if FW == 4 else load_cg2

    @cuda.jit(device=True, **INLINE)
    def summer(ws, nsplit, b, row, out):
        for f in range(FW):
            out[f] = float32(0.0)
        last = nsplit - 1
        for sp in range(0, nsplit, S):
            v = cuda.local.array(NV, float32)
            for k in range(S):  # constant trip counts: unrolled, v and t in registers
                t = load(ws, min(sp + k, last), b, row)
                for f in range(FW):
                    v[k * FW + f] = t[f]
            for k in range(S):
                if sp + k <= last:
                    for f in range(FW):
                        out[f] += v[k * FW + f]

    _summers[FW] = summer
    return summer


@cuda.jit(device=True, **INLINE)
def sum_splits8(ws, nsplit, b, blast, row):
    """ws[:, b..b+7, row] summed over the ``nsplit`` K-slices, the loads of four slices x eight
    outputs in flight at once (batch rows past ``blast`` and slices past the last read one again,
    their values unused): B outputs a thread wait for B / 8 x nsplit / 4 serial L2 round trips,
    where a slice at a time waited for B / 8 x nsplit (32 in the tile kernel's finish at batch 64,
    NOTES "Session 26")."""
    bs = (b, min(b + 1, blast), min(b + 2, blast), min(b + 3, blast),
          min(b + 4, blast), min(b + 5, blast), min(b + 6, blast), min(b + 7, blast))
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = float32(0.0)
    last = nsplit - 1
    for sp in range(0, nsplit, 4):
        v = cuda.local.array(32, float32)
        for k in range(4):
            spk = min(sp + k, last)
            for i in range(8):
                v[8 * k + i] = load_cg(ws, spk, bs[i], row)
        for k in range(4):
            if sp + k <= last:
                s0, s1, s2, s3 = s0 + v[8 * k], s1 + v[8 * k + 1], s2 + v[8 * k + 2], s3 + v[8 * k + 3]
                s4, s5, s6, s7 = s4 + v[8 * k + 4], s5 + v[8 * k + 5], s6 + v[8 * k + 6], s7 + v[8 * k + 7]
    return s0, s1, s2, s3, s4, s5, s6, s7


@cuda.jit(device=True)
def load4(a, i):
    return a[i], a[i + 1], a[i + 2], a[i + 3]


def byte_addressed(K: int) -> bool:
    """Whether :func:`lut_kernel`'s K-entry table is laid out for one-PRMT lookups: row-block pairs as
    [code][row-block parity][lane], 256 bytes a code, so a code byte's lookup address is
    code << 8 | parity << 7 | lane << 2, the code byte moved into place beside a per-lane constant by
    one byte permute (a shift and an and-or otherwise). uint8 K=64 only: a K=256 table of a lone
    row-block would double to 64 KiB, past the 48 KiB a block gets without opt-in."""
    return K == 64


def half_table(K: int, B: int) -> bool:
    """Whether :func:`lut_kernel` keeps its table in fp16, in the codebooks' own [code][lane] order
    (copied by cp.async; a lookup widened to fp32 by one instruction) rather than converted to fp32
    in the prologue. uint8 K=256 at batch 2..16: at 4096 x 14336 on the H100, 46.6 us against 51.5
    at batch 4 and 95.4 against 135.8 at batch 8, the halved table leaving room for fewer K-slices;
    at batch 1 the extra instruction a lookup cost what the prologue saved (NOTES "Session 37").
    Lanes 2m and 2m + 1 share a bank when their codes differ with the same parity; a pair-interleaved
    copy that avoids it gained 3-6 % more at batch 4 and 8 but slowed batch 1's fp32 conversion."""
    return K == 256 and B > 1


def lut_table_words(K: int, RB: int, B: int = 1) -> int:
    """32-bit words of :func:`lut_kernel`'s table for RB row-blocks at batch B: fp32 (a byte-addressed
    table pads an odd row-block count to a pair) or fp16 pairs (:func:`half_table`)."""
    if half_table(K, B):
        return RB * K * 16
    return (RB + (RB & 1 if byte_addressed(K) else 0)) * K * 32


def _make_device_functions(K: int, B: int):
    """Code extraction and the per-word multiply-accumulate, specialised for K and batch B."""
    bits = 4 if K == 16 else 8
    mask = uint32((1 << bits) - 1)
    per_word = 32 // bits
    BYTES = byte_addressed(K)
    HALF = half_table(K, B)
    load_entry = load_half_byte_offset if HALF else load_byte_offset
    CODE_SHIFT = uint32(6 if HALF else 7)  # log2 of a table row's bytes: 32 lanes of fp16 or fp32
    LANE_SHIFT = uint32(1 if HALF else 0)  # lane4 (4 x lane) -> a lane's byte offset in that row

    @cuda.jit(device=True)
    def code_at(packed_row, i):
        # Natural layout: column i's code (low nibble first for 4-bit).
        if bits == 4:
            return (packed_row[i >> 1] >> ((i & 1) * 4)) & 15
        return packed_row[i]

    @cuda.jit(device=True)
    def dot_word(cur, off, q, lut, lane4, xs, xi, ncols, acc, RB, lut_stride):
        # Word q of each of the RB row-blocks' chunks in pipeline slot cur[off:]: per_word codes of
        # the same columns, the first at xs[xi]. Each x value read from shared memory serves RB rows.
        for g in range(per_word // 4):
            for b in range(B):
                x0, x1, x2, x3 = sload4(xs, xi + b * ncols + 4 * g)
                for r in range(RB):
                    w = uint32(cur[off + 4 * r + q])
                    if BYTES:  # see byte_addressed; the pair's offset folds into the loads' immediates
                        lp = lane4 | uint32(128 * (r & 1))
                        base = uint32((r >> 1) * 2 * lut_stride)
                        v0 = load_byte_offset(lut, base + prmt(w, lp, 0x5504))
                        v1 = load_byte_offset(lut, base + prmt(w, lp, 0x5514))
                        v2 = load_byte_offset(lut, base + prmt(w, lp, 0x5524))
                        v3 = load_byte_offset(lut, base + prmt(w, lp, 0x5534))
                    else:  # [code][lane]: 128 bytes a code (fp32), or 64 (fp16, half_table)
                        lo = lane4 >> LANE_SHIFT
                        base = uint32(r * lut_stride)
                        v0 = load_entry(lut, base + ((((w >> uint32(bits * (4 * g))) & mask) << CODE_SHIFT) | lo))
                        v1 = load_entry(lut, base + ((((w >> uint32(bits * (4 * g + 1))) & mask) << CODE_SHIFT) | lo))
                        v2 = load_entry(lut, base + ((((w >> uint32(bits * (4 * g + 2))) & mask) << CODE_SHIFT) | lo))
                        v3 = load_entry(lut, base + ((((w >> uint32(bits * (4 * g + 3))) & mask) << CODE_SHIFT) | lo))
                    acc[r * B + b] = cuda.fma(v3, x3, cuda.fma(v2, x2, cuda.fma(v1, x1, cuda.fma(v0, x0, acc[r * B + b]))))

    return code_at, dot_word, per_word


_kernel_cache: dict = {}


def row_blocks_per_block(K: int, B: int) -> int:
    """How many 32-row blocks a thread block streams side by side, sharing each x read.

    More row-blocks cut shared-memory reads of x (one a code at RB = 1) but cost LUT space
    (RB x K x 128 bytes) and registers (RB x B accumulators, 8 RB words of codes in flight).
    """
    if K == 256:
        return 1
    if K == 64:
        return 2 if B <= 4 else 1
    return 4 if B <= 2 else (2 if B <= 8 else 1)


SUMSQ_LOADS = 2  # 16-byte loads of x a thread of a pre="rms" kernel keeps in flight for the sum of squares
SUMSQ_WORDS = 4 * SUMSQ_LOADS
PRE_OPS = ("", "rms", "silu")  # what lut_kernel applies to x as it stages it (see there)
POST_OPS = ("", "add")  # what it applies to y as it writes it


def check_ops(pre: str, post: str) -> None:
    if pre not in PRE_OPS or post not in POST_OPS:
        raise ValueError(f"pre must be one of {PRE_OPS} and post one of {POST_OPS}, got {pre!r}, {post!r}")


# The pre-operations on one fp16 word of x, rounded as transformers' fp16 Llama rounds them, for
# kernels that feed x to the tensor cores as fp16 (the additive table build); lut_kernel stages fp32.
@cuda.jit(device=True, **INLINE)
def rms_word(w, gw, irms):
    """fp16(g * fp16(x / rms)) of the pair in ``w`` (LlamaRMSNorm: the normalised x is cast to fp16
    before the weight multiplies it); ``gw`` the norm weight's word, ``irms`` 1 / rms of the row."""
    a, b = half2_to_float2(w)
    a, b = half2_to_float2(float2_to_half2(a * irms, b * irms))
    c, d = half2_to_float2(gw)
    return float2_to_half2(a * c, b * d)


@cuda.jit(device=True, **INLINE)
def silu_word(w, uw):
    """fp16(fp16(silu(a)) * b) of the gate pair ``w`` and the up pair ``uw`` (LlamaMLP in fp16)."""
    a, b = half2_to_float2(w)
    a, b = half2_to_float2(float2_to_half2(silu(a), silu(b)))
    c, d = half2_to_float2(uw)
    return float2_to_half2(a * c, b * d)


def apply_pre(x64: torch.Tensor, pre: str, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A fused kernel's pre-operation on float64 x (for the references)."""
    if pre == "rms":
        return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(x64.device).double()
    if pre == "silu":
        a, b = x64.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
    return x64


def apply_post(y64: torch.Tensor, post: str, res: torch.Tensor | None) -> torch.Tensor:
    return y64 + res.to(y64.device).double() if post == "add" else y64


def fused_operands(xa, pre: str, post: str, norm_weight, res, eps: float):
    """A fused call's extra kernel arguments (g32, res, eps), with ``xa`` (never read) for an absent
    operand; and ``(res, res_src)``: under the simulator, which copies every array argument back after
    a launch, res must not share out's memory (its unchanged copy would overwrite the output), so it is
    a copy the launcher refreshes from res_src each call (res_src is None elsewhere)."""
    res_src = None
    if SIM and post:
        res, res_src = res.clone(), res
    extra = (_as_kernel_array(norm_weight.view(torch.int32)) if pre == "rms" else xa,
             _as_kernel_array(res) if post else xa, float(eps))
    return extra, res, res_src


def fused_tuning_operands(n_in: int, n_out: int, B: int, pre: str, post: str, device):
    """Operands for timing a fused kernel's plans: random x, a unit norm weight, a zero residual.
    Returns (xa, the extra arguments, the tensors, to be kept alive while the plans are timed)."""
    x = torch.randn(B, 2 * n_in if pre == "silu" else n_in, device=device, dtype=torch.float16)
    w = torch.ones(n_in, device=device, dtype=torch.float16)
    res = torch.zeros(B, n_out, device=device, dtype=torch.float16)
    xa = _as_kernel_array(x.view(torch.int32))
    return xa, fused_operands(xa, pre, post, w, res, 1e-5)[0], (x, w, res)


def check_fused(g, x: torch.Tensor, out: torch.Tensor, pre: str, post: str, norm_weight, res, why: str) -> torch.Tensor:
    """The operands of a fused call of GEMV ``g`` (n_in, n_out, device, fusable()); returns x as (B, in).
    ``why``: what makes a weight of g's kind unfusable, for the error."""
    check_ops(pre, post)
    n_x = 2 * g.n_in if pre == "silu" else g.n_in
    x2 = check_activation(x, n_x, g.device, MAX_FUSED_BATCH)
    if not g.fusable(x2.shape[0]):
        raise ValueError(f"this layer's kernel cannot fuse operations ({why}): apply them with torch around an unfused call")
    if pre == "rms":
        if (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (g.n_in,)
                or norm_weight.dtype != torch.float16 or norm_weight.device != x2.device or not norm_weight.is_contiguous()
                or norm_weight.data_ptr() % 16):
            raise ValueError(f"pre='rms' takes a contiguous, 16-byte aligned float16 norm_weight of shape ({g.n_in},) on {x2.device}")
    if post == "add":
        if not isinstance(res, torch.Tensor):
            raise ValueError("post='add' takes the residual tensor res")
        check_output(res, x2.shape[0], g.n_out, x2.device)
    return x2


@cuda.jit(device=True, **INLINE)
def inv_rms(sumsq, n, eps):
    """1 / rms of a row of ``n`` inputs whose squares sum to ``sumsq`` (LlamaRMSNorm, fp32)."""
    return float32(1.0) / math.sqrt(sumsq / float32(n) + float32(eps))


def rms_sums(B: int, warps: int):
    """Device functions for a fused RMSNorm's statistics in a block of ``warps`` warps and batch B
    (the lut and additive kernels): ``row_sumsq(x32, wsq, tid, warp)`` leaves each warp's share of
    every row's sum of squares in wsq[warp, b] (shared, (warps, B)); ``warp_sums(part, wsq, warp)``
    puts a warp's own per-row sums there; after a barrier, ``irms_of(wsq, b, n, eps)`` is 1 / rms of
    row b (n inputs), read by any thread."""
    nt = warps * 32

    @cuda.jit(device=True, **INLINE)
    def warp_sums(part, wsq, warp):
        # Every row's sum over this warp's lanes of ``part``, to wsq[warp, b] (all lanes call it).
        for bb in range(B):
            v = warp_sum_f32(part[bb])
            if cuda.laneid == 0:
                wsq[warp, bb] = v

    @cuda.jit(device=True, **INLINE)
    def row_sumsq(x32, wsq, tid, warp):
        part = cuda.local.array(B, float32)
        for bb in range(B):
            part[bb] = 0.0
        # SUMSQ_LOADS 16-byte loads a thread issued before any is used: one memory latency, not one a
        # load (at 4096 inputs and 8 warps the loop-carried version cost ~2 us a launch).
        nq = x32.shape[1] // 4
        tot = B * nq
        wv = cuda.local.array(SUMSQ_WORDS, int32)
        for base in range(tid, tot, SUMSQ_LOADS * nt):
            for u in range(SUMSQ_LOADS):
                idx = min(base + u * nt, tot - 1)
                bb = idx // nq
                wv[4 * u], wv[4 * u + 1], wv[4 * u + 2], wv[4 * u + 3] = load16(x32[bb], (idx - bb * nq) * 4)
            for u in range(SUMSQ_LOADS):
                idx = base + u * nt
                if idx < tot:
                    bb = idx // nq
                    for k in range(4):
                        a, b = half2_to_float2(wv[4 * u + k])
                        part[bb] += a * a + b * b
        warp_sums(part, wsq, warp)

    @cuda.jit(device=True, **INLINE)
    def irms_of(wsq, bb, n, eps):
        t = float32(0.0)
        for w in range(warps):
            t += wsq[w, bb]
        return inv_rms(t, n, eps)

    return row_sumsq, warp_sums, irms_of


def output_writer(rms: bool, add: bool):
    """Device function writing one output ``s`` of batch row ``b`` to y[b, row] through the fused
    post-operations: times irms[b] (``rms``: the row's 1 / rms, applied to the sums), plus res[b, row]
    (``add``; res may be y, each element read and written by the same thread)."""

    @cuda.jit(device=True, **INLINE)
    def write(s, y, b, row, res, irms):
        if rms:
            s *= irms[b]
        if add:
            s += float32(res[b, row])
        y[b, row] = s

    return write


def lut_kernel(K: int, B: int, warps: int, wide: bool = True, RB: int | None = None, stages: int = 2,
               pre: str = "", post: str = ""):
    """The tiled LUT-GEMV kernel for codebook size K and batch B (compiled on first use).

    A block owns RB row-blocks (RB x 32 rows) and one K-slice. Each warp keeps ``stages`` chunks
    of every row-block in registers: one being used, ``stages - 1`` loads in flight behind it.
    Arguments: x32 (B, in/2) int32
    view of fp16 x; tiled int32 codes; cbt32 (row-blocks, K*16) int32 view of the fp16
    [code][lane] codebooks; y (B, out) fp16; ws (ksplit, B, out_pad) fp32; counters (blocks,)
    int32; n_out; rbs (row-blocks); nchunks (16-byte chunks a row); cps (chunks a K-slice);
    g32, res, eps: the fused operations' operands (unused without them).

    The decode step's elementwise work rides on the GEMV (a launch of its own costs 1-3 us of a
    ~10 us layer; NOTES "Fused projections"):

    * ``pre="rms"``: y = W (g * x / rms(x)), Llama's RMSNorm before the GEMV: g32 the int32 view of
      the fp16 norm weight (in,), eps its epsilon. Every block takes the whole row's sum of squares
      (its warps' sums meet in shared memory) while its codebooks load; g scales x as it is staged,
      1/rms the sum as it is written.
    * ``pre="silu"``: y = W (silu(a) * b) for x32 = [a | b] (B, in): the MLP's gate and up halves.
    * ``post="add"``: y = res + W x (res (B, out) fp16, which may be y itself: the residual stream
      updated in place, each element read and written by the same thread).
    """
    RB = RB or row_blocks_per_block(K, B)
    if stages < 2:
        raise ValueError(f"stages must be at least 2 (one chunk used, one in flight), got {stages}")
    check_ops(pre, post)
    key = ("lut", K, B, warps, wide, RB, stages, pre, post)
    if key in _kernel_cache:
        return _kernel_cache[key]
    _, dot_word, per_word = _make_device_functions(K, B)
    cpb = CHUNK_BYTES * (2 if K == 16 else 1)  # columns a 16-byte chunk covers
    nt = warps * 32
    HALF = half_table(K, B)
    lut_stride = K * (64 if HALF else 128)  # bytes of one row-block's [code][lane] table
    lut_size = lut_table_words(K, RB, B)
    LUT_T = int32 if HALF else float32  # fp16 pairs, or fp32
    BYTES = byte_addressed(K)
    lut_quads = RB * K * 4  # 16-byte pieces of the block's fp16 codebooks
    quads_per_rb = K * 4
    quads_per_thread = -(-lut_quads // nt)
    buf_size = 4 if HALF else quads_per_thread * 4
    nreg = RB * 4
    ring_size = stages * nreg
    nacc = RB * B
    load = load16 if wide else load4
    zero = int32(0)
    zeros8 = (zero,) * 8
    RMS, SILU, ADD = pre == "rms", pre == "silu", post == "add"
    row_sumsq, warp_sums, irms_of = rms_sums(B, warps)
    wait, release = launch_hooks()

    @cuda.jit(device=True, **INLINE)
    def put2(xs, o, w, u):
        # Two staged values of x from their fp16 word w, through the pre-op (u: its operand's word).
        # Returns the raw pair's sum of squares (pre="rms": a block that stages the whole row sums them).
        a, b = half2_to_float2(w)
        sq = a * a + b * b
        if RMS:
            c, d = half2_to_float2(u)
            a, b = a * c, b * d
        elif SILU:
            c, d = half2_to_float2(u)
            a = silu(a) * c
            b = silu(b) * d
        xs[o], xs[o + 1] = a, b
        return sq

    @cuda.jit(device=True, **INLINE)
    def load8(x32, g32, bb, wo, up):
        # Eight values of x (fp16 words w) and their pre-op operands' words (u).
        w0, w1, w2, w3 = load16(x32[bb], wo)
        if SILU:
            u0, u1, u2, u3 = load16(x32[bb], up + wo)
        elif RMS:
            u0, u1, u2, u3 = load16(g32, wo)
        else:
            u0, u1, u2, u3 = w0, w1, w2, w3
        return w0, w1, w2, w3, u0, u1, u2, u3

    @cuda.jit(device=True, **INLINE)
    def put8(xs, o, v):
        return (put2(xs, o, v[0], v[4]) + put2(xs, o + 2, v[1], v[5]) + put2(xs, o + 4, v[2], v[6])
                + put2(xs, o + 6, v[3], v[7]))

    write_out = output_writer(RMS, ADD)

    @cuda.jit(device=True)
    def fetch(dst, off, tiled, base, rstride, rleft, j, j1):
        # Chunk j of each row-block: base = word of (the block's first row-block, chunk 0, lane),
        # row-blocks rstride words apart, chunks 32 lanes x 4 words; rleft = row-blocks from the
        # block's first to the last. 32-bit, as pair_table_builder's.
        for r in range(RB):
            o = off + 4 * r
            if r < rleft and j < j1:
                dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = load(tiled, u32(u32(base + u32(r * rstride)) + u32(u32(j) << u32(7))))
            else:
                dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = zero, zero, zero, zero

    # Blocks above 8 warps get launch bounds, so ptxas keeps to registers that many threads can launch with.
    @cuda.jit(**({"launch_bounds": (nt,)} if warps > 8 and not SIM else {}))
    def kernel(x32, tiled, cbt32, y, ws, counters, n_out, rbs, nchunks, cps, g32, res, eps):
        lut = cuda.shared.array(lut_size, LUT_T)  # [row-block][code][lane] (or byte_addressed): 32 banks a warp
        red = cuda.shared.array((warps, nacc, 32), float32)
        last = cuda.shared.array(1, int32)
        wsq = cuda.shared.array((warps, B), float32)  # pre="rms": each warp's share of the sums of squares
        irms = cuda.shared.array(B, float32)  # pre="rms": 1 / rms of each row of x
        xs = cuda.shared.array(0, float32)  # dynamic: B x (cps * cpb)
        # Indices in 32-bit arithmetic, wrapped in u32 / i32 at every step (numba widens int32 and
        # uint32 operations, and Python-int launch arguments, to 64 bits; its int64 division is a
        # subroutine): as the mma kernel's (NOTES "Session 35").
        tid = i32(cuda.threadIdx.x)
        warp = i32(u32(tid) >> u32(5))
        lane4 = u32(u32(cuda.laneid) << u32(2))
        blk = i32(cuda.blockIdx.x)
        rb0 = i32(blk * RB)
        rleft = i32(rbs - rb0)
        split = i32(cuda.blockIdx.y)
        nsplit = cuda.gridDim.y
        j0 = i32(split * cps)
        j1 = i32(min(i32(j0 + cps), i32(nchunks)))
        ncols = u32(u32(j1 - j0) * u32(cpb))
        rstride = u32(u32(nchunks) << u32(7))  # words of one row-block's codes
        base = u32(u32(u32(rb0) * rstride) + lane4)

        # Start streaming codes before anything waits: this warp's first stages-1 chunks of each
        # row-block. Slot s of the ring holds chunk j + s*warps (mod stages).
        j = i32(j0 + warp)
        ring = cuda.local.array(ring_size, int32)
        for s in range(stages - 1):
            fetch(ring, s * nreg, tiled, base, rstride, rleft, i32(j + s * warps), j1)

        # Codebooks -> fp32 LUT: every 16-byte load issued before the first store waits on one.
        # (An fp16 table is the codebooks' own layout: asynchronous copies, waited for at the barrier.)
        buf = cuda.local.array(buf_size, int32)
        for i in range(quads_per_thread):
            q = u32(tid + i * nt)
            r = u32(q // u32(quads_per_rb))
            if q < u32(lut_quads) and i32(r) < rleft:
                src = cbt32[i32(rb0 + i32(r))]
                si = u32(u32(q - u32(r * u32(quads_per_rb))) << u32(2))
                if HALF:
                    copy16_async(lut, u32(q << u32(2)), src, si)
                else:
                    buf[4 * i], buf[4 * i + 1], buf[4 * i + 2], buf[4 * i + 3] = load16(src, si)
            elif HALF:
                if q < u32(lut_quads):
                    store16(lut, u32(q << u32(2)), zero, zero, zero, zero)
            else:
                buf[4 * i], buf[4 * i + 1], buf[4 * i + 2], buf[4 * i + 3] = zero, zero, zero, zero

        # Codes and codebooks are weights; x is the launch before's output (programmatic launch).
        # This block's slice of x, 8 values a 16-byte load: a thread's first load flies with the
        # codebooks', so the prologue waits one round trip, not two.
        wait()
        xq = u32(ncols >> u32(3))
        xbase = u32(u32(j0) * u32(cpb // 2))
        up = u32(u32(x32.shape[1]) >> u32(1))
        nx = i32(u32(B) * xq)
        bb0 = u32(u32(tid) // xq) if B > 1 else u32(0)  # (batch 1: every staging thread's row is 0)
        x0 = zeros8
        if tid < nx:
            x0 = load8(x32, g32, bb0, u32(xbase + u32(u32(u32(tid) - u32(bb0 * xq)) << u32(2))), up)
        if RMS and nsplit > 1:  # a K-slice: the row's other inputs load for the norm alone (behind the codebooks')
            row_sumsq(x32, wsq, tid, warp)
        for i in range(0 if HALF else quads_per_thread):
            q = u32(tid + i * nt)
            if q < u32(lut_quads):
                o = u32(q << u32(3))  # word of (row-block r, code c, lanes 8 (q % 4) ..): r K 32 + c 32 + 8 (q % 4)
                if BYTES:  # (r >> 1) K 64 + c 64 + (r & 1) 32 + 8 (q % 4)
                    r = u32(q // u32(quads_per_rb))
                    qq = u32(q - u32(r * u32(quads_per_rb)))
                    o = u32(u32(u32(u32(r >> u32(1)) * u32(K * 64)) + u32(u32(r & u32(1)) << u32(5)))
                            + u32(u32(u32(qq >> u32(2)) << u32(6)) + u32(u32(qq & u32(3)) << u32(3))))
                for h in range(4):
                    lut[u32(o + u32(2 * h))], lut[u32(o + u32(2 * h + 1))] = half2_to_float2(buf[4 * i + h])
        part = cuda.local.array(B, float32)
        for bb in range(B):
            part[bb] = 0.0
        if tid < nx:
            part[bb0] += put8(xs, u32(u32(bb0 * ncols) + u32(u32(u32(tid) - u32(bb0 * xq)) << u32(3))), x0)
        for t in range(i32(tid + nt), nx, i32(nt)):  # an i32 range counts in 32 bits
            bb = u32(u32(t) // xq) if B > 1 else u32(0)
            q = u32(u32(t) - u32(bb * xq))
            part[bb] += put8(xs, u32(u32(bb * ncols) + u32(q << u32(3))), load8(x32, g32, bb, u32(xbase + u32(q << u32(2))), up))
        if RMS and nsplit == 1:  # the block staged the whole row: its squares are summed already
            warp_sums(part, wsq, warp)
        if HALF:
            async_wait_all()
        cuda.syncthreads()
        if RMS and tid < B:
            # Once a block, into shared memory (read after the finish's barrier): computed at each
            # write it held ~25 more registers through the main loop (ptxas: 89 against 64).
            irms[tid] = irms_of(wsq, tid, x32.shape[1] * 2, eps)

        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = 0.0
        # Software pipeline over a ring of `stages` slots, unrolled so every slot index is a
        # constant (the ring stays in registers, no copies): refill the slot used last step with
        # the chunk stages-1 steps ahead, then use this step's slot.
        while j < j1:
            for s in range(stages):
                fetch(ring, ((s + stages - 1) % stages) * nreg, tiled, base, rstride, rleft, i32(j + (stages - 1) * warps), j1)
                if j < j1:
                    col = u32(u32(j - j0) * u32(cpb))  # x's index unwrapped past here, so its offsets fold into the loads
                    for q in range(4):
                        dot_word(ring, s * nreg, q, lut, lane4, xs, col + q * per_word, ncols, acc, RB, lut_stride)
                j = i32(j + warps)

        release()  # the next launch may start placing its blocks: this one's are into their last stage
        for i in range(nacc):
            red[warp, i, cuda.laneid] = acc[i]
        cuda.syncthreads()
        if warp == 0:
            for r in range(RB):
                row = i32(u32(u32(u32(rb0 + r) << u32(5)) + u32(cuda.laneid)))
                for bb in range(B):
                    s = float32(0.0)
                    for w in range(warps):
                        s += red[w, r * B + bb, cuda.laneid]
                    if nsplit == 1:
                        if row < n_out:
                            write_out(s, y, bb, row, res, irms)
                    elif r < rleft:
                        ws[split, bb, row] = s
        if nsplit > 1 and last_to_finish(counters, blk, nsplit, last, tid):
            # the block's RB x B rows a lane spread over its warps: each row's sum waits for its own
            # round trips, which warp 0 alone took one row after another
            for i in range(warp, RB * B, warps):
                r = i // B
                bb = i - r * B
                row = i32(u32(u32(u32(rb0 + r) << u32(5)) + u32(cuda.laneid)))
                if row < n_out:  # so rb0 + r < rbs
                    write_out(sum_splits(ws, nsplit, bb, row), y, bb, row, res, irms)

    _kernel_cache[key] = kernel
    return kernel


MMA_UNROLL = 4  # chunks a warp of the mma kernel keeps in use (and as many more in flight)
MMA_TABLE_WORDS = 256 * 64  # the pair table: [code byte][row-block 0/1][lane], one fp16 pair a word
MMA_CB_WORDS = 16 * 16 + 16  # one row-block's staged [code][lane] fp16 codebook; +16 words: the two in other banks


@cuda.jit(device=True, **INLINE)
def stage_codebooks(sm, cbt32, CO, bx, rbs, tid, nt):
    """Both row-blocks' [code][lane] fp16 codebooks at word CO (zeros past the last row-block), as
    asynchronous copies: the caller waits (:func:`async_wait_all`) before its barrier, so the
    codebooks' round trip overlaps x's (a load and a store put them one after the other)."""
    zero = int32(0)
    for q in range(i32(tid), i32(128), i32(nt)):  # 32-bit, as pair_table_builder's
        uq = u32(q)
        gq = u32(uq >> u32(6))
        r = i32(u32(u32(bx) << u32(1)) + gq)
        w = u32(u32(uq & u32(63)) << u32(2))
        o = u32(u32(u32(CO) + u32(gq * u32(MMA_CB_WORDS))) + w)
        if r < rbs:
            copy16_async(sm, o, cbt32[r], w)
        else:
            store16(sm, o, zero, zero, zero, zero)


@cuda.jit(device=True, **INLINE)
def stage_pair_block(sm, cbt32, x32, CO, XO, xrow, bx, rbs, j0, jend, B, tid, nt):
    """mma_kernel's prologue: the codebooks (:func:`stage_codebooks`) and B rows of this K-slice
    of x at XO, ``xrow`` words a row."""
    stage_codebooks(sm, cbt32, CO, bx, rbs, tid, nt)
    stage_x_rows(sm, x32, XO, xrow, j0, jend, B, B, tid, nt)


@cuda.jit(device=True, **INLINE)
def stage_x_rows(sm, x32, XO, xrow, j0, jend, B, BP, tid, nt):
    """Rows 0..BP-1 of this K-slice (chunks j0..jend-1) of x at word XO, ``xrow`` words a row, fp16
    as staged: the B rows of x, then zeros (rows a kernel's n-tile reads past the batch)."""
    xq = (jend - j0) * 4  # 16-byte pieces of a batch row
    # 32-bit division: numba's int64 one is a long emulated sequence. The pieces are asynchronous
    # copies, all of a thread's in flight at once and holding no registers: a load and a store a
    # piece waited one L2 round trip a piece, 32 of them a thread at batch 64 (a fifth of the tile
    # kernel's stall samples there; NOTES "Session 26").
    n = u32(BP * xq)
    uxq = u32(xq)
    zero = int32(0)
    for it in range(i32(tid), i32(n), i32(nt)):  # an i32 range counts in 32 bits (a u32 one in 64)
        t = u32(it)
        bb = u32(t // uxq)
        w = u32(u32(t - u32(bb * uxq)) << u32(2))
        o = u32(u32(u32(XO) + u32(bb * u32(xrow))) + w)
        if BP == B or bb < u32(B):  # the first folds away where every staged row is x's
            copy16_async(sm, o, x32[bb], u32(u32(j0 * 16) + w))
        else:
            store16(sm, o, zero, zero, zero, zero)
    async_wait_all()


def pair_table_builder(swizzle: bool):
    """Device function building the 64 KiB pair table from the staged codebooks (words at CO): per
    code byte, row-block g and row r, the fp16 pair (C[lo], C[hi]) at word byte * 64 + g * 32 + slot.
    slot = r, or with ``swizzle`` r ^ 8 (byte & 3): rows 8q..8q+7 then spread over all 32 banks with
    the byte's low bits, for kernels whose four lanes of a quad look up one row (wide_kernel)."""

    @cuda.jit(device=True, **INLINE)
    def build(sm, CO, tid, nt):
        # 32-bit arithmetic throughout (u32 / i32 wrap every step): numba widens u32 op u32 to 64
        # bits and counts range() of plain ints in 64, which cost ~60 instructions an item here
        # against nvcc's ~15 for the C++ twin (NOTES "Session 34").
        cob = u32(CO) << u32(2)  # byte offset of the staged codebooks
        for it in range(i32(tid), i32(256 * 16), i32(nt)):  # item = (byte, row-block, 4 rows): one 16-byte store
            u = u32(it)
            lq = u32(u & u32(7))
            gq = u32(u32(u >> u32(3)) & u32(1))
            byte = u32(u >> u32(4))
            cb = u32(cob + u32(gq * u32(4 * MMA_CB_WORDS)) + u32(lq << u32(3)))  # rows 4lq.. of code k at cb + 64 k
            lo = u32(cb + u32(u32(byte & u32(15)) << u32(6)))
            hi = u32(cb + u32(u32(byte >> u32(4)) << u32(6)))
            lo0 = load_byte_offset(sm, lo)
            lo1 = load_byte_offset(sm, u32(lo + u32(4)))
            hi0 = load_byte_offset(sm, hi)
            hi1 = load_byte_offset(sm, u32(hi + u32(4)))
            slot = u32(u32(lq << u32(2)) ^ u32(u32(byte & u32(3)) << u32(3))) if swizzle else u32(lq << u32(2))  # an xor of bits 3-4 keeps 4 rows together
            store16(sm, u32(u32(byte << u32(6)) + u32(gq << u32(5)) + slot),
                    prmt(lo0, hi0, 0x5410), prmt(lo0, hi0, 0x7632), prmt(lo1, hi1, 0x5410), prmt(lo1, hi1, 0x7632))

    return build


def pair_block_finisher(B: int, W2: int, nt: int, add: bool = False):
    """Device function ending a two-row-block kernel: the W2 warps of each row-block left their
    partials in red[(warp * B + b) * 32 + r] (warp = 2 w + g); their sums go to y, or with a K-split
    to ws, and the last K-slice's block sums ws into y. ``add``: y = res + the sum (res may be y: each
    element is read and written by one thread)."""
    write = output_writer(False, add)

    @cuda.jit(device=True, **INLINE)
    def item(it, bx):
        # Output item ``it`` of the block: its lane r, batch row b, row-block gq of the pair and row,
        # in 32-bit arithmetic, as the pair table's build.
        u = u32(it)
        r = u32(u & u32(31))
        b = u32(u32(u >> u32(5)) % u32(B))
        gq = u32(u32(u >> u32(5)) // u32(B))
        return r, b, gq, i32(u32(u32(u32(bx * 2) + gq) << u32(5)) + r)

    @cuda.jit(device=True, **INLINE)
    def finish(red, y, ws, counters, last, bx, split, nsplit, n_out, tid, res):
        for it in range(i32(tid), i32(2 * B * 32), i32(nt)):
            r, b, gq, row = item(it, bx)
            s = float32(0.0)
            for v in range(W2):
                s += red[u32(u32(u32(u32(u32(v * 2) + gq) * u32(B)) + b) << u32(5)) + r]
            if row < n_out:
                if nsplit == 1:
                    write(s, y, b, row, res, res)  # (no 1/rms here: its irms is never read)
                else:
                    ws[split, b, row] = s
        if nsplit > 1 and last_to_finish(counters, bx, nsplit, last, tid):
            for it in range(i32(tid), i32(2 * B * 32), i32(nt)):
                _, b, _, row = item(it, bx)
                if row < n_out:
                    write(sum_splits(ws, nsplit, b, row), y, b, row, res, res)

    return finish


def pair_block_stream(fetch, use_chunk, U: int, W2: int, WPC: int = 4):
    """The two-row-block kernels' main loop over a warp's ``nk`` chunks (chunk ``wg``, ``wg + W2``, ...
    of the K-slice starting at ``j0``): ``U`` chunks in use while the next ``U`` load, the two
    register sets ``c`` (holding the first U, fetched before the prologue) and ``d`` alternating,
    two turns a trip, so no turn copies its prefetched codes (a copy a turn cost ptxas ~30 moves).
    Indices past the slice are clamped to ``jlast`` (a re-read, never used): whole turns, no
    bounds checks. ``fetch(dst, o, tiled, base, j)`` and ``use_chunk(regs, o, sm, lb, xo, rel, xa,
    xb, acc)`` are the kernel's own; a chunk is ``WPC`` code words of a lane (8: both row-blocks')."""
    NU = WPC * U

    @cuda.jit(device=True, **INLINE)
    def stream(c, d, tiled, base, j0, jlast, wg, nk, sm, lb, xo, xa, xb, acc):
        rel = wg  # this turn's first chunk, relative to the slice
        turns = nk // U
        for _ in range(turns // 2):
            for u in range(U):  # the next U chunks fly while these U are used
                fetch(d, WPC * u, tiled, base, min(j0 + rel + (U + u) * W2, jlast))
            for u in range(U):
                use_chunk(c, WPC * u, sm, lb, xo, rel + u * W2, xa, xb, acc)
            rel += U * W2
            for u in range(U):
                fetch(c, WPC * u, tiled, base, min(j0 + rel + (U + u) * W2, jlast))
            for u in range(U):
                use_chunk(d, WPC * u, sm, lb, xo, rel + u * W2, xa, xb, acc)
            rel += U * W2
        if turns % 2 == 1:
            for u in range(U):
                fetch(d, WPC * u, tiled, base, min(j0 + rel + (U + u) * W2, jlast))
            for u in range(U):
                use_chunk(c, WPC * u, sm, lb, xo, rel + u * W2, xa, xb, acc)
            rel += U * W2
            for i in range(NU):
                c[i] = d[i]
        for u in range(U - 1):  # the last nk % U chunks, already loaded
            if u < nk % U:
                use_chunk(c, WPC * u, sm, lb, xo, rel + u * W2, xa, xb, acc)

    return stream


def pair_block_prime(fetch, U: int, W2: int, WPC: int = 4):
    """Device function starting :func:`pair_block_stream`'s register set ``c``: a warp's first ``U``
    chunks (``wg``, ``wg + W2``, ...) of the K-slice j0..j1-1, fetched before anything waits. Indices
    past the slice are clamped to its last chunk (a re-read, never used), so the main loop runs whole
    turns without a bounds check. Returns (chunks this warp uses, the slice's last chunk)."""

    @cuda.jit(device=True, **INLINE)
    def prime(c, tiled, base, j0, j1, wg):
        nk = (j1 - j0 - wg + W2 - 1) // W2
        jlast = j1 - 1
        if nk > 0:
            for u in range(U):
                fetch(c, WPC * u, tiled, base, min(j0 + wg + u * W2, jlast))
        return nk, jlast

    return prime


def mma_shared_bytes(B: int, warps: int, cps: int) -> int:
    """Dynamic shared memory of :func:`mma_kernel`: the pair table (aliased by the warps' partials
    after the main loop), B rows of the x slice as fp16 (16 bytes of padding a row so batch rows
    fall in other banks) and the two row-blocks' staged codebooks."""
    return 4 * (max(MMA_TABLE_WORDS, warps * B * 32) + B * (cps * 16 + 4) + 2 * MMA_CB_WORDS)


def mma_min_blocks(B: int, warps: int) -> int:
    """Blocks an SM the mma kernel's launch bounds ask ptxas to fit, so the registers it may use.
    Up to batch 4 (one mma a step): 64 a thread, so two blocks of 16 warps share an SM as the C++
    twin's do (nvcc gives it 64 unasked; ptxas gave numba's 96, one 16-warp block an SM: NOTES
    "Session 34"). Above that 128, the most that a 16-warp block launches with."""
    return max(1, (1024 if B <= 4 else 512) // (warps * 32))


def mma_kernel(B: int, warps: int, unroll: int = MMA_UNROLL, stream: bool = True):
    """4-bit (K = 16) fused GEMV whose multiply-adds run on the tensor cores (compiled on first use):
    the numba twin of ``gemv4_mma`` in kernels/gemv_codebook_4bit.cu, batch 1..16.

    A block owns two row-blocks (64 rows): warps with ``warp % 2 == g`` stream row-block
    ``2 * blockIdx.x + g``, so one 64 KiB table serves both. Per code *byte* (two columns) and lane,
    the table holds the fp16 pair (C[lo], C[hi]) of that lane's row: one lookup serves two codes,
    and its byte address ``byte << 8 | g << 7 | lane << 2`` is one PRMT of the code word.

    A looked-up pair is already an mma B-fragment register: lane 4n + t gives column n rows 2t, 2t+1
    (``b0``) and 2t+8, 2t+9 (``b1``), so the four lanes of quad n feed four *different* rows into
    one column. A keeps them apart: A row m = 4 bq + t holds x of batch bq only at lane t's four
    k-slots (zero elsewhere), so D[m][n] is the dot product of row 4n + m % 4 with batch m / 4. In
    the A fragment only the 8 "diagonal" lanes ((lane >> 2) % 4 == lane % 4) hold x; every other lane's
    x registers stay zero. One m16n8k16 eats 128 codes of 32 rows for 4 batches; batches 5..16 add
    one mma per 4. Step h of a code word uses bytes 2h, 2h+1 (columns 4h..4h+3 of its 8).

    Only the lanes that hold x read it, once a code word, apart from the mmas: ptxas predicates
    that read (one shared wavefront, not the four of a 16-byte read by all 32 lanes); a read
    guarded inside the step loop made it branch around every mma. (x staged as ready-made A
    fragments, zeros for an absent batch b + 2, saved ptxas two register moves an mma but doubled
    the x slice at batch 1, costing a block an SM, and a 16-byte read a step where this design has
    one a word: 22.9 us against the C++ kernel's 16.5 at 4096 x 14336; ncu: MIO-throttle and
    short-scoreboard stalls.)

    Arguments as :func:`lut_kernel`'s (cbt32 holds fp16 [code][lane] codebooks); grid
    (ceil(rbs / 2), ksplit), ``warps`` in {4, 8, 16}, :func:`mma_shared_bytes` of dynamic shared memory.
    ``unroll``: chunks a warp uses in one turn while as many more are in flight. ``stream``: code
    loads skip L1 (read once; the ablation is plain loads).
    """
    key = ("mma", B, warps, unroll, stream)
    if key in _kernel_cache:
        return _kernel_cache[key]
    if not 1 <= B <= MAX_FUSED_BATCH or warps not in (4, 8, 16):
        raise ValueError(f"the mma kernel takes batch 1..{MAX_FUSED_BATCH} and 4, 8 or 16 warps, got {B} and {warps}")
    W2 = warps // 2
    G = (B + 3) // 4  # mmas a step: 4 batches each
    U = unroll
    codes_load = load16_stream if stream else load16
    nt = warps * 32
    XO = max(MMA_TABLE_WORDS, warps * B * 32)  # word where the x slice starts
    HI = B > 2  # batches 2, 3 of each group of 4 ride in A rows 8..15 (a1, a3)
    NU, NG, NG2 = 4 * U, 4 * G, 2 * G  # local array sizes: numba needs them as constants
    build_table = pair_table_builder(swizzle=False)
    finish = pair_block_finisher(B, W2, nt)

    @cuda.jit(device=True, **INLINE)
    def fetch(dst, o, tiled, base, jj):
        dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = codes_load(tiled, base + jj * 128)

    @cuda.jit(device=True, **INLINE)
    def use_chunk(c, o, sm, lb, xl, rel, xa, xb, acc):
        # rel: the chunk's index in the K-slice. xl: where each of this lane's x rows starts
        # (batch 4 gg + lane / 16 at xl[2 gg], its + 2 at xl[2 gg + 1]); -1 where it holds none.
        for w in range(4):  # word w: bytes 4w..4w+3, columns 8w..8w+7 of the chunk
            cw = c[o + w]
            for gg in range(G):
                k = 4 * gg
                if xl[2 * gg] >= 0:
                    xa[k], xa[k + 1], xa[k + 2], xa[k + 3] = sload4(sm, xl[2 * gg] + rel * 16 + 4 * w)
                if HI and xl[2 * gg + 1] >= 0:
                    xb[k], xb[k + 1], xb[k + 2], xb[k + 3] = sload4(sm, xl[2 * gg + 1] + rel * 16 + 4 * w)
            for h in range(2):  # step: bytes 2h, 2h+1 of the word
                b0 = load_byte_offset(sm, prmt(cw, lb, 0x5504 | ((2 * h) << 4)))
                b1 = load_byte_offset(sm, prmt(cw, lb, 0x5504 | ((2 * h + 1) << 4)))
                for gg in range(G):
                    k = 4 * gg
                    acc[k], acc[k + 1], acc[k + 2], acc[k + 3] = mma_m16n8k16(
                        xa[k + 2 * h], xb[k + 2 * h], xa[k + 2 * h + 1], xb[k + 2 * h + 1], b0, b1,
                        acc[k], acc[k + 1], acc[k + 2], acc[k + 3])

    stream = pair_block_stream(fetch, use_chunk, U, W2)
    prime = pair_block_prime(fetch, U, W2)

    # launch_bounds (mma_min_blocks): without them ptxas gave batch 16 148 registers, which 512 threads cannot launch with.
    @cuda.jit(**({} if SIM else {"launch_bounds": (nt, mma_min_blocks(B, warps))}))
    def kernel(x32, tiled, cbt32, y, ws, counters, n_out, rbs, nchunks, cps):
        sm = cuda.shared.array(0, uint32)  # table | x slice | codebooks
        red = cuda.shared.array(0, float32)  # the warps' partials, over the table once it is done
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = warp & 1
        wg = warp >> 1
        bx = cuda.blockIdx.x
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        rb = bx * 2 + g
        j0 = split * cps
        jend = min(j0 + cps, nchunks)
        j1 = jend if rb < rbs else j0  # an odd row-block count leaves the last block's g = 1 idle
        xrow = cps * 16 + 4  # words of one batch row of the x slice
        CO = XO + B * xrow
        base = (rb * nchunks * 32 + lane) * 4  # chunk j of this warp's row-block at base + 128 j

        c = cuda.local.array(NU, int32)
        nk, jlast = prime(c, tiled, base, j0, j1, wg)  # this warp's first U chunks, before anything waits

        # Stage both row-blocks' codebooks and this K-slice of x, as fp16; then the pair table.
        stage_pair_block(sm, cbt32, x32, CO, XO, xrow, bx, rbs, j0, jend, B, tid, nt)
        cuda.syncthreads()
        build_table(sm, CO, tid, nt)
        cuda.syncthreads()

        diag = ((lane >> 2) & 3) == (lane & 3)
        xa = cuda.local.array(NG, uint32)  # x words of batch 4 gg + lane / 16: A rows 0..7 (a0, a2)
        xb = cuda.local.array(NG, uint32)  # and of that + 2: A rows 8..15 (a1, a3)
        acc = cuda.local.array(NG, float32)
        xl = cuda.local.array(NG2, int32)
        for i in range(NG):
            xa[i] = uint32(0)
            xb[i] = uint32(0)
            acc[i] = float32(0.0)
        for i in range(NG2):
            ba = 4 * (i >> 1) + (lane >> 4) + 2 * (i & 1)
            xl[i] = XO + ba * xrow if diag and ba < B else -1
        lb = uint32((lane << 2) | (g << 7))  # byte 0 of every lookup address
        d = cuda.local.array(NU, int32)  # the second register set (pair_block_stream)
        stream(c, d, tiled, base, j0, jlast, wg, nk, sm, lb, xl, xa, xb, acc)

        cuda.syncthreads()  # every warp is done with the table: the partials reuse its space
        # D fragment: lane (g', t') holds D[g'][2t'], D[g'][2t'+1], D[g'+8][2t'], D[g'+8][2t'+1], and
        # D[m][n] is row 4n + m % 4 of batch 4 gg + m / 4.
        for gg in range(G):
            for i in range(4):
                b = 4 * gg + (lane >> 4) + (i >> 1) * 2
                r = 8 * (lane & 3) + (i & 1) * 4 + ((lane >> 2) & 3)
                if b < B:
                    red[(warp * B + b) * 32 + r] = acc[4 * gg + i]
        cuda.syncthreads()
        finish(red, y, ws, counters, last, bx, split, nsplit, n_out, tid, y)

    _kernel_cache[key] = kernel
    return kernel


def dual_shared_bytes(B: int, warps: int, cps: int) -> int:
    """Dynamic shared memory of :func:`dual_kernel`: :func:`mma_shared_bytes`' layout, with room over
    the table for each warp's partials of both row-blocks."""
    return 4 * (max(MMA_TABLE_WORDS, 2 * warps * B * 32) + B * (cps * 16 + 4) + 2 * MMA_CB_WORDS)


DUAL_UNROLL = 2  # chunks a warp of the dual kernel keeps in use: 8 code words each (ptxas spilled unroll 4 at 64 registers)


def x_pre_stager(pre: str):
    """Device function staging rows 0..B-1 of this K-slice of x (chunks j0..jend-1) at word XO,
    ``xrow`` words a row, fp16, through the pre-operation as transformers' fp16 Llama rounds it
    (:func:`rms_word`, :func:`silu_word`): the tensor-core kernels' fused counterpart of
    :func:`stage_x_rows` (a 16-byte load and store a piece, not an asynchronous copy). ``irms``:
    1 / rms of each row (shared, pre="rms"); ``g32``: the norm weight's words (pre="rms")."""
    RMS, SILU = pre == "rms", pre == "silu"

    @cuda.jit(device=True, **INLINE)
    def stage(sm, x32, g32, irms, XO, xrow, j0, jend, B, tid, nt):
        xq = u32(u32(jend - j0) * u32(4))  # 16-byte pieces of a batch row
        up = u32(u32(x32.shape[1]) >> u32(1))  # pre="silu": where the up half starts, in words
        for it in range(i32(tid), i32(u32(B) * xq), i32(nt)):
            t = u32(it)
            bb = u32(t // xq)
            w = u32(u32(t - u32(bb * xq)) << u32(2))
            src = u32(u32(j0 * 16) + w)
            w0, w1, w2, w3 = load16(x32[bb], src)
            if RMS:
                g0, g1, g2, g3 = load16(g32, src)
                r = irms[bb]
                w0, w1, w2, w3 = rms_word(w0, g0, r), rms_word(w1, g1, r), rms_word(w2, g2, r), rms_word(w3, g3, r)
            elif SILU:
                u0, u1, u2, u3 = load16(x32[bb], u32(up + src))
                w0, w1, w2, w3 = silu_word(w0, u0), silu_word(w1, u1), silu_word(w2, u2), silu_word(w3, u3)
            store16(sm, u32(u32(u32(XO) + u32(bb * u32(xrow))) + w), w0, w1, w2, w3)

    return stage


def dual_kernel(B: int, warps: int, unroll: int = DUAL_UNROLL, pre: str = "", post: str = "", early: bool = False):
    """4-bit (K = 16) fused GEMV on the tensor cores with the looked-up weights as the mma's A operand
    and x on the diagonal of B (compiled on first use), batch 1..16.

    The block, its 64 KiB pair table and its prologue are :func:`mma_kernel`'s; what differs is the
    fragment a lookup feeds. Every warp streams *both* row-blocks (a lane's row L in each), and a
    lane's four A registers are the pairs of its two rows at the same four columns: a0, a2 (row L of
    row-block 0: bytes 2h, 2h + 1 of its code word), a1, a3 (row L of row-block 1). So A row g
    (g + 8) holds, in k-slots 2t, 2t + 1, 2t + 8, 2t + 9, row 4g + t of row-block 0 (1). B keeps the
    lanes apart: column n = 4b + t holds batch b's x at lane t's four k-slots only (lanes 4n + t with
    n % 4 = t hold x, the others zeros), so D[g][n] is row 4g + n % 4 of row-block 0 against batch
    n / 4, and D[g + 8][n] the same of row-block 1. One m16n8k16 eats 256 codes (4 lookups a lane)
    for 2 batches, where mma_kernel's eats 128 (2 lookups) for 4: half the mmas and their operand
    moves at batch 1 and 2 (NOTES "Session 51"). Batches 3..16 add an mma per 2.

    Arguments, grid ((rbs + 1) // 2, ksplit) and K-split as mma_kernel's, then the fused operations'
    operands (g32, res, eps) as :func:`lut_kernel`'s; ``warps`` in {4, 8, 16}, :func:`dual_shared_bytes`
    of dynamic shared memory; ``unroll`` chunks a warp uses in one turn while as many more are in flight.

    ``pre``/``post``: the decode step's operations, as :func:`lut_kernel` takes them, but with x staged
    in fp16 as transformers' fp16 Llama rounds it: ``pre="rms"`` sums the whole row's squares first
    (its x is read twice; lut_kernel scales its fp32 sums instead), then stages fp16(g * fp16(x / rms));
    ``pre="silu"`` stages fp16(fp16(silu(a)) * b); ``post="add"`` adds res at the finish.

    ``early``: the kernel is launched while the one before it runs (:class:`programmatic`): it builds
    its table from the codebooks (weights) first, then waits for the launch before, then stages x.
    Launched serially, the codebooks and x fly together and the table comes after both.
    """
    check_ops(pre, post)
    key = ("dual", B, warps, unroll, pre, post, early)
    if key in _kernel_cache:
        return _kernel_cache[key]
    if not 1 <= B <= MAX_FUSED_BATCH or warps not in (4, 8, 16):
        raise ValueError(f"the dual kernel takes batch 1..{MAX_FUSED_BATCH} and 4, 8 or 16 warps, got {B} and {warps}")
    RMS, ADD = pre == "rms", post == "add"
    row_sumsq, _, irms_of = rms_sums(B, warps)
    stage_x_pre = x_pre_stager(pre)
    wait, release = launch_hooks()
    G = (B + 1) // 2  # mmas a step: 2 batches each
    U = unroll
    nt = warps * 32
    XO = max(MMA_TABLE_WORDS, 2 * warps * B * 32)
    NU, NG = 8 * U, 4 * G  # local array sizes: numba needs them as constants
    build_table = pair_table_builder(swizzle=False)
    finish = pair_block_finisher(B, warps, nt, add=ADD)  # partials as if each warp were one warp of each row-block

    @cuda.jit(device=True, **INLINE)
    def fetch(dst, o, tiled, base, jj):
        # chunk jj of both row-blocks: words o..o+3 of row-block 0, o+4..o+7 of row-block 1
        dst[o], dst[o + 1], dst[o + 2], dst[o + 3] = load16_stream(tiled, u32(base[0] + u32(u32(jj) << u32(7))))
        dst[o + 4], dst[o + 5], dst[o + 6], dst[o + 7] = load16_stream(tiled, u32(base[1] + u32(u32(jj) << u32(7))))

    @cuda.jit(device=True, **INLINE)
    def use_chunk(c, o, sm, lb, xl, rel, xw, unused, acc):
        # xl[gg]: the shared address where this lane's x row (batch 2 gg + lane / 16) starts; 0 where
        # it holds none (no shared address is 0: the window starts past the reserved KiB)
        for w in range(4):  # word w: columns 8w..8w+7 of the chunk, both row-blocks
            c0 = c[o + w]
            c1 = c[o + 4 + w]
            for gg in range(G):
                if xl[gg] != 0:
                    k = 4 * gg
                    xw[k], xw[k + 1], xw[k + 2], xw[k + 3] = load_shared_v4(sm, u32(xl[gg] + u32(u32(rel) << u32(6))) + u32(16 * w))
            for h in range(2):  # step h: bytes 2h, 2h + 1 (columns 8w + 4h ..+3)
                a0 = load_byte_offset(sm, prmt(c0, lb, 0x5504 | ((2 * h) << 4)))
                a2 = load_byte_offset(sm, prmt(c0, lb, 0x5504 | ((2 * h + 1) << 4)))
                a1 = load_byte_offset(sm, prmt(c1, lb | uint32(128), 0x5504 | ((2 * h) << 4)))
                a3 = load_byte_offset(sm, prmt(c1, lb | uint32(128), 0x5504 | ((2 * h + 1) << 4)))
                for gg in range(G):
                    k = 4 * gg
                    acc[k], acc[k + 1], acc[k + 2], acc[k + 3] = mma_m16n8k16(
                        a0, a1, a2, a3, xw[k + 2 * h], xw[k + 2 * h + 1], acc[k], acc[k + 1], acc[k + 2], acc[k + 3])

    stream = pair_block_stream(fetch, use_chunk, U, warps, WPC=8)
    prime = pair_block_prime(fetch, U, warps, WPC=8)

    @cuda.jit(**({} if SIM else {"launch_bounds": (nt, mma_min_blocks(B, warps))}))
    def kernel(x32, tiled, cbt32, y, ws, counters, n_out, rbs, nchunks, cps, g32, res, eps):
        sm = cuda.shared.array(0, uint32)  # table | x slice | codebooks
        red = cuda.shared.array(0, float32)  # the warps' partials, over the table once it is done
        last = cuda.shared.array(1, int32)
        wsq = cuda.shared.array((warps, B), float32)  # pre="rms": each warp's share of the sums of squares
        irms = cuda.shared.array(B, float32)  # pre="rms": 1 / rms of each row of x
        tid = i32(cuda.threadIdx.x)
        warp = i32(u32(tid) >> u32(5))
        lane = i32(cuda.laneid)
        bx = i32(cuda.blockIdx.x)
        split = i32(cuda.blockIdx.y)
        nsplit = cuda.gridDim.y
        j0 = i32(split * cps)
        jend = i32(min(i32(j0 + cps), i32(nchunks)))
        xrow = i32(cps * 16 + 4)  # words of one batch row of the x slice
        CO = XO + B * xrow
        rstride = u32(u32(nchunks) << u32(7))  # words of one row-block's codes
        base0 = u32(u32(u32(u32(bx) << u32(1)) * rstride) + u32(u32(lane) << u32(2)))  # chunk j at + 128 j
        # an odd row-block count: the last block's second row-block re-reads the first's codes; its
        # table is zeros (stage_codebooks) and its rows are past n_out, never written
        base = (base0, u32(base0 + rstride) if i32(bx * 2 + 1) < rbs else base0)

        c = cuda.local.array(NU, int32)
        nk, jlast = prime(c, tiled, base, j0, jend, warp)

        stage_codebooks(sm, cbt32, CO, bx, rbs, tid, nt)  # (serial: its round trip overlaps x's)
        if early:  # the prologue's weights-only part before the wait: the codebooks, then the table
            async_wait_all()
            cuda.syncthreads()
            build_table(sm, CO, tid, nt)
            wait()
        if RMS:  # the whole row's sum of squares (serial: while the codebooks fly)
            row_sumsq(x32, wsq, tid, warp)
            cuda.syncthreads()
            if tid < B:
                irms[tid] = irms_of(wsq, tid, x32.shape[1] * 2, eps)
            cuda.syncthreads()
        if pre:
            stage_x_pre(sm, x32, g32, irms, XO, xrow, j0, jend, B, tid, nt)
        else:
            stage_x_rows(sm, x32, XO, xrow, j0, jend, B, B, tid, nt)
        async_wait_all()
        cuda.syncthreads()
        if not early:
            build_table(sm, CO, tid, nt)
            cuda.syncthreads()

        xw = cuda.local.array(NG, uint32)  # B fragments: batch 2 gg + lane / 16's x at k-step h in xw[4 gg + 2h ..]
        acc = cuda.local.array(NG, float32)
        xl = cuda.local.array(G, uint32)
        diag = ((lane >> 2) & 3) == (lane & 3)
        for i in range(NG):
            xw[i] = uint32(0)
            acc[i] = float32(0.0)
        for gg in range(G):
            b = 2 * gg + (lane >> 4)
            xl[gg] = u32(shared_address(sm) + u32((XO + b * xrow) * 4)) if diag and b < B else u32(0)
        lb = uint32(lane << 2)  # byte 0 of a row-block-0 lookup's address (| 128: row-block 1)
        d = cuda.local.array(NU, int32)  # the second register set (pair_block_stream)
        stream(c, d, tiled, base, j0, jlast, warp, nk, sm, lb, xl, xw, xw, acc)

        release()  # a programmatic launch after this one (attention, greedy) may start placing its blocks
        cuda.syncthreads()  # every warp is done with the table: the partials reuse its space
        # D fragment: lane (g, t) holds D[g][2t + i], D[g + 8][2t + i] (i = 0, 1): column n = 2t + i is
        # batch 2 gg + n / 4, row 4g + n % 4 of row-block 0 (1). Stored as pair_block_finisher reads
        # them: as partials of "warp" 2 * warp + row-block.
        for gg in range(G):
            for i in range(4):
                b = 2 * gg + ((lane & 3) >> 1)
                r = 4 * (lane >> 2) + 2 * (lane & 1) + (i & 1)
                if b < B:
                    red[(((2 * warp + (i >> 1)) * B + b) << 5) + r] = acc[4 * gg + i]
        cuda.syncthreads()
        finish(red, y, ws, counters, last, bx, split, nsplit, n_out, tid, res)

    _kernel_cache[key] = kernel
    return kernel


DUAL_MAX_TUNED = 8  # the largest batch the tuner tries the dual kernel at (an mma a step for every 2)
MAX_WIDE_BATCH = 64  # the wide kernel's batches: up to four 16-row m-tiles of the mma
WIDE_UNROLL = 2


def wide_xrow(cps: int) -> int:
    """Words of one row *pair* of :func:`wide_kernel`'s x slice (batch rows m and m + 8 of an m-tile,
    word by word interleaved): 4 mod 8, so the two quads of a quarter-warp (pairs g and g + 1, a
    16-byte read each, 8 words apart a lane) fall in disjoint banks."""
    return cps * 32 + 4


def wide_shared_bytes(B: int, warps: int, cps: int) -> int:
    """Dynamic shared memory of :func:`wide_kernel`: the pair table (the warps' partials reuse it
    after each row pair's main loop), 8 row pairs an m-tile of the x slice, kept for every row pair
    the block walks, and the two row-blocks' staged codebooks."""
    return 4 * (MMA_TABLE_WORDS + 8 * ((B + 15) // 16) * wide_xrow(cps) + 2 * MMA_CB_WORDS)


def wide_min_blocks(B: int, warps: int) -> int:
    """The wide kernel's launch bounds: blocks an SM must hold, so what ptxas sizes its registers for
    (128 a thread up to batch 32; batch 33..64 holds 64 accumulators a lane and may take 255)."""
    return max(1, (512 if B <= 32 else 256) // (warps * 32))


def wide_blocks_per_sm(B: int, warps: int, shared_bytes: int) -> int:
    """Blocks of :func:`wide_kernel` (or :func:`tile_kernel`: the same launch bounds) an H100-class SM
    holds: by threads, by shared memory (228 KiB, 1 KiB of it reserved a block) and by the registers
    its launch bounds allow."""
    return max(1, min(2048 // (warps * 32), (228 * 1024) // (shared_bytes + 1024), wide_min_blocks(B, warps)))


def resolve_walk(walk, groups: int, ksplit: int, per_sm: int, sms: int) -> int:
    """Row groups a walking block takes (:attr:`LaunchPlan.walk`): ``walk``, or for ``"wave"`` as many
    as make the grid one wave of ``per_sm`` blocks an SM; never more than the layer's ``groups``."""
    if walk == "wave":
        walk = -(-groups * ksplit // (per_sm * sms))
    if not isinstance(walk, int) or walk < 1:
        raise ValueError(f"walk is a positive number of row groups a block, or 'wave'; got {walk!r}")
    return min(walk, groups)


@cuda.jit(device=True, **INLINE)
def stage_x_pairs(sm, x32, XO, xrow, j0, jend, B, tid, nt):
    """B rows of this K-slice of x at XO as row pairs: pair 8 mt + g holds rows 16 mt + g and
    16 mt + g + 8 word by word interleaved, so one 16-byte read is a ready mma A fragment (a0..a3)
    and ptxas needs no register moves to assemble it (4 an mma when the rows were apart)."""
    xq = uint32((jend - j0) * 4)  # 16-byte pieces of a row
    n = uint32(((B + 15) // 16) * 8) * xq
    zero = uint32(0)
    for t in range(uint32(tid), n, uint32(nt)):
        p = t // xq
        q = t - p * xq
        r0 = (p >> uint32(3)) * uint32(16) + (p & uint32(7))
        w = uint32(j0 * 16) + q * uint32(4)
        a0, a1, a2, a3 = zero, zero, zero, zero
        b0, b1, b2, b3 = zero, zero, zero, zero
        if r0 < uint32(B):
            a0, a1, a2, a3 = load16(x32[r0], w)
        if r0 + uint32(8) < uint32(B):
            b0, b1, b2, b3 = load16(x32[r0 + uint32(8)], w)
        o = uint32(XO) + p * uint32(xrow) + q * uint32(8)
        store16(sm, o, a0, b0, a1, b1)
        store16(sm, o + uint32(4), a2, b2, a3, b3)


def check_wide_batch_kernel(kind: str, B: int, warps: int, unroll: int) -> None:
    """The wide and tile kernels' compile-time arguments: batch 1..64, 4, 8 or 16 warps, unroll 1, 2 or 4."""
    if not 1 <= B <= MAX_WIDE_BATCH or warps not in (4, 8, 16) or unroll not in (1, 2, 4):
        raise ValueError(f"the {kind} kernel takes batch 1..{MAX_WIDE_BATCH}, 4, 8 or 16 warps and unroll 1, 2 or 4, "
                         f"got {B}, {warps} and {unroll}")


@cuda.jit(device=True, **INLINE)
def fetch_row_words(dst, o, tiled, base, jj):
    """Chunk jj of a row-block as four 4-byte loads (``base``: the row-block's first word + lane):
    load q gives lane (g, t) word t (columns 8t..8t+7) of row 8q + g, one 128-byte line a load."""
    for q in range(4):
        dst[o + q] = load_stream(tiled, base + jj * 128 + q * 32)


def wide_kernel(B: int, warps: int, unroll: int = WIDE_UNROLL):
    """4-bit (K = 16) fused kernel for batches of up to 64 rows, on the tensor cores with x as the
    mma's A operand (batch rows as M) and the looked-up weights as B (weight rows as N).

    :func:`mma_kernel` keeps a lane on its own row (its 16-byte load is that row's chunk), so A has
    to be "diagonal" and 3/4 of every mma multiplies zeros: batch 16 costs 4 mmas a step and batch
    64 would cost 16. Here the four lanes of a quad feed one row, as the mma's fragments want: a
    warp reads a chunk (32 rows x 16 bytes) as four 4-byte loads, load q giving lane (g, t) word t
    of row 8q + g (each load one contiguous 128-byte line), so n-tile q holds rows 8q..8q+7. Byte
    2h (2h + 1) of that word, looked up in the pair table, is the lane's b0 (b1) of k-step h; the
    k-slots 2t, 2t + 1 (2t + 8, 2t + 9) are then the chunk's columns 8t + 4h, + 1 (+ 2, + 3); x is
    staged as row pairs (m, m + 8) interleaved word by word (:func:`stage_x_pairs`), so one 16-byte
    read is a k-step's whole A fragment. Per chunk and warp: 4 loads, 16 lookups, and per 16 batch
    rows 2 x-reads and 8 mmas, where mma_kernel needs 32 mmas at batch 64.

    The cost: a quad's four lanes look up one row's table, so the table is swizzled (see
    :func:`pair_table_builder`) and a lookup takes ~3 shared wavefronts, not 1. Blocks, K-split
    and arguments as mma_kernel's, but the grid's x may be smaller than the row pairs: block bx
    walks pairs bx, bx + gridDim.x, ... (:attr:`LaunchPlan.walk` a block), keeping its x slice.
    ``unroll``: chunks a warp uses in one turn while as many more are in flight.
    :func:`wide_shared_bytes` of dynamic shared memory.
    """
    key = ("wide", B, warps, unroll)
    if key in _kernel_cache:
        return _kernel_cache[key]
    check_wide_batch_kernel("wide", B, warps, unroll)
    if warps * B * 32 > MMA_TABLE_WORDS:
        raise ValueError(f"the wide kernel's partials ({warps} warps x batch {B}) must fit its 64 KiB table: "
                         f"at most {MMA_TABLE_WORDS // (32 * B)} warps at batch {B}")
    MT = (B + 15) // 16  # m-tiles: 16 batch rows each
    W2 = warps // 2
    U = unroll
    nt = warps * 32
    XO = MMA_TABLE_WORDS
    NU, NA, NC, NX = 4 * U, 4 * MT, 16 * MT, MT  # local array sizes: numba needs them as constants
    build_table = pair_table_builder(swizzle=True)
    finish = pair_block_finisher(B, W2, nt)

    @cuda.jit(device=True, **INLINE)
    def use_chunk(c, o, sm, lb, xr, rel, xa, xb, acc):
        for mt in range(MT):  # A fragments of x rows 16 mt + g, + 8, columns 8t..8t+3 (xa) and 8t+4..8t+7 (xb)
            k = 4 * mt
            if xr[mt] >= 0:
                xa[k], xa[k + 1], xa[k + 2], xa[k + 3] = sload4(sm, xr[mt] + rel * 32)
                xb[k], xb[k + 1], xb[k + 2], xb[k + 3] = sload4(sm, xr[mt] + rel * 32 + 4)
        for q in range(4):  # n-tile q: rows 8q..8q+7
            cw = uint32(c[o + q])
            lq = lb + uint32(32 * q)
            for h in range(2):  # k-step h: bytes 2h, 2h + 1 of the word
                # byte address b << 8 | row-block << 7 | slot << 2, slot's bits 3-4 xor'd with b & 3
                a0 = prmt(cw, lq, 0x5504 | ((2 * h) << 4)) ^ (((cw >> uint32(16 * h)) << uint32(5)) & uint32(0x60))
                a1 = prmt(cw, lq, 0x5504 | ((2 * h + 1) << 4)) ^ ((cw >> uint32(16 * h + 3)) & uint32(0x60))
                b0 = load_byte_offset(sm, a0)
                b1 = load_byte_offset(sm, a1)
                for mt in range(MT):
                    k = 4 * mt
                    i = 4 * (4 * mt + q)
                    if h == 0:
                        acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mma_m16n8k16(
                            xa[k], xa[k + 1], xa[k + 2], xa[k + 3], b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                    else:
                        acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mma_m16n8k16(
                            xb[k], xb[k + 1], xb[k + 2], xb[k + 3], b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])

    stream = pair_block_stream(fetch_row_words, use_chunk, U, W2)
    prime = pair_block_prime(fetch_row_words, U, W2)

    # batch 33..64 spilled at 128 registers; its x slice allows one block an SM anyway (wide_min_blocks)
    @cuda.jit(**({} if SIM else {"launch_bounds": (nt, wide_min_blocks(B, warps))}))
    def kernel(x32, tiled, cbt32, y, ws, counters, n_out, rbs, nchunks, cps):
        sm = cuda.shared.array(0, uint32)  # table | x slice | codebooks
        red = cuda.shared.array(0, float32)  # the warps' partials, over the table once a pair's loop is done
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = warp & 1
        wg = warp >> 1
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        j0 = split * cps
        jend = min(j0 + cps, nchunks)
        xrow = cps * 32 + 4  # wide_xrow
        CO = XO + 8 * MT * xrow
        gq = lane >> 2
        t = lane & 3
        xa = cuda.local.array(NA, uint32)
        xb = cuda.local.array(NA, uint32)
        acc = cuda.local.array(NC, float32)
        xr = cuda.local.array(NX, int32)  # where this lane's x row pair starts (-1: past the batch, stays zero)
        for i in range(NA):
            xa[i] = uint32(0)
            xb[i] = uint32(0)
        for mt in range(MT):
            xr[mt] = XO + (8 * mt + gq) * xrow + 8 * t if 16 * mt + gq < B else -1
        lb = uint32((g << 7) | (gq << 2))
        c = cuda.local.array(NU, int32)
        d = cuda.local.array(NU, int32)

        # The block walks row pairs bx, bx + gridDim.x, ... of its K-slice, staging that slice of x
        # once: a block per pair re-staged it for every 64 rows, B / 16 times the codes' bytes a pair.
        for p in range(cuda.blockIdx.x, (rbs + 1) // 2, cuda.gridDim.x):
            rb = p * 2 + g
            j1 = jend if rb < rbs else j0  # an odd row-block count leaves the last pair's g = 1 idle
            base = rb * nchunks * 128 + lane  # this lane's first word of chunk j at base + 128 j
            nk, jlast = prime(c, tiled, base, j0, j1, wg)  # this warp's first U chunks, before anything waits
            stage_codebooks(sm, cbt32, CO, p, rbs, tid, nt)
            if p == cuda.blockIdx.x:
                stage_x_pairs(sm, x32, XO, xrow, j0, jend, B, tid, nt)
            async_wait_all()
            cuda.syncthreads()  # also: the last pair's partials are read, so the table may be rebuilt
            build_table(sm, CO, tid, nt)
            cuda.syncthreads()
            for i in range(NC):
                acc[i] = float32(0.0)
            stream(c, d, tiled, base, j0, jlast, wg, nk, sm, lb, xr, xa, xb, acc)

            cuda.syncthreads()  # everyone is done with the table: the partials reuse its space
            # D fragment (mt, q): lane (g, t) holds batch 16 mt + g (+ 8 for i >= 2), rows 8q + 2t (+ 1 for odd i)
            for mt in range(MT):
                for q in range(4):
                    for i in range(4):
                        b = 16 * mt + gq + 8 * (i >> 1)
                        if b < B:
                            red[(warp * B + b) * 32 + 8 * q + 2 * t + (i & 1)] = acc[4 * (4 * mt + q) + i]
            cuda.syncthreads()
            finish(red, y, ws, counters, last, p, split, nsplit, n_out, tid, y)

    _kernel_cache[key] = kernel
    return kernel


TILE_UNROLL = 2
TILE_UNROLLS = (2, 4)  # the unrolls the tuner tries
# A warp's table: its row-block's 32 rows x 16 fp16 codebook entries, once for each of the 4 lanes
# that read a row, so that lane l's entries all lie in bank l (:func:`tile_kernel`).
TILE_TABLE_WORDS = 32 * 32
TILE_ALIGN = 2048  # the tables' shared-address alignment: a lookup's entry offset (bits 7-10) is or'd in


def tile_xrow(cps: int) -> int:
    """Words of one batch row of :func:`tile_kernel`'s x slice: 16 a chunk, padded so rows r and
    r + 1 start 64 bytes apart modulo 128: the 16-byte reads of a quarter-warp (rows g, g + 1, four
    lanes each) then fall in disjoint banks."""
    return cps * 16 + (16 if cps % 2 == 0 else 0)


# The tile kernel's launch bounds are the wide kernel's: 128 registers a thread up to batch 32 (ptxas on
# the CPU: no spills at unroll 2), ~245 above (64 accumulators a lane). (64 registers up to batch 8 and
# 80 up to 16 bought nothing on the H100 and spilled once the finish summed 8 outputs at a time.)
tile_min_blocks = wide_min_blocks


def tile_shared_bytes(B: int, warps: int, cps: int) -> int:
    """Dynamic shared memory of :func:`tile_kernel`: each warp's table and the x slice (batch rows
    padded to a multiple of 8, the mma's n-tile), after up to 2 KiB less 16 bytes of padding (the
    dynamic array starts 16-byte aligned)."""
    return 4 * (8 * ((B + 7) // 8) * tile_xrow(cps) + warps * TILE_TABLE_WORDS) + TILE_ALIGN - 16  # the pad that aligns them


def tile_kernel(B: int, warps: int, unroll: int = TILE_UNROLL):
    """4-bit (K = 16) fused kernel for batches of up to 64 rows (tuned from 8) on the tensor cores, with the weights as
    the mma's A operand (weight rows as M) and x as B (batch rows as N, 8 an n-tile), the way a GEMM
    tiles them.

    The wide kernel holds x as A, so its warps split a row-block's chunks, and the partials of
    every warp (B x 32 floats each) meet in shared memory a row pair: at batch 64 that costs more
    than the row pair's codes (NOTES "Wide v2"), and its 64 KiB pair table is rebuilt for every 64
    rows. Here each warp owns one row-block over the block's whole K-slice, so nothing meets in
    shared memory, and its table is the row-block's 32 codebooks (16 fp16 a row), copied, not
    built. A copy a lane: lane l = (g, t) reads only rows 8q + g, so word ((q >> 1) 16 + e) 32 + l
    holds entry e of rows 8q + g for q even (low half) and odd (high half), 4 KiB a warp. Every
    lookup of a warp then hits 32 distinct banks, one wavefront, where one copy of each row put
    rows g and g + 4 in the same 8 banks (two wavefronts; NOTES "Session 25"). A lookup is one
    code, not a pair: per chunk and warp 4 loads
    (:func:`fetch_row_words`: lane (g, t) gets word t of rows g, g + 8, g + 16, g + 24), 32 lookups
    (two a register of A: 16 rows x 16 k-slots an m-tile, two m-tiles a row-block), then per
    n-tile of 8 batch rows one 16-byte read of x and 4 mmas. Bytes 2h, 2h + 1 of word t feed k-step
    h: k-slots 2t, 2t + 1 (2t + 8, 2t + 9) are the chunk's columns 8t + 4h, + 1 (+ 2, + 3), so a
    lane's 16-byte read of x (columns 8t..8t+7 of batch row 8n + g) is B of both k-steps.

    Grid (ceil(rbs / warps / walk), ksplit): block bx walks groups of ``warps`` row-blocks bx,
    bx + gridDim.x, ... keeping its K-slice of x; K-slices meet in ``ws``, summed by the last block
    of a group (:func:`last_to_finish`). Arguments as :func:`wide_kernel`'s, except ``cb32``: the
    natural (out, 16) fp16 codebooks as int32 words. :func:`tile_shared_bytes` of shared memory.
    ``unroll``: chunks a warp uses in one turn while as many more are in flight.
    """
    key = ("tile", B, warps, unroll)
    if key in _kernel_cache:
        return _kernel_cache[key]
    check_wide_batch_kernel("tile", B, warps, unroll)
    NB = (B + 7) // 8  # n-tiles
    BP = 8 * NB
    U = unroll
    nt = warps * 32
    NU, NC = 4 * U, 8 * NB  # local array sizes: numba needs them as constants

    @cuda.jit(device=True, **INLINE)
    def nibble_at(cw, i):
        """Byte offset 128 x nibble i of ``cw`` (bits 7-10): entry e's word row in the lane's table column."""
        return ((cw << uint32(7 - 4 * i)) if i < 2 else (cw >> uint32(4 * i - 7))) & uint32(0x780)

    @cuda.jit(device=True, **INLINE)
    def look(tab, lb, q, cw, i):
        """The fp16 pair (C[nibble i], C[nibble i + 1]) of code word ``cw`` of row 8q + g (``lb``: the
        shared address of the lane's column, a word below 128 bytes past a 2 KiB-aligned table, so
        the offset is or'd in: one LOP3 an address; q's word half and 16-row block fold into the
        load's immediate)."""
        qo = uint32(2 * (q & 1) + 2048 * (q >> 1))
        lo = load_shared_u16(tab, (nibble_at(cw, i) | lb) + qo)
        hi = load_shared_u16(tab, (nibble_at(cw, i + 1) | lb) + qo)
        return prmt(lo, hi, 0x5410)

    @cuda.jit(device=True, **INLINE)
    def use_chunk(c, o, sm, lb, xo, rel, a, tab, acc):
        # rel: the chunk's index in the K-slice; xo[n]: this lane's x words of n-tile n; lb: the
        # byte of row g in this warp's table. a[8 mt + 4 h + r]: A register r of m-tile mt, k-step h.
        for q in range(4):  # row 8q + g: m-tile q >> 1, A row g (q even: a0, a2) or g + 8 (a1, a3)
            cw = uint32(c[o + q])
            for h in range(2):
                a[8 * (q >> 1) + 4 * h + (q & 1)] = look(tab, lb, q, cw, 4 * h)
                a[8 * (q >> 1) + 4 * h + 2 + (q & 1)] = look(tab, lb, q, cw, 4 * h + 2)
        for n in range(NB):
            b0, b1, b2, b3 = sload4(sm, xo[n] + rel * 16)  # B of k-step 0 (b0, b1) and 1 (b2, b3)
            for mt in range(2):
                i = 4 * (NB * mt + n)
                k = 8 * mt
                acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mma_m16n8k16(
                    a[k], a[k + 1], a[k + 2], a[k + 3], b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = mma_m16n8k16(
                    a[k + 4], a[k + 5], a[k + 6], a[k + 7], b2, b3, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])

    stream = pair_block_stream(fetch_row_words, use_chunk, U, 1)

    @cuda.jit(device=True, **INLINE)
    def get_rows(cbw, cb32, row, live, n_out):
        """The codebooks of rows ``row`` + 8k (k = 0..3) as cbw[8k..8k + 7], every load issued before
        any is used: put one row pair at a time, they waited four L2 round trips in the prologue."""
        zero = int32(0)
        for k in range(4):
            for w in range(0, 8, 4):
                i = 8 * k + w
                if live and row + 8 * k < n_out:
                    cbw[i], cbw[i + 1], cbw[i + 2], cbw[i + 3] = load16(cb32[row + 8 * k], w)
                else:
                    cbw[i], cbw[i + 1], cbw[i + 2], cbw[i + 3] = zero, zero, zero, zero

    @cuda.jit(device=True, **INLINE)
    def put_rows(sm, cbw, o):
        """Entries 0..15 of rows 16h + g and 16h + 8 + g (cbw's rows 2h, 2h + 1) as the low and high
        halves of words o + 512h, o + 512h + 32, ..."""
        for h in range(2):
            for w in range(8):  # word w holds entries 2w (low half) and 2w + 1
                lo = cbw[16 * h + w]
                hi = cbw[16 * h + 8 + w]
                sm[o + 512 * h + 64 * w] = prmt(lo, hi, 0x5410)
                sm[o + 512 * h + 64 * w + 32] = prmt(lo, hi, 0x7632)

    @cuda.jit(device=True, **INLINE)
    def put_d(y, ws, split, nsplit, n_out, r, b, d0, d1, d2, d3):
        """One D fragment's four sums (rows r, r + 8 x batch rows b, b + 1) to y, or with a K-split to ws."""
        for i in range(4):
            ri = r + uint32(8 * (i >> 1))
            bi = b + uint32(i & 1)
            v = d0 if i == 0 else d1 if i == 1 else d2 if i == 2 else d3
            if (BP == B or bi < uint32(B)) and ri < uint32(n_out):
                if nsplit == 1:
                    y[bi, ri] = v
                else:
                    ws[split, bi, ri] = v

    # Every fragment, written out as straight-line calls: NVVM leaves a loop over 16 fragments rolled
    # (batch 64), and acc, indexed by its counter, then lives in local memory (a 256-byte stack frame).
    src = "def put_all(y, ws, split, nsplit, n_out, r, b, acc):\n" + "".join(
        f"    put_d(y, ws, split, nsplit, n_out, r + uint32({16 * mt}), b + uint32({8 * n}), "
        f"acc[{i}], acc[{i + 1}], acc[{i + 2}], acc[{i + 3}])\n"
        for mt in range(2) for n in range(NB) for i in [4 * (NB * mt + n)])
    env = {"put_d": put_d, "uint32": uint32}
    exec(src, env)
    put_all = cuda.jit(device=True, **INLINE)(env["put_all"])

    @cuda.jit(**({} if SIM else {"launch_bounds": (nt, tile_min_blocks(B, warps))}))
    def kernel(x32, tiled, cb32, y, ws, counters, n_out, rbs, nchunks, cps):
        sm = cuda.shared.array(0, uint32)  # x slice | the warps' tables
        tab = cuda.shared.array(0, uint16)  # the same memory, for 2-byte lookups
        last = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        gq = lane >> 2
        t = lane & 3
        split = cuda.blockIdx.y
        nsplit = cuda.gridDim.y
        j0 = split * cps
        jend = min(j0 + cps, nchunks)
        xrow = cps * 16 + (16 if cps % 2 == 0 else 0)  # tile_xrow
        sbase = shared_address(sm)
        pad = ((uint32(TILE_ALIGN) - (sbase & uint32(TILE_ALIGN - 1))) & uint32(TILE_ALIGN - 1)) >> uint32(2)
        TO = pad + warp * TILE_TABLE_WORDS  # this warp's table, at a 2 KiB-aligned shared address
        XO = pad + warps * TILE_TABLE_WORDS  # the x slice
        lb = sbase + uint32(TO * 4 + lane * 4)
        xo = cuda.local.array(NB, int32)
        for n in range(NB):
            xo[n] = XO + (8 * n + gq) * xrow + 4 * t
        a = cuda.local.array(16, uint32)
        acc = cuda.local.array(NC, float32)
        c = cuda.local.array(NU, int32)
        d = cuda.local.array(NU, int32)  # the second register set (pair_block_stream)
        cbw = cuda.local.array(32, int32)  # the row-block's codebook words, on their way to the table

        for p in range(cuda.blockIdx.x, (rbs + warps - 1) // warps, cuda.gridDim.x):
            rb = p * warps + warp
            j1 = jend if rb < rbs else j0  # a last group of fewer row-blocks leaves warps idle
            base = rb * nchunks * 128 + lane
            nk = j1 - j0
            jlast = j1 - 1
            if nk > 0:  # start streaming before anything waits (chunks past the slice: clamped, unused)
                for u in range(U):
                    fetch_row_words(c, 4 * u, tiled, base, min(j0 + u, jlast))
            get_rows(cbw, cb32, rb * 32 + gq, rb < rbs, n_out)  # in flight with the codes and x
            if p == cuda.blockIdx.x:
                stage_x_rows(sm, x32, XO, xrow, j0, jend, B, BP, tid, nt)
            cuda.syncthreads()  # the last group's tables are read
            put_rows(sm, cbw, TO + lane)
            cuda.syncthreads()  # the x slice and the tables are in place
            for i in range(NC):
                acc[i] = float32(0.0)
            stream(c, d, tiled, base, j0, jlast, 0, nk, sm, lb, xo, a, tab, acc)

            # D fragment (mt, n): lane (g, t) holds rows 16 mt + g, + 8 and batch rows 8n + 2t, + 1.
            if rb < rbs:
                put_all(y, ws, split, nsplit, n_out, uint32(rb * 32 + gq), uint32(2 * t), acc)
            if nsplit > 1 and last_to_finish(counters, p, nsplit, last, tid):
                r = p * nt + tid  # the group's nt rows, a thread each, 8 batch rows at a time
                if r < n_out:
                    for b in range(0, BP, 8):
                        v = sum_splits8(ws, nsplit, b, B - 1, r)
                        for k in range(8):
                            if BP == B or b + k < B:
                                y[b + k, r] = v[k]

    _kernel_cache[key] = kernel
    return kernel


def naive_kernel(K: int, B: int):
    """One thread a row, natural layout, byte loads, codebook and x from global memory.

    Kept as the book's negative result: it reads the same bytes, but uncoalesced and narrow.
    """
    key = ("naive", K, B)
    if key in _kernel_cache:
        return _kernel_cache[key]
    code_at, _, _ = _make_device_functions(K, B)

    @cuda.jit
    def kernel(x, codes, cb, y, n_out, n_in):
        row = cuda.grid(1)
        if row >= n_out:
            return
        for b in range(B):
            s = float32(0.0)
            for i in range(n_in):
                s += float32(cb[row, code_at(codes[row], i)]) * float32(x[b, i])
            y[b, row] = s

    _kernel_cache[key] = kernel
    return kernel


@cuda.jit
def stream_kernel(a, out, n16):
    """The floor a GEMV over ``a`` can reach: read its ``n16`` 16-byte pieces (int32 words, grid-stride,
    four pieces in flight a thread) and do nothing else. Thread t writes the XOR of the words it
    read to ``out[t]``, so nothing is optimised away and the XOR of ``out`` is the XOR of ``a``."""
    t = cuda.grid(1)
    nt = cuda.gridsize(1)
    acc = int32(0)
    i = t
    while i + 3 * nt < n16:
        a0, a1, a2, a3 = load16(a, 4 * i)
        b0, b1, b2, b3 = load16(a, 4 * (i + nt))
        c0, c1, c2, c3 = load16(a, 4 * (i + 2 * nt))
        d0, d1, d2, d3 = load16(a, 4 * (i + 3 * nt))
        acc ^= a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1 ^ b2 ^ b3 ^ c0 ^ c1 ^ c2 ^ c3 ^ d0 ^ d1 ^ d2 ^ d3
        i += 4 * nt
    while i < n16:
        a0, a1, a2, a3 = load16(a, 4 * i)
        acc ^= a0 ^ a1 ^ a2 ^ a3
        i += nt
    out[t] = acc


@cuda.jit
def empty_kernel(out):
    """A launch that does no work (one thread writes one word): the fixed cost of a graph node."""
    if cuda.grid(1) == 0:
        out[0] = 0


def dequant_kernel(K: int, tiled: bool = True):
    """Codes + codebooks -> fp16 weight (natural layout), for batches where cuBLAS beats the fused kernel
    (prefill, and uint8 codes above the fused kernels' batches).

    A thread 8 weights, 16 bytes of output: a code word (K = 16) or two (uint8), a lookup a weight in
    the row's codebook (the lanes of a warp share a row, so its few lines stay in L1), the weights
    paired into words and written as one 16-byte store, so a warp's stores are 512 contiguous bytes.
    Arguments: the tiled codes' int32 words (:func:`trapetum.codebook.tile`), or with ``tiled=False``
    the slab's natural codes as int32 words (rows, bytes / 4); the slab's codebooks' fp16 bits as
    int16 (rows, K); the output's int32 words (rows, in / 2); the unit count (rows x in / 8), units
    a row, the slab's first row and the chunks a row.
    One byte a thread, with 2-byte stores and a 64-bit division a byte, took 1.7-1.9x as long at
    4096 x 14336; 16 code bytes a thread, whose four 16-byte stores a warp spread over 2 KiB,
    1.1-1.5x (NOTES "Session 26").
    """
    key = ("dequant", K, tiled)
    if key in _kernel_cache:
        return _kernel_cache[key]
    FOUR = K == 16
    TILED = tiled
    mask = uint32(0xFFFF)

    @cuda.jit(device=True, **INLINE)
    def code_word(codes, row, r, nchunks, k):
        """Code word k of the slab's row ``row`` (absolute row r): in the tiled layout word k % 4 of
        chunk k / 4 at ((rb * nchunks + j) * 32 + lane) * 4 + q; else codes[row, k]."""
        if TILED:
            return uint32(codes[((r >> uint32(5)) * uint32(nchunks) * uint32(32) + (r & uint32(31))) * uint32(4)
                                + (k >> uint32(2)) * uint32(128) + (k & uint32(3))])
        return uint32(codes[row, k])

    @cuda.jit(device=True, **INLINE)
    def pair(cbr, lo, hi):
        """The word of two weights: entry ``lo`` in the low half, ``hi`` in the high half."""
        return int32((uint32(cbr[lo]) & mask) | ((uint32(cbr[hi]) & mask) << uint32(16)))

    @cuda.jit
    def kernel(codes, cb16, W32, n_units, upr, r0, nchunks):
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for i in range(uint32(start), uint32(n_units), uint32(stride)):
            row = i // uint32(upr)  # 32-bit division: numba's int64 one is a long emulated sequence
            u = i - row * uint32(upr)
            cbr = cb16[row]
            r = row + uint32(r0)
            if FOUR:  # code word u; byte b: weights 2b (low nibble) and 2b + 1
                w = code_word(codes, row, r, nchunks, u)
                store16(W32[row], u * uint32(4),
                        pair(cbr, w & uint32(15), (w >> uint32(4)) & uint32(15)),
                        pair(cbr, (w >> uint32(8)) & uint32(15), (w >> uint32(12)) & uint32(15)),
                        pair(cbr, (w >> uint32(16)) & uint32(15), (w >> uint32(20)) & uint32(15)),
                        pair(cbr, (w >> uint32(24)) & uint32(15), w >> uint32(28)))
            else:  # a byte a weight: code words 2u, 2u + 1
                a = code_word(codes, row, r, nchunks, u * uint32(2))
                b = code_word(codes, row, r, nchunks, u * uint32(2) + uint32(1))
                store16(W32[row], u * uint32(4),
                        pair(cbr, a & uint32(255), (a >> uint32(8)) & uint32(255)),
                        pair(cbr, (a >> uint32(16)) & uint32(255), a >> uint32(24)),
                        pair(cbr, b & uint32(255), (b >> uint32(8)) & uint32(255)),
                        pair(cbr, (b >> uint32(16)) & uint32(255), b >> uint32(24)))

    _kernel_cache[key] = kernel
    return kernel


# -- host side -------------------------------------------------------------------------------
def require_gpu() -> None:
    if SIM:
        return
    if not torch.cuda.is_available() or not cuda.is_available():
        raise NoGPUError(
            "trapetum's GEMV kernels need a CUDA GPU and none is visible "
            "(for the CPU simulator set NUMBA_ENABLE_CUDASIM=1 before importing trapetum)"
        )


def _as_kernel_array(t: torch.Tensor):
    # The simulator runs on numpy arrays; a real GPU takes torch memory zero-copy.
    if SIM:
        return t.detach().cpu().numpy()
    return cuda.as_cuda_array(t.detach())


def check_activation(x: torch.Tensor, n_in: int, device: torch.device, max_batch: int = MAX_FUSED_BATCH) -> torch.Tensor:
    """The checks every fused kernel needs of x; returns it as (batch, n_in)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float16:
        raise TypeError(f"x must be float16, got {x.dtype}")
    if x.device != device and not (SIM and x.device.type == "cpu"):
        raise ValueError(f"x is on {x.device} but the weight is on {device}")
    if x.dim() not in (1, 2) or x.shape[-1] != n_in:
        raise ValueError(f"x must have shape ({n_in},) or (batch, {n_in}), got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous() first)")
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned (the kernels read it 16 bytes at a time); pass a fresh tensor, not an offset view")
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    if not 1 <= x2.shape[0] <= max_batch:
        raise ValueError(f"fused kernels take batch 1..{max_batch}, got {x2.shape[0]} (use QLinear's dispatch)")
    return x2


def check_output(out: torch.Tensor, batch: int, n_out: int, device) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != (batch, n_out) or out.dtype != torch.float16 or not out.is_contiguous():
        got = f"{str(out.dtype).removeprefix('torch.')} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        hint = " (not contiguous)" if isinstance(out, torch.Tensor) and not out.is_contiguous() else ""
        raise ValueError(f"out must be a contiguous float16 tensor of shape {(batch, n_out)}, got {got}{hint}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, the kernel runs on {device}")


def max_shared_bytes(device) -> int:
    """Shared memory a block may opt in to (227 KiB on an H100); the 48 KiB default in the simulator,
    or where raising a numba kernel's limit does not work here (see :func:`shared_optin_works`)."""
    if SIM or not torch.cuda.is_available() or not shared_optin_works(device):
        return SMEM_BUDGET
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", SMEM_BUDGET))


def tuning_enabled(family: str) -> bool:
    """False where TRAPETUM_NO_TUNE (a comma-separated list, or "all") names this kernel family:
    its planner's heuristic plan is used instead of timing every candidate (each one compiles)."""
    off = {f.strip() for f in os.environ.get("TRAPETUM_NO_TUNE", "").split(",") if f.strip()}
    return not ({family, "all"} & off)


_OPTIN: dict = {}


def shared_optin_works(device) -> bool:
    """Whether a numba kernel raised by :func:`with_shared_limit` really launches with 64 KiB of
    dynamic shared memory on this device (tried once, on a tiny kernel; a failure is reported and
    the planners then keep every kernel under 48 KiB)."""
    dev = torch.device(device)
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _OPTIN:
        import warnings

        @cuda.jit
        def probe(out):
            buf = cuda.shared.array(0, float32)
            i = cuda.threadIdx.x
            buf[i * 512] = float32(i)
            cuda.syncthreads()
            out[i] = buf[i * 512]

        n = 64 * 1024
        out = torch.zeros(32, dtype=torch.float32, device=dev)
        args = (_as_kernel_array(out),)
        try:
            k = with_shared_limit(probe, args, n)
            k[1, 32, cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream), n](*args)
            torch.cuda.synchronize(dev)
            _OPTIN[key] = bool((out == torch.arange(32, device=dev, dtype=torch.float32)).all())
        except Exception as e:  # noqa: BLE001 - any failure means: stay under 48 KiB
            warnings.warn(f"raising a numba kernel's shared-memory limit failed here ({type(e).__name__}: {e}); "
                          "kernels stay under 48 KiB of shared memory", RuntimeWarning, stacklevel=2)
            _OPTIN[key] = False
    return _OPTIN[key]


_RAISED: dict = {}  # id(specialized dispatcher) -> the limit it was raised to


PORTABLE_CLUSTER = 8  # the most blocks a thread block cluster holds without the kernel's opt-in


def with_shared_limit(dispatcher, args, nbytes: int, cluster: int = 0):
    """A dispatcher specialized to `args` whose kernel may use `nbytes` of dynamic shared memory
    (and, for ``cluster`` > 8 blocks a cluster, launch as a non-portable cluster).

    numba never opts a kernel in to more than the 48 KiB default (numba-cuda issue #94), so
    a launch asking for more fails with "invalid argument". This compiles the kernel for these
    argument types and raises the kernel's limit through the driver, as cudaFuncSetAttribute
    would. A cluster of 9 to 16 blocks (sm_90) needs the kernel's opt-in the same way. Call it
    once, outside any CUDA-graph capture.
    """
    # Static shared memory counts against the same 48 KiB default: a 48 KiB table beside a 4-byte
    # static flag failed ("invalid argument") until this raised every limit above zero.
    if SIM or (nbytes <= 0 and cluster <= PORTABLE_CLUSTER):
        return dispatcher
    from numba.cuda.cudadrv.driver import binding, driver

    spec = dispatcher.specialize(*args)
    attrs = []
    if nbytes > 0:
        # The limit belongs to the kernel, shared by every launch of it: never lower it, or a launcher
        # bound earlier with more shared memory fails ("invalid argument").
        nbytes = max(int(nbytes), _RAISED.get(id(spec), 0))
        _RAISED[id(spec)] = nbytes
        attrs.append((binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes))
    if cluster > PORTABLE_CLUSTER:
        attrs.append((binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    for k in spec.overloads.values():
        f = k._codelibrary.get_cufunc()
        err, fn = binding.cuKernelGetFunction(f.handle)
        for attr, value in attrs:
            driver.cuKernelSetAttribute(attr, value, f.handle, f.device.id)
            # and on this context's function of that kernel, which is what a launch runs
            if int(err) == 0:
                binding.cuFuncSetAttribute(fn, attr, value)
    return spec


def kernel_device(device, who: str) -> torch.device:
    """The device a fused kernel runs on: a CUDA device with its index (the CPU under the simulator);
    raises NoGPUError without a GPU and a clear ValueError for a non-CUDA device."""
    require_gpu()
    if device is None:
        device = "cpu" if SIM else "cuda"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if not SIM and dev.type != "cuda":
        raise ValueError(f"{who} runs on a CUDA device, got {dev}")
    return dev


def tuning_inputs(tiled: torch.Tensor, weight_bytes: int, n_in: int, n_out: int, B: int, device):
    """What a tuner times its candidates on: copies of the kernel's tiled codes that together
    exceed the L2 (kernel views of each), and fp16 x (as int32 words) and y buffers.
    Returns (owners, views, xa, ya); keep ``owners`` alive while the views are used."""
    from .bench import copies_for  # bench imports this module

    copies = [tiled] + [tiled.clone() for _ in range(copies_for(weight_bytes) - 1)]
    x = torch.randn(B, n_in, device=device, dtype=torch.float16)
    y = torch.empty(B, n_out, device=device, dtype=torch.float16)
    return (copies, x, y), [_as_kernel_array(c) for c in copies], _as_kernel_array(x.view(torch.int32)), _as_kernel_array(y)


def clusters_available(device) -> bool:
    """Whether kernels on ``device`` can run as thread block clusters: compute capability 9.0 or later
    (the simulator runs one block at a time, so never there)."""
    if SIM or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def sm_count(device) -> int:
    if SIM or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


STAGES = (2, 3, 4)  # pipeline depths the tuner tries
LARGE_BLOCK_WARPS = (16, 32)  # the larger blocks the tuner tries for batch-1 layers (4-bit since session 18, uint8 since 28)


@dataclass
class LaunchPlan:
    warps: int
    ksplit: int
    cps: int  # chunks a K-slice
    shared_bytes: int  # dynamic shared memory
    RB: int = 1  # row-blocks a thread block
    stages: int = 2  # chunks of each row-block a warp holds: one in use, stages - 1 in flight
    kernel: str = "lut"  # "lut" (lut_kernel), "mma" (mma_kernel), "dual" (dual_kernel), "wide" (wide_kernel) or "tile" (tile_kernel):
    # the other four 4-bit, with their own shared-memory layouts (RB 2, or a row-block a warp for tile);
    # their ``stages`` is the chunks a warp uses in one turn, with as many more in flight
    walk: int = 1  # groups of RB row-blocks a block walks (wide_kernel and tile_kernel only)

    def label(self) -> str:
        """The plan in a few words (the fused step's and the bench's record of it); a kernel other than
        the lut kernel is named first."""
        head = "" if self.kernel == "lut" else f"{self.kernel}: "
        return f"{head}{self.warps} warps, RB {self.RB}, K-split {self.ksplit}, stages {self.stages}"

    def grid(self, rbs: int) -> tuple[int, int]:
        """(blocks along the rows, K-slices) for a layer of ``rbs`` row-blocks."""
        return -(-(-(-rbs // self.RB)) // self.walk), self.ksplit


def plan_launch(n_out: int, nchunks: int, K: int, B: int, sms: int, warps: int | None = None,
                RB: int | None = None, ksplit: int | None = None, stages: int = 2) -> LaunchPlan:
    """Grid shape for one layer: row-blocks a block (RB), warps a block, K-slices (ksplit).

    Without overrides: the widest RB allowed, 8 warps when shared memory allows, and a K-split
    that gives about two blocks an SM while leaving every warp at least 4 chunks to stream.
    On a GPU, :meth:`LutGemv.tune` times the candidates instead.
    """
    cpb = CHUNK_BYTES * (2 if K == 16 else 1)
    rbs = -(-n_out // ROW_BLOCK)
    RB = RB or row_blocks_per_block(K, B)
    for w in ([warps] if warps else [8, 4]):  # fewer warps when the LUT and batch leave no room
        static = lut_table_words(K, RB, B) * 4 + w * RB * B * 32 * 4 + 16
        x_budget = SMEM_BUDGET - static
        if x_budget >= B * cpb * 4 * w:
            warps = w
            break
    else:
        raise ValueError(f"K={K}, batch {B}, RB={RB}: the block's shared memory does not fit {SMEM_BUDGET} bytes")
    cps_max = x_budget // (B * cpb * 4)
    min_split = math.ceil(nchunks / cps_max)
    if ksplit is None:
        want = math.ceil(2 * sms / -(-rbs // RB))
        ksplit = max(min_split, min(want, max(1, nchunks // (4 * warps))), 1)
    elif ksplit < min_split:
        raise ValueError(f"ksplit={ksplit} leaves more of x than shared memory holds; at least {min_split}")
    cps = math.ceil(nchunks / ksplit)
    ksplit = math.ceil(nchunks / cps)
    assert static + B * cps * cpb * 4 <= SMEM_BUDGET
    return LaunchPlan(warps, ksplit, cps, B * cps * cpb * 4, RB, stages)


OPTIN_SIM = 227 * 1024  # the simulator plans as if it had an H100's opt-in shared memory


def _min_split(kind, smem, max_batch, unrolls, nchunks, B, budget, warps, stages) -> int:
    """A tensor-core plan's checks (warps, batch, unroll, shared memory ``smem(B, warps, cps)`` within
    ``budget``), then the fewest K-slices whose slice of x fits."""
    if warps not in (4, 8, 16):
        raise ValueError(f"the {kind} kernel takes 4, 8 or 16 warps, got {warps}")
    if not 1 <= B <= max_batch:
        raise ValueError(f"the {kind} kernel takes batch 1..{max_batch}, got {B}")
    if stages not in unrolls:
        raise ValueError(f"the {kind} kernel unrolls {', '.join(map(str, unrolls))} chunks a turn, got {stages}")
    if smem(B, warps, 1) > budget:
        raise ValueError(f"the {kind} kernel's tables and batch {B} do not fit {budget} bytes of shared memory")
    cps_max = 1
    while cps_max < nchunks and smem(B, warps, cps_max + 1) <= budget:
        cps_max += 1
    return -(-nchunks // cps_max)


def _plan_pair_blocks(kind, smem, max_batch, unrolls, heuristic_unroll, n_out, nchunks, B, sms, budget, warps, ksplit, stages):
    """The grid of a two-row-block tensor-core kernel (``kind``, shared memory ``smem(B, warps, cps)``).

    Without overrides: 8 warps (4 a row-block) unless the layer is too small to give every SM a
    block that way, then the smallest K-split giving about two waves of blocks, as long as every
    warp keeps two full pipeline turns: the 64 KiB table build has to be paid back by the stream."""
    rbs = -(-n_out // ROW_BLOCK)
    nbx = -(-rbs // 2)
    if warps is None:
        warps = 8 if nbx * max(1, nchunks // (4 * 2 * heuristic_unroll)) >= sms else 4
    min_split = _min_split(kind, smem, max_batch, unrolls, nchunks, B, budget, warps, stages)
    if ksplit is None:
        max_split = max(min_split, nchunks // (warps // 2 * 2 * stages))
        ksplit = min_split
        while ksplit < max_split:
            cps = -(-nchunks // ksplit)
            # blocks an SM by shared memory and threads; registers are not counted (mma_min_blocks gives two 16-warp blocks up to batch 4)
            occ = max(1, min(2048 // (warps * 32), (228 * 1024) // (smem(B, warps, cps) + 1024)))
            if nbx * -(-nchunks // cps) >= 2 * occ * sms:
                break
            ksplit += 1
    elif ksplit < min_split:
        raise ValueError(f"ksplit={ksplit} leaves more of x than shared memory holds; at least {min_split}")
    cps = -(-nchunks // min(ksplit, nchunks))
    return LaunchPlan(warps, -(-nchunks // cps), cps, smem(B, warps, cps), RB=2, stages=stages, kernel=kind)


def plan_mma(n_out: int, nchunks: int, B: int, sms: int, budget: int = OPTIN_SIM, warps: int | None = None,
             ksplit: int | None = None, stages: int = MMA_UNROLL) -> LaunchPlan:
    """Grid of :func:`mma_kernel` for one 4-bit layer (kernels/harness.cuh's plan_mma), see
    :func:`_plan_pair_blocks`. ``budget``: the shared memory a block may opt in to. ValueError
    where the plan cannot launch."""
    return _plan_pair_blocks("mma", mma_shared_bytes, MAX_FUSED_BATCH, (2, 4, 8), MMA_UNROLL,
                             n_out, nchunks, B, sms, budget, warps, ksplit, stages)


def plan_dual(n_out: int, nchunks: int, B: int, sms: int, budget: int = OPTIN_SIM, warps: int | None = None,
              ksplit: int | None = None, stages: int = DUAL_UNROLL) -> LaunchPlan:
    """Grid of :func:`dual_kernel` for one 4-bit layer: :func:`plan_mma`'s blocks (two row-blocks, the
    same table) with the dual kernel's shared memory. ``stages``: its unroll."""
    return _plan_pair_blocks("dual", dual_shared_bytes, MAX_FUSED_BATCH, (1, 2, 4), DUAL_UNROLL,
                             n_out, nchunks, B, sms, budget, warps, ksplit, stages)


def plan_wide(n_out: int, nchunks: int, B: int, sms: int, budget: int = OPTIN_SIM, warps: int | None = None,
              ksplit: int | None = None, stages: int = WIDE_UNROLL, walk: int | str = 1) -> LaunchPlan:
    """Grid of :func:`wide_kernel` for one 4-bit layer, chosen as :func:`plan_mma` chooses its own
    (the same two-row-block blocks), with the wide kernel's shared memory. ``stages``: its unroll.
    ``walk``: row pairs a block walks, or ``"wave"``: as many as make the grid one wave of the
    blocks an SM holds (:func:`wide_blocks_per_sm`)."""
    p = _plan_pair_blocks("wide", wide_shared_bytes, MAX_WIDE_BATCH, (1, 2, 4), stages,
                          n_out, nchunks, B, sms, budget, warps, ksplit, stages)
    if p.warps * B * 32 > MMA_TABLE_WORDS:
        raise ValueError(f"the wide kernel's partials ({p.warps} warps x batch {B}) must fit its 64 KiB table")
    npairs = -(-(-(-n_out // ROW_BLOCK)) // 2)
    p.walk = resolve_walk(walk, npairs, p.ksplit, wide_blocks_per_sm(B, p.warps, p.shared_bytes), sms)
    return p


def plan_tile(n_out: int, nchunks: int, B: int, sms: int, budget: int = OPTIN_SIM, warps: int | None = None,
              ksplit: int | None = None, stages: int = TILE_UNROLL, walk: int | str = 1) -> LaunchPlan:
    """Grid of :func:`tile_kernel` for one 4-bit layer: groups of ``warps`` row-blocks (default 8,
    or 4 where 8 leave SMs without a group) x K-slices. Without a ``ksplit``: the smallest that the
    x slice allows and that fills every SM's blocks, as long as every warp keeps two full pipeline
    turns. ``walk`` as :func:`plan_wide`'s (groups a block walks, or ``"wave"``). ValueError where
    the plan cannot launch."""
    rbs = -(-n_out // ROW_BLOCK)
    if warps is None:
        warps = 8 if -(-rbs // 8) >= sms // 2 else 4
    min_split = _min_split("tile", tile_shared_bytes, MAX_WIDE_BATCH, (1, 2, 4), nchunks, B, budget, warps, stages)
    groups = -(-rbs // warps)
    if ksplit is None:
        ksplit = min_split
        while ksplit < max(min_split, nchunks // (2 * stages)):
            cps = -(-nchunks // ksplit)
            if groups * -(-nchunks // cps) >= wide_blocks_per_sm(B, warps, tile_shared_bytes(B, warps, cps)) * sms:
                break
            ksplit += 1
    elif ksplit < min_split:
        raise ValueError(f"ksplit={ksplit} leaves more of x than shared memory holds; at least {min_split}")
    cps = -(-nchunks // min(ksplit, nchunks))
    ksplit = -(-nchunks // cps)
    smem = tile_shared_bytes(B, warps, cps)
    walk = resolve_walk(walk, groups, ksplit, wide_blocks_per_sm(B, warps, smem), sms)
    return LaunchPlan(warps, ksplit, cps, smem, RB=warps, stages=stages, kernel="tile", walk=walk)


def candidate_plans(n_out: int, nchunks: int, K: int, B: int, sms: int, mma_budget: int = 0) -> list[LaunchPlan]:
    """The plans the tuner times: every allowed RB x a ladder of K-splits, 8 warps where they fit;
    for 4-bit codes also the tensor-core kernels' warps x K-splits, where ``mma_budget`` bytes of
    shared memory hold their tables: mma_kernel up to batch 16, dual_kernel up to 8, wide_kernel from batch 4 to 16 and
    tile_kernel from 4 to 64."""
    seen, out = set(), []
    rb_max = row_blocks_per_block(K, B) if B <= MAX_FUSED_BATCH else 0
    for RB in (1, 2, 4):
        if RB > rb_max:
            continue
        # (warps, K-split, stages); warps None: 8 where they fit. Batch-1 layers also as 16 or 32
        # warps a block over whole rows (K-split 1 or 2): at 4096 x 4096 and 4096 x 14336 they beat the
        # 8-warp 4-bit plans by 5-8 % (NOTES, session 18); uint8: NOTES, session 28.
        options = list(itertools.product(LARGE_BLOCK_WARPS, (1, 2), (2, 3))) if B == 1 and RB <= 2 else []
        options += list(itertools.product((None,), (1, 2, 3, 4, 6, 8, 12, 16, None), STAGES))
        for w, ks, st in options:
            try:
                p = plan_launch(n_out, nchunks, K, B, sms, warps=w, RB=RB, ksplit=ks, stages=st)
            except ValueError:
                continue
            key = (p.RB, p.warps, p.ksplit, p.stages)
            # A warp that streams fewer chunks than it holds in flight only pays for the ring.
            if key not in seen and p.cps >= max(2, p.stages) * p.warps:
                seen.add(key)
                out.append(p)
    if K == 16 and mma_budget:
        # unroll 8 (the plans' other option) never won on the H100: left out, as every candidate compiles
        for w, ks, st in itertools.product((4, 8, 16), (1, 2, 3, 4, 6, 8, 12, 16, None), (MMA_UNROLL,) if B <= MAX_FUSED_BATCH else ()):
            try:
                p = plan_mma(n_out, nchunks, B, sms, mma_budget, warps=w, ksplit=ks, stages=st)
            except ValueError:
                continue
            key = ("mma", p.warps, p.ksplit, p.stages)
            if key not in seen and p.cps >= (p.warps // 2) * p.stages:  # every warp uses its pipeline
                seen.add(key)
                out.append(p)
        # dual: batch 1..8 (an mma a step for 2 batches), unroll 1 or 2 (4 spills); every warp streams both row-blocks
        for w, ks, st in itertools.product((4, 8, 16), (1, 2, 3, 4, 6, 8, 12, 16, None), (1, DUAL_UNROLL) if B <= DUAL_MAX_TUNED else ()):
            try:
                p = plan_dual(n_out, nchunks, B, sms, mma_budget, warps=w, ksplit=ks, stages=st)
            except ValueError:
                continue
            key = ("dual", p.warps, p.ksplit, p.stages)
            if key not in seen and p.cps >= p.warps * p.stages:  # every warp uses its pipeline
                seen.add(key)
                out.append(p)
        # wide: batch 4..16, 8 or 16 warps and chunks in flight up to 4 (a warp holding one or two
        # waited on every fetch: probe at 4096 x 14336, NOTES "wide v1"), each also as one wave of blocks
        # walking the row pairs (the same compiled kernel). Above batch 16 the tile kernel takes over:
        # 1.7-2.1x faster at 32 and 64 (NOTES "Session 23").
        for w, ks, st, walk in itertools.product((8, 16), (1, 2, 3, 4, 6, 8, 12, 16, None), (1, 2, 4) if 4 <= B <= MAX_FUSED_BATCH else (), (1, "wave")):
            try:
                p = plan_wide(n_out, nchunks, B, sms, mma_budget, warps=w, ksplit=ks, stages=st, walk=walk)
            except ValueError:
                continue
            key = ("wide", p.warps, p.ksplit, p.stages, p.walk)
            if key not in seen and p.cps >= (p.warps // 2) * p.stages:
                seen.add(key)
                out.append(p)
        # tile: from batch 4 (its n-tile of 8 rows padded: batch 8 took 20.6 us at 4096 x 14336 on the H100,
        # the mma kernel's batch 4 23.6; NOTES "Session 33"), alone above 16; 8 or 16 warps up to batch 32,
        # 4 or 8 above; each also as one wave of walking blocks (batch 64's fastest plan walks 2 groups)
        tile = ((8, 16), TILE_UNROLLS) if B <= 32 else ((4, 8), (1, 2))
        for w, ks, st, walk in itertools.product(tile[0], (2, 4, 8, None), tile[1] if B >= 4 else (), (1, "wave")):
            try:
                p = plan_tile(n_out, nchunks, B, sms, mma_budget, warps=w, ksplit=ks, stages=st, walk=walk)
            except ValueError:
                continue
            key = ("tile", p.warps, p.ksplit, p.stages, p.walk)
            if key not in seen and p.cps >= 2 * p.stages:
                seen.add(key)
                out.append(p)
    if not out:
        out.append(plan_launch(n_out, nchunks, K, B, sms) if B <= MAX_FUSED_BATCH else plan_tile(n_out, nchunks, B, sms, mma_budget))
    return out


_TUNED = PlanCache("lut", LaunchPlan)
TC_KERNELS = ("mma", "dual", "wide", "tile")  # the 4-bit tensor-core kernels: own shared-memory layouts, opt-in limits
FUSED_KERNELS = ("lut", "dual")  # the kernels that take the decode step's fused operations
# The LutGemv kernels a launcher bound after a kernel launches programmatically (bind's after_kernel).
# Not the lut kernel: it made a 7B 4-bit token 6 % slower on the H200 that way, 2 % releasing only at
# its exit (NOTES "Session 50"); its release after the main loop still lets the launch after it
# (attention, greedy) start early.
PROGRAMMATIC_KERNELS = ("dual",)


class LutGemv:
    """A codebook weight prepared for the fused kernels on one device: ``y = gemv(x)``.

    ``variant``: "lut" (16-byte loads, the product), "lut32" (same kernel, 4-byte loads: the
    ablation), "naive" (one thread a row, natural layout: the negative result).
    ``plan``: optional overrides for :func:`plan_launch` (keys RB, ksplit, warps, stages), or with
    ``kernel="mma"`` / ``"dual"`` / ``"wide"`` / ``"tile"`` for :func:`plan_mma` / :func:`plan_dual` / :func:`plan_wide` / :func:`plan_tile`
    (keys warps, ksplit, stages, and walk for the last two; 4-bit only); otherwise the plan is tuned on a GPU (``tune=True``: the tensor-core kernels are
    among the 4-bit candidates) or taken from the heuristic.
    ``keep_natural=False``: hold the codes only in the kernel's tiled layout (half the memory of
    keeping both); :attr:`ct` then rebuilds the natural layout on demand (a copy).
    ``kernels``: the kernel families the "lut" variant may plan with: "lut" (fp32 table, FMA) and,
    for 4-bit codes, "mma" (pair table, tensor cores, batch 1..16), "dual" (the same table, the weights
    as the mma's A operand, batch 1..16; tuned up to batch 8), "wide" (the same table with x
    as the mma's A operand, batch 4..64) and "tile" (the weights as the mma's A operand, batch
    1..64; tuned from batch 4); the default tunes over all. :attr:`max_batch` is 64 where "wide" or "tile" may run,
    else 16.
    """

    FAMILIES = ("lut", "mma", "dual", "wide", "tile")

    VARIANTS = ("lut", "lut32", "naive")

    def __init__(self, ct: CodebookTensor, device=None, variant: str = "lut", plan: dict | None = None, tune: bool = True,
                 keep_natural: bool = True, kernels: tuple[str, ...] = FAMILIES):
        if variant not in self.VARIANTS:
            raise ValueError(f"unknown kernel variant {variant!r}; choose one of {self.VARIANTS}")
        kernels = tuple(kernels)
        if not kernels or set(kernels) - set(self.FAMILIES):
            raise ValueError(f"kernels must name some of {self.FAMILIES}, got {kernels}")
        if "lut" not in kernels and (ct.K != 16 or variant != "lut"):
            raise ValueError(f"the tensor-core kernels take 4-bit codes (K=16) in the 'lut' variant, not K={ct.K} / {variant!r}")
        self.kernels = kernels
        self.device = kernel_device(device, "LutGemv")
        ct.validate()
        ct = ct.to(self.device)
        self.K, self.n_in, self.n_out = ct.K, ct.in_features, ct.out_features
        self.variant = variant
        self.fixed_plan = plan
        self.tune_on_gpu = tune and not SIM and tuning_enabled("lut")
        self.weight_bytes = ct.nbytes
        self._ncode_bytes = ct.codes.shape[1]
        self.nchunks = self._ncode_bytes // CHUNK_BYTES
        self.rbs = -(-self.n_out // ROW_BLOCK)
        self._codebook = ct.codebook
        self._ct = ct if keep_natural or variant == "naive" else None
        if variant == "naive":
            self._codes = _as_kernel_array(ct.codes)
            self._cb = _as_kernel_array(ct.codebook)
        else:
            tiled, cbt = tile(ct)
            cbt32 = cbt.reshape(cbt.shape[0], -1).view(torch.int32)
            self._tiled_t, self._cbt_t = tiled, cbt32  # keep torch owners alive under the views
            self._tiled = _as_kernel_array(tiled)
            self._cbt = _as_kernel_array(cbt32)
            # the tile kernel copies each row's 16 entries as they are: the natural (out, 16) codebook
            self._cbn = _as_kernel_array(ct.codebook.view(torch.int32)) if ct.K == 16 else None
        self._plans: dict[int, tuple] = {}
        self._fused_plans: dict[tuple, tuple] = {}

    @property
    def ct(self) -> CodebookTensor:
        """The weight in the natural layout (rebuilt from the tiled codes when not kept)."""
        if self._ct is not None:
            return self._ct
        codes = untile(self._tiled_t, self.n_out, self._ncode_bytes)
        return CodebookTensor(codes, self._codebook, self.K, self.n_in, self.n_out)

    @property
    def bytes_read(self) -> int:
        """Bytes a batch-1 call must move at least: codes, codebooks, x and y."""
        return self.weight_bytes + 2 * (self.n_in + self.n_out)

    @property
    def max_batch(self) -> int:
        """The largest batch a fused kernel takes for this weight (larger ones: QLinear dequantizes)."""
        return MAX_WIDE_BATCH if self.K == 16 and self.variant == "lut" and {"wide", "tile"} & set(self.kernels) else MAX_FUSED_BATCH

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        return check_activation(x, self.n_in, self.device, self.max_batch)

    def _mma_budget(self) -> int:
        """Shared memory the tensor-core kernels may plan with (0: not candidates for this weight)."""
        if self.K != 16 or self.variant != "lut" or not set(TC_KERNELS) & set(self.kernels):
            return 0
        return OPTIN_SIM if SIM else max_shared_bytes(self.device)

    def _plan_fixed(self, B: int) -> LaunchPlan:
        opts = dict(self.fixed_plan)
        sms = sm_count(self.device)
        kind = opts.pop("kernel", "lut")
        if kind in TC_KERNELS:
            if self.K != 16 or self.variant != "lut":
                raise ValueError(f"the {kind} kernel takes 4-bit codes in the 'lut' variant, not K={self.K} / {self.variant!r}")
            budget = OPTIN_SIM if SIM else max_shared_bytes(self.device)
            if kind in ("mma", "dual") and "walk" in opts:
                raise ValueError("walk (row groups a block walks) is an option of the wide and tile kernels only")
            return {"mma": plan_mma, "dual": plan_dual, "wide": plan_wide, "tile": plan_tile}[kind](self.n_out, self.nchunks, B, sms, budget, **opts)
        return plan_launch(self.n_out, self.nchunks, self.K, B, sms, **opts)

    def _launch_parts(self, B: int, plan: LaunchPlan, pre: str = "", post: str = ""):
        if (pre or post) and plan.kernel not in FUSED_KERNELS:
            raise ValueError(f"only the lut and dual kernels fuse operations, not the {plan.kernel} kernel")
        if plan.kernel == "mma":
            kern = mma_kernel(B, plan.warps, plan.stages)
        elif plan.kernel == "dual":
            kern = dual_kernel(B, plan.warps, plan.stages, pre=pre, post=post)
        elif plan.kernel == "wide":
            kern = wide_kernel(B, plan.warps, plan.stages)
        elif plan.kernel == "tile":
            kern = tile_kernel(B, plan.warps, plan.stages)
        else:
            kern = lut_kernel(self.K, B, plan.warps, wide=self.variant == "lut", RB=plan.RB, stages=plan.stages, pre=pre, post=post)
        ws = torch.empty(plan.ksplit, B, self.rbs * ROW_BLOCK, dtype=torch.float32, device=self.device)
        counters = torch.zeros(-(-self.rbs // plan.RB), dtype=torch.int32, device=self.device)
        return kern, plan, (ws, counters), (_as_kernel_array(ws), _as_kernel_array(counters))

    def _prepare(self, B: int):
        if B in self._plans:
            return self._plans[B]
        if self.variant == "naive":
            entry = (naive_kernel(self.K, B), None, None, None)
        else:
            if self.fixed_plan is not None:  # overrides; the shape comes from the layer
                plan = self._plan_fixed(B)
            elif self.tune_on_gpu:
                plan = self.tune(B)
            elif B > MAX_FUSED_BATCH or not {"lut", "mma", "dual"} & set(self.kernels):  # only a wide-batch kernel may run
                plan_wb = plan_tile if "tile" in self.kernels else plan_wide
                plan = plan_wb(self.n_out, self.nchunks, B, sm_count(self.device), self._mma_budget())
            elif "lut" not in self.kernels:
                plan_tc = plan_mma if "mma" in self.kernels else plan_dual
                plan = plan_tc(self.n_out, self.nchunks, B, sm_count(self.device), self._mma_budget())
            else:
                plan = plan_launch(self.n_out, self.nchunks, self.K, B, sm_count(self.device))
            entry = self._launch_parts(B, plan)
            if B > MAX_FUSED_BATCH:
                # Batches above 16 are prefill, not the graphed decode step: a workspace kept per layer
                # (K-slices x B x rows, fp32) held 0.3-0.4 GB at 7B for batch 32; allocate it per call.
                entry = (entry[0], plan, None, None)
        self._plans[B] = entry
        return entry

    def plan(self, B: int = 1) -> LaunchPlan | None:
        return self._prepare(B)[1]

    def tune(self, B: int = 1, pre: str = "", post: str = "") -> LaunchPlan:
        """Time every candidate plan for this shape (CUDA-graph replays over copies of the codes
        that exceed the L2; :func:`trapetum.bench.pick_fastest`) and keep the fastest; cached per GPU
        model and shape. With fused operations (``pre``/``post``, see :func:`lut_kernel`) the lut
        kernel's plans are timed with them: a fused variant does more per block (``pre="rms"`` a sum
        of squares of x, ``"silu"`` two rows of x), so its best plan can differ."""
        fused = bool(pre or post)
        kernels = tuple(k for k in self.kernels if k in FUSED_KERNELS) if fused else self.kernels
        key = (torch.cuda.get_device_name(self.device), self.variant, kernels, self.K, B, self.n_in, self.n_out, pre, post)
        if key in _TUNED:
            return _TUNED[key]
        from .bench import pick_fastest  # bench imports this module

        cands = [p for p in candidate_plans(self.n_out, self.nchunks, self.K, B, sm_count(self.device),
                                            self._mma_budget()) if p.kernel in kernels]
        if not cands:
            raise ValueError(f"no launch plan of kernels {kernels} fits this device's shared memory")
        if len(cands) == 1:
            _TUNED[key] = cands[0]
            return cands[0]
        copies, views, xa, ya = tuning_inputs(self._tiled_t, self.weight_bytes, self.n_in, self.n_out, B, self.device)
        extra = ()
        if fused:
            xa, extra, _keep = fused_tuning_operands(self.n_in, self.n_out, B, pre, post, self.device)

        def launchers(plan):
            kern, _, owners, (wsa, cnta) = self._launch_parts(B, plan, pre, post)
            kern = with_shared_limit(kern, self._args(plan, xa, views[0], ya, wsa, cnta, extra),
                                     plan.shared_bytes if plan.kernel in TC_KERNELS else 0)
            grid, block = plan.grid(self.rbs), plan.warps * 32

            def launcher(ta):
                args = self._args(plan, xa, ta, ya, wsa, cnta, extra)

                def go():
                    _ = owners  # the candidate's workspace lives as long as its launchers
                    stream = cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)
                    kern[grid, block, stream, plan.shared_bytes](*args)
                return go
            return [launcher(v) for v in views]

        best = pick_fastest(cands, launchers, self.device)
        del copies, views
        _TUNED[key] = best
        return best

    def fused_plan(self, B: int, pre: str, post: str) -> LaunchPlan:
        """The plan a :meth:`bind` with these fused operations launches (tuned for them on a GPU)."""
        return self._prepare_fused(B, pre, post)[1]

    def _prepare_fused(self, B: int, pre: str, post: str):
        """The launch parts of a fused call (its fused kernel): its own plan, tuned for these
        operations where the tuner runs, else the plain call's plan."""
        k = (B, pre, post)
        if k not in self._fused_plans:
            tuned = self.tune_on_gpu and self.fixed_plan is None
            plan = self.tune(B, pre, post) if tuned else self._prepare(B)[1]
            self._fused_plans[k] = self._launch_parts(B, plan, pre, post)
        return self._fused_plans[k]

    def _args(self, plan: LaunchPlan, xa, tiled, ya, wsa, cnta, fused: tuple = ()) -> tuple:
        """A tiled kernel's arguments; the lut kernel also takes its fused operands (g32, res, eps),
        which default to arrays it never reads when it fuses nothing."""
        args = (xa, tiled, self._cbn if plan.kernel == "tile" else self._cbt, ya, wsa, cnta, self.n_out, self.rbs, self.nchunks, plan.cps)
        # Not ya as the unread res: the simulator copies each array argument back after a launch, and
        # an unchanged copy of y would overwrite the kernel's output.
        return args + (fused or (xa, xa, 0.0)) if plan.kernel in FUSED_KERNELS else args

    def fusable(self, B: int = 1) -> bool:
        """Whether :meth:`bind` can fuse the decode step's pre/post operations at batch ``B``: only
        the lut and dual kernels take them (:data:`FUSED_KERNELS`), so this weight must be allowed one.
        Where the tuner runs, a fused call has its own plan of those kernels whatever the plain call's
        tuned plan is: at 13B the plain qkv GEMV's fastest plan is sometimes another tensor-core one,
        and taking that as "not fusable" left the layer's RMSNorm to ~9 torch launches (~0.5 ms a
        token; NOTES "Session 21")."""
        if self.variant != "lut" or B > MAX_FUSED_BATCH or not set(FUSED_KERNELS) & set(self.kernels):
            return False
        if self.fixed_plan is not None or not self.tune_on_gpu:
            return self._prepare(B)[1].kernel in FUSED_KERNELS
        if "lut" not in self.kernels and B > DUAL_MAX_TUNED:
            return False  # the dual kernel alone (4-bit codes): the tuner tries it up to DUAL_MAX_TUNED
        return True

    def bind(self, x: torch.Tensor, out: torch.Tensor, pre: str = "", post: str = "", norm_weight: torch.Tensor | None = None,
             eps: float = 1e-5, res: torch.Tensor | None = None, after_kernel: bool = False):
        """A zero-argument launcher for fixed x and out buffers.

        Array views are made here, once, so the launcher does no host-side work a CUDA graph
        capture could trip on, and costs only numba's launch path when called eagerly.
        It launches on torch's stream current at call time (the capture stream under a graph).

        ``pre`` / ``post``: operations fused into the lut or dual kernel (see :func:`lut_kernel`):
        ``pre="rms"`` with ``norm_weight`` (in,) and ``eps``; ``pre="silu"`` with x (B, 2 * in);
        ``post="add"`` with ``res`` (B, out), which may be ``out`` itself.
        ``after_kernel``: the launcher always follows a kernel in its stream, so a plan of
        :data:`PROGRAMMATIC_KERNELS` may start while that kernel runs (:class:`programmatic`; the dual
        kernel builds its table, then waits).
        """
        fused = bool(pre or post)
        if fused:
            x2 = check_fused(self, x, out, pre, post, norm_weight, res, "its plan is neither a lut nor a dual plan, its kernels include neither, "
                            "or the variant is not 'lut'")
        else:
            x2 = self.check_input(x)
        B = x2.shape[0]
        check_output(out, B, self.n_out, x2.device)
        kern, plan, owners, views = self._prepare_fused(B, pre, post) if fused else self._prepare(B)
        if plan is not None and owners is None:  # a large batch: its own workspace, freed with the launcher
            kern, plan, owners, views = self._launch_parts(B, plan)
        ya = _as_kernel_array(out)
        xa = _as_kernel_array(x2 if self.variant == "naive" else x2.view(torch.int32))
        if self.variant == "naive":
            threads = 128
            cfg = (-(-self.n_out // threads), threads)
            args = (xa, self._codes, self._cb, ya, self.n_out, self.n_in)
        else:
            cfg = (plan.grid(self.rbs), plan.warps * 32)
            extra, res_src = (), None
            if fused:
                extra, res, res_src = fused_operands(xa, pre, post, norm_weight, res, eps)
            args = self._args(plan, xa, self._tiled, ya, views[0], views[1], extra)
        pdl = after_kernel and plan is not None and plan.kernel in PROGRAMMATIC_KERNELS
        # its table built before it waits; only where the launch can overlap (serially, the codebooks
        # and x fly together), and in the simulator, which runs this form one launch after another
        if pdl and plan.kernel == "dual" and (SIM or programmatic_kernels()):
            kern = dual_kernel(B, plan.warps, plan.stages, pre=pre, post=post, early=True)
        if plan is not None and plan.kernel in TC_KERNELS:  # above the 48 KiB default: raise this kernel's limit (compiles it, once)
            kern = with_shared_limit(kern, args, plan.shared_bytes)
        smem = 0 if plan is None else plan.shared_bytes
        dev = self.device

        def launch():
            _ = owners  # the workspace lives as long as the launcher
            stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            if SIM and post:
                res.copy_(res_src)
            with programmatic(pdl):
                kern[cfg[0], cfg[1], stream, smem](*args)
            if SIM:
                out.copy_(torch.from_numpy(ya).view(out.shape))

        return launch

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = self.check_input(x)
        y = out if out is not None else torch.empty(x2.shape[0], self.n_out, dtype=torch.float16, device=x2.device)
        self.bind(x2, y)()
        return y.reshape(self.n_out) if x.dim() == 1 else y

    def dequantize(self, out: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The fp16 weight (out, in), built on the device by a kernel; ``rows=(r0, r1)``: only that
        slab (r0 a multiple of 32), so a large-batch call never holds the whole fp16 weight."""
        r0, r1 = check_rows(rows, self.n_out)
        if out is None:
            W = torch.empty(r1 - r0, self.n_in, dtype=torch.float16, device=self.device)
        else:
            check_output(out, r1 - r0, self.n_in, self.device)
            W = out
        Wa = _as_kernel_array(W.view(torch.int32))
        stream = 0 if SIM else cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)
        upr = self.n_in // 8  # 8 weights a thread
        units = (r1 - r0) * upr
        blocks = 4 if SIM else max(1, min(-(-units // 256), 16 * sm_count(self.device)))
        # The tiled codes, read in place: untiling a slab with torch first took as long as the kernel.
        # (The naive variant keeps only the natural codes.)
        tiled = self.variant != "naive"
        codes = self._tiled if tiled else _as_kernel_array(self._ct.codes[r0:r1].view(torch.int32))
        dequant_kernel(self.K, tiled)[blocks, 256, stream](codes, _as_kernel_array(self._codebook[r0:r1].contiguous().view(torch.int16)),
                                                           Wa, units, upr, r0, self._ncode_bytes // CHUNK_BYTES)
        if SIM:
            W.view(torch.int32).copy_(torch.from_numpy(Wa))
        return W


def reference(x: torch.Tensor, ct: CodebookTensor, pre: str = "", post: str = "", norm_weight: torch.Tensor | None = None,
              res: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """float64 reference y = x @ W.T, computed where the weight lives (a GPU's float64 is IEEE
    double too, and the correctness sweep's hundreds of references are minutes on the CPU) unless
    the float64 weight would take more than a quarter of the GPU's free memory; returned on the CPU.
    ``pre`` / ``post`` (with their operands): the operations :func:`lut_kernel` fuses, in float64."""
    check_ops(pre, post)
    if ct.codes.is_cuda and not SIM and 8 * ct.out_features * ct.in_features > torch.cuda.mem_get_info(ct.codes.device)[0] // 4:
        ct = ct.to("cpu")
    W = ct.dequantize(torch.float64)
    x64 = apply_pre(x.detach().to(W.device).double(), pre, norm_weight, eps)
    return apply_post(x64 @ W.T, post, res).cpu()


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|: one number per output, insensitive to outputs near zero."""
    y64 = y.detach().cpu().double()
    if not torch.isfinite(y64).all():
        return float("inf")
    return float((y64 - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

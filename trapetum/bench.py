"""Benchmark harness: CUDA-graph replays timed with CUDA events, L2-rotated weights, medians.

Every timing of a Trapetum kernel is taken in the same process and run as torch fp16
``x @ W.t()`` on the same shape, timed the same way, and reported as a ratio.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

from .codebook import random_codebook_tensor
from .gemv import LARGE_BLOCK_WARPS, MAX_FUSED_BATCH, MAX_WIDE_BATCH, LutGemv, max_rel_err, reference, row_blocks_per_block

METHOD = "CUDA-graph replay, CUDA events, median, weights rotated past L2"


def l2_bytes() -> int:
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(p, "L2_cache_size", 50 * 2**20))


def copies_for(bytes_one: int, factor: int = 4, cap: int = 256) -> int:
    """How many copies of a working set make it `factor` x the L2 (at least 2)."""
    return max(2, min(cap, math.ceil(factor * l2_bytes() / max(bytes_one, 1))))


def time_graph(launchers: list[Callable[[], None]], launches: int = 20, replays: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of one launch: `launches` calls (cycling through `launchers`) per graph replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in launchers[: min(len(launchers), 3)]:  # compile and load modules outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    n = max(launches, len(launchers))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            launchers[i % len(launchers)]()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    del g
    return statistics.median(times)


_warmed: set = set()


def warm_gpu(device, seconds: float = 0.3) -> None:
    """Keep the GPU busy for ``seconds``, once a process: a tuner's first candidates were otherwise
    timed while the clocks still rose from idle, and a worse plan could win (NOTES, session 20)."""
    dev = torch.device(device)
    if dev in _warmed:
        return
    a = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(dev)
    _warmed.add(dev)


def pick_fastest(cands: list, launchers_of: Callable, device, on_error: Callable | None = None, recheck: int = 3):
    """The candidate plan whose launchers (``launchers_of(plan)``: one per L2-rotated weight copy)
    time fastest, or None if none launches. After one pass over all candidates the ``recheck``
    fastest are timed again in reverse order, each keeping its faster median, so drift during
    tuning (clocks, another process) cannot crown a candidate by one lucky or unlucky timing.
    ``on_error(plan, exc)``: skip a candidate that cannot launch (re-raised without it).
    With TRAPETUM_TUNE_LOG set, each timing prints a line to stderr: the candidate, its time, and
    the wall seconds it took (the first timing of a kernel includes its compilation)."""
    warm_gpu(device)
    best: dict[int, float] = {}
    log = bool(os.environ.get("TRAPETUM_TUNE_LOG"))

    def time_one(k):
        t0 = time.perf_counter()
        try:
            launchers = launchers_of(cands[k])  # rebuilt per timing: one candidate's workspace at a time
            ms = time_graph(launchers, launches=max(10, len(launchers)), replays=5, warmup=1)
        except Exception as e:  # noqa: BLE001 - the caller decides whether a candidate may fail
            if on_error is None:
                raise
            on_error(cands[k], e)
            ms = math.inf
        best[k] = min(best.get(k, math.inf), ms)
        if log:
            print(f"tune: {cands[k]}: {ms * 1e3:.2f} us, {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    for k in range(len(cands)):
        time_one(k)
    for k in sorted(best, key=best.get)[:recheck][::-1]:
        if best[k] < math.inf:
            time_one(k)
    k = min(best, key=best.get, default=None)
    return None if k is None or best[k] == math.inf else cands[k]


def copy_bandwidth(nbytes: int = 2 * 2**30) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    Two ways: torch's copy_ (cudaMemcpy) and an elementwise kernel (``torch.mul(src, 1, out=dst)``,
    16-byte vectorized); the roofline ("copy_gbps") is the faster of the two.
    """
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    out = {}
    for name, f in (("memcpy", lambda: dst.copy_(src)), ("elementwise", lambda: torch.mul(src, 1, out=dst))):
        ms = time_graph([f], launches=5, replays=20)
        out[f"copy_{name}_gbps"] = 2 * nbytes / (ms * 1e-3) / 1e9
    out["copy_gbps"] = max(out.values())
    del src, dst
    return out


def fp16_launchers(n_in: int, n_out: int, batch: int, seed: int = 0):
    """torch fp16 x @ W.t() on rotated copies of W (the cuBLAS baseline)."""
    k = copies_for(n_in * n_out * 2)
    g = torch.Generator(device="cuda").manual_seed(seed)
    Ws = [torch.randn(n_out, n_in, device="cuda", dtype=torch.float16, generator=g) * 0.02 for _ in range(k)]
    x = torch.randn(batch, n_in, device="cuda", dtype=torch.float16, generator=g)
    y = torch.empty(batch, n_out, device="cuda", dtype=torch.float16)
    # torch.mm with out= is what nn.Linear's batch-1 path runs (cuBLAS GEMV/GEMM), minus the allocation.
    return [lambda W=W: torch.mm(x, W.t(), out=y) for W in Ws], (Ws, x, y)


def lut_launchers(n_in: int, n_out: int, K: int, batch: int, variant: str = "lut", seed: int = 0, kernels=LutGemv.FAMILIES,
                  pre: str = "", post: str = ""):
    """Rotated copies of one random codebook weight, each bound to the same x and y; with ``pre`` /
    ``post`` (see :meth:`LutGemv.bind`) a random norm weight, x of 2 n_in columns for "silu", and
    y as its own residual for "add"."""
    ct = random_codebook_tensor(n_out, n_in, K, seed=seed, device="cuda")
    gemvs = [LutGemv(ct, variant=variant, kernels=kernels) for _ in range(copies_for(ct.nbytes))]
    launchers, x, y = bind_rotated(gemvs, n_in, n_out, batch, pre, post)
    return launchers, (gemvs, x, y)


def bind_rotated(gemvs: list, n_in: int, n_out: int, batch: int, pre: str = "", post: str = ""):
    """Launchers of ``gemvs`` (rotated copies of one weight, any format's GEMV with ``bind``) all on
    the same x and y, and that x and y. With ``pre`` / ``post`` (see :meth:`LutGemv.bind`): a random
    norm weight, x of 2 n_in columns for "silu", and y as its own residual for "add"."""
    x = torch.randn(batch, 2 * n_in if pre == "silu" else n_in, device="cuda", dtype=torch.float16)
    y = torch.randn(batch, n_out, device="cuda", dtype=torch.float16) if post else torch.empty(batch, n_out, device="cuda", dtype=torch.float16)
    w = (torch.rand(n_in, device="cuda") + 0.5).half() if pre == "rms" else None
    return [g.bind(x, y, pre=pre, post=post, norm_weight=w, res=y if post else None) for g in gemvs], x, y


def poisoned_check(gemv, x: torch.Tensor, ref: Callable[[torch.Tensor], torch.Tensor], what: str) -> float:
    """Run ``gemv(x, out=y)`` with y poisoned (NaN) first; max relative error against ``ref(x)``.

    Raises AssertionError if any output was left unwritten (still NaN) or is not finite.
    """
    y = torch.full((x.shape[0], gemv.n_out), float("nan"), dtype=torch.float16, device=x.device)
    gemv(x, out=y)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    if not torch.isfinite(y).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(y)).sum())} outputs unwritten or non-finite")
    return max_rel_err(y, ref(x))


def check_kernel(n_in: int, n_out: int, K: int, batch: int, variant: str, seed: int, device="cuda", plan: dict | None = None,
                 kernels=LutGemv.FAMILIES, tune: bool = True) -> float:
    """Max relative error of one kernel against float64, on fresh inputs, with y poisoned first."""
    ct = random_codebook_tensor(n_out, n_in, K, seed=seed, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(batch, n_in, generator=g).half().to(device)
    return poisoned_check(LutGemv(ct, device=device, variant=variant, plan=plan, kernels=kernels, tune=tune), x, lambda x: reference(x, ct),
                          f"{variant} K={K} batch={batch} {n_in}x{n_out}")


def gemv_record(kernel: str, K: int | None, batch: int, n_in: int, n_out: int, ms: float, fp16_ms: float, nbytes: int, err: float | None, **extra) -> dict:
    return {
        "kernel": kernel,
        "K": K,
        "batch": batch,
        "in_features": n_in,
        "out_features": n_out,
        "time_ms": ms,
        "fp16_ms": fp16_ms,
        "speedup": fp16_ms / ms,
        "gbps": nbytes / (ms * 1e-3) / 1e9,
        "max_rel_err": err,
        "method": METHOD,
        **extra,
    }


# -- the gemv chapter's suite ----------------------------------------------------------------
SCHEMES = {16: "4-bit K=16", 64: "uint8 K=64", 256: "uint8 K=256"}
TOLERANCE = 2e-3  # fp16 output rounding is 2^-11 of the largest output; fp32 accumulation adds far less


def correctness_sweep(shapes, Ks=(16, 64, 256), batches=(1, 2, 3, 8, 16), variants=("lut", "lut32", "naive"), seed=0, progress=True) -> list[dict]:
    """Every kernel on fresh random inputs against float64, outputs poisoned first. Raises on any failure.

    Plans are the heuristic ones plus forced plans of every kernel shape the tuner may pick (the
    tuned plan of each timed shape is checked again where it is timed, see time_lut)."""
    from tqdm.auto import tqdm

    jobs = [(s, K, b, v, None) for s in shapes for K in Ks for b in batches for v in variants if not (v == "naive" and s[0] * s[1] > 2**24)]
    # Plans the tuner may pick on other GPUs: every row-block width, with and without a K-split.
    jobs += [(shapes[0], K, b, "lut", dict(RB=rb, ksplit=ks, stages=st)) for K in Ks for b in (1, 3) for rb in (1, 2, 4)
             for ks in (1, 3) for st in (2, 4) if rb <= row_blocks_per_block(K, b)]
    # The 16- and 32-warp blocks the tuner tries for batch-1 4-bit layers (warps with no chunk at the small shapes).
    if 16 in Ks:
        jobs += [(s, 16, 1, "lut", dict(RB=rb, ksplit=ks, warps=w, stages=st)) for s in shapes[:3] for w in LARGE_BLOCK_WARPS
                 for rb in (1, 2) for ks in (1, 2) for st in (2, 3) if st == 2 or s == shapes[2]]
    # The tensor-core kernel: every warp count, with and without a K-split, batches across its mma groups.
    if 16 in Ks:
        jobs += [(s, 16, b, "lut", dict(kernel="mma", warps=w, ksplit=ks)) for s in shapes[:2] for b in (1, 3, 5, 16)
                 for w in (4, 8, 16) for ks in (1, 3)]
        jobs += [(s, 16, b, "lut", dict(kernel="dual", warps=w, ksplit=ks, stages=st)) for s in shapes[:2] for b in (1, 2, 3, 8)
                 for w in (4, 8, 16) for ks in (1, 3) for st in (1, 2)]
        # the wide kernel (batch 4..16 in the tuner, up to 64 forced): partial and full m-tiles, the unrolls, blocks walking row pairs
        # (several each, and one wave), and the heuristic plan above batch 16
        jobs += [(s, 16, b, "lut", dict(kernel="wide", warps=w, ksplit=ks, stages=st, walk=wk)) for s in shapes[:2]
                 for b in (5, 17, 64) for w, st, wk in ((4, 2, 1), (8, 4, "wave"), (8, 1, 2), (16, 1, 3)) for ks in (1, 3)
                 if w * b <= 512]
        # the tile kernel (batch 17..64 in the tuner, any batch forced): partial and full n-tiles, K-splits,
        # a block walking two groups, 4-16 warps; and the heuristic plan above batch 16
        jobs += [(s, 16, b, "lut", dict(kernel="tile", warps=w, ksplit=ks, stages=st, walk=wk)) for s in shapes[:2]
                 for b in (5, 17, 64) for w, st, wk in ((4, 2, 1), (8, 4, 2), (16, 1, 1)) for ks in (1, 3)]
        jobs += [(s, 16, b, "lut", None) for s in shapes for b in (32, 64)]
    recs, failures = [], []
    for i, ((n_in, n_out), K, b, v, plan) in enumerate(tqdm(jobs, desc="correctness", disable=not progress)):
        try:
            err = check_kernel(n_in, n_out, K, b, v, seed=seed + i, plan=plan, tune=False)
            ok = err <= TOLERANCE
        except AssertionError as e:
            err, ok = float("nan"), False
            failures.append(str(e))
        recs.append({"kernel": v, "K": K, "scheme": SCHEMES[K], "batch": b, "in_features": n_in, "out_features": n_out, "max_rel_err": err, "passed": ok, "plan": str(plan) if plan else "tuned"})
        if not ok:
            failures.append(f"{v} K={K} batch={b} {n_in}x{n_out}: max rel err {err:.3g} > {TOLERANCE}")
    if failures:
        raise AssertionError("correctness sweep failed:\n" + "\n".join(failures))
    return recs


FAMILIES = {"lut-fma": ("lut",), "mma": ("mma",), "dual": ("dual",)}  # kernel names of the lut variant held to one kernel family


def time_lut(n_in, n_out, K, batch, variant, fp16_ms, seed=0, kernels=LutGemv.FAMILIES, name: str | None = None) -> dict:
    """One fused kernel, tuned over ``kernels`` (see LutGemv), timed and checked; recorded as ``name``
    (default: the variant) with the plan it ran, ``plan_kernel`` saying which kernel family."""
    launchers, keep = lut_launchers(n_in, n_out, K, batch, variant, seed=seed, kernels=kernels)
    ms = time_graph(launchers)
    # The same launch on one copy, so the weight stays in L2 between launches: if this is not faster,
    # the kernel is bound inside the SM, not by DRAM.
    l2_ms = time_graph(launchers[:1], launches=len(launchers)) if keep[0][0].weight_bytes < 3 * l2_bytes() // 4 else None
    g = keep[0][0]
    err = check_kernel(n_in, n_out, K, batch, variant, seed=seed + 7, kernels=kernels)
    nbytes = g.weight_bytes + 2 * batch * (n_in + n_out)
    plan = g._plans[batch][1]
    del launchers, keep
    torch.cuda.empty_cache()
    return gemv_record(name or variant, K, batch, n_in, n_out, ms, fp16_ms, nbytes, err, scheme=SCHEMES[K],
                       ksplit=getattr(plan, "ksplit", None), warps=getattr(plan, "warps", None), rb=getattr(plan, "RB", None),
                       stages=getattr(plan, "stages", None), plan_kernel=getattr(plan, "kernel", None),
                       walk=getattr(plan, "walk", None), l2_resident_ms=l2_ms)


def time_fused(n_in: int, n_out: int, K: int, pre: str = "", post: str = "", seed: int = 0,
               kernels=LutGemv.FAMILIES) -> float:
    """Milliseconds of one batch-1 GEMV with fused operations (``pre`` "rms" or "silu", ``post``
    "add", as :class:`trapetum.step.FusedStep` launches it) at its own tuned fused plan (over the
    kernels of ``kernels`` that fuse: lut, and dual for 4-bit codes), timed as :func:`time_graph`
    replays over rotated copies of the weight. Correctness of these kernels is
    :func:`trapetum.step.kernel_checks`'s."""
    launchers, keep = lut_launchers(n_in, n_out, K, 1, seed=seed, kernels=kernels, pre=pre, post=post)
    ms = time_graph(launchers)
    del launchers, keep
    torch.cuda.empty_cache()
    return ms


STREAM_FLOOR = "stream floor"  # kernel name of the records of time_stream in the gemv suite
STREAM_BLOCKS_PER_SM = 8  # the streaming floor's grid: 8 blocks of 256 threads an SM (the fastest of 2-8 probed)


def time_stream(nbytes: int) -> float:
    """Milliseconds to only read ``nbytes`` (rotated copies past L2): the floor under any kernel that
    must read those bytes once (:func:`trapetum.gemv.stream_kernel`)."""
    from numba import cuda

    from .gemv import _as_kernel_array, sm_count, stream_kernel

    if nbytes % 16:
        raise ValueError(f"the streaming floor reads 16-byte pieces; {nbytes} bytes is not a multiple of 16")
    k = copies_for(nbytes)
    bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(k)]
    blocks = STREAM_BLOCKS_PER_SM * sm_count("cuda")
    out = torch.empty(blocks * 256, dtype=torch.int32, device="cuda")
    oa, arrs = _as_kernel_array(out), [_as_kernel_array(b) for b in bufs]

    def launcher(a):
        def go():
            stream_kernel[blocks, 256, cuda.external_stream(torch.cuda.current_stream().cuda_stream)](a, oa, nbytes // 16)
        return go

    ms = time_graph([launcher(a) for a in arrs])
    del bufs, arrs
    torch.cuda.empty_cache()
    return ms


def time_empty() -> float:
    """Milliseconds of a graph-replayed launch that does no work (132 x 4 blocks on an H100)."""
    from numba import cuda

    from .gemv import _as_kernel_array, empty_kernel, sm_count

    out = torch.empty(1, dtype=torch.int32, device="cuda")
    oa, blocks = _as_kernel_array(out), 4 * sm_count("cuda")
    return time_graph([lambda: empty_kernel[blocks, 256, cuda.external_stream(torch.cuda.current_stream().cuda_stream)](oa)])


def time_fp16(n_in, n_out, batch) -> float:
    launchers, keep = fp16_launchers(n_in, n_out, batch)
    ms = time_graph(launchers)
    del launchers, keep
    torch.cuda.empty_cache()
    return ms


def time_dequant_cublas(n_in, n_out, K, batch, fp16_ms, seed=0) -> dict:
    """The large-batch path: dequantize to fp16 on the device, then cuBLAS."""
    ct = random_codebook_tensor(n_out, n_in, K, seed=seed, device="cuda")
    gs = [LutGemv(ct, variant="naive") for _ in range(2)]
    W = torch.empty(n_out, n_in, dtype=torch.float16, device="cuda")
    x = torch.randn(batch, n_in, device="cuda", dtype=torch.float16)
    y = torch.empty(batch, n_out, device="cuda", dtype=torch.float16)

    def run(g):
        return lambda: (g.dequantize(out=W), torch.mm(x, W.t(), out=y))

    ms = time_graph([run(g) for g in gs], launches=10)
    ref = reference(x.cpu(), ct.to("cpu"))
    run(gs[0])()
    torch.cuda.synchronize()
    err = max_rel_err(y, ref)
    nbytes = ct.nbytes + 2 * batch * (n_in + n_out)
    return gemv_record("dequant+cublas", K, batch, n_in, n_out, ms, fp16_ms, nbytes, err, scheme=SCHEMES[K])


def gemv_suite(table_shape=(4096, 4096), layer_shapes=((3072, 768), (4096, 4096), (11008, 4096), (4096, 11008)),
               large_shapes=((4096, 14336), (14336, 4096), (8192, 28672), (16384, 53248)),
               batch_shape=(4096, 14336), batches=(1, 2, 4, 8, 16, 32, 64), Ks=(16, 64, 256), progress=True) -> list[dict]:
    """The chapter's three grids plus the batch sweep; fp16 timed beside every shape. Returns records."""
    from tqdm.auto import tqdm

    recs = []
    fp16 = {}

    def base(n_in, n_out, b):
        if (n_in, n_out, b) not in fp16:
            fp16[(n_in, n_out, b)] = time_fp16(n_in, n_out, b)
            recs.append(gemv_record("torch fp16", None, b, n_in, n_out, fp16[(n_in, n_out, b)], fp16[(n_in, n_out, b)], 2 * n_in * n_out + 2 * b * (n_in + n_out), None, scheme="dense fp16", grid="baseline"))
        return fp16[(n_in, n_out, b)]

    jobs = [("table", table_shape, K, 1, v) for K in Ks for v in ("lut", "lut32", "naive")]
    # The 4-bit kernel's two families on their own: the FMA table kernel and the tensor-core one.
    jobs += [("table", table_shape, 16, 1, v) for v in ("lut-fma", "mma", "dual")] if 16 in Ks else []
    jobs += [("layers", s, 16, 1, "lut") for s in layer_shapes]
    jobs += [("bandwidth", s, K, 1, "lut") for s in large_shapes for K in Ks]
    jobs += [("batch", batch_shape, 16, b, "lut") for b in batches if b <= MAX_WIDE_BATCH]
    # dequantize + cuBLAS, the large-batch path before the wide kernel (and still uint8's): the comparison
    jobs += [("batch", batch_shape, 16, b, "dequant+cublas") for b in batches if b > MAX_FUSED_BATCH]
    done = set()
    for grid, (n_in, n_out), K, b, v in tqdm(jobs, desc="timings", disable=not progress):
        f = base(n_in, n_out, b)
        key = (n_in, n_out, K, b, v)
        if key in done:
            prev = next(r for r in recs if (r["in_features"], r["out_features"], r["K"], r["batch"], r["kernel"]) == key)
            recs.append({**prev, "grid": grid})
            continue
        done.add(key)
        if v == "dequant+cublas":
            r = time_dequant_cublas(n_in, n_out, K, b, f)
        elif v in FAMILIES:
            r = time_lut(n_in, n_out, K, b, "lut", f, kernels=FAMILIES[v], name=v)
        else:
            r = time_lut(n_in, n_out, K, b, v, f)
        r["grid"] = grid
        recs.append(r)
        if progress:
            # tqdm.write, not print: a print lands on the progress bar's line in a captured log
            tqdm.write(f"{grid:9s} {v:15s} K={K:<3d} b={b:<2d} {n_in:>5d}x{n_out:<5d} {r['time_ms']*1e3:8.2f} us  fp16 {f*1e3:8.2f} us  "
                       f"{r['speedup']:.2f}x  {r['gbps']:.0f} GB/s  err {r['max_rel_err']:.1e}")
    if 16 in Ks:
        # What bounds the 4-bit kernel: a kernel that only reads the same code bytes, and an empty launch.
        empty = time_empty()
        for n_in, n_out in dict.fromkeys([table_shape, *layer_shapes, *large_shapes]):
            nbytes = n_in * n_out // 2
            ms = time_stream(nbytes)
            recs.append(gemv_record(STREAM_FLOOR, 16, 1, n_in, n_out, ms, base(n_in, n_out, 1), nbytes, None,
                                    scheme=SCHEMES[16], grid="floor", empty_launch_ms=empty))
    for r in recs:
        if r.get("grid") == "batch" and r["kernel"] != "torch fp16":
            r["path"] = "dequant+cublas" if r["kernel"] == "dequant+cublas" else "fused"
    return recs


def default_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def run_cuda_cpp(arch: str | None = None, program: str = "gemv_codebook_4bit", build_dir=None, extra_args=()) -> list[dict]:
    """Build a kernels/ program with ``nvcc -O3 -arch=<arch>``, run it, return its records.

    The program seeds its data with std::mt19937(0), checks against cuBLAS, and times itself
    and cuBLAS fp16 the same way this harness does (graph replays, events, L2 rotation).
    """
    import json
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from .results import REPO_ROOT

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH: the CUDA C++ counterparts in kernels/ need the CUDA toolkit")
    arch = arch or default_arch()
    src = REPO_ROOT / "kernels" / f"{program}.cu"
    out_dir = Path(build_dir or tempfile.mkdtemp(prefix="trapetum-kernels-"))
    exe = out_dir / f"{program}-{arch}"
    subprocess.run([nvcc, "-O3", f"-arch={arch}", "-std=c++17", "-o", str(exe), str(src), "-lcublas"], check=True,
                   cwd=src.parent)
    js = out_dir / f"{program}.json"
    run = subprocess.run([str(exe), "--json", str(js), *extra_args], capture_output=True, text=True)
    print(run.stdout[-4000:])
    if run.returncode != 0:
        raise RuntimeError(f"{program} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    recs = json.loads(js.read_text())["records"]
    for r in recs:
        r.setdefault("method", METHOD)
        r["arch"] = arch
    return recs


# -- the vector-codebook chapter's suite -----------------------------------------------------
RESIDUAL_GRID = dict(in_features=(1024, 2048, 4096, 8192, 16384), out_features=(1024, 4096, 8192, 14336, 28672, 53248),
                     mains=(4096, 8192), residuals=(256, 512))


def residual_configs(grid: dict) -> list[tuple[int, int, int, int]]:
    """(in, out, main, residual) of a residual grid in the order it is measured: codebook pairs outer, then
    outputs, then inputs. The pairs are ``grid["pairs"]`` where given (a subset), else mains x residuals."""
    pairs = grid.get("pairs") or [(m, r) for m in grid["mains"] for r in grid["residuals"]]
    return [(n_in, n_out, m, r) for m, r in pairs for n_out in grid["out_features"] for n_in in grid["in_features"]]
# 4096 x 4096 (the seed's shape), Llama-2-7B's MLP projections, and the large shapes of the targets.
ADDITIVE_SHAPES = ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (16384, 53248))


AQLM_PACKAGE = "aqlm package 2x8"  # the kernel name of its records


def aqlm_package_available() -> str | None:
    """None if the `aqlm` package's CUDA kernel builds here, else why not (one line)."""
    try:
        import aqlm.inference_kernels.cuda_kernel  # noqa: F401 - JIT-compiles the kernels with this machine's nvcc
        torch.ops.aqlm.code2x8_matmat  # noqa: B018
    except Exception as e:  # noqa: BLE001 - any failure to build is reported, not raised
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


def time_aqlm_package(n_in: int, n_out: int, fp16_ms: float, seed: int = 0) -> dict:
    """The `aqlm` package's 2x8 kernel on the same shape, same harness, checked against our reference.

    Its layout (codes int8 (out, in/8, 2), codebooks (2, 256, 1, 8), scales (out, 1, 1, 1)) is
    what :func:`trapetum.additive.to_aqlm` writes, so the check also tests that conversion.
    """
    from .additive import random_additive_tensor, reference, to_aqlm

    t = random_additive_tensor(n_out, n_in, 2, seed=seed, device="cuda")
    k = copies_for(t.nbytes)
    parts = [to_aqlm(t)] + [{n: v.clone() for n, v in to_aqlm(t).items()} for _ in range(k - 1)]
    x = torch.randn(1, n_in, device="cuda", dtype=torch.float16)
    y = torch.empty(1, n_out, device="cuda", dtype=torch.float16)
    op = torch.ops.aqlm.code2x8_matmat

    def launcher(p):
        return lambda: y.copy_(op(x, p["codes"], p["codebooks"], p["scales"], None).view(1, n_out))

    ms = time_graph([launcher(p) for p in parts])
    y.fill_(float("nan"))
    launcher(parts[0])()
    torch.cuda.synchronize()
    err = max_rel_err(y, reference(x, t))
    nbytes = t.nbytes + 2 * (n_in + n_out)
    del parts
    torch.cuda.empty_cache()
    return gemv_record(AQLM_PACKAGE, None, 1, n_in, n_out, ms, fp16_ms, nbytes, err, scheme="2-bit additive (M=2)",
                       bits_per_weight=t.bits_per_weight, grid="additive")


def residual_key(rec: dict) -> tuple:
    """A residual-grid configuration: (in, out, main centroids, residual centroids)."""
    return rec["in_features"], rec["out_features"], rec["main_centroids"], rec["residual_centroids"]


def additive_key(rec: dict) -> tuple:
    """An additive-table job: (kernel, M, in, out); the `aqlm` package's kernel has no M (None). M is
    normalised to int, so a record read back from a partial jsonl matches the job it came from."""
    M = rec.get("M")
    return rec["kernel"], None if M is None else int(M), int(rec["in_features"]), int(rec["out_features"])


def floor_key(rec: dict) -> tuple:
    """A streaming-floor record's configuration: (what, in, out, M or main centroids, residual centroids)."""
    return (rec["floor_of"], rec["in_features"], rec["out_features"], rec.get("M") or rec.get("main_centroids"),
            rec.get("residual_centroids"))


def floor_jobs(grid: dict = RESIDUAL_GRID, additive_shapes=ADDITIVE_SHAPES, Ms=(2, 4)) -> list[dict]:
    """The configurations whose streaming floor the vq suite measures, each with the bytes its kernel must
    read from DRAM: the codes (additive) or the index words (residual). The codebooks and scales are a few
    hundred KiB at most, read from L2 by every block, and left out."""
    from .additive import SCHEMES as ADDITIVE_SCHEMES
    from .residual import index_bytes, scheme_name

    jobs = [dict(floor_of="additive", in_features=n_in, out_features=n_out, M=M, nbytes=n_out * n_in * M // 8,
                 scheme=ADDITIVE_SCHEMES[M])
            for n_in, n_out in additive_shapes for M in Ms]
    jobs += [dict(floor_of="residual", in_features=n_in, out_features=n_out, main_centroids=m, residual_centroids=r,
                  nbytes=index_bytes(n_in, n_out, m, r), scheme=scheme_name(m, r))
             for n_in, n_out, m, r in residual_configs(grid)]
    for j in jobs:
        j["nbytes"] = -(-j["nbytes"] // 16) * 16  # the floor reads whole 16-byte pieces
        j["code_bits_per_weight"] = 8 * j["nbytes"] / (j["in_features"] * j["out_features"])
    return jobs


def vq_suite(grid: dict = RESIDUAL_GRID, additive_shapes=ADDITIVE_SHAPES, Ms=(2, 4), aqlm: bool = True, progress: bool = True,
             on_record=None, skip_residual=frozenset(), floors: dict | None = None, skip_floor=frozenset(),
             skip_additive=frozenset()) -> tuple[list[dict], dict]:
    """The additive table, then the residual grid, fp16 timed beside every shape; returns (records,
    extra provenance). A configuration that fails is recorded in ``extra["failures"]`` and the
    suite goes on; ``on_record(rec)`` sees every record as it is made (for partial saves).
    ``skip_residual``: :func:`residual_key` s already measured (a resumed run); ``skip_additive`` likewise,
    :func:`additive_key` s.
    ``floors``: keyword arguments of :func:`floor_jobs` (the configurations, whatever the parts timed):
    for each, a kernel that only reads its code bytes (:func:`time_stream`), fp16 beside it, as
    records of grid "floor": fp16 over that time is the speedup no kernel of those bytes can pass.
    ``skip_floor``: :func:`floor_key` s already measured."""
    import traceback

    from tqdm.auto import tqdm

    from . import additive, residual

    recs, fp16, extra = [], {}, {"failures": []}

    def add(r):
        recs.append(r)
        if on_record is not None:
            on_record(r)
        if progress and r["kernel"] != "torch fp16":
            tqdm.write(f"{r['grid']:9s} {r['kernel']:18s} {r['in_features']:>5d}x{r['out_features']:<5d} {r.get('scheme', ''):26s} "
                       f"{r['time_ms'] * 1e3:8.2f} us  fp16 {r['fp16_ms'] * 1e3:8.2f} us  {r['speedup']:.2f}x  {r['gbps']:.0f} GB/s"
                       + (f"  err {r['max_rel_err']:.1e}" if r["max_rel_err"] is not None else ""))  # not print: a print lands on the progress bar's line in a log

    def base(n_in, n_out):
        if (n_in, n_out) not in fp16:
            fp16[(n_in, n_out)] = time_fp16(n_in, n_out, 1)
            add(gemv_record("torch fp16", None, 1, n_in, n_out, fp16[(n_in, n_out)], fp16[(n_in, n_out)],
                            2 * n_in * n_out + 2 * (n_in + n_out), None, scheme="dense fp16", grid="baseline"))
        return fp16[(n_in, n_out)]

    def attempt(what, f, grid_name):
        try:
            r = f()
            r["grid"] = grid_name
            add(r)
        except Exception as e:  # noqa: BLE001 - one configuration's failure must not lose the run
            extra["failures"].append(f"{what}: {type(e).__name__}: {e}")
            print(f"FAILED {what}:\n{traceback.format_exc()[-1500:]}", flush=True)
            torch.cuda.synchronize()

    aqlm_todo = {s for s in additive_shapes if (AQLM_PACKAGE, None, *s) not in skip_additive} if aqlm else set()
    # The package JIT-compiles on import: only where it has something left to time.
    why = aqlm_package_available() if aqlm_todo else "not checked: none of its shapes left to time" if aqlm else "not requested"
    extra["aqlm_package"] = why or "built"
    for n_in, n_out in tqdm(additive_shapes, desc="additive", disable=not progress):
        todo = [M for M in Ms if ("additive", M, n_in, n_out) not in skip_additive]
        with_aqlm = why is None and (n_in, n_out) in aqlm_todo
        if not todo and not with_aqlm:
            continue  # all kept from a first process, fp16 with them: each ratio is of one process
        f = base(n_in, n_out)
        for M in todo:
            attempt(f"additive M={M} {n_in}x{n_out}", lambda: additive.time_additive(n_in, n_out, M, 1, f), "additive")
        if with_aqlm:
            attempt(f"aqlm package {n_in}x{n_out}", lambda: time_aqlm_package(n_in, n_out, f), "additive")
    jobs = [c for c in residual_configs(grid) if c not in skip_residual]
    for n_in, n_out, m, r in tqdm(jobs, desc="residual grid", disable=not progress):
        f = base(n_in, n_out)
        attempt(f"residual {m}+{r} {n_in}x{n_out}", lambda: residual.time_residual(n_in, n_out, m, r, 1, f), "residual")
    todo = [j for j in floor_jobs(**floors) if floor_key(j) not in skip_floor] if floors is not None else []
    if todo:
        extra["empty_launch_ms"] = time_empty()
    for j in tqdm(todo, desc="streaming floors", disable=not progress):
        n_in, n_out = j["in_features"], j["out_features"]
        f = base(n_in, n_out)
        keys = {k: v for k, v in j.items() if k not in ("in_features", "out_features", "nbytes")} | {"code_bytes": j["nbytes"]}
        attempt(f"floor {j['scheme']} {n_in}x{n_out}",
                lambda: gemv_record(STREAM_FLOOR, None, 1, n_in, n_out, time_stream(j["nbytes"]), f, j["nbytes"], None, **keys), "floor")
    return recs, extra

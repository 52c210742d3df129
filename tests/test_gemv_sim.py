"""The LUT-GEMV kernels in numba's CUDA simulator, against the float64 reference.

conftest.py turns the simulator on before numba is imported. Each simulated CUDA thread is a
Python thread, so shapes stay small; the K-split, row-padding and multi-row-block paths are
reached by choosing shapes (and, where needed, an explicit plan) rather than by size.
"""
from __future__ import annotations

import os

import pytest
import torch

from trapetum import gemv
from trapetum.bench import TOLERANCE
from trapetum.codebook import random_codebook_tensor
from trapetum.gemv import MAX_FUSED_BATCH, LutGemv, lut_kernel, max_rel_err, plan_launch, reference

# Shapes and CPU tensors are chosen for the simulator: skip only where a run opted out of it
# explicitly (NUMBA_ENABLE_CUDASIM=0 on a GPU machine); anywhere else the simulator must be on.
pytestmark = pytest.mark.skipif(
    not gemv.SIM and os.environ.get("NUMBA_ENABLE_CUDASIM") == "0", reason="NUMBA_ENABLE_CUDASIM=0: written for the CUDA simulator"
)

VARIANTS = LutGemv.VARIANTS


def x_for(n_in, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n_in, generator=g).half()


def poisoned(batch, n_out):
    return torch.full((batch, n_out), float("nan"), dtype=torch.float16)


def check(g: LutGemv, x: torch.Tensor) -> torch.Tensor:
    """Run g on x into a NaN-poisoned output; assert every output was written and is accurate."""
    y = poisoned(x.shape[0], g.n_out)
    ret = g(x, out=y)
    assert ret is y
    assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} outputs left unwritten"
    err = max_rel_err(y, reference(x, g.ct))
    assert err <= TOLERANCE, f"max rel err {err:.3g} > {TOLERANCE}"
    return y


def test_the_suite_runs_in_the_simulator():
    assert gemv.SIM, "conftest.py must set NUMBA_ENABLE_CUDASIM=1 before numba is imported"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("K", [16, 64, 256])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_float64_reference(variant, K, batch):
    ct = random_codebook_tensor(96, 64, K, seed=K + batch)
    check(LutGemv(ct, variant=variant), x_for(64, batch, seed=K * batch))


@pytest.mark.parametrize(
    "variant, K, n_out, n_in, batch",
    [
        ("lut", 16, 33, 64, 1),  # one padded row-block, RB=4: three of the block's row-blocks are absent
        ("lut", 16, 130, 64, 2),  # 5 row-blocks over two blocks of RB=4, the last row-block 2 rows
        ("lut", 64, 47, 48, 3),  # RB=2, the second row-block 15 rows
        ("lut", 64, 70, 48, 1),  # byte-addressed pairs: the second block's pair holds one row-block of 6 rows
        ("lut32", 256, 70, 32, 1),
        ("naive", 16, 45, 64, 2),
    ],
)
def test_rows_not_a_multiple_of_32(variant, K, n_out, n_in, batch):
    ct = random_codebook_tensor(n_out, n_in, K, seed=n_out)
    check(LutGemv(ct, variant=variant), x_for(n_in, batch, seed=n_out))


def test_plan_launch_splits_K_for_long_rows_and_few_row_blocks():
    # Few row-blocks cannot fill the (simulated) SMs, so the heuristic splits the columns.
    p = plan_launch(n_out=33, nchunks=64, K=16, B=1, sms=4)
    assert p.ksplit > 1
    assert (p.ksplit - 1) * p.cps < 64 <= p.ksplit * p.cps  # every K-slice non-empty, all chunks covered


@pytest.mark.parametrize("K, n_in, B, ks", [(16, 64, 1, 64 // 32), (16, 4096, 16, None), (64, 1024, 5, 3), (256, 1024, 2, 7), (256, 4096, 16, None)])
def test_plan_launch_covers_every_chunk_within_shared_memory(K, n_in, B, ks):
    nchunks = n_in // (32 if K == 16 else 16)
    p = plan_launch(200, nchunks, K, B, sms=132, ksplit=ks)
    assert (p.ksplit - 1) * p.cps < nchunks <= p.ksplit * p.cps
    static = gemv.lut_table_words(K, p.RB, B) * 4 + p.warps * p.RB * B * 32 * 4 + 16
    assert static + p.shared_bytes <= gemv.SMEM_BUDGET
    if ks is not None:
        assert p.ksplit == ks


def test_plan_launch_refuses_a_ksplit_that_overflows_shared_memory():
    with pytest.raises(ValueError, match="ksplit=1 leaves more of x than shared memory holds"):
        plan_launch(64, 4096 // 32, 16, 16, sms=4, ksplit=1)


@pytest.mark.parametrize(
    "K, n_in, plan",
    [
        (16, 256, {"ksplit": 2, "warps": 2}),  # 8 chunks in two K-slices of 4, 2 warps each
        (64, 192, {"ksplit": 3, "warps": 1, "RB": 1}),
        (256, 256, {"ksplit": 4, "warps": 2}),
        (64, 160, {"ksplit": 10, "warps": 1, "RB": 1}),  # the last block sums 8 partials at a time, then 2
        (64, 112, {"ksplit": 7, "warps": 1, "RB": 1}),  # 4 at a time, then 3 one by one
        (64, 208, {"ksplit": 13, "warps": 1, "RB": 1}),  # 8, then 4, then 1
    ],
)
def test_k_split_reduces_in_the_last_block_and_resets_its_counters(K, n_in, plan):
    ct = random_codebook_tensor(40, n_in, K, seed=n_in)
    g = LutGemv(ct, plan=plan)
    p = g.plan(2)
    assert p.ksplit == plan["ksplit"] > 1
    y1 = check(g, x_for(n_in, 2, seed=1))
    # The counters must be back at zero, or no block of the second launch sees itself last and
    # the poisoned output stays NaN.
    counters = g._plans[2][2][1]
    assert not counters.any(), f"atomic counters not reset: {counters.tolist()}"
    y2 = check(g, x_for(n_in, 2, seed=2))
    assert not torch.equal(y1, y2)


def test_k_split_from_the_heuristic_plan():
    # 33 rows x 1024 columns: one thread block of row-blocks, 32 chunks -> the default K-split
    # (only the warp count is fixed, to keep the simulator quick).
    ct = random_codebook_tensor(33, 1024, 16, seed=9)
    g = LutGemv(ct, plan={"warps": 2})
    assert g.plan(1).ksplit > 1
    check(g, x_for(1024, 1, seed=3))
    check(g, x_for(1024, 1, seed=4))


@pytest.mark.parametrize("variant", VARIANTS)
def test_1d_input_gives_1d_output(variant):
    ct = random_codebook_tensor(40, 64, 16, seed=2)
    x = x_for(64, 1, seed=5)[0]
    y = LutGemv(ct, variant=variant)(x)
    assert y.shape == (40,) and y.dtype == torch.float16
    assert max_rel_err(y, reference(x, ct)) <= TOLERANCE


@pytest.mark.parametrize("variant", ["lut", "naive"])
@pytest.mark.parametrize("K", [16, 64, 256])
@pytest.mark.parametrize("n_in", [32, 160])  # one 16-byte piece of codes a row (4-bit), or several
def test_device_dequantize_equals_codebook_dequantize(K, variant, n_in):
    ct = random_codebook_tensor(37, n_in, K, seed=K)
    g = LutGemv(ct, variant=variant)
    W = torch.full((37, n_in), float("nan"), dtype=torch.float16)
    assert g.dequantize(out=W) is W
    assert torch.equal(W, ct.dequantize())
    assert torch.equal(g.dequantize(), ct.dequantize())


def test_device_dequantize_refuses_a_wrong_output():
    # The kernel writes whole 16-byte pieces of each row: an output of another shape, type or layout
    # would be written past or across, so it is refused before the launch.
    g = LutGemv(random_codebook_tensor(37, 64, 16, seed=1))
    for bad in (torch.empty(37, 32, dtype=torch.float16), torch.empty(37, 64, dtype=torch.float32),
                torch.empty(64, 37, dtype=torch.float16).t(), torch.empty(36, 64, dtype=torch.float16)):
        with pytest.raises(ValueError, match="out must be a contiguous float16 tensor of shape"):
            g.dequantize(out=bad)
    with pytest.raises(ValueError, match="not contiguous"):
        g.dequantize(out=torch.empty(64, 37, dtype=torch.float16).t())


@pytest.mark.parametrize("keep_natural", [True, False])
def test_device_dequantize_of_a_row_slab(keep_natural):
    # A slab comes from its own row-blocks of the tiled codes (large-batch calls rebuild the fp16
    # weight a slab at a time); a bad slab is refused, not silently clipped.
    ct = random_codebook_tensor(70, 32, 16, seed=3)
    g = LutGemv(ct, keep_natural=keep_natural)
    full = ct.dequantize()
    for r0, r1 in ((0, 32), (32, 70), (64, 65), (0, 70)):
        assert torch.equal(g.dequantize(rows=(r0, r1)), full[r0:r1])
    for bad in ((5, 40), (32, 32), (0, 71), (-32, 10)):
        with pytest.raises(ValueError, match="rows must be"):
            g.dequantize(rows=bad)


@pytest.mark.parametrize("variant", ["lut", "naive"])
def test_bind_returns_a_launcher_that_reads_x_at_call_time(variant):
    ct = random_codebook_tensor(40, 64, 16, seed=3)
    g = LutGemv(ct, variant=variant)
    x = x_for(64, 2, seed=6)
    y = poisoned(2, 40)
    launch = g.bind(x, y)
    assert torch.isnan(y).all(), "bind() must not launch"
    launch()
    assert max_rel_err(y, reference(x, ct)) <= TOLERANCE
    x.copy_(x_for(64, 2, seed=7))  # same buffer, new values
    y.fill_(float("nan"))
    launch()
    assert max_rel_err(y, reference(x, ct)) <= TOLERANCE


# -- bad input --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return LutGemv(random_codebook_tensor(40, 64, 16, seed=4))


def test_x_wrong_dtype(small):
    with pytest.raises(TypeError, match="x must be float16, got torch.float32"):
        small(torch.randn(1, 64))


@pytest.mark.parametrize("shape", [(1, 32), (96,), (2, 1, 64), (1, 65)])
def test_x_wrong_shape(small, shape):
    with pytest.raises(ValueError, match=r"x must have shape \(64,\) or \(batch, 64\)"):
        small(torch.zeros(shape, dtype=torch.float16))


def test_x_not_contiguous(small):
    x = torch.zeros(64, 2, dtype=torch.float16).t()
    with pytest.raises(ValueError, match="x must be contiguous"):
        small(x)


@pytest.mark.parametrize("offset", [1, 4])
def test_x_not_16_byte_aligned(small, offset):
    buf = torch.zeros(64 + 8, dtype=torch.float16)
    assert buf.data_ptr() % 16 == 0
    x = buf[offset : offset + 64]
    with pytest.raises(ValueError, match="x must be 16-byte aligned"):
        small(x)


def test_batch_above_max_fused_batch(small):
    limit = small.max_batch  # 64 for 4-bit codes (the wide kernel), 16 for uint8
    with pytest.raises(ValueError, match=rf"fused kernels take batch 1..{limit}, got {limit + 1}"):
        small(torch.zeros(limit + 1, 64, dtype=torch.float16))
    uint8 = LutGemv(random_codebook_tensor(32, 64, 64, seed=1))
    with pytest.raises(ValueError, match=rf"fused kernels take batch 1..{MAX_FUSED_BATCH}, got {MAX_FUSED_BATCH + 1}"):
        uint8(torch.zeros(MAX_FUSED_BATCH + 1, 64, dtype=torch.float16))


def test_unknown_variant():
    with pytest.raises(ValueError, match=r"unknown kernel variant 'lut64'"):
        LutGemv(random_codebook_tensor(32, 64, 16), variant="lut64")


@pytest.mark.parametrize("shape, dtype", [((1, 41), torch.float16), ((2, 40), torch.float16), ((40,), torch.float16), ((1, 40), torch.float32)])
def test_out_of_the_wrong_shape_or_dtype(small, shape, dtype):
    with pytest.raises(ValueError, match=r"out must be a contiguous float16 tensor of shape \(1, 40\)"):
        small(torch.zeros(1, 64, dtype=torch.float16), out=torch.empty(shape, dtype=dtype))


def test_x_not_a_tensor(small):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        small([0.0] * 64)


# -- no GPU -----------------------------------------------------------------------------------
NO_GPU_SCRIPT = """
import torch
from trapetum import gemv
from trapetum.codebook import random_codebook_tensor
assert not gemv.SIM, "the simulator is still on"
for what, call in (("require_gpu", gemv.require_gpu), ("LutGemv", lambda: gemv.LutGemv(random_codebook_tensor(32, 64, 16)))):
    try:
        call()
    except gemv.NoGPUError as e:
        print(what, "NoGPUError:", e)
    else:
        print(what, "returned without an error")
"""


def test_require_gpu_without_simulator_raises_a_helpful_NoGPUError(run_without_simulator):
    p = run_without_simulator(["-c", NO_GPU_SCRIPT])
    assert p.returncode == 0, p.stderr
    lines = dict(line.split(" ", 1) for line in p.stdout.strip().splitlines())
    for what in ("require_gpu", "LutGemv"):
        msg = lines.get(what, "")
        assert msg.startswith("NoGPUError:"), f"{what}: {msg or p.stdout}"
        assert "CUDA GPU" in msg and "NUMBA_ENABLE_CUDASIM=1" in msg, msg


@pytest.mark.parametrize(
    "K, n_in, plan",
    [
        (16, 448, {"warps": 2, "stages": 3, "ksplit": 1}),  # 7 chunks: the ring of 3 ends mid-round
        (64, 160, {"warps": 1, "stages": 4, "ksplit": 2, "RB": 1}),  # 10 chunks in slices of 5
        (256, 96, {"warps": 2, "stages": 4, "ksplit": 1}),  # fewer chunks than the ring holds
    ],
)
def test_deeper_pipelines_use_every_chunk_once(K, n_in, plan):
    ct = random_codebook_tensor(37, n_in, K, seed=n_in + K)
    g = LutGemv(ct, plan=plan)
    assert g.plan(1).stages == plan["stages"]
    check(g, x_for(n_in, 1, seed=5))


def test_a_pipeline_needs_two_stages():
    with pytest.raises(ValueError, match="stages must be at least 2"):
        lut_kernel(16, 1, 2, stages=1)


# -- the tensor-core kernels, 4-bit codes: mma (pair table, diagonal A, batch 1..16), dual (pair table, weights as A,
# diagonal B, batch 1..16), wide (pair table, x as A,
# up to 64) and tile (per-row tables, the weights as A, up to 64)
@pytest.mark.parametrize(
    "kernel, n_out, n_in, batch, plan",
    [
        ("mma", 64, 64, 1, {"warps": 4}),
        ("mma", 96, 128, 3, {"warps": 4, "ksplit": 2}),  # 3 row-blocks: the second block's g = 1 warps idle
        ("mma", 33, 64, 5, {"warps": 4}),  # batch pairs (0, 2), (1, 3), (4, -): an absent partner reads zeros
        ("mma", 64, 256, 16, {"warps": 8, "ksplit": 2}),  # four mmas a step
        ("mma", 64, 320, 1, {"warps": 4, "ksplit": 10}),  # the last block sums 8 partials at a time, then 2
        ("dual", 64, 64, 1, {"warps": 4, "stages": 1}),  # one chunk in use, one in flight
        ("dual", 96, 128, 3, {"warps": 4, "ksplit": 2}),  # 3 row-blocks: the second block's row-block 1 reads zeros; batch 2 alone in its mma
        ("dual", 33, 64, 2, {"warps": 4, "stages": 2}),  # both batches in one mma (columns 0..3 and 4..7)
        ("dual", 64, 320, 1, {"warps": 4, "ksplit": 10}),  # the last block sums 8 partials at a time, then 2
        ("dual", 64, 256, 16, {"warps": 8, "ksplit": 2}),  # eight mmas a step
        ("wide", 64, 64, 4, {"warps": 4}),  # one m-tile, 12 of its 16 rows absent
        ("wide", 96, 128, 17, {"warps": 4, "ksplit": 2, "stages": 4}),  # 3 row-blocks; a second m-tile with one row
        ("wide", 33, 64, 40, {"warps": 4, "stages": 1}),  # three m-tiles, a partial row-block
        ("wide", 64, 256, 64, {"warps": 8, "ksplit": 2}),  # four full m-tiles, two K-slices
        ("wide", 160, 128, 12, {"warps": 4, "ksplit": 2, "walk": 2}),  # block 0 walks pairs 0 and 2 (half idle)
        ("wide", 256, 64, 20, {"warps": 4, "ksplit": 2, "walk": 4}),  # one block a K-slice walks all four pairs
        ("tile", 64, 64, 8, {"warps": 4}),  # one n-tile; two of the block's four warps past the rows
        ("tile", 96, 128, 3, {"warps": 4, "ksplit": 2}),  # a partial n-tile (x rows 3..7 staged as zeros), two K-slices
        ("tile", 33, 64, 17, {"warps": 4, "stages": 1}),  # three n-tiles, a row-block of one row
        ("tile", 160, 128, 64, {"warps": 4, "ksplit": 2, "walk": 2}),  # eight n-tiles; block 0 walks both groups
        ("tile", 64, 320, 2, {"warps": 4, "ksplit": 10, "stages": 4}),  # the last block sums 8 partials, then 2
    ],
)
def test_tensor_core_kernels_match_float64_reference(kernel, n_out, n_in, batch, plan):
    ct = random_codebook_tensor(n_out, n_in, 16, seed=n_out + batch)
    g = LutGemv(ct, plan={"kernel": kernel, **plan})
    p = g.plan(batch)
    RB = plan["warps"] if kernel == "tile" else 2  # a tile block owns a row-block a warp
    assert (p.kernel, p.RB, p.warps, p.walk) == (kernel, RB, plan["warps"], plan.get("walk", 1))
    check(g, x_for(n_in, batch, seed=batch))
    if p.walk > 1 and batch <= 16:  # the kept K-split counters of every walked pair were reset
        assert not g._plans[batch][2][1].any()
        check(g, x_for(n_in, batch, seed=batch + 1))
    if p.ksplit > 1:  # calls through one launcher (its workspace and counters kept) each get their own x's answer
        xb, y = x_for(n_in, batch, seed=batch + 2), poisoned(batch, n_out)
        launch = g.bind(xb, y)
        for seed in (batch + 2, batch + 3):
            xb.copy_(x_for(n_in, batch, seed=seed))
            y.fill_(float("nan"))
            launch()
            assert max_rel_err(y, reference(xb, ct)) <= TOLERANCE


def test_mma_k_split_resets_its_counters():
    ct = random_codebook_tensor(70, 192, 16, seed=4)
    g = LutGemv(ct, plan={"kernel": "mma", "warps": 4, "ksplit": 3})
    assert g.plan(2).ksplit == 3
    y1 = check(g, x_for(192, 2, seed=1))
    assert not g._plans[2][2][1].any()
    y2 = check(g, x_for(192, 2, seed=2))
    assert not torch.equal(y1, y2)


def test_mma_plans_are_tuner_candidates_only_for_4_bit_codes():
    four = gemv.candidate_plans(4096, 128, 16, 1, 132, mma_budget=227 * 1024)
    assert {p.kernel for p in four} == {"lut", "mma", "dual"}
    assert all(p.cps >= p.warps // 2 * p.stages for p in four if p.kernel == "mma")
    assert all(p.cps >= p.warps * p.stages for p in four if p.kernel == "dual")  # every warp streams both row-blocks
    assert all(p.shared_bytes <= 227 * 1024 for p in four)
    assert {p.kernel for p in gemv.candidate_plans(4096, 256, 64, 1, 132, mma_budget=227 * 1024)} == {"lut"}
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 1, 132, mma_budget=0)} == {"lut"}


def test_batch_1_large_blocks_are_candidates_for_every_K():
    # 16 or 32 warps over whole rows: 4-bit since session 18, uint8 since session 28 (NOTES)
    for K, nchunks in ((16, 128), (64, 256), (256, 256)):
        large = {p.warps for p in gemv.candidate_plans(14336, nchunks, K, 1, 132) if p.warps >= 16}
        assert large, K
        assert all(p.ksplit <= 2 for p in gemv.candidate_plans(14336, nchunks, K, 1, 132) if p.warps >= 16)
        assert not any(p.warps >= 16 for p in gemv.candidate_plans(14336, nchunks, K, 2, 132) if p.kernel == "lut")


def test_plan_mma_heuristic_and_its_errors():
    p = gemv.plan_mma(14336, 128, 1, 132)
    assert p.kernel == "mma" and p.warps == 8 and p.ksplit * p.cps >= 128
    assert p.shared_bytes == gemv.mma_shared_bytes(1, p.warps, p.cps)
    assert gemv.plan_mma(768, 96, 1, 132).warps == 4  # 12 blocks of 64 rows: fewer warps, more K-slices
    with pytest.raises(ValueError, match="4, 8 or 16 warps"):
        gemv.plan_mma(4096, 128, 1, 132, warps=2)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.plan_mma(4096, 128, 1, 132, budget=48 * 1024)
    with pytest.raises(ValueError, match="batch 1..16"):
        gemv.plan_mma(4096, 128, 17, 132)


def test_plan_dual_and_its_errors():
    p = gemv.plan_dual(14336, 128, 1, 132, warps=16, ksplit=1)
    assert (p.kernel, p.RB, p.ksplit, p.cps) == ("dual", 2, 1, 128)
    assert p.shared_bytes == gemv.dual_shared_bytes(1, 16, 128)
    # both row-blocks' partials lie over the table, which they just fill at 16 warps x batch 16
    assert gemv.dual_shared_bytes(16, 16, 1) == gemv.mma_shared_bytes(16, 16, 1)
    with pytest.raises(ValueError, match="4, 8 or 16 warps"):
        gemv.plan_dual(4096, 128, 1, 132, warps=2)
    with pytest.raises(ValueError, match="batch 1..16"):
        gemv.plan_dual(4096, 128, 17, 132)
    with pytest.raises(ValueError, match="walk"):
        LutGemv(random_codebook_tensor(32, 64, 16, seed=1), plan={"kernel": "dual", "walk": 2}).plan(1)
    with pytest.raises(ValueError, match="4, 8 or 16 warps"):
        gemv.dual_kernel(1, 2)


@pytest.mark.parametrize("warps", [4, 8, 16])
@pytest.mark.parametrize("batch", range(1, MAX_FUSED_BATCH + 1))
def test_mma_launch_bounds_fit_the_registers_the_planner_assumes(batch, warps):
    # ptxas caps a thread's registers at 64 K / (min blocks x threads); the planner counts two 16-warp
    # blocks an SM, which needs 64 up to batch 4, and every plan must launch (at most 2048 threads an SM,
    # at most 255 registers), the most accumulators (batch 16) getting 128.
    blocks = gemv.mma_min_blocks(batch, warps)
    cap = min(255, 65536 // (blocks * warps * 32))
    assert blocks * warps * 32 <= 2048
    assert cap == 64 if batch <= 4 else cap >= 128


@pytest.mark.parametrize("K", [64, 256])
def test_mma_kernel_refuses_8_bit_codes(K):
    ct = random_codebook_tensor(32, 64, K, seed=1)
    with pytest.raises(ValueError, match="K=16"):
        LutGemv(ct, kernels=("mma",))
    with pytest.raises(ValueError, match="4-bit"):
        LutGemv(ct, plan={"kernel": "mma"}).plan(1)


def test_wide_kernel_batches_and_plans():
    ct = random_codebook_tensor(32, 64, 16, seed=2)
    assert LutGemv(ct).max_batch == 64 and LutGemv(ct, kernels=("lut", "mma")).max_batch == 16
    assert LutGemv(random_codebook_tensor(32, 64, 64, seed=2)).max_batch == 16
    with pytest.raises(ValueError, match="batch 1..64"):
        LutGemv(ct)(torch.zeros(65, 64, dtype=torch.float16))
    # tuner candidates: the wide kernel from batch 4 to 16, the tile kernel from 4, alone above 16
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 1, 132, mma_budget=227 * 1024)} == {"lut", "mma", "dual"}
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 3, 132, mma_budget=227 * 1024)} == {"lut", "mma", "dual"}
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 4, 132, mma_budget=227 * 1024)} == {"lut", "mma", "dual", "wide", "tile"}
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 8, 132, mma_budget=227 * 1024)} == {"lut", "mma", "dual", "wide", "tile"}
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 9, 132, mma_budget=227 * 1024)} == {"lut", "mma", "wide", "tile"}
    tile = gemv.candidate_plans(4096, 128, 16, 64, 132, mma_budget=227 * 1024)
    assert {p.kernel for p in tile} == {"tile"} and all(p.shared_bytes <= 227 * 1024 for p in tile)
    assert {p.kernel for p in gemv.candidate_plans(4096, 128, 16, 17, 132, mma_budget=227 * 1024)} == {"tile"}
    p = gemv.plan_wide(14336, 128, 64, 132)
    assert p.ksplit * p.cps >= 128 and p.shared_bytes == gemv.wide_shared_bytes(64, p.warps, p.cps)
    assert gemv.wide_xrow(3) % 8 == 4 and gemv.wide_xrow(4) % 8 == 4  # the quads of a quarter-warp in other banks
    with pytest.raises(ValueError, match="batch 1..64"):
        gemv.plan_wide(4096, 128, 65, 132)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.plan_wide(4096, 128, 64, 132, budget=48 * 1024)
    with pytest.raises(ValueError, match="unroll"):
        gemv.wide_kernel(8, 4, unroll=3)
    # blocks walking row pairs: the partials must fit the table (the x slice is kept), walk >= 1
    with pytest.raises(ValueError, match="partials"):
        gemv.plan_wide(14336, 128, 64, 132, warps=16)
    with pytest.raises(ValueError, match="partials"):
        gemv.wide_kernel(33, 16)
    with pytest.raises(ValueError, match="walk"):
        gemv.plan_wide(14336, 128, 32, 132, walk=0)
    with pytest.raises(ValueError, match="wide and tile kernels only"):
        LutGemv(ct, plan={"kernel": "mma", "walk": 2}).plan(1)
    wave = gemv.plan_wide(14336, 128, 32, 132, warps=8, ksplit=4, walk="wave")
    blocks = wave.grid(448)[0] * wave.ksplit
    assert wave.walk > 1 and blocks <= gemv.wide_blocks_per_sm(32, 8, wave.shared_bytes) * 132 < blocks + wave.ksplit * wave.walk
    assert gemv.plan_wide(64, 128, 32, 132, walk=9).walk == 1  # never more than the layer's pairs
    walks = {p.walk for p in gemv.candidate_plans(14336, 128, 16, 16, 132, mma_budget=227 * 1024) if p.kernel == "wide"}
    assert 1 in walks and max(walks) > 1  # each wide plan also as one wave of walking blocks


def test_tile_kernel_plans_and_errors():
    p = gemv.plan_tile(14336, 128, 64, 132)
    assert p.kernel == "tile" and p.RB == p.warps and p.ksplit * p.cps >= 128
    assert p.shared_bytes == gemv.tile_shared_bytes(64, p.warps, p.cps) <= 227 * 1024
    assert gemv.tile_xrow(3) % 32 == 16 and gemv.tile_xrow(4) % 32 == 16  # batch rows r, r + 1: other banks
    assert gemv.plan_tile(768, 96, 32, 132).warps == 4  # 24 row-blocks: 4 warps, more blocks
    assert p.grid(448) == (-(-448 // p.warps), p.ksplit)
    # registers: 128 a thread up to batch 32, 245 or so above (ptxas on the CPU)
    assert [gemv.tile_min_blocks(b, 8) for b in (2, 16, 32, 64)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="batch 1..64"):
        gemv.plan_tile(4096, 128, 65, 132)
    with pytest.raises(ValueError, match="4, 8 or 16 warps"):
        gemv.plan_tile(4096, 128, 8, 132, warps=2)
    with pytest.raises(ValueError, match="unrolls 1, 2, 4 chunks"):
        gemv.plan_tile(4096, 128, 8, 132, stages=3)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.plan_tile(4096, 128, 64, 132, budget=4 * 1024)
    with pytest.raises(ValueError, match="at least"):
        gemv.plan_tile(4096, 128, 64, 132, ksplit=1)
    with pytest.raises(ValueError, match="walk"):
        gemv.plan_tile(4096, 128, 8, 132, walk=0)
    with pytest.raises(ValueError, match="unroll 1, 2 or 4"):
        gemv.tile_kernel(8, 4, unroll=3)
    # the heuristic plan above batch 16 is the tile kernel's; a weight limited to it plans it at any batch
    ct = random_codebook_tensor(64, 64, 16, seed=3)
    assert LutGemv(ct).plan(17).kernel == "tile" and LutGemv(ct, kernels=("tile",)).plan(1).kernel == "tile"
    assert LutGemv(ct, kernels=("lut", "tile")).max_batch == 64


def test_large_batches_keep_no_workspace():
    # Prefill-sized batches allocate their K-split workspace per call; decode batches keep theirs
    # (a CUDA graph replays it). Both give the right answer twice in a row (counters reset).
    ct = random_codebook_tensor(64, 128, 16, seed=8)
    g = LutGemv(ct, plan={"kernel": "wide", "warps": 4, "ksplit": 2})
    for _ in range(2):
        check(g, x_for(128, 17, seed=4))
    assert g._plans[17][2] is None
    check(g, x_for(128, 16, seed=5))
    assert g._plans[16][2] is not None


def test_kernels_must_name_known_families():
    ct = random_codebook_tensor(32, 64, 16, seed=1)
    with pytest.raises(ValueError, match="kernels must name"):
        LutGemv(ct, kernels=("wgmma",))
    g = LutGemv(ct, kernels=("mma",))  # untuned (simulator): the mma heuristic plan
    assert g.plan(1).kernel == "mma"
    check(g, x_for(64, 1, seed=3))


def test_stream_floor_kernel_reads_every_word_once():
    # The floor's kernel XORs what each thread reads into out[thread]: the XOR of out is the XOR of
    # the buffer only if every word was read exactly once (a grid-stride of 4 pieces a step, then the rest).
    import numpy as np

    from trapetum.gemv import stream_kernel

    rng = np.random.default_rng(0)
    for n16, blocks, threads in ((37, 2, 4), (64, 1, 8), (5, 3, 2)):
        a = rng.integers(-2**31, 2**31 - 1, size=4 * n16, dtype=np.int64).astype(np.int32)
        out = np.zeros(blocks * threads, dtype=np.int32)
        stream_kernel[blocks, threads](a, out, n16)
        assert np.bitwise_xor.reduce(out) == np.bitwise_xor.reduce(a)


# -- operations fused into the lut kernel (the decode step's norms, SiLU and residual adds) -------
@pytest.mark.parametrize("pre,post", [("rms", ""), ("silu", ""), ("", "add"), ("rms", "add"), ("silu", "add")])
@pytest.mark.parametrize("K,batch,plan", [(16, 1, {"ksplit": 1}), (16, 2, {"ksplit": 2}), (64, 1, {"ksplit": 2, "RB": 1}),
                                          (256, 1, {"ksplit": 1, "RB": 1, "warps": 16}),
                                          # the dual kernel: the whole row staged, then K-slices with an odd row-block count
                                          (16, 1, {"kernel": "dual", "warps": 4, "ksplit": 1, "stages": 1}),
                                          (16, 3, {"kernel": "dual", "warps": 4, "ksplit": 2})])
def test_fused_operations_match_the_float64_reference(pre, post, K, batch, plan):
    n_in, n_out, eps = 64, 96, 1e-5
    ct = random_codebook_tensor(n_out, n_in, K, seed=7)
    g = LutGemv(ct, plan=plan)
    x = x_for(2 * n_in if pre == "silu" else n_in, batch, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    res = x_for(n_out, batch, seed=9)
    y = poisoned(batch, n_out)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, eps=eps, res=res if post else None)()
    err = max_rel_err(y, reference(x, ct, pre, post, w, res, eps))
    assert torch.isfinite(y).all() and err <= TOLERANCE, err


def test_fused_residual_add_may_update_its_input_in_place():
    ct = random_codebook_tensor(64, 64, 16, seed=2)
    g = LutGemv(ct, plan={"ksplit": 2})
    x, h = x_for(64, 1, seed=4), x_for(64, 1, seed=6)
    want = reference(x, ct, post="add", res=h)
    g.bind(x, h, post="add", res=h)()
    assert max_rel_err(h, want) <= TOLERANCE


def test_a_fused_call_takes_its_own_lut_plan_when_the_plain_call_tuned_to_a_tensor_core_kernel(monkeypatch):
    # On a GPU the plain call's tuner may crown the mma kernel (13B's qkv GEMV did); the fused call is
    # tuned over lut plans alone, so the layer stays fusable and fuses (here the tuner is scripted).
    n_in, n_out = 64, 96
    ct = random_codebook_tensor(n_out, n_in, 16, seed=11)
    g = LutGemv(ct)
    sms = gemv.sm_count(g.device)
    mma = gemv.plan_mma(n_out, g.nchunks, 1, sms, gemv.OPTIN_SIM)
    lut = plan_launch(n_out, g.nchunks, 16, 1, sms, ksplit=2)
    asked = []

    def scripted_tune(B=1, pre="", post=""):
        asked.append((pre, post))
        return lut if pre or post else mma

    g.tune_on_gpu = True
    monkeypatch.setattr(g, "tune", scripted_tune)
    assert g.fusable(1) and asked == []  # fusability no longer needs the plain call's plan
    assert g.plan(1).kernel == "mma"
    assert g.fused_plan(1, "rms", "") == lut and asked == [("", ""), ("rms", "")]
    x = x_for(n_in, 1, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    y = poisoned(1, n_out)
    g.bind(x, y, pre="rms", norm_weight=w, eps=1e-5)()
    assert max_rel_err(y, reference(x, ct, "rms", "", w, None, 1e-5)) <= TOLERANCE


def test_a_weight_held_to_the_tensor_core_kernels_is_not_fusable():
    ct = random_codebook_tensor(96, 64, 16, seed=11)
    x, y = x_for(64, 1), poisoned(1, 96)
    for g in (LutGemv(ct, plan={"kernel": "mma"}), LutGemv(ct, kernels=("mma",))):
        assert not g.fusable(1)
        with pytest.raises(ValueError, match="cannot fuse"):
            g.bind(x, y, post="add", res=torch.zeros(1, 96, dtype=torch.float16))


def test_a_weight_held_to_the_dual_kernel_fuses_with_it():
    ct = random_codebook_tensor(96, 64, 16, seed=11)
    g = LutGemv(ct, kernels=("dual",))  # untuned (simulator): the dual heuristic plan
    assert g.fusable(1) and g.plan(1).kernel == "dual"
    x, h = x_for(64, 1, seed=4), x_for(96, 1, seed=6)
    want = reference(x, ct, post="add", res=h)
    g.bind(x, h, post="add", res=h)()  # the residual stream updated in place
    assert max_rel_err(h, want) <= TOLERANCE
    with pytest.raises(ValueError, match="pre must be one of"):
        gemv.dual_kernel(1, 4, pre="gelu")


@pytest.mark.parametrize("pre,post,batch", [("rms", "", 1), ("silu", "add", 3), ("", "", 2)])
def test_the_dual_kernel_bound_after_a_kernel_builds_its_table_before_it_waits(pre, post, batch):
    # after_kernel: bind launches a dual plan programmatically, in the form that builds its table
    # (weights only) before the wait and stages x after it; the result must not change
    n_in, n_out, eps = 64, 96, 1e-5
    ct = random_codebook_tensor(n_out, n_in, 16, seed=13)
    g = LutGemv(ct, plan={"kernel": "dual", "warps": 4, "ksplit": 2, "stages": 1})
    x = x_for(2 * n_in if pre == "silu" else n_in, batch, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    res = x_for(n_out, batch, seed=9)
    y = poisoned(batch, n_out)
    gemv._kernel_cache.pop(("dual", batch, 4, 1, pre, post, True), None)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, eps=eps, res=res if post else None, after_kernel=True)()
    assert ("dual", batch, 4, 1, pre, post, True) in gemv._kernel_cache  # the early form ran
    err = max_rel_err(y, reference(x, ct, pre, post, w, res, eps))
    assert torch.isfinite(y).all() and err <= TOLERANCE, err
    assert "dual" in gemv.PROGRAMMATIC_KERNELS and "lut" not in gemv.PROGRAMMATIC_KERNELS  # the lut kernel launches serially


def test_fused_operations_refuse_bad_operands(small):
    x = x_for(small.n_in, 1)
    y = poisoned(1, small.n_out)
    with pytest.raises(ValueError, match="pre must be one of"):
        small.bind(x, y, pre="gelu")
    with pytest.raises(ValueError, match="norm_weight"):
        small.bind(x, y, pre="rms")
    with pytest.raises(ValueError, match="norm_weight"):
        small.bind(x, y, pre="rms", norm_weight=torch.ones(small.n_in))  # float32
    with pytest.raises(ValueError, match=r"shape \(128,\)|\(batch, 128\)"):
        small.bind(x, y, pre="silu")  # silu takes [gate | up], twice the width
    with pytest.raises(ValueError, match="res"):
        small.bind(x, y, post="add")
    with pytest.raises(ValueError, match="out must be"):
        small.bind(x, y, post="add", res=torch.zeros(1, small.n_out + 1, dtype=torch.float16))


def test_programmatic_launches_carry_the_attribute_only_inside_the_context(monkeypatch):
    # numba-cuda builds each launch's cuda.core LaunchConfig itself; the patched constructor adds
    # programmatic_stream_serialization only to launches made under gemv.programmatic(True).
    import types

    made = []
    fake = types.SimpleNamespace(LaunchConfig=lambda **kw: made.append(kw) or kw)
    gemv._install_programmatic(fake)
    gemv._install_programmatic(fake)  # idempotent: not wrapped twice
    monkeypatch.setattr(gemv, "programmatic_kernels", lambda: True)
    fake.LaunchConfig(grid=1, block=32)
    with gemv.programmatic(True):
        fake.LaunchConfig(grid=1, block=32)
        with gemv.programmatic(False):
            fake.LaunchConfig(grid=2, block=32)
        fake.LaunchConfig(grid=3, block=32)
    fake.LaunchConfig(grid=4, block=32)
    assert [("programmatic_stream_serialization" in kw, kw["grid"]) for kw in made] == [
        (False, 1), (True, 1), (False, 2), (True, 3), (False, 4)]
    monkeypatch.setattr(gemv, "programmatic_kernels", lambda: False)
    assert not gemv.programmatic(True).on  # no sm_90 (or no attribute in cuda.core): plain launches


from numba import cuda  # noqa: E402  (after conftest has switched the simulator on)


@cuda.jit
def _sum_splits_each(ws, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = gemv.sum_splits(ws[:i + 1], i + 1, 0, 0)  # a read past slice i would raise


def test_sum_splits_adds_every_slice_once_whatever_the_count():
    # The K-split finish loads the next 1..32 slices in one go (8, 16 or 32 loads), the slices past
    # the last reading it again: every count from 1 to 72 (three rounds, each branch) must add each
    # partial exactly once (small integers, so every order of the sums is exact).
    import numpy as np

    ws = np.arange(1, 73, dtype=np.float32).reshape(72, 1, 1)
    out = np.full(72, np.nan, dtype=np.float32)
    _sum_splits_each[1, 72](ws, out)
    assert np.array_equal(out, np.cumsum(ws.ravel())), out

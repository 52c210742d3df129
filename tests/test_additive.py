"""Additive (AQLM-style) vector codebooks: format, files, quantizer, AQLM loader and the fused
kernel in numba's CUDA simulator against float64 (conftest.py turns the simulator on).

Simulated CUDA threads are Python threads, so shapes are tiny and plans are forced with 2 warps:
a 16-byte chunk column is 8 groups (64 columns) at M=2 and 4 groups (32 columns) at M=4.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from trapetum import additive as A
from trapetum import gemv
from trapetum.additive import (
    AdditiveGemv,
    AdditiveTensor,
    AqlmFormatError,
    from_aqlm,
    to_aqlm,
    load_aqlm_checkpoint,
    quantize_additive,
    random_additive_tensor,
    reference,
)
from trapetum.codebook import CodebookFormatError
from trapetum.gemv import max_rel_err

pytestmark = pytest.mark.skipif(
    not gemv.SIM and os.environ.get("NUMBA_ENABLE_CUDASIM") == "0", reason="NUMBA_ENABLE_CUDASIM=0: written for the CUDA simulator"
)
TOL = A.TOLERANCE


def x_for(n_in, batch, seed=1):
    return torch.randn(batch, n_in, generator=torch.Generator().manual_seed(seed)).half()


def check(g: AdditiveGemv, x: torch.Tensor, t: AdditiveTensor | None = None) -> torch.Tensor:
    """g(x) into a NaN-poisoned output: every output written, within TOL of float64."""
    y = torch.full((x.shape[0], g.n_out), float("nan"), dtype=torch.float16)
    assert g(x, out=y) is y
    assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} outputs left unwritten"
    err = max_rel_err(y, reference(x, t if t is not None else g.t))
    assert err <= TOL, f"max rel err {err:.3g} > {TOL}"
    return y


def with_bias(t, seed=0):
    b = (torch.randn(t.out_features, generator=torch.Generator().manual_seed(seed)) * 0.1).half()
    return AdditiveTensor(t.codes, t.codebooks, t.scales, b)


# -- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("M, n_in", [(2, 64), (4, 32)])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_kernel_matches_float64(M, n_in, batch):
    t = random_additive_tensor(33, n_in, M, seed=M * batch)
    plan = {"warps": 2}  # batch 16: 8 tiles of 2 (the simulator allows 48 KiB of table)
    check(AdditiveGemv(t, plan=plan), x_for(n_in, batch, seed=batch), t)


@pytest.mark.parametrize(
    "M, n_out, n_in, batch, plan",
    [
        (2, 40, 192, 1, {"cps": 1, "warps": 2}),  # 3 chunk columns, K-split 3
        (4, 37, 96, 3, {"cps": 2, "warps": 2, "bt": 1}),  # K-slices of 2 and 1 chunk; three batch tiles
        (2, 70, 64, 2, {"RB": 1, "warps": 2}),  # 3 row-blocks, a block each; warp 1 idle in phase 2
        (4, 130, 32, 1, {"RB": 4, "warps": 2}),  # 5 row-blocks: each warp streams two, the ring alternates
        (2, 100, 128, 3, {"RB": 2, "cps": 1, "warps": 2, "bt": 2}),  # K-split, two row-groups, batch tiles of 2 and 1
        # the table on the tensor cores: 2 batch rows x 8 groups fill 2 N-tiles, 32 M-tiles over 2 warps
        (2, 40, 128, 2, {"cps": 1, "warps": 2, "bt": 2, "build": "mma"}),
        # M = 4: 8 groups a K-slice, but the last slice holds 1 chunk of 3 (4 groups): half the columns zero
        (4, 33, 96, 1, {"cps": 2, "warps": 1, "build": "mma"}),
        # fp16 tables: 2-byte entries and lookups, a K-split and batch tiles
        (2, 40, 128, 2, {"cps": 1, "warps": 2, "bt": 2, "build": "mma", "table": "fp16"}),
        # K-split 10: the last block sums eight partials at a time, then a remainder of two
        (4, 33, 320, 1, {"cps": 1, "warps": 2, "build": "mma", "table": "fp16"}),
        (4, 37, 96, 3, {"cps": 2, "warps": 2, "bt": 2, "build": "mma", "table": "fp16"}),
    ],
)
def test_kernel_plans(M, n_out, n_in, batch, plan):
    t = with_bias(random_additive_tensor(n_out, n_in, M, seed=n_out), seed=n_in)
    g = AdditiveGemv(t, plan=plan)
    p = g.plan(batch)
    for k, v in plan.items():
        assert getattr(p, k) == v
    check(g, x_for(n_in, batch, seed=n_out), t)


@pytest.mark.parametrize("table", ["fp32", "fp16"])
def test_tables_stay_finite_for_activations_in_the_thousands(table):
    # Entries dot(codebook entry, x group) beyond fp16's 65504: the fp16 table must scale its
    # K-slice by a power of two (and the sums back), not overflow to inf.
    r = random_additive_tensor(40, 128, 2, seed=9)
    t = AdditiveTensor(r.codes, r.codebooks * 64, (r.scales.float() / 4096).half())  # same codes, larger entries
    x = x_for(128, 2, seed=9) * 3000
    x[1, 70] = -60000.0  # one slice has a far larger max |x| than the other
    l1 = t.codebooks.float().abs().sum(-1).max()
    assert float(x.float().abs().max()) * float(l1) > 65504 * 4  # the unscaled table would overflow
    assert float(reference(x, t).abs().max()) < 30000  # while y itself is well inside fp16
    check(AdditiveGemv(t, plan={"cps": 1, "warps": 2, "bt": 2, "build": "mma", "table": table}), x, t)


# -- the streaming kernel (M = 2, batch 1) ------------------------------------------------------
# A chunk is 64 groups (512 inputs); a block holds two 64 KiB chunk tables, so the simulator plans
# with an H100's opt-in shared memory. 4 warps keep the simulated threads few.
@pytest.mark.parametrize(
    "n_out, n_in, plan",
    [
        (38, 1088, {"warps": 4, "ksplit": 2, "slots": 3}),  # 3 chunks (the last half zero-padded groups), K-split 2 (slices of 2 and 1)
        (21, 576, {"warps": 4, "ksplit": 1, "slots": 2}),  # a quad of 1 row; 2 chunks
        (70, 512, {"warps": 8, "ksplit": 1, "slots": 2}),  # one chunk: no table built inside the loop
    ],
)
def test_stream_kernel_matches_float64(n_out, n_in, plan):
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=n_out), seed=n_in)
    g = AdditiveGemv(t, plan={"kernel": "stream", **plan})
    p = g.plan(1)
    assert isinstance(p, A.StreamPlan) and (p.warps, p.ksplit, p.slots) == (plan["warps"], plan["ksplit"], plan["slots"])
    check(g, x_for(n_in, 1, seed=n_out), t)


def test_stream_tables_scale_activations_in_the_thousands():
    # As the table kernel's fp16 tables: each chunk's table is scaled by its own power of two.
    r = random_additive_tensor(9, 1024, 2, seed=4)
    t = AdditiveTensor(r.codes, r.codebooks * 64, (r.scales.float() / 4096).half())
    x = x_for(1024, 1, seed=4) * 3000
    x[0, 700] = -60000.0  # only the second chunk needs a large factor
    assert float(x.float().abs().max()) * float(t.codebooks.float().abs().sum(-1).max()) > 65504 * 4
    check(AdditiveGemv(t, plan={"kernel": "stream", "warps": 4, "ksplit": 1, "slots": 2}), x, t)


@pytest.mark.parametrize("plan", [{"kernel": "chunk", "warps": 4, "tile": 4, "rows": 64},
                                  {"kernel": "stream", "warps": 4, "ksplit": 1, "slots": 2}])
def test_stream_tables_keep_a_code_words_four_entries_summed_in_fp16_finite(plan):
    # The streaming and chunk kernels sum a code word's four lookups in fp16 (gemv.half_sum4), so their
    # tables keep entries below 2**13. Here every lookup is the largest entry the bound allows:
    # |x| = 16304 on every input, each signed as the one codebook entry (L1 1.99), so an entry is
    # ~32400, and four of them overflow fp16 unless the table is scaled down by 4 first.
    r = random_additive_tensor(40, 1024, 2, seed=5)
    sign = torch.tensor([1.0, -1.0] * 4)
    cb = (sign * 0.24875).expand(r.codebooks.shape).contiguous().half()
    t = AdditiveTensor(torch.zeros_like(r.codes), cb, torch.full_like(r.scales, 2.0 ** -10))
    x = (sign.repeat(128) * 16304.0).half()[None]
    assert A.codebook_exponent(cb) == 1 and 4 * 16304.0 * float(cb[0, 0].float().abs().sum()) > 65504
    check(AdditiveGemv(t, plan=plan, tune=False), x, t)


# The chunk kernel: one chunk's table a block, rows streamed through it in tiles of 16 or 32.
@pytest.mark.parametrize(
    "n_out, n_in, plan",
    [
        (150, 1088, {"warps": 4, "tile": 4, "rows": 128}),  # 3 chunks (the last half padding), 2 row-groups, 2 tiles a warp
        (70, 512, {"warps": 4, "tile": 8, "rows": 64}),  # one chunk: y written by the tiles themselves
        (21, 1024, {"warps": 2, "tile": 8, "rows": 32}),  # a quad of 1 row; tiles mostly past the last row
    ],
)
def test_chunk_kernel_matches_float64(n_out, n_in, plan):
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=n_out), seed=n_in)
    g = AdditiveGemv(t, plan={"kernel": "chunk", **plan})
    p = g.plan(1)
    assert isinstance(p, A.StreamPlan) and p.tile == plan["tile"] and p.ksplit == -(-n_in // 512) and p.qpb % (p.tile * p.warps) == 0
    check(g, x_for(n_in, 1, seed=n_out), t)
    assert g._tiled_t is None and g._stream_t is not None  # the streaming kernel's layout


@pytest.mark.parametrize("pre,post,n_in", [("rms", "add", 1088), ("rms", "", 512), ("silu", "add", 1088), ("", "add", 1088)])
def test_chunk_kernel_fused_operations(pre, post, n_in):
    # pre='rms': each chunk's block sums only its own chunk's squares; 3 chunks meet in the workspace's
    # last column and the finishing block applies 1 / rms, one chunk applies it itself
    n_out = 70
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=7), seed=8)
    g = AdditiveGemv(t, plan={"kernel": "chunk", "warps": 4, "tile": 4, "rows": 64})
    x = x_for(2 * n_in if pre == "silu" else n_in, 1, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    h = x_for(n_out, 1, seed=9)
    want = reference(x, t, pre, post, w, h, 1e-5)
    y = h if post else torch.full((1, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, res=h if post else None)()  # the add in place, as the step does
    assert g.fused_plan(1, pre, post).ksplit == -(-n_in // 512)
    err = max_rel_err(y, want)
    assert torch.isfinite(y).all() and err <= TOL, err


@pytest.mark.parametrize("rows, fw, pre, post", [(256, 4, "rms", "add"), (256, 4, "", ""), (128, 2, "rms", "add")])
def test_chunk_kernel_finish_sums_adjacent_rows(rows, fw, pre, post):
    # The finishing block's threads each sum fw adjacent rows (one 8- or 16-byte load a K-slice) with
    # the K-slices' sums of squares loaded beside the first of them. 266 rows: the last row-group
    # holds 10, inside a last quad of 2 padding rows, so most of its threads' loads are clamped.
    n_out, n_in = 266, 1088
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=11), seed=12)
    g = AdditiveGemv(t, plan={"kernel": "chunk", "warps": 2, "tile": 4, "rows": rows})
    p = g.fused_plan(1, pre, post)
    assert A.chunk_finish_rows(p.qpb, p.warps) == fw and p.ksplit == 3 and p.grid(n_out)[0] == -(-67 * 4 // rows)
    x = x_for(n_in, 1, seed=13) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(14)) + 0.5).half()
    h = x_for(n_out, 1, seed=15)
    want = reference(x, t, pre, post, w if pre else None, h if post else None, 1e-5)
    y = h.clone() if post else torch.full((1, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre else None, res=y if post else None)()
    err = max_rel_err(y, want)
    assert torch.isfinite(y).all() and err <= TOL, err


@pytest.mark.parametrize("n_in", [1088, 512])
def test_chunk_kernel_rms_survives_g_x_past_fp16(n_in):
    # The deferred norm stages g * x before normalising: 60000 x 1.5 is past fp16's 65504, where
    # LlamaRMSNorm's normalised x is not. The block stages that chunk at 2**-k instead (3 chunks: one
    # of them; 1 chunk: the row), and the answer must still match float64.
    n_out = 40
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=7), seed=8)
    g = AdditiveGemv(t, plan={"kernel": "chunk", "warps": 4, "tile": 4, "rows": 64})
    x = x_for(n_in, 1, seed=3)
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    x[0, n_in - 100], w[n_in - 100] = 60000.0, 1.5
    x[0, 10] = -2000.0
    y = torch.full((1, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre="rms", norm_weight=w)()
    err = max_rel_err(y, reference(x, t, "rms", "", w, None, 1e-5))
    assert torch.isfinite(y).all() and err <= TOL, err


# M=4 as two M=2 layers over the same x and scales (codebooks 0-1, then 2-3): the chunk kernel's grid
# has twice the chunks, its second half reading the second codebook pair over x's chunks again.
@pytest.mark.parametrize(
    "n_out, n_in, plan",
    [
        (150, 1088, {"warps": 4, "tile": 4, "rows": 128}),  # 3 x-chunks, 6 chunks, 2 row-groups
        (70, 512, {"warps": 4, "tile": 8, "rows": 64}),  # one x-chunk: two chunks meet in the finish
    ],
)
def test_chunk_kernel_runs_m4_as_two_halves(n_out, n_in, plan):
    t = with_bias(random_additive_tensor(n_out, n_in, 4, seed=n_out), seed=n_in)
    g = AdditiveGemv(t, plan={"kernel": "chunk", **plan})
    p = g.plan(1)
    assert isinstance(p, A.StreamPlan) and p.kernel == "chunk" and p.ksplit == 2 * -(-n_in // 512)
    check(g, x_for(n_in, 1, seed=n_out), t)
    assert torch.equal(g.t.codes, t.codes)  # the natural codes back from the two halves' layouts


@pytest.mark.parametrize("pre,post", [("rms", "add"), ("silu", ""), ("", "add")])
def test_chunk_kernel_m4_fused_operations(pre, post):
    # pre='rms': only the first half's blocks count their chunk's squares (each input once)
    n_out, n_in = 70, 1088
    t = with_bias(random_additive_tensor(n_out, n_in, 4, seed=17), seed=18)
    g = AdditiveGemv(t, plan={"kernel": "chunk", "warps": 4, "tile": 4, "rows": 64})
    x = x_for(2 * n_in if pre == "silu" else n_in, 1, seed=19) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(20)) + 0.5).half()
    h = x_for(n_out, 1, seed=21)
    want = reference(x, t, pre, post, w if pre == "rms" else None, h if post else None, 1e-5)
    y = h.clone() if post else torch.full((1, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, res=y if post else None)()
    err = max_rel_err(y, want)
    assert torch.isfinite(y).all() and err <= TOL, err


def test_m4_stream_layout_and_plans():
    t = random_additive_tensor(38, 1088, 4, seed=3)
    w = A.stream_codes(t.codes)
    assert torch.equal(w, torch.cat([A.stream_codes(t.codes[..., :2]), A.stream_codes(t.codes[..., 2:])]))
    assert torch.equal(A.unstream_codes(w, 38, 136, M=4), t.codes)
    assert torch.equal(A.unstream_codes(w, 38, 136, rows=(4, 38), M=4), t.codes[4:])
    with pytest.raises(ValueError, match="M=2 or M=4"):
        A.stream_codes(t.codes[..., :3])
    p2, p4 = A.plan_chunk(14336, 4096, 227 * 1024, rows=512), A.plan_chunk(14336, 4096, 227 * 1024, rows=512, M=4)
    assert (p2.ksplit, p4.ksplit) == (8, 16) and p4.qpb == p2.qpb
    with pytest.raises(ValueError, match="at M=4"):  # 32 chunks: more than a cluster holds
        A.plan_chunk(14336, 8192, 227 * 1024, cluster=True, M=4)
    assert A.plan_chunk(14336, 2048, 227 * 1024, cluster=True, M=4).cluster == 8
    assert A.plan_chunk(14336, 4096, 227 * 1024, cluster=True, M=4).cluster == 16  # a non-portable cluster
    with pytest.raises(ValueError, match="M=2 or M=4"):
        A.plan_chunk(64, 512, 227 * 1024, M=3)
    with pytest.raises(ValueError, match="M=2 at batch 1"):  # the streaming kernel stays M=2
        AdditiveGemv(random_additive_tensor(16, 512, 4), plan={"kernel": "stream", "warps": 4})(torch.randn(1, 512).half())
    assert all(q.ksplit == 16 for q in A.chunk_candidates(14336, 4096, 227 * 1024, M=4))


def test_chunk_plans_and_their_errors():
    p = A.plan_chunk(14336, 4096, 227 * 1024, warps=8, tile=4, rows=512)
    assert (p.qpb * 4, p.ksplit, p.grid(14336)) == (512, 8, (28, 8)) and "a chunk a block" in p.label()
    assert A.plan_chunk(64, 4096, 227 * 1024, rows=4096).qpb == 32  # never past the layer's rows (a round of tiles)
    for kw in ({"warps": 12}, {"tile": 2}, {"rows": 0}):
        with pytest.raises(ValueError, match="chunk plan"):
            A.plan_chunk(64, 512, 227 * 1024, **kw)
    with pytest.raises(ValueError, match="shared memory"):
        A.plan_chunk(64, 512, 48 * 1024)
    got = A.chunk_candidates(14336, 4096, 227 * 1024)
    assert got and len({q.label() for q in got}) == len(got) and all(q.tile for q in got)
    with pytest.raises(ValueError, match="leave the streaming kernel out"):
        AdditiveGemv(random_additive_tensor(16, 512, 2), plan={"kernel": "chunk"}, kernels=("table",))


def test_chunk_cluster_plans_and_their_errors():
    # A cluster finish: the row-group's 8 chunks one cluster; the chunk's sum of squares after x (dynamic),
    # each block's row sums a static array of CLUSTER_ROWS.
    p = A.plan_chunk(14336, 4096, 227 * 1024, warps=8, tile=8, rows=512, cluster=True)
    assert (p.cluster, p.grid(14336), p.shared_bytes) == (8, (28, 8), A.chunk_shared_bytes() + 4)
    assert A.chunk_shared_bytes(True) == A.chunk_shared_bytes() + 4 * (1 + A.CLUSTER_ROWS)
    assert A.plan_chunk(14336, 4096, 227 * 1024, warps=8, tile=8, rows=1024, cluster=True).qpb * 4 == A.CLUSTER_ROWS
    with pytest.raises(ValueError, match="at most 1024 rows a block"):
        A.plan_chunk(14336, 4096, 227 * 1024, warps=8, tile=8, rows=2048, cluster=True)
    too_big = dataclasses.replace(p, qpb=512)  # 2048 rows: a plan built by hand, past the static array
    g = AdditiveGemv(random_additive_tensor(16, 1024, 2), plan={"kernel": "chunk", "warps": 4, "tile": 4, "rows": 16})
    with pytest.raises(ValueError, match="at most 1024 rows a block"):
        g._launch_parts(1, too_big)
    assert "clusters of 8" in p.label() and A.plan_chunk(14336, 4096, 227 * 1024).cluster == 0
    assert A.plan_chunk(100, 1024, 227 * 1024, cluster=True).cluster == 2
    for n_in in (512, 8704):  # 1 chunk (nothing to meet) and 17 (past what sm_90 lets a cluster hold)
        with pytest.raises(ValueError, match="cluster finish takes 2 to 16 chunks"):
            A.plan_chunk(64, n_in, 227 * 1024, cluster=True)
    # 9 to 16 chunks: a non-portable cluster, which the launch opts in to (gemv.with_shared_limit)
    assert [A.plan_chunk(64, n_in, 227 * 1024, cluster=True).cluster for n_in in (4608, 5120, 8192)] == [9, 10, 16]
    assert any(q.cluster == 10 for q in A.chunk_candidates(15360, 5120, 227 * 1024))
    assert not any(q.cluster for q in A.chunk_candidates(15360, 5120, 227 * 1024, max_cluster=A.PORTABLE_CLUSTER))
    got = A.chunk_candidates(4096, 4096, 227 * 1024)
    # every plan of up to CLUSTER_ROWS rows a block also with a cluster
    assert sum(q.cluster == 8 for q in got) == sum(q.cluster == 0 and q.qpb * 4 <= A.CLUSTER_ROWS for q in got) > 0
    assert not any(q.cluster for q in A.chunk_candidates(4096, 11008, 227 * 1024))
    # before sm_90 (an sm_86 rerun of a chapter) the tuner is offered no cluster plan to compile
    assert [q for q in got if not q.cluster] == A.chunk_candidates(4096, 4096, 227 * 1024, clusters=False)
    assert not A.clusters_available("cpu")
    with pytest.raises(ValueError, match="GPU only"):  # the simulator runs a grid's blocks one at a time
        AdditiveGemv(random_additive_tensor(16, 1024, 2), plan={"kernel": "chunk", "warps": 4, "tile": 4, "rows": 16,
                                                                "cluster": True})(torch.randn(1, 1024).half())


@pytest.mark.parametrize("n_out, n_in", [(38, 1088), (4, 512), (130, 64)])
def test_stream_layout_and_its_inverse(n_out, n_in):
    t = random_additive_tensor(n_out, n_in, 2, seed=n_out)
    w = A.stream_codes(t.codes)
    nq, nch = -(-n_out // 4), -(-(n_in // 8) // 64)
    assert w.dtype == torch.int32 and w.numel() == nch * nq * 32 * 4
    assert torch.equal(A.unstream_codes(w, n_out, n_in // 8), t.codes)
    for r0, r1 in ((0, 1), (4, n_out), (n_out // 8 * 4, n_out)):  # row slabs copy only their quads
        assert torch.equal(A.unstream_codes(w, n_out, n_in // 8, rows=(r0, r1)), t.codes[r0:r1])
    # word ((c * quads + q) * 32 + s) * 4 + r: row 4q + r's codes of groups 64c + s and 64c + s + 32
    b = w.view(torch.uint8).reshape(nch, nq, 32, 4, 4)
    row, grp = min(n_out - 1, 5), min(n_in // 8 - 1, 3)
    assert b[0, row // 4, grp, row % 4, 0] == t.codes[row, grp, 0] and b[0, row // 4, grp, row % 4, 1] == t.codes[row, grp, 1]


def test_a_stream_layer_holds_one_copy_of_its_codes_until_called_both_ways():
    t = random_additive_tensor(38, 1088, 2, seed=3)
    g = AdditiveGemv(t, plan={"kernel": "stream", "warps": 4, "ksplit": 1, "slots": 2})
    check(g, x_for(1088, 1), t)
    assert g._tiled_t is None and g._stream_t is not None  # the tiled copy was dropped
    assert torch.equal(g.t.codes, t.codes) and torch.equal(g.dequantize(rows=(32, 38)), t.dequantize()[32:38].half())
    g.fixed_plan = {"warps": 2}  # a batch-3 call needs the table kernel: its layout comes back, both are held
    check(g, x_for(1088, 3), t)
    assert g._tiled_t is not None and g._stream_t is not None


@pytest.mark.parametrize("pre,post,plan", [("", "", "stream"), ("rms", "add", "stream"), ("silu", "add", "stream"), ("rms", "add", "chunk")])
def test_a_single_layout_stream_layer_runs_small_batches_a_row_at_a_time(pre, post, plan):
    # A model's layer (single_layout) whose batch-1 plan is the streaming (or chunk) kernel keeps only that
    # layout: batches 2..16, plain or fused, launch it once a row instead of bringing the tiled codes back.
    n_out, n_in, B = 38, 1088, 3
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=5), seed=6)
    plan = ({"kernel": "stream", "warps": 4, "ksplit": 2, "slots": 2} if plan == "stream" else
            {"kernel": "chunk", "warps": 4, "tile": 4, "rows": 32})
    g = AdditiveGemv(t, plan=plan, single_layout=True)
    x = x_for(2 * n_in if pre == "silu" else n_in, B, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    h = x_for(n_out, B, seed=9)
    want = reference(x, t, pre, post, w, h, 1e-5)
    y = h if post else torch.full((B, n_out), float("nan"), dtype=torch.float16)  # the add in place, as the step does
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, res=h if post else None)()
    err = max_rel_err(y, want)
    assert torch.isfinite(y).all() and err <= TOL, err
    assert isinstance(g.plan(B), A.StreamPlan) and g._tiled_t is None and g._stream_t is not None
    assert g._kernels_for(B, False) == g._kernels_for(1, True) == ("stream",) and g._kernels_for(1, False) == A.AdditiveGemv.FAMILIES
    assert torch.equal(g.dequantize(rows=(32, 38)), t.dequantize()[32:38].half())  # the prefill's slabs, from that layout
    table = AdditiveGemv(t, plan={"warps": 2}, single_layout=True)
    assert table._kernels_for(1, True) == table._kernels_for(4, False) == ("table",)


def test_fused_tuning_candidates_follow_the_family_and_leave_room_for_the_norm(monkeypatch):
    t = random_additive_tensor(4096, 14336, 2, seed=0)
    g = AdditiveGemv(t, tune=False)
    monkeypatch.setattr(g, "_smem", lambda: 227 * 1024)
    monkeypatch.setattr(A, "sm_count", lambda device: 132)
    both = g._candidates(1, "rms", "", A.AdditiveGemv.FAMILIES)
    assert {type(p) for p in both} == {A.AdditivePlan, A.StreamPlan}
    assert all(p.build == "mma" for p in both if isinstance(p, A.AdditivePlan))  # the fused table kernel builds on tensor cores
    streams = g._candidates(1, "rms", "", ("stream",))
    assert streams and all(isinstance(p, A.StreamPlan) and p.shared_bytes + 4 * (1 + p.warps) <= 227 * 1024 for p in streams)
    tight = A.plan_stream(4096, 14336, 132, 227 * 1024, warps=A.STREAM_WARPS).shared_bytes + 66  # K-split 1 fits, its norm sums do not
    monkeypatch.setattr(g, "_smem", lambda: tight)
    assert 1 not in {p.ksplit for p in g._candidates(1, "rms", "", ("stream",))}
    assert 1 in {p.ksplit for p in g._candidates(1, "silu", "add", ("stream",))}
    assert all(isinstance(p, A.AdditivePlan) for p in g._candidates(1, "", "add", ("table",)))
    assert g._candidates(2, "", "", ("stream",)) == []  # the streaming kernel is batch 1's


def test_the_fused_step_is_offered_portable_clusters_only(monkeypatch):
    # 13B's 5120 inputs make 10 chunks: a plain call may time a cluster of 10, the decode step's fused
    # calls (where those lost to the global finish) only clusters of up to 8
    g = AdditiveGemv(random_additive_tensor(640, 5120, 2, seed=0), tune=False)
    monkeypatch.setattr(g, "_smem", lambda: 227 * 1024)
    monkeypatch.setattr(A, "sm_count", lambda device: 132)
    monkeypatch.setattr(A, "clusters_available", lambda device: True)
    plain = {p.cluster for p in g._candidates(1, "", "", ("stream",)) if p.kernel == "chunk"}
    assert plain == {0, 10}
    for pre, post in (("rms", ""), ("", "add"), ("silu", "add")):
        assert {p.cluster for p in g._candidates(1, pre, post, ("stream",)) if p.kernel == "chunk"} == {0}
    g4 = AdditiveGemv(random_additive_tensor(64, 2048, 4, seed=0), tune=False)  # M=4: 8 chunks, a portable cluster
    monkeypatch.setattr(g4, "_smem", lambda: 227 * 1024)
    assert 8 in {p.cluster for p in g4._candidates(1, "rms", "", ("stream",)) if p.kernel == "chunk"}


def test_stream_plans_refuse_what_they_cannot_run():
    t = random_additive_tensor(16, 1024, 2, seed=0)
    with pytest.raises(ValueError, match="batch 1"):
        AdditiveGemv(t, plan={"kernel": "stream", "warps": 4})(x_for(1024, 2))
    with pytest.raises(ValueError, match="M=2"):
        AdditiveGemv(random_additive_tensor(16, 1024, 4, seed=0), plan={"kernel": "stream", "warps": 4})(x_for(1024, 1))
    with pytest.raises(ValueError, match="chunks"):
        A.plan_stream(16, 1024, 4, 227 * 1024, ksplit=3)
    with pytest.raises(ValueError, match="shared memory"):
        A.plan_stream(16, 1024, 4, 99 * 1024)  # an sm_86 / sm_89 block: the tuner leaves the kernel out there
    with pytest.raises(ValueError, match="warps must divide 64"):
        A.plan_stream(16, 1024, 4, 227 * 1024, warps=12)
    assert A.stream_candidates(16, 1024, 132, 99 * 1024) == []
    got = A.stream_candidates(4096, 14336, 132, 227 * 1024)
    assert [p.ksplit for p in got] == [1, 2, 4, 6] and all(A.stream_registers_fit(p.warps, p.QW, p.slots) for p in got)
    assert [p.ksplit for p in A.stream_candidates(14336, 4096, 132, 227 * 1024)] == [1, 2, 4]  # 8 chunks: 6 is 4 again
    with pytest.raises(ValueError, match="spill"):  # 55 quads a block: 2 a warp of 32, whose 64 registers cannot hold them
        A.plan_stream(14336, 4096, 132, 227 * 1024, warps=32, ksplit=2)
    assert AdditiveGemv(t, plan={"kernel": "stream", "warps": 4}).fusable(1)  # batch 1 takes the fused operations
    with pytest.raises(ValueError, match="batch 1"):  # batch 2 is not the streaming kernel's
        AdditiveGemv(t, plan={"kernel": "stream", "warps": 4}).bind(x_for(1024, 2), torch.zeros(2, 16, dtype=torch.float16),
                                                                    post="add", res=torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="kernels"):
        AdditiveGemv(t, kernels=("stream",))  # the table kernel serves every batch
    with pytest.raises(ValueError, match="leave the streaming kernel out"):
        AdditiveGemv(t, plan={"kernel": "stream"}, kernels=("table",))


def test_codebook_exponent_bounds_every_entrys_l1_norm():
    cb = torch.zeros(2, 256, 8, dtype=torch.float16)
    assert A.codebook_exponent(cb) == 0
    cb[1, 7, :4] = 0.5  # L1 norm 2.0: the least e with 2.0 < 2**e is 2
    assert A.codebook_exponent(cb) == 2
    cb[0, 3, 0] = -3.0
    assert A.codebook_exponent(cb) == 2
    cb[0, 3, 1] = 1.5  # 4.5
    assert A.codebook_exponent(cb) == 3


def test_k_split_resets_its_counters_and_replays():
    t = random_additive_tensor(40, 192, 2, seed=5)
    g = AdditiveGemv(t, plan={"cps": 1, "warps": 2})
    assert g.plan(2).ksplit == 3
    y1 = check(g, x_for(192, 2, seed=1), t)
    counters = g._plans[2][3][1]
    assert not counters.any(), f"atomic counters not reset: {counters.tolist()}"
    y2 = check(g, x_for(192, 2, seed=2), t)
    assert not torch.equal(y1, y2)


def test_kernel_adds_the_bias_and_the_scales_matter():
    t = random_additive_tensor(33, 64, 2, seed=3)
    x = x_for(64, 1, seed=4)
    g = AdditiveGemv(t, plan={"warps": 2})
    y = check(g, x, t)
    tb = with_bias(t, seed=1)
    yb = check(AdditiveGemv(tb, plan={"warps": 2}), x, tb)
    assert (yb - y).float().sub(tb.bias.float()).abs().max() < 1e-2
    t2 = AdditiveTensor(t.codes, t.codebooks, (t.scales.float() * 2).half())
    y2 = check(AdditiveGemv(t2, plan={"warps": 2}), x, t2)
    assert torch.allclose(y2.float(), 2 * y.float(), rtol=1e-2, atol=1e-3)


def test_1d_input_gives_1d_output_and_bind_reads_x_at_call_time():
    t = random_additive_tensor(33, 32, 4, seed=6)
    g = AdditiveGemv(t, plan={"warps": 2})
    x1 = x_for(32, 1, seed=8)[0]
    y = g(x1)
    assert y.shape == (33,) and y.dtype == torch.float16
    assert max_rel_err(y, reference(x1, t)) <= TOL
    x = x_for(32, 2, seed=6)
    out = torch.full((2, 33), float("nan"), dtype=torch.float16)
    launch = g.bind(x, out)
    assert torch.isnan(out).all(), "bind() must not launch"
    launch()
    assert max_rel_err(out, reference(x, t)) <= TOL
    x.copy_(x_for(32, 2, seed=7))
    out.fill_(float("nan"))
    launch()
    assert max_rel_err(out, reference(x, t)) <= TOL


@pytest.mark.parametrize("M, n_out, n_in", [(2, 33, 128), (4, 64, 32)])
def test_tiled_layout_and_its_inverse(M, n_out, n_in):
    t = random_additive_tensor(n_out, n_in, M, seed=2)
    tiled = A.tile_codes(t.codes).view(torch.uint8)
    nbytes = n_in // 8 * M
    rbs = -(-n_out // 32)
    flat = torch.cat([t.codes.reshape(n_out, -1), torch.zeros(rbs * 32 - n_out, nbytes, dtype=torch.uint8)])
    for rb in range(rbs):
        for j in range(nbytes // 16):
            for lane in (0, 5, 31):
                start = ((rb * (nbytes // 16) + j) * 32 + lane) * 16
                assert torch.equal(tiled[start:start + 16], flat[rb * 32 + lane, j * 16:j * 16 + 16])
    g = AdditiveGemv(t, plan={"warps": 2})
    assert torch.equal(g.t.codes, t.codes)
    assert torch.equal(g.dequantize(), t.dequantize())
    assert torch.equal(g.dequantize(rows=(32, 33)), t.dequantize()[32:33])
    with pytest.raises(ValueError, match="rows must be"):
        g.dequantize(rows=(1, 33))


@pytest.fixture(scope="module")
def small():
    return AdditiveGemv(random_additive_tensor(33, 64, 2, seed=4), plan={"warps": 2})


def test_x_wrong_dtype(small):
    with pytest.raises(TypeError, match="x must be float16, got torch.float32"):
        small(torch.randn(1, 64))


@pytest.mark.parametrize("shape", [(1, 32), (65,), (2, 1, 64)])
def test_x_wrong_shape(small, shape):
    with pytest.raises(ValueError, match=r"x must have shape \(64,\) or \(batch, 64\)"):
        small(torch.zeros(shape, dtype=torch.float16))


def test_x_not_contiguous(small):
    with pytest.raises(ValueError, match="x must be contiguous"):
        small(torch.zeros(64, 2, dtype=torch.float16).t())


def test_x_on_another_device(small):
    with pytest.raises(ValueError, match="x is on meta"):
        small(torch.zeros(1, 64, dtype=torch.float16, device="meta"))


def test_batch_above_the_fused_limit(small):
    with pytest.raises(ValueError, match="fused kernels take batch 1..16"):
        small(torch.zeros(17, 64, dtype=torch.float16))


def test_gemv_takes_only_an_additive_tensor():
    with pytest.raises(TypeError, match="AdditiveTensor"):
        AdditiveGemv(torch.zeros(4, 4))


def test_plans_fit_shared_memory_and_cover_every_chunk():
    for n_out, nchunks, M, B in [(14336, 256, 2, 1), (4096, 512, 4, 1), (4096, 256, 2, 16), (40, 3, 2, 3)]:
        for smem in (48 * 1024, 227 * 1024):
            cands = A.candidate_plans(n_out, nchunks, M, B, 132, smem)
            assert cands
            for p in cands + [A.plan_additive(n_out, nchunks, M, B, 132, smem)]:
                pad = 16 * (16 // M) if p.build == "mma" else 0  # 4 entries a table column under the mma build
                size = A.TABLES[p.table]
                assert p.shared_bytes == p.bt * p.cps * (16384 + pad) * size // 4 <= smem - 64
                assert (p.ksplit - 1) * p.cps < nchunks <= p.ksplit * p.cps
                assert 1 <= p.bt <= B and p.cps <= A.MAX_CPS
    cands = A.candidate_plans(14336, 256, 2, 1, 132, 227 * 1024)
    assert {p.build for p in cands} == {"mma", "fma"}
    assert {(p.table, p.build) for p in cands} == {("fp32", "fma"), ("fp32", "mma"), ("fp16", "mma")}
    with pytest.raises(ValueError, match="build must be"):
        A.plan_additive(64, 8, 2, 1, 4, 227 * 1024, build="wmma")
    with pytest.raises(ValueError, match="table must be one of"):
        A.plan_additive(64, 8, 2, 1, 4, 227 * 1024, build="mma", table="bf16")
    with pytest.raises(ValueError, match="fp16 table needs the tensor-core build"):
        A.plan_additive(64, 8, 2, 1, 4, 227 * 1024, table="fp16")
    # the same slice in half the bytes
    p32 = A.plan_additive(4096, 256, 2, 1, 132, 227 * 1024, cps=4, build="mma")
    p16 = A.plan_additive(4096, 256, 2, 1, 132, 227 * 1024, cps=4, build="mma", table="fp16")
    assert (p16.cps, p16.ksplit) == (p32.cps, p32.ksplit) and 2 * p16.shared_bytes == p32.shared_bytes
    with pytest.raises(ValueError, match="need .* bytes of table"):
        A.plan_additive(64, 8, 2, 1, 4, 48 * 1024, cps=4)
    with pytest.raises(ValueError, match="at most 8"):
        A.plan_additive(64, 64, 2, 1, 4, 227 * 1024, ksplit=4)


# -- the format -------------------------------------------------------------------------------
def parts(t, **change):
    p = {"codes": t.codes, "codebooks": t.codebooks, "scales": t.scales, **change}
    return p["codes"], p["codebooks"], p["scales"]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: {"codebooks": torch.zeros(4, 256, 8, dtype=torch.float16)}, r"codes shape .* M=4"),
        (lambda t: {"codebooks": t.codebooks[:, :128]}, r"codebooks shape \(2, 128, 8\)"),
        (lambda t: {"codebooks": torch.zeros(3, 256, 8, dtype=torch.float16)}, "M must be one of"),
        (lambda t: {"codes": t.codes.to(torch.int32).index_fill(0, torch.tensor([1]), 256)}, r"codes out of range: found \[0, 256\]"),
        (lambda t: {"codes": t.codes.to(torch.int64) - 1}, r"codes out of range: found \[-1"),
        (lambda t: {"codes": t.codes.float()}, "codes must be an integer tensor"),
        (lambda t: {"codebooks": t.codebooks.float()}, "codebooks must be float16"),
        (lambda t: {"scales": t.scales.float()}, "scales must be float16"),
        (lambda t: {"scales": t.scales[:-1]}, r"scales shape \(7,\)"),
        (lambda t: {"codes": t.codes[:, :12]}, "in_features=96 is not divisible by 64"),
        (lambda t: {"codebooks": t.codebooks.clone().index_fill(1, torch.tensor([3]), float("nan"))}, "codebooks have NaN/Inf"),
        (lambda t: {"scales": t.scales.clone().fill_(float("inf"))}, "scales have NaN/Inf"),
    ],
)
def test_additive_tensor_validates(change, match):
    t = random_additive_tensor(8, 128, 2)
    with pytest.raises(CodebookFormatError, match=match):
        AdditiveTensor(*parts(t, **change(t)))


def test_int_codes_in_range_are_stored_as_uint8():
    t = random_additive_tensor(8, 128, 2)
    t2 = AdditiveTensor(t.codes.long(), t.codebooks, t.scales)
    assert t2.codes.dtype == torch.uint8 and torch.equal(t2.codes, t.codes)


@pytest.mark.parametrize("M, n_in", [(2, 100), (2, 96), (4, 48), (2, 0)])
def test_in_features_must_fill_groups_and_chunks(M, n_in):
    with pytest.raises(ValueError, match=rf"in_features={n_in} is not divisible by"):
        random_additive_tensor(8, n_in, M)
    with pytest.raises(ValueError, match=rf"in_features={n_in} is not divisible by"):
        quantize_additive(torch.randn(8, n_in), M=M, progress=False)


@pytest.mark.parametrize("M, bits", [(2, 2 + (2 * 256 * 8 * 16) / (4096 * 4096) + 16 / 4096), (4, 4 + (4 * 256 * 8 * 16) / (4096 * 4096) + 16 / 4096)])
def test_bits_per_weight_counts_codes_codebooks_and_scales(M, bits):
    t = random_additive_tensor(4096, 4096, M)
    assert t.bits_per_weight == pytest.approx(bits)
    assert t.nbytes * 8 == pytest.approx(bits * 4096 * 4096)


def test_dequantize_is_the_scaled_sum_of_codewords():
    t = random_additive_tensor(5, 64, 4, seed=3)
    W = t.dequantize(torch.float64)
    o, g = 3, 6
    want = sum(t.codebooks[m, int(t.codes[o, g, m])].double() for m in range(4)) * float(t.scales[o])
    assert torch.allclose(W[o, 8 * g:8 * g + 8], want)


# -- files ------------------------------------------------------------------------------------
@pytest.fixture(params=[(2, False), (4, True)], ids=["M2", "M4-bias"])
def saved(request, tmp_path):
    M, bias = request.param
    t = random_additive_tensor(40, 128, M, seed=M)
    if bias:
        t = with_bias(t)
    return t, t.save(tmp_path / f"layer-m{M}.safetensors")


def test_save_load_round_trip(saved):
    t, path = saved
    back = AdditiveTensor.load(path)
    for name in ("codes", "codebooks", "scales"):
        assert torch.equal(getattr(back, name), getattr(t, name))
    assert (back.bias is None) == (t.bias is None)
    if t.bias is not None:
        assert torch.equal(back.bias, t.bias)
    assert json.loads(__import__("safetensors").safe_open(str(path), "pt").metadata()["trapetum"])["M"] == t.M


def test_truncated_file_is_refused(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CodebookFormatError, match="truncated or corrupt"):
        AdditiveTensor.load(path)


@pytest.mark.parametrize("tensor", ["codes", "codebooks", "scales"])
def test_tampered_tensor_fails_the_sha256(saved, tensor):
    _, path = saved
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8:start])[tensor]["data_offsets"]
    data[start + (lo + hi) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CodebookFormatError, match=rf"{tensor} bytes do not match the header's SHA-256"):
        AdditiveTensor.load(path)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"format_version": 2}, "format_version 2"),
        ({"kind": "scalar-codebook"}, "kind 'scalar-codebook'"),
        ({"M": 4}, "the header says M=4"),
        ({"K": 16}, "K=16"),
        ({"out_features": 41}, "41 x 128"),
    ],
)
def test_edited_header_is_refused(tmp_path, changes, match):
    from safetensors.torch import save_file

    t = random_additive_tensor(40, 128, 2)
    h = {**t.header(), **changes}
    path = tmp_path / "edited.safetensors"
    save_file(t._tensors(), str(path), metadata={"trapetum": json.dumps(h)})
    with pytest.raises(CodebookFormatError, match=match):
        AdditiveTensor.load(path)


def test_extra_tensor_or_missing_header_is_refused(tmp_path):
    from safetensors.torch import save_file

    t = random_additive_tensor(40, 128, 2)
    path = tmp_path / "x.safetensors"
    save_file({**t._tensors(), "junk": torch.zeros(3)}, str(path), metadata={"trapetum": json.dumps(t.header())})
    with pytest.raises(CodebookFormatError, match="expected tensors codes, codebooks, scales"):
        AdditiveTensor.load(path)
    save_file(t._tensors(), str(path))
    with pytest.raises(CodebookFormatError, match="no 'trapetum' header"):
        AdditiveTensor.load(path)
    with pytest.raises(FileNotFoundError):
        AdditiveTensor.load(tmp_path / "absent.safetensors")


# -- the quantizer ----------------------------------------------------------------------------
def weight(n_out=32, n_in=128, seed=0):
    return torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("M", [2, 4])
def test_quantizer_round_trip_and_error_decreases(M):
    W = weight(64, 256, seed=M)  # 2048 groups: more than the 256 M codewords can fit exactly
    t, rep = quantize_additive(W, M=M, iters=3, progress=False)
    assert (t.M, t.out_features, t.in_features) == (M, 64, 256)
    assert len(rep.rel_err_curve) == 4
    assert all(b <= a * (1 + 1e-5) + 1e-9 for a, b in zip(rep.rel_err_curve, rep.rel_err_curve[1:])), rep.rel_err_curve
    assert rep.rel_err_curve[-1] < rep.rel_err_curve[0]
    W_hat = t.dequantize(torch.float32)
    rel = float(((W - W_hat) ** 2).sum() / (W**2).sum())
    assert rep.rel_mse == pytest.approx(rel, rel=1e-4)
    assert rep.rel_err == pytest.approx(rel, rel=1e-4)  # plain objective: the same number
    assert rel < (0.2 if M == 2 else 0.05)
    assert rel == pytest.approx(rep.rel_err_curve[-1], rel=0.05)  # fp16 storage costs little


def test_quantizer_is_deterministic_for_a_seed():
    W = weight(32, 128, seed=3)
    X = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    a, ra = quantize_additive(W, M=2, X=X, iters=2, seed=5, progress=False)
    b, rb = quantize_additive(W, M=2, X=X, iters=2, seed=5, progress=False)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.codebooks, b.codebooks) and torch.equal(a.scales, b.scales)
    assert ra.rel_err_curve == rb.rel_err_curve


def test_calibration_objective_weights_by_H():
    # Inputs whose first 16 columns are 30x larger than the rest: the output error is almost all
    # theirs, which the H-aware quantizer must see and plain MSE cannot.
    n_in = 128
    g = torch.Generator().manual_seed(2)
    X = torch.randn(512, n_in, generator=g)
    X[:, :16] *= 30
    W = weight(64, n_in, seed=4)
    H = X.T @ X

    def out_err(t):
        E = W - t.dequantize(torch.float32)
        return float(((E @ H) * E).sum())

    t_mse, r_mse = quantize_additive(W, M=2, iters=3, progress=False)
    t_h, r_h = quantize_additive(W, M=2, X=X, iters=3, progress=False)
    t_h2, _ = quantize_additive(W, M=2, H=H, iters=3, progress=False)
    assert r_h.objective == "calibration" and r_mse.objective == "mse"
    assert out_err(t_h) < 0.5 * out_err(t_mse), (out_err(t_h), out_err(t_mse))
    assert torch.equal(t_h.codes, t_h2.codes)  # X and its H = X^T X give the same result
    assert all(b <= a * (1 + 1e-5) for a, b in zip(r_h.rel_err_curve, r_h.rel_err_curve[1:])), r_h.rel_err_curve


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantizer_refuses_non_finite_weights(bad):
    W = weight()
    W[3, 7] = bad
    with pytest.raises(ValueError, match=r"NaN.*\[3, 7\]"):
        quantize_additive(W, progress=False)


def test_quantizer_argument_checks():
    with pytest.raises(ValueError, match="M .* must be one of"):
        quantize_additive(weight(), M=3, progress=False)
    with pytest.raises(ValueError, match="X must be"):
        quantize_additive(weight(), X=torch.randn(4, 64), progress=False)
    with pytest.raises(ValueError, match="pass X or H, not both"):
        quantize_additive(weight(), X=torch.randn(4, 128), H=torch.eye(128), progress=False)


# -- the AQLM checkpoint layout ---------------------------------------------------------------
def aqlm_layer(n_out, n_in, M, seed, bias=False):
    """One layer in the Hugging Face AQLM Mx8 layout, codes packed as AQLM's pack_int_data does."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n_out, n_in // 8, M), generator=g)
    packed = codes.clone()
    packed[packed >= 128] -= 256
    d = {
        "codes": packed.to(torch.int8),
        "codebooks": (torch.randn(M, 256, 1, 8, generator=g) * 0.02).half(),
        "scales": (1 + torch.rand(n_out, 1, 1, 1, generator=g)).half(),
    }
    if bias:
        d["bias"] = torch.randn(n_out, generator=g).half()
    return d, codes


def aqlm_dequantize(d):
    """AQLM's own decoding (aqlm.utils: codes % 256, embedding-bag sum, times scales), in float64."""
    codes = d["codes"].to(torch.int64) % 256
    n_out, G, M = codes.shape
    cb = d["codebooks"].double().reshape(M * 256, 8)
    vec = cb[codes + torch.arange(M) * 256].sum(2)
    return (vec * d["scales"].double().reshape(n_out, 1, 1)).reshape(n_out, G * 8)


def write_checkpoint(folder, M=2, sharded=False, **qc):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    layers = {"model.layers.0.self_attn.q_proj": (64, 128, False), "model.layers.0.mlp.down_proj": (40, 192, True)}
    state, truth = {"model.embed_tokens.weight": torch.randn(10, 128).half(), "lm_head.weight": torch.randn(10, 128).half()}, {}
    for i, (name, (o, n_in, b)) in enumerate(layers.items()):
        d, _ = aqlm_layer(o, n_in, M, seed=i, bias=b)
        truth[name] = d
        state.update({f"{name}.{k}": v for k, v in d.items()})
    config = {"model_type": "llama", "quantization_config": {"quant_method": "aqlm", "in_group_size": 8, "out_group_size": 1,
              "num_codebooks": M, "nbits_per_codebook": 8, "linear_weights_not_to_quantize": ["model.embed_tokens.weight", "lm_head.weight"], **qc}}
    (folder / "config.json").write_text(json.dumps(config))
    if sharded:
        keys = sorted(state)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for fname, ks in shards.items():
            save_file({k: state[k] for k in ks}, str(folder / fname))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    else:
        save_file(state, str(folder / "model.safetensors"))
    return truth


@pytest.mark.parametrize("M, sharded", [(2, False), (4, True)])
def test_aqlm_checkpoint_round_trip(tmp_path, M, sharded):
    truth = write_checkpoint(tmp_path / "ckpt", M=M, sharded=sharded)
    layers = load_aqlm_checkpoint(tmp_path / "ckpt")
    assert set(layers) == set(truth)
    for name, d in truth.items():
        t = layers[name]
        assert t.M == M and t.codes.dtype == torch.uint8
        assert torch.equal(t.codes.long(), d["codes"].long() % 256)
        assert torch.equal(t.dequantize(torch.float64), aqlm_dequantize(d))
        assert (t.bias is not None) == ("bias" in d)
    # and the kernel computes the layer AQLM describes, bias included
    name = "model.layers.0.mlp.down_proj"
    d = truth[name]
    x = x_for(192, 1, seed=3)
    y = AdditiveGemv(layers[name], plan={"warps": 2})(x)
    ref = x.double() @ aqlm_dequantize(d).T + d["bias"].double()
    assert max_rel_err(y, ref) <= TOL


def test_from_aqlm_maps_negative_int8_codes_to_high_codes():
    d, codes = aqlm_layer(8, 64, 2, seed=0)
    assert (d["codes"] < 0).any()
    t = from_aqlm({f"m.{k}": v for k, v in d.items()}, prefix="m.")
    assert torch.equal(t.codes.long(), codes)


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"num_codebooks": 1, "nbits_per_codebook": 16}, "nbits_per_codebook=16"),  # 1x16
        ({"out_group_size": 8, "in_group_size": 1}, "in_group_size=1"),
        ({"out_group_size": 2}, "out_group_size=2"),
        ({"num_codebooks": 3}, "num_codebooks=3"),
        ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ],
)
def test_unsupported_aqlm_variants_are_refused(tmp_path, qc, match):
    write_checkpoint(tmp_path / "ckpt", M=2, **qc)
    with pytest.raises(AqlmFormatError, match=match):
        load_aqlm_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "change, match",
    [
        ({"codebooks": torch.zeros(1, 65536, 1, 8, dtype=torch.float16)}, "only 8-bit codebooks"),
        ({"codebooks": torch.zeros(2, 256, 2, 8, dtype=torch.float16)}, "out_group_size=2"),
        ({"codes": torch.zeros(8, 8, 2, dtype=torch.int16)}, "int8 codes"),
        ({"scales": torch.ones(8, dtype=torch.float16)}, r"scales shape \(8,\)"),
    ],
)
def test_from_aqlm_rejects_other_tensor_layouts(change, match):
    d, _ = aqlm_layer(8, 64, 2, seed=0)
    d.update(change)
    with pytest.raises(AqlmFormatError, match=match):
        from_aqlm(d)


def test_from_aqlm_missing_tensor():
    with pytest.raises(AqlmFormatError, match="missing 'q.codebooks'"):
        from_aqlm({"q.codes": torch.zeros(8, 8, 2, dtype=torch.int8)}, prefix="q.")


def test_to_aqlm_is_the_inverse_of_from_aqlm():
    t = random_additive_tensor(40, 64, 2, seed=3)
    d = to_aqlm(t)
    assert d["codes"].dtype == torch.int8 and d["codebooks"].shape == (2, 256, 1, 8) and d["scales"].shape == (40, 1, 1, 1)
    back = from_aqlm(d)
    assert torch.equal(back.codes, t.codes) and torch.equal(back.dequantize(), t.dequantize())


def test_check_additive_large_inputs_reach_beyond_fp16_and_pass():
    # The GPU sweep's "large" checks, on the simulator: both tables within tolerance.
    for table in ("fp32", "fp16"):
        plan = {"cps": 1, "warps": 2, "bt": 2, "build": "mma", "table": table}
        assert A.check_additive(128, 40, 2, 3, seed=3, device="cpu", plan=plan, large=True, tune=False) <= TOL


# -- operations fused into the kernel (the decode step's norms, SiLU and residual adds) ----------
@pytest.mark.parametrize("pre,post", [("rms", ""), ("silu", ""), ("", "add"), ("rms", "add"), ("silu", "add")])
@pytest.mark.parametrize("M,batch,plan", [
    (2, 1, {"cps": 1, "warps": 2, "build": "mma", "table": "fp16"}),  # K-split 2: the last block adds res
    (4, 2, {"cps": 2, "warps": 2, "bt": 1, "build": "mma"}),  # one K-slice, two batch tiles (irms a row each)
    (2, 3, {"cps": 1, "warps": 2, "bt": 2, "build": "mma", "table": "fp16"}),  # K-split 2, a tile of 2 and one of 1
    (2, 1, None),  # no plan: the fused call builds its table on the tensor cores, the plain call need not
])
def test_fused_operations_match_the_float64_reference(pre, post, M, batch, plan):
    n_in, n_out, eps = 128, 40, 1e-5
    t = with_bias(random_additive_tensor(n_out, n_in, M, seed=7), seed=3)
    g = AdditiveGemv(t, plan=plan)
    x = x_for(2 * n_in if pre == "silu" else n_in, batch, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    res = x_for(n_out, batch, seed=9)
    y = torch.full((batch, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, eps=eps, res=res if post else None)()
    err = max_rel_err(y, reference(x, t, pre, post, w, res, eps))
    assert torch.isfinite(y).all() and err <= TOL, err
    assert g.fused_plan(batch, pre, post).build == "mma"


@pytest.mark.parametrize("pre,post", [("rms", ""), ("silu", ""), ("", "add"), ("rms", "add"), ("silu", "add")])
@pytest.mark.parametrize("n_out,n_in,plan", [
    (38, 1088, {"warps": 4, "ksplit": 2, "slots": 3}),  # K-split 2: the last block adds res; x zero-padded past 1088
    (21, 576, {"warps": 4, "ksplit": 1, "slots": 2}),  # one K-slice: each row's own write adds res
])
def test_stream_kernel_fuses_the_step_operations(pre, post, n_out, n_in, plan):
    # Staged x is normalised (rms: over the whole row, not the block's slice) or gated on its way to
    # shared memory, rounded as transformers' fp16 Llama rounds it; res is added where y is written.
    t = with_bias(random_additive_tensor(n_out, n_in, 2, seed=n_out), seed=n_in)
    g = AdditiveGemv(t, plan={"kernel": "stream", **plan})
    assert g.fusable(1)
    x = x_for(2 * n_in if pre == "silu" else n_in, 1, seed=3) * 3
    w = (torch.rand(n_in, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    res = x_for(n_out, 1, seed=9)
    y = torch.full((1, n_out), float("nan"), dtype=torch.float16)
    g.bind(x, y, pre=pre, post=post, norm_weight=w if pre == "rms" else None, res=res if post else None)()
    err = max_rel_err(y, reference(x, t, pre, post, w, res, 1e-5))
    assert torch.isfinite(y).all() and err <= TOL, err
    assert isinstance(g.fused_plan(1, pre, post), A.StreamPlan) and g._tiled_t is None  # one layout held


def test_stream_fused_residual_add_may_update_its_input_in_place():
    t = random_additive_tensor(38, 1088, 2, seed=2)
    x, h = x_for(1088, 1, seed=4), x_for(38, 1, seed=6)
    want = reference(x, t, post="add", res=h)
    AdditiveGemv(t, plan={"kernel": "stream", "warps": 4, "ksplit": 2, "slots": 2}).bind(x, h, post="add", res=h)()
    assert max_rel_err(h, want) <= TOL


def test_rms_input_in_the_thousands_is_normalised_before_fp16():
    # g * x would overflow fp16 here: it is scaled by a power of two before it becomes a B fragment.
    t = random_additive_tensor(40, 128, 2, seed=4)
    x = x_for(128, 1, seed=2) * 3000
    x[0, 5] = 60000.0
    w = torch.full((128,), 4.0, dtype=torch.float16)
    y = torch.full((1, 40), float("nan"), dtype=torch.float16)
    AdditiveGemv(t, plan={"cps": 1, "warps": 2, "build": "mma", "table": "fp16"}).bind(x, y, pre="rms", norm_weight=w)()
    assert torch.isfinite(y).all() and max_rel_err(y, reference(x, t, "rms", "", w, None, 1e-5)) <= TOL


@pytest.mark.parametrize("cps", [2, 1])  # one K-slice; two, meeting in the workspace
def test_rms_rows_of_any_scale_share_a_batch_tile(cps):
    # 1 / rms multiplies the row sums, so each batch row's g * x is scaled on its own: a row of 1e-6
    # (normalised to O(1) by a small eps) beside one of 3000 would otherwise sit in fp16's subnormals
    # (~1 % off), and a row of zeros gives y = bias.
    t = with_bias(random_additive_tensor(40, 128, 2, seed=4), seed=6)
    x = (x_for(128, 4, seed=2).float() * torch.tensor([[3000.0], [1e-6], [1.0], [0.0]])).half()
    w = (torch.rand(128, generator=torch.Generator().manual_seed(5)) + 0.5).half()
    y = torch.full((4, 40), float("nan"), dtype=torch.float16)
    g = AdditiveGemv(t, plan={"cps": cps, "warps": 2, "bt": 2, "build": "mma", "table": "fp16"})
    g.bind(x, y, pre="rms", norm_weight=w, eps=1e-14)()
    want = reference(x, t, "rms", "", w, None, 1e-14)
    for b in range(3):
        assert max_rel_err(y[b:b + 1], want[b:b + 1]) <= TOL, b
    assert torch.equal(y[3], t.bias)


def test_fused_residual_add_may_update_its_input_in_place():
    t = random_additive_tensor(40, 128, 2, seed=2)
    x, h = x_for(128, 1, seed=4), x_for(40, 1, seed=6)
    want = reference(x, t, post="add", res=h)
    AdditiveGemv(t, plan={"cps": 1, "warps": 2, "build": "mma"}).bind(x, h, post="add", res=h)()
    assert max_rel_err(h, want) <= TOL


def test_a_fixed_plan_without_the_tensor_core_build_is_not_fusable():
    t = random_additive_tensor(40, 128, 2, seed=2)
    g = AdditiveGemv(t, plan={"cps": 1, "warps": 2})  # fma build
    assert not g.fusable(1) and AdditiveGemv(t).fusable(1) and not AdditiveGemv(t).fusable(gemv.MAX_FUSED_BATCH + 1)
    with pytest.raises(ValueError, match="cannot fuse"):
        g.bind(x_for(128, 1), torch.zeros(1, 40, dtype=torch.float16), post="add", res=torch.zeros(1, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match="tensor-core table build"):
        A.additive_kernel(2, 1, 1, 2, 1, 1, mma=False, pre="rms")


def test_fused_operations_refuse_bad_operands():
    small = AdditiveGemv(random_additive_tensor(33, 64, 2, seed=4), plan={"warps": 2, "build": "mma"})
    x, y = x_for(small.n_in, 1), torch.zeros(1, small.n_out, dtype=torch.float16)
    with pytest.raises(ValueError, match="pre must be one of"):
        small.bind(x, y, pre="gelu")
    with pytest.raises(ValueError, match="norm_weight"):
        small.bind(x, y, pre="rms", norm_weight=torch.ones(small.n_in))  # float32
    with pytest.raises(ValueError, match="shape"):
        small.bind(x, y, pre="silu")  # silu takes [gate | up], twice the width
    with pytest.raises(ValueError, match="res"):
        small.bind(x, y, post="add")

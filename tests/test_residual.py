"""Residual vector codebooks: format, packing, quantizer, and the fused kernel in numba's CUDA simulator.

Shapes are tiny (one warp a block, 256-512 columns): every simulated thread is a Python thread.
"""
from __future__ import annotations

import os

import pytest
import torch

from trapetum import gemv
from trapetum.bench import TOLERANCE
from trapetum.codebook import CodebookFormatError
from trapetum.gemv import max_rel_err
from trapetum.residual import (FORCED_PLANS, ResidualGemv, ResidualTensor, candidate_plans, pack_indices, plan_residual, quantize_residual,
                               random_residual_tensor, reference, skew_indices, unpack_indices)

pytestmark = pytest.mark.skipif(
    not gemv.SIM and os.environ.get("NUMBA_ENABLE_CUDASIM") == "0", reason="NUMBA_ENABLE_CUDASIM=0: written for the CUDA simulator"
)


def x_for(n_in, batch, seed=1):
    return torch.randn(batch, n_in, generator=torch.Generator().manual_seed(seed)).half()


def check(g: ResidualGemv, t: ResidualTensor, x: torch.Tensor) -> torch.Tensor:
    y = torch.full((x.shape[0], g.n_out), float("nan"), dtype=torch.float16)
    assert g(x, out=y) is y
    assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} outputs left unwritten"
    err = max_rel_err(y, reference(x, t))
    assert err <= TOLERANCE, f"max rel err {err:.3g} > {TOLERANCE}"
    return y


# -- kernel ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "Nm, Nr, norm, batch, n_out, n_in, plan",
    [
        (4096, 256, False, 1, 32, 256, dict(warps=1, RB=1, main="global", ksplit=1)),
        (4096, 256, True, 3, 40, 256, dict(warps=1, RB=2, main="shared", ksplit=1)),  # 2 row-blocks, the second 8 rows
        (8192, 512, False, 16, 32, 256, dict(warps=1, RB=1, main="shared", ksplit=1)),
        (8192, 512, True, 1, 32, 512, dict(warps=1, RB=1, main="global", ksplit=2)),
        (4096, 512, False, 3, 70, 512, dict(warps=2, RB=1, main="shared", ksplit=2)),  # K-split, a padded 3rd row-block
    ],
)
def test_kernel_matches_float64_reference(Nm, Nr, norm, batch, n_out, n_in, plan):
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=Nm + batch, with_norm=norm)
    g = ResidualGemv(t, plan=plan)
    p = g.plan(batch)
    assert (p.main, p.ksplit, p.RB, p.warps) == (plan["main"], plan["ksplit"], plan["RB"], plan["warps"])
    check(g, t, x_for(n_in, batch, seed=batch))


@pytest.mark.parametrize(
    "Nm, Nr, norm, n_out, n_in, plan",
    [
        # the tuner's large-layer plan: codebook in shared memory, 8 row-blocks a warp (the 8th partly
        # padded), G = 2, an uneven K-split in steps (16 steps in slices of 6, 6, 4)
        (4096, 256, True, 250, 256, dict(kind="table", warps=1, RB=8, G=2, main="shared", ksplit=3)),
        # codebook in registers, one group a step, K-slices that start inside a chunk (64 steps by 5s),
        # summed in two levels (runs of 4, 4, 4 and 1 K-slices)
        (4096, 512, False, 32, 512, dict(kind="table", warps=1, RB=1, G=1, main="registers", ksplit=13, fanin=4)),
        # RB = 7: a row-group of 224 rows (200 used) whose finish leaves a quarter of its 16-byte quads idle
        (4096, 256, False, 200, 512, dict(kind="table", warps=1, RB=7, G=2, main="shared", ksplit=3)),
    ],
)
def test_table_kernel_matches_float64_reference(Nm, Nr, norm, n_out, n_in, plan):
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=n_out, with_norm=norm)
    g = ResidualGemv(t, plan=plan)
    p = g.plan(1)
    assert (p.kind, p.RB, p.G, p.main, p.ksplit) == ("table", plan["RB"], plan["G"], plan["main"], plan["ksplit"])
    check(g, t, x_for(n_in, 1, seed=n_out))


@pytest.mark.parametrize(
    "Nm, Nr, norm, batch, n_out, n_in, plan",
    [
        # v3, the table built on the tensor cores: 8 groups a step fill an mma's 8 columns; 2 row-blocks
        # (the second partly padded), the codebooks' 272 M-tiles over one warp
        (4096, 256, False, 1, 40, 256, dict(kind="table", warps=1, RB=2, G=8, build="mma", ksplit=1)),
        # batch rows share the mma's columns (2 x 4), under a norm, K-split in two; 9-bit residual
        # indices; codebooks read from global memory
        (4096, 512, True, 2, 32, 256, dict(kind="table", warps=2, RB=1, G=4, build="mma", ksplit=2, main="global")),
    ],
)
def test_tensor_core_table_matches_float64_reference(Nm, Nr, norm, batch, n_out, n_in, plan):
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=n_out + batch, with_norm=norm)
    g = ResidualGemv(t, plan=plan)
    p = g.plan(batch)
    assert (p.kind, p.build, p.G, p.ksplit) == ("table", "mma", plan["G"], plan["ksplit"])
    codebooks = 0 if plan.get("main") == "global" else 16 * (Nm + Nr)
    assert p.shared_bytes == codebooks + 4 * batch * plan["G"] * (Nm + Nr + 4) + 4 * batch * p.cps * 8 * plan["G"]
    check(g, t, x_for(n_in, batch, seed=batch))


@pytest.mark.parametrize(
    "Nm, Nr, norm, n_out, n_in, plan, xscale",
    [
        # v6, the banked fp16 table: 2 row-blocks (the second 8 rows), 2 chunks = 4 steps of 16 groups in
        # K-slices of 2 (the second half of each step's words loaded row by row after the first half)
        (4096, 256, False, 40, 512, dict(kind="table", warps=1, RB=2, build="banked", ksplit=2), 1.0),
        # 9-bit residual indices (fields of 21 bits straddle words), a norm, codebooks read from global
        # memory, and x and codebooks large enough that the entries are scaled down by 2**s to stay in fp16
        (4096, 512, True, 32, 256, dict(kind="table", warps=2, RB=1, build="banked", ksplit=1, main="global"), 300.0),
        # G = 8 (8192 centroids: 16 groups' fp16 tables do not fit), 4 lanes a group's four banks; 22-bit fields
        (8192, 512, False, 40, 512, dict(kind="table", warps=1, RB=2, build="banked", G=8, ksplit=3, main="global"), 1.0),
        (4096, 256, True, 32, 256, dict(kind="table", warps=2, RB=1, build="banked", G=8, ksplit=2, main="shared"), 1.0),
    ],
)
def test_banked_table_matches_float64_reference(Nm, Nr, norm, n_out, n_in, plan, xscale):
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=n_out, with_norm=norm)
    if xscale > 1:
        t = ResidualTensor(t.indices, t.main * 64, t.res * 64, n_in, n_out, t.scale, t.bias)
    g = ResidualGemv(t, plan=plan)
    p = g.plan(1)
    G = plan.get("G", 16)
    assert (p.kind, p.build, p.G, p.ksplit) == ("table", "banked", G, plan["ksplit"])
    codebooks = 0 if plan.get("main") == "global" else 16 * (Nm + Nr)
    assert p.shared_bytes == codebooks + 2 * G * (Nm + Nr) + 4 * p.cps * 8 * G
    x = (x_for(n_in, 1, seed=n_out).float() * xscale).half()
    # past the headroom (gemv.FP16_HEADROOM): the kernel scales this layer's entries by 2**-1
    assert xscale < 10 or float(x.abs().max()) * float(torch.cat([t.main, t.res]).float().abs().sum(-1).max()) > 2**14
    check(g, t, x)
    assert torch.equal(g.t.indices, t.indices)  # the natural words, not the skewed ones


@pytest.mark.parametrize(
    "Nm, Nr, norm, n_out, n_in, plan, sms",
    [
        # two row-groups of 32 rows, each over 2 K-slices: a block sums 4 of its group's 8 row quads
        (4096, 256, False, 64, 512, dict(kind="table", warps=1, RB=1, build="banked", ksplit=2), 4),
        # one row-group (64 rows, 40 used) over 4 K-slices, under a norm: 4 quads a block, the last two blocks'
        # rows past the layer summed but not written
        (4096, 512, True, 40, 512, dict(kind="table", warps=1, RB=2, build="banked", ksplit=4, main="global"), 4),
        # 16 K-slices of one G = 8 step: two threads a quad (8 slices each, added in shared memory in slice order;
        # a mutation that drops the second thread's sum fails here), half the blocks with no rows to sum
        (4096, 256, False, 32, 1024, dict(kind="table", warps=1, RB=1, build="banked", G=8, ksplit=16, main="global"), 16),
    ],
)
def test_spread_finish_matches_float64_reference(Nm, Nr, norm, n_out, n_in, plan, sms, monkeypatch):
    import sim_scheduler

    from trapetum import residual

    monkeypatch.setattr(residual, "sm_count", lambda device: sms)
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=n_out + sms, with_norm=norm)
    g = ResidualGemv(t, plan=plan | {"spread": True})
    p = g.plan(1)
    assert (p.spread, p.ksplit, p.fanin) == (True, plan["ksplit"], 0)
    with sim_scheduler.concurrent_grid():
        y1 = check(g, t, x_for(n_in, 1, seed=1))
        assert not g._plans[1][2][1].any(), "the counters were not reset: a replay would not wait"
        y2 = check(g, t, x_for(n_in, 1, seed=2))  # the launch again, on the reset counters
    assert not torch.equal(y1, y2)


def test_spread_finish_timeline_stamps_after_both_counters(monkeypatch):
    import sim_scheduler

    from trapetum import residual

    monkeypatch.setattr(residual, "sm_count", lambda device: 4)
    t = random_residual_tensor(64, 512, 4096, 256, seed=4)
    g = ResidualGemv(t, plan=dict(kind="table", warps=1, RB=1, build="banked", ksplit=2, spread=True))
    x = x_for(512, 1)
    with sim_scheduler.concurrent_grid():
        df = g.timeline(x, launches=2)  # the second launch waits only if the first reset the counters
        y = check(g, t, x)
    assert sorted(zip(df.block_x, df.block_y)) == [(bx, by) for bx in range(2) for by in range(2)]
    assert (df.sums == 3).all(), df
    assert ((df.start < df.prologue) & (df.prologue < df.steps) & (df.steps < df.finish)).all(), df
    assert not g._plans[1][2][1].any() and torch.isfinite(y).all()


def test_spread_finish_refuses_what_it_cannot_run():
    kw = dict(sms=132, budget=227 * 1024, build="banked", spread=True)
    assert plan_residual(28672, 16, 4096, 256, 1, RB=7, **kw).overrides()["spread"] is True
    for bad, match in ((dict(ksplit=1), "at least 2 K-slices"), (dict(fanin=4), "no fanin"),
                       (dict(RB=8, ksplit=32), "one wave")):
        with pytest.raises(ValueError, match=match):
            plan_residual(28672, 16, 4096, 256, 1, **(kw | bad))
    with pytest.raises(ValueError, match="table-kernel options"):
        plan_residual(28672, 16, 4096, 256, 1, kind="split", spread=True, sms=132)
    # the tuner times each banked one-level K-split plan's spread twin where its grid is one wave
    cands = candidate_plans(28672, 16, 4096, 256, 1, 132, False, 227 * 1024)
    twins = {(c.RB, c.ksplit) for c in cands if c.spread}
    assert twins == {(8, 16), (7, 16)}, twins
    assert all(c.build == "banked" and not c.fanin and c.groups(896) * c.ksplit <= 132 for c in cands if c.spread)


def test_a_spread_finish_outside_a_concurrent_grid_fails_instead_of_hanging(monkeypatch):
    from trapetum import gemv as gemv_mod

    monkeypatch.setattr(gemv_mod, "SPIN_LIMIT_S", 0.05)
    t = random_residual_tensor(32, 512, 4096, 256, seed=9)
    g = ResidualGemv(t, plan=dict(kind="table", warps=1, RB=1, build="banked", ksplit=2, spread=True))
    with pytest.raises(RuntimeError, match="concurrent_grid"):
        g(x_for(512, 1))


def test_skewed_words_rotate_each_lanes_fields_and_come_back():
    t = random_residual_tensor(64, 512, 4096, 512, seed=3)
    s = skew_indices(t.indices, 4096, 512, rows=24)  # slabs that do not align with the 32-row blocks
    im, ir = unpack_indices(t.indices, 4096, 512)
    sm, sr = unpack_indices(s, 4096, 512)
    for r in (0, 1, 2, 33, 63):
        k = (r % 32) // 2
        for i in (0, 5, 15, 16, 31, 63):
            j = i - i % 16 + (i % 16 + k) % 16
            assert (sm[r, i], sr[r, i]) == (im[r, j], ir[r, j])
    assert torch.equal(skew_indices(s, 4096, 512, inverse=True), t.indices)
    with pytest.raises(ValueError, match="divide"):
        skew_indices(t.indices, 4096, 512, G=3)


def test_banked_plans_are_batch_1_with_16_or_8_groups():
    kw = dict(sms=132, budget=227 * 1024)
    p = plan_residual(28672, 16, 4096, 256, 1, build="banked", **kw)
    assert (p.G, p.RB, p.ksplit, p.cps) == (16, 8, 16, 2)
    for bad, match in ((dict(B=2), "batch-1"), (dict(G=4), "G in"), (dict(main="registers"), "shared memory")):
        args = dict(B=1) | bad
        with pytest.raises(ValueError, match=match):
            plan_residual(28672, 16, 4096, 256, args.pop("B"), build="banked", **args, **kw)
    # 8192 + 512: 16 groups' fp16 tables (272 KiB) never fit; 8 fit with the codebooks in global memory only
    with pytest.raises(ValueError, match="fp16 table"):
        plan_residual(28672, 16, 8192, 512, 1, build="banked", **kw)
    with pytest.raises(ValueError, match="fp16 table"):
        plan_residual(28672, 16, 8192, 512, 1, build="banked", main="global", G=16, **kw)
    assert plan_residual(28672, 16, 8192, 512, 1, build="banked", main="global", **kw).G == 8
    banked = {(c.RB, c.ksplit, c.fanin) for c in candidate_plans(28672, 16, 4096, 256, 1, 132, False, 227 * 1024) if c.build == "banked"}
    assert banked == {(8, 16, 0), (8, 32, 0), (7, 16, 0), (8, 16, 4), (7, 16, 4)}, banked
    # the tuner times it at 8192 main centroids too: G = 8, codebooks through L1
    banked = [c for c in candidate_plans(28672, 16, 8192, 512, 1, 132, False, 227 * 1024) if c.build == "banked"]
    assert banked and {(c.G, c.main) for c in banked} == {(8, "global")}
    small = {(c.G, c.main) for c in candidate_plans(28672, 16, 4096, 256, 1, 132, False, 100 * 1024) if c.build == "banked"}
    assert small == {(8, "global")}, small
    assert not [c for c in candidate_plans(28672, 16, 4096, 256, 2, 132, False, 227 * 1024) if c.build == "banked"]


def test_table_kernel_timeline_stamps_every_block_in_order():
    # 40 rows in row-groups of 32: two row-groups, each split over 6 K-slices (12 blocks), summed in two
    # levels (runs of 4 and 2 K-slices, then the two runs' sums)
    t = random_residual_tensor(40, 256, 4096, 256, seed=5)
    g = ResidualGemv(t, plan=dict(kind="table", warps=1, RB=1, G=2, main="shared", ksplit=6, fanin=4))
    x = x_for(256, 1)
    df = g.timeline(x, launches=2)  # the second launch: the counters reset themselves
    assert sorted(zip(df.block_x, df.block_y)) == [(bx, by) for bx in range(2) for by in range(6)]
    assert df.start.min() == 0
    assert ((df.start < df.prologue) & (df.prologue < df.steps) & (df.steps < df.finish)).all(), df
    for _, grp in df.groupby("block_x"):
        assert sorted(grp.sums) == [0, 0, 0, 0, 1, 2], grp  # a level-one sum a run; one of them also wrote y
        assert set(grp.block_y[grp.sums > 0] // 4) == {0, 1}
    y = torch.full((1, 40), float("nan"), dtype=torch.float16)
    g(x, out=y)
    assert max_rel_err(y.float(), reference(x, t).float()) < TOLERANCE
    with pytest.raises(ValueError, match="table kernel"):
        g.timeline(x, plan=dict(kind="split", warps=1, RB=1, ksplit=1))


@pytest.mark.parametrize(
    "Nm, Nr, norm, batch, n_out, n_in, plan",
    [
        # the warps of a block split the chunks of the same rows: two warps, one chunk each
        (4096, 256, False, 1, 32, 512, dict(kind="split", warps=2, RB=1, ksplit=1)),
        # one block walks both row-groups (RB = 2: 3 row-blocks, the last padded), under a norm
        (4096, 512, True, 2, 70, 512, dict(kind="split", warps=1, RB=2, ksplit=1, blocks=1)),
        # a K-split across blocks as well (3 chunks in slices of 2 and 1, so a warp idles), walking
        (8192, 256, False, 1, 96, 768, dict(kind="split", warps=2, RB=1, ksplit=2, blocks=2)),
        # one warp streams 3 chunks a row-group over 3 row-groups: its ring slot alternates across groups
        (4096, 256, False, 1, 96, 768, dict(kind="split", warps=1, RB=1, ksplit=1, blocks=1)),
        # 2 and 1 copies of the residual codebook (the others above: as many as fit, 8)
        (8192, 512, True, 3, 64, 512, dict(kind="split", warps=2, RB=2, ksplit=1, rc=2)),
        (4096, 256, False, 2, 40, 256, dict(kind="split", warps=1, RB=1, ksplit=1, rc=1)),
        # lane splits: two groups of 16 rows, a step of both chunks; four groups of 8 rows over a padded second
        # row-block (groups 5-7 all padding), walked by 3 blocks, batch 3; one warp taking two steps of 2
        (4096, 256, False, 1, 32, 512, dict(kind="split", lanes=2, warps=1, RB=1, ksplit=1)),
        (8192, 512, False, 3, 40, 1024, dict(kind="split", lanes=4, warps=1, RB=1, ksplit=1, blocks=3)),
        (4096, 512, True, 2, 64, 1024, dict(kind="split", lanes=2, warps=1, RB=1, ksplit=1, rc=2)),  # under a norm
        (4096, 256, False, 1, 32, 2048, dict(kind="split", lanes=4, warps=2, RB=1, ksplit=1)),
    ],
)
def test_split_kernel_matches_float64_reference(Nm, Nr, norm, batch, n_out, n_in, plan):
    t = random_residual_tensor(n_out, n_in, Nm, Nr, seed=n_out + batch, with_norm=norm)
    g = ResidualGemv(t, plan=plan)
    p = g.plan(batch)
    assert (p.kind, p.warps, p.RB, p.ksplit, p.main) == ("split", plan["warps"], plan["RB"], plan["ksplit"], "shared")
    assert p.blocks == plan.get("blocks", p.blocks) and p.rc == plan.get("rc", 8) and p.lanes == plan.get("lanes", 1)
    check(g, t, x_for(n_in, batch, seed=batch))
    if p.ksplit > 1:
        assert not g._plans[batch][2][1].any(), "atomic counters not reset"


def test_main_and_residual_are_summed_as_fp16_pairs_rounded_once():
    # The gather and split kernels add a main and a residual codebook word (two fp16 each) as fp16 pairs:
    # each sum is fp16(main + residual), as ResidualTensor.dequantize(fp16) rounds the weight.
    g = torch.Generator().manual_seed(0)
    m = (torch.rand(2048, 2, generator=g) * 4 - 2).half()
    r = (torch.rand(2048, 2, generator=g) * 2**-9).half()  # below fp16's spacing near 1-2: the rounding shows
    want = (m.float() + r.float()).half().float()
    mw, rw = m.view(torch.int32).reshape(-1), r.view(torch.int32).reshape(-1)
    got = torch.tensor([gemv.hadd2_to_float2(int(a), int(b)) for a, b in zip(mw.tolist(), rw.tolist())])
    assert torch.equal(got, want)
    assert not torch.equal(got, m.float() + r.float())  # the inputs do round: fp32 sums would differ


def test_the_tuner_times_the_split_kernel_at_small_batches():
    kw = dict(sms=132, budget=227 * 1024)
    for n_out, nchunks in ((1024, 16), (4096, 4), (4096, 16)):
        kinds = {p.kind for p in candidate_plans(n_out, nchunks, 4096, 256, 1, norm=False, **kw)}
        assert kinds == {"table", "gather", "split"}, kinds
    assert "split" not in {p.kind for p in candidate_plans(4096, 16, 4096, 256, 8, norm=False, **kw)}


def test_split_plans():
    kw = dict(sms=132, budget=227 * 1024)
    p = plan_residual(1024, 4, 4096, 256, 1, kind="split", **kw)  # 32 row-groups: a K-split of 4 fills the SMs
    assert (p.RB, p.ksplit, p.cps, p.warps, p.blocks, p.rc) == (1, 4, 1, 1, 32, 8)
    assert p.shared_bytes == 16 * (4096 + 8 * 256) + 4 * 256 + 4 * 32
    # copies of the residual codebook: as many as fit (8192 + 512 beside 16384 columns of x: 4), or as asked
    assert plan_residual(14336, 64, 8192, 512, 1, kind="split", **kw).rc == 4
    assert plan_residual(14336, 16, 4096, 256, 1, kind="split", rc=1, **kw).shared_bytes == 16 * (4096 + 256) + 4 * 4096 + 4 * 16 * 32
    p = plan_residual(14336, 16, 4096, 256, 1, kind="split", **kw)  # 448 row-groups walked by 132 blocks
    assert (p.ksplit, p.warps, p.blocks, p.grid(448)) == (1, 16, 132, (132, 1))
    assert p.groups(448) == 448 and plan_residual(14336, 16, 4096, 256, 1, kind="split", RB=2, **kw).groups(448) == 224
    for bad, match in ((dict(main="global"), "shared"), (dict(RB=4), "RB"), (dict(warps=3), "warps"), (dict(blocks=999), "blocks"),
                       (dict(G=2), "table-kernel"), (dict(rc=3), "rc")):
        with pytest.raises(ValueError, match=match):
            plan_residual(14336, 16, 4096, 256, 1, kind="split", **bad, **kw)
    for kind, bad in (("gather", dict(blocks=4)), ("table", dict(rc=2)), ("gather", dict(lanes=2))):
        with pytest.raises(ValueError, match="blocks, rc and lanes are split"):
            plan_residual(14336, 16, 4096, 256, 1, kind=kind, **bad, **kw)
    with pytest.raises(ValueError, match="raise ksplit"):  # 128 KiB of codebooks and 16384 columns of x at batch 4
        plan_residual(4096, 64, 8192, 512, 4, kind="split", ksplit=1, **kw)


def test_lane_split_plans():
    kw = dict(sms=132, budget=227 * 1024)
    # 1024 x 2048: 32 row-blocks, 8 chunks. Four groups of 8 rows a row-block: 128 row-groups, one K-slice, a block
    # each; 2 warps make a step of 8 chunks. x is padded by 4 floats a chunk.
    p = plan_residual(1024, 8, 4096, 256, 1, kind="split", lanes=4, rc=2, **kw)
    assert (p.lanes, p.RB, p.ksplit, p.cps, p.warps, p.blocks, p.groups(32), p.grid(32)) == (4, 1, 1, 8, 2, 128, 128, (128, 1))
    assert p.shared_bytes == 16 * (4096 + 2 * 256) + 4 * 8 * (256 + 4) + 4 * 2 * 32
    assert plan_residual(1024, 8, 4096, 256, 1, kind="split", lanes=2, **kw).groups(32) == 64
    assert plan_residual(**p.overrides(), n_out=1024, nchunks=8, Nm=4096, Nr=256, B=1, **kw) == p
    for bad, match in ((dict(lanes=3), "lanes"), (dict(lanes=2, RB=2), "lane split"), (dict(lanes=2, ksplit=2), "lane split")):
        with pytest.raises(ValueError, match=match):
            plan_residual(1024, 8, 4096, 256, 1, kind="split", **bad, **kw)
    with pytest.raises(ValueError, match="lane split"):  # 6 chunks do not make steps of 4
        plan_residual(1024, 6, 4096, 256, 1, kind="split", lanes=4, **kw)
    with pytest.raises(ValueError, match="one K-slice"):  # 64 chunks of x at batch 4 beside 8192 + 512 do not fit one block
        plan_residual(1024, 64, 8192, 512, 4, kind="split", lanes=2, **kw)
    # The tuner times lane splits where the row-groups of 32 rows fill at most half the SMs
    small = [c for c in candidate_plans(1024, 8, 4096, 256, 1, norm=False, **kw) if c.lanes > 1]
    assert {(c.lanes, c.warps) for c in small} == {(2, 4), (4, 2), (4, 4)} and {c.rc for c in small} == {8, 2}
    for c in small:
        assert plan_residual(1024, 8, 4096, 256, 1, **kw, **c.overrides()) == c
    assert [c for c in candidate_plans(1024, 8, 4096, 256, 1, norm=True, **kw) if c.lanes > 1]
    assert not [c for c in candidate_plans(4096, 8, 4096, 256, 1, norm=False, **kw) if c.lanes > 1]  # 128 row-groups
    with pytest.raises(ValueError, match="lane split"):
        from trapetum.residual import residual_kernel
        residual_kernel(4096, 256, 1, 1, 1, True, False, split=False, lanes=2)


def test_the_planner_picks_the_table_kernel_where_its_table_fits():
    kw = dict(sms=132, budget=227 * 1024)
    p = plan_residual(28672, 16, 4096, 256, 1, **kw)
    assert (p.kind, p.main, p.RB, p.G) == ("table", "shared", 8, 2)
    assert p.shared_bytes == 4096 * 16 + 2 * 4352 * 4 + p.cps * 16 * 4  # codebook, tables, x slice
    assert plan_residual(1024, 4, 4096, 256, 1, **kw).RB == 2  # 32 row-blocks over 16 warps
    assert plan_residual(4096, 16, 8192, 512, 3, **kw).kind == "gather"  # 3 tables beside 128 KiB of codebook
    assert plan_residual(4096, 16, 4096, 256, 8, **kw).kind == "gather"  # past TABLE_MAX_BATCH
    assert plan_residual(4096, 16, 4096, 256, 1, main="shared", **kw).kind == "gather"  # as before the table kernel
    for bad, match in ((dict(G=3), "G"), (dict(kind="table", RB=3), "RB"), (dict(kind="table", main="global"), "main codebook"),
                       (dict(kind="bogus"), "kind"), (dict(kind="gather", G=2), "table-kernel options"),
                       (dict(kind="split", fanin=4), "table-kernel options"), (dict(kind="table", fanin=1), "fanin")):
        with pytest.raises(ValueError, match=match):
            plan_residual(4096, 16, 4096, 256, 1, **bad, **kw)
    kinds = {(c.kind, c.main, c.build) for c in candidate_plans(4096, 16, 4096, 256, 1, 132, False, 227 * 1024)}
    assert kinds == {("table", "shared", "fma"), ("table", "registers", "fma"), ("table", "shared", "mma"), ("table", "shared", "banked"),
                     ("gather", "global", ""), ("split", "shared", "")}
    m = plan_residual(28672, 16, 4096, 256, 1, build="mma", **kw)  # the tensor-core build takes 8 groups a step here...
    assert (m.kind, m.G, m.RB, m.fanin) == ("table", 8, 8, 0)
    # the tuner also times row-groups of 3584 rows (8 of them divide 28672) and the finish in two levels
    mma = {(c.RB, c.ksplit, c.fanin) for c in candidate_plans(28672, 16, 4096, 256, 1, 132, False, 227 * 1024) if c.build == "mma"}
    assert mma == {(8, 16, 0), (8, 32, 0), (7, 16, 0), (8, 16, 4), (7, 16, 4)}, mma
    assert plan_residual(28672, 16, 4096, 256, 1, build="mma", fanin=4, **kw).overrides()["fanin"] == 4
    assert plan_residual(28672, 64, 8192, 512, 1, build="mma", **kw).G == 2  # ...but only 2 beside 136 KiB of codebooks
    two = plan_residual(28672, 16, 4096, 256, 1, build="mma", main="global", warps=8, G=4, **kw)  # codebooks through L1
    assert two.shared_bytes == 4 * 4 * (4352 + 4) + 4 * two.cps * 32 < 113 * 1024  # two blocks an SM
    from trapetum.residual import _fits
    assert _fits(dict(kind="table", build="mma", G=8, main="shared"), 1024, 1000, 4096, 256, 1, False)
    assert not _fits(dict(kind="table", build="mma", G=8, main="shared"), 1024, 1000, 8192, 512, 1, False)
    # the sweep's forced plans on the GPU it runs on: the spread plan (2 row-groups x 8 K-slices at 1024 x 1000)
    # skipped where that grid is more than one wave, a banked plan with both codebooks in shared memory where a
    # block has 99 KiB (sm_86)
    spread = next(p for p in FORCED_PLANS if p.get("spread"))
    assert _fits(spread, 1024, 1000, 4096, 256, 1, False) and not _fits(spread, 1024, 1000, 4096, 256, 1, False, sms=12)
    banked = next(p for p in FORCED_PLANS if p.get("build") == "banked" and p.get("main") == "shared")
    assert _fits(banked, 1024, 1000, 4096, 256, 1, False) and not _fits(banked, 1024, 1000, 4096, 256, 1, False, budget=99 * 1024)
    for bad, match in ((dict(build="mma", main="registers"), "shared memory"), (dict(build="wmma"), "build")):
        with pytest.raises(ValueError, match=match):
            plan_residual(4096, 16, 4096, 256, 1, **bad, **kw)
    # a small layer's heuristic gather grid underfills the GPU: narrower gather blocks compete too
    small = candidate_plans(1024, 4, 4096, 256, 1, 132, False, 227 * 1024)
    narrow = [(c.warps, c.RB, c.ksplit) for c in small if c.kind == "gather" and c.warps < 4]
    assert narrow == [(2, 1, 4), (1, 1, 4)]
    assert all(c.warps == 4 for c in candidate_plans(16384, 64, 4096, 256, 1, 132, False, 227 * 1024) if c.kind == "gather")


def test_the_tuner_times_split_plans_around_the_heuristic():
    kw = dict(sms=132, budget=227 * 1024)
    # A mid layer: the heuristic, half its warps, RB = 2 at two warp counts; as many residual copies as fit, and 2
    # as well where an SM's share of the vectors is small (14336 x 1024: ~14 K vectors an SM < 16 x 4096).
    mid = [c for c in candidate_plans(14336, 4, 4096, 256, 1, **kw, norm=False) if c.kind == "split"]
    assert sorted({(c.warps, c.RB) for c in mid}) == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert {c.rc for c in mid} == {8, 2} and all(c.ksplit == 1 for c in mid)
    big = [c for c in candidate_plans(28672, 16, 4096, 256, 1, **kw, norm=False) if c.kind == "split"]
    assert {c.rc for c in big} == {8} and sorted({(c.warps, c.RB) for c in big}) == [(4, 2), (8, 1), (8, 2), (16, 1)]
    # A small layer whose heuristic splits K (32 row-groups): K-split 1 and half the heuristic's compete
    small = [c for c in candidate_plans(1024, 8, 4096, 256, 1, **kw, norm=False) if c.kind == "split"]
    assert {c.ksplit for c in small} >= {1, 2, 4}
    # every candidate rebuilds from its overrides (how the tuner's pick is recorded and replayed)
    for n_out, nchunks, plans in ((14336, 4, mid), (28672, 16, big), (1024, 8, small)):
        for c in plans:
            assert plan_residual(n_out, nchunks, 4096, 256, 1, **kw, **c.overrides()) == c


def test_k_split_counters_reset_so_the_launch_replays():
    t = random_residual_tensor(32, 512, 4096, 256, seed=3, with_norm=True)
    g = ResidualGemv(t, plan=dict(warps=1, RB=1, main="global", ksplit=2))
    y1 = check(g, t, x_for(512, 1, seed=1))
    assert not g._plans[1][2][1].any(), "atomic counters not reset"
    y2 = check(g, t, x_for(512, 1, seed=2))
    assert not torch.equal(y1, y2)


def test_norm_is_applied_as_vptq_does():
    # W = W_hat * scale[col] + bias[col]: the kernel (scale x, add bias . x) must agree with dequantize.
    t = random_residual_tensor(32, 256, 4096, 256, seed=5, with_norm=True)
    plain = ResidualTensor(t.indices, t.main, t.res, 256, 32)
    W = plain.dequantize(torch.float64) * t.scale.double() + t.bias.double()
    assert torch.allclose(t.dequantize(torch.float64), W)
    x = x_for(256, 1, seed=9)
    y = ResidualGemv(t, plan=dict(warps=1, main="global"))(x)
    assert max_rel_err(y, x.double() @ W.T) <= TOLERANCE
    assert max_rel_err(y, reference(x, plain)) > 10 * TOLERANCE  # the norm matters: the check can fail


def test_plan_refuses_what_shared_memory_cannot_hold():
    with pytest.raises(ValueError, match="bytes of shared memory"):
        plan_residual(4096, 64, 8192, 512, 16, sms=132, ksplit=1, main="shared")
    p = plan_residual(4096, 64, 8192, 512, 16, sms=132, ksplit=16, main="shared")
    assert p.cps == 4 and p.shared_bytes == 8192 * 16 + 512 * 16 + 16 * 4 * 256 * 4


# -- packing and format ------------------------------------------------------------------------
@pytest.mark.parametrize("Nm, Nr", [(4096, 256), (4096, 512), (8192, 256), (8192, 512)])
def test_packing_round_trip_at_exact_widths(Nm, Nr):
    g = torch.Generator().manual_seed(Nm + Nr)
    im = torch.randint(0, Nm, (3, 64), generator=g)
    ir = torch.randint(0, Nr, (3, 64), generator=g)
    im[0, :32], ir[0, :32] = Nm - 1, Nr - 1  # all-ones fields across every word boundary
    im[1, :32], ir[1, :32] = 0, 0
    words = pack_indices(im, ir, Nm, Nr)
    bits = (Nm.bit_length() - 1) + (Nr.bit_length() - 1)
    assert words.shape == (3, 64 * bits // 32) and words.dtype == torch.int32
    assert (words[0, :bits] == -1).all() and (words[1, :bits] == 0).all()
    a, b = unpack_indices(words, Nm, Nr)
    assert torch.equal(a, im) and torch.equal(b, ir)


def test_bits_per_weight():
    t = random_residual_tensor(4096, 4096, 4096, 256)
    assert abs(t.bits_per_weight - (2.5 + (4096 + 256) * 16 * 8 / 4096**2)) < 1e-9


def test_save_load_round_trip(tmp_path):
    for norm in (False, True):
        t = random_residual_tensor(33, 256, 8192, 512, seed=2, with_norm=norm)
        u = ResidualTensor.load(t.save(tmp_path / f"w{norm}.safetensors"))
        assert torch.equal(u.dequantize(), t.dequantize()) and u.has_norm == norm


def test_truncated_and_tampered_files(tmp_path):
    t = random_residual_tensor(32, 256, 4096, 256, seed=1)
    p = t.save(tmp_path / "w.safetensors")
    data = p.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CodebookFormatError, match="truncated or corrupt"):
        ResidualTensor.load(tmp_path / "cut.safetensors")
    bad = bytearray(data)
    bad[-5] ^= 0xFF
    (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
    with pytest.raises(CodebookFormatError, match="SHA-256"):
        ResidualTensor.load(tmp_path / "bad.safetensors")


def test_bad_tensors():
    t = random_residual_tensor(32, 256, 4096, 256)
    with pytest.raises(CodebookFormatError, match=r"main codebook must be \(Nm, 8\)"):
        ResidualTensor(t.indices, t.main[:, :4], t.res, 256, 32)
    with pytest.raises(CodebookFormatError, match="Nm must be one of"):
        ResidualTensor(t.indices, t.main[:2048], t.res, 256, 32)
    with pytest.raises(CodebookFormatError, match="indices shape"):
        ResidualTensor(t.indices[:, :-1], t.main, t.res, 256, 32)
    with pytest.raises(CodebookFormatError, match="not divisible by 256"):
        ResidualTensor(t.indices, t.main, t.res, 128, 32)
    nan = t.main.clone()
    nan[3, 1] = float("nan")
    with pytest.raises(CodebookFormatError, match="NaN"):
        ResidualTensor(t.indices, nan, t.res, 256, 32)
    with pytest.raises(ValueError, match="main indices out of range"):
        pack_indices(torch.full((1, 32), 4096), torch.zeros(1, 32, dtype=torch.long), 4096, 256)
    with pytest.raises(ValueError, match="residual indices out of range"):
        pack_indices(torch.zeros(1, 32, dtype=torch.long), torch.full((1, 32), -1), 4096, 256)


# -- quantizer ---------------------------------------------------------------------------------
def _weight(seed=0, n_out=160, n_in=256):
    return torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed))


def test_quantizer_residual_lowers_error_and_is_deterministic():
    W = _weight()
    t, rep = quantize_residual(W, 4096, 256, iters=3, progress=False)
    assert rep.rel_mse < rep.rel_mse_main < 1
    err = float(((t.dequantize(torch.float32) - W) ** 2).sum() / (W**2).sum())
    assert abs(err - rep.rel_mse) < 1e-4
    t2, _ = quantize_residual(W, 4096, 256, iters=3, progress=False)
    assert torch.equal(t.indices, t2.indices) and torch.equal(t.main, t2.main)


def test_more_centroids_than_vectors_still_works():
    W = _weight(n_out=8)  # 256 vectors, 8192 centroids
    t, rep = quantize_residual(W, 8192, 512, iters=2, progress=False)
    assert rep.rel_mse < 1e-5  # every vector has a centroid of its own
    assert torch.unique(t.main.float(), dim=0).shape[0] == 8192


def test_hessian_weighting_favours_important_columns():
    W = _weight(1)
    X = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    X[:, :64] *= 10  # the first 64 inputs dominate
    h = (X * X).sum(0)

    def weighted(t):
        return float((((t.dequantize(torch.float32) - W) ** 2) * h).sum())

    plain, _ = quantize_residual(W, 4096, 256, iters=3, progress=False)
    cal, rep = quantize_residual(W, 4096, 256, X=X, iters=3, progress=False)
    assert rep.weighted
    assert weighted(cal) < 0.9 * weighted(plain)
    hcal, _ = quantize_residual(W, 4096, 256, H=X.T @ X, iters=3, progress=False)
    assert abs(weighted(hcal) - weighted(cal)) < 0.02 * weighted(cal)  # diag(X^T X) == sum of x^2, up to rounding


def test_quantizer_rejects_bad_weights():
    W = _weight()
    W[3, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_residual(W, progress=False)
    with pytest.raises(ValueError, match="not divisible by 256"):
        quantize_residual(torch.randn(8, 320), progress=False)


# -- bad activations ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return ResidualGemv(random_residual_tensor(32, 256, 4096, 256, seed=4), plan=dict(warps=1, main="global"))


def test_x_wrong_dtype(small):
    with pytest.raises(TypeError, match="x must be float16"):
        small(torch.randn(1, 256))


@pytest.mark.parametrize("shape", [(1, 128), (2, 1, 256)])
def test_x_wrong_shape(small, shape):
    with pytest.raises(ValueError, match=r"x must have shape \(256,\)"):
        small(torch.zeros(shape, dtype=torch.float16))


def test_x_not_contiguous(small):
    with pytest.raises(ValueError, match="x must be contiguous"):
        small(torch.zeros(256, 2, dtype=torch.float16).t())


def test_x_wrong_device(small):
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type to put x on")
    with pytest.raises(ValueError, match="x is on"):
        small(torch.zeros(1, 256, dtype=torch.float16, device="cuda"))


@pytest.mark.parametrize("B", [1, 2, 4, 8])
@pytest.mark.parametrize("Nm, Nr", [(4096, 256), (4096, 512), (8192, 256), (8192, 512)])
def test_plans_fit_a_99_kib_block(B, Nm, Nr):
    # sm_86 / sm_89 give a block 99 KiB: the heuristics raise the K-split (and take the main codebook through L1)
    # until a plan fits, and the tuner leaves out the kernels that cannot fit at all, instead of failing.
    kw = dict(sms=84, budget=99 * 1024, norm=False)
    for n_out, nchunks in ((1024, 4), (4096, 16), (28672, 64)):
        plans = candidate_plans(n_out, nchunks, Nm, Nr, B, **kw)
        assert plans and all(p.static_bytes + p.shared_bytes <= kw["budget"] for p in plans)
        assert plan_residual(n_out, nchunks, Nm, Nr, B, **kw) in plans or B > 4
        for p in plans:
            assert plan_residual(n_out, nchunks, Nm, Nr, B, **kw, **p.overrides()) == p
    # the gather heuristic's K-split (2) is kept, with the 128 KiB main codebook read through L1 instead of staged
    g = plan_residual(28672, 64, 8192, 256, 1, kind="gather", **kw)
    assert (g.main, g.ksplit) == ("global", 2) and g.shared_bytes == 256 * 16 + 32 * 256 * 4
    assert plan_residual(28672, 64, 8192, 256, 1, kind="gather", sms=84, budget=227 * 1024).main == "shared"
    with pytest.raises(ValueError, match="raise ksplit"):  # pinned, it is not moved
        plan_residual(28672, 64, 8192, 256, 4, kind="gather", ksplit=1, **kw)
    with pytest.raises(ValueError, match="both codebooks"):  # 128 KiB of main codebook cannot fit at any K-split
        plan_residual(28672, 64, 8192, 256, 1, kind="split", **kw)


def test_banked_steps_loop_where_their_field_layouts_repeat():
    from trapetum import residual as R

    def steps(b, G):
        if G == 8:
            return R._step_layout(b, 8)
        h = R._step_layout(b, G // 2)
        return [h[2 * s] + h[2 * s + 1] for s in range(R.VECS_PER_CHUNK // G)]

    # 20-bit fields (4096 + 256): 8 fields are 5 whole words, so every step of 16 is laid out alike, 10 words on;
    # 22-bit (8192 + 512) at G = 8: every second step; 21-bit (4096 + 512, 8192 + 256): never within a chunk
    assert R._step_period(steps(20, 16)) == (1, 10) and R._step_period(steps(22, 8)) == (2, 11)
    assert R._step_period(steps(21, 16)) == (2, 0) and R._step_period(steps(21, 8)) == (4, 0)
    src = R._banked_source(20, 2, 16)
    assert "for p in range(2):" in src and src.count("look_row(") == 2 * 16 and "int32(5 + 10 * p)" in src
    src = R._banked_source(21, 2, 16)  # unrolled as before: each step's words and bit offsets constants
    assert "for p in" not in src and src.count("look_row(") == 2 * 2 * 16
    assert "for p in" not in R._banked_source(22, 2, 8)  # G = 8 stays unrolled (measured no faster as a loop)


def test_tuner_times_smaller_banked_row_groups_where_the_grid_is_short_of_blocks():
    from trapetum import residual as R

    def banked(n_out, n_in, Nm=4096, Nr=256):
        return {p.RB: p for p in R.candidate_plans(n_out, n_in // R.CHUNK, Nm, Nr, 1, 132, False, 227 * 1024) if p.build == "banked"}

    small = banked(14336, 1024)  # 4 row-groups x 8 K-slices at RB 7-8: 32 blocks on 132 SMs
    assert {1, 2, 4, 7, 8} <= set(small)
    assert all(p.grid(448)[0] * p.grid(448)[1] <= 132 for p in small.values())  # each at most one wave
    assert small[2].grid(448) == (14, 8)
    assert set(banked(28672, 4096)) == {7, 8}  # 128 blocks already: no smaller row-groups to time

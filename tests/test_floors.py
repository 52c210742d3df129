"""The vector-codebook streaming floors: which bytes each configuration must read, the suite's floor records
(timers faked: what is recorded is real), and the chapter's ceiling table and figure on synthetic data."""
from __future__ import annotations

import numpy as np
import pytest

from trapetum import bench, report, results
from test_report_vq import synthetic_vq


def test_floor_jobs_count_the_code_bytes_of_every_configuration():
    jobs = bench.floor_jobs()
    assert len(jobs) == 2 * len(bench.ADDITIVE_SHAPES) + 120
    assert len({bench.floor_key(j) for j in jobs}) == len(jobs)
    assert all(j["nbytes"] % 16 == 0 for j in jobs)
    by = {bench.floor_key(j): j for j in jobs}
    # 4096 main + 256 residual centroids: 12 + 8 index bits a vector of 8 weights
    assert by[("residual", 4096, 28672, 4096, 256)]["nbytes"] == 4096 * 28672 * 20 // 64
    assert by[("residual", 1024, 1024, 8192, 512)]["code_bits_per_weight"] == (13 + 9) / 8
    assert by[("additive", 4096, 14336, 2, None)]["nbytes"] == 4096 * 14336 * 2 // 8  # two 8-bit codes a group of 8
    assert by[("additive", 4096, 14336, 2, None)]["scheme"] == "2-bit additive (M=2)"
    quick = bench.floor_jobs(dict(bench.RESIDUAL_GRID, in_features=(1024,), out_features=(1024,)), additive_shapes=(), Ms=(2,))
    assert len(quick) == 4


def test_the_suite_records_a_floor_beside_fp16_for_each_configuration(monkeypatch):
    timed = []
    monkeypatch.setattr(bench, "time_fp16", lambda n_in, n_out, b: 1e-6 * n_in * n_out / 1000)
    monkeypatch.setattr(bench, "time_stream", lambda nbytes: timed.append(nbytes) or 1e-6 * nbytes / 3000 + 0.002)
    monkeypatch.setattr(bench, "time_empty", lambda: 0.0013)
    grid = dict(bench.RESIDUAL_GRID, in_features=(), out_features=())
    floors = dict(grid=dict(bench.RESIDUAL_GRID, in_features=(1024, 4096), out_features=(4096,)), additive_shapes=((4096, 4096),))
    done = bench.floor_key(dict(floor_of="residual", in_features=1024, out_features=4096, main_centroids=4096, residual_centroids=256))
    seen = []
    recs, extra = bench.vq_suite(grid=grid, additive_shapes=(), aqlm=False, progress=False, on_record=seen.append,
                                 floors=floors, skip_floor={done})
    fl = [r for r in recs if r["grid"] == "floor"]
    assert len(fl) == 2 * 4 - 1 + 2 and len(timed) == len(fl) and seen == recs
    assert all(r["kernel"] == bench.STREAM_FLOOR and r["max_rel_err"] is None for r in fl)
    assert extra["empty_launch_ms"] == 0.0013 and extra["failures"] == []
    r = next(r for r in fl if bench.floor_key(r) == ("residual", 4096, 4096, 8192, 512))
    assert r["code_bytes"] == 4096 * 4096 * 22 // 64 and np.isclose(r["speedup"], r["fp16_ms"] / r["time_ms"])
    assert np.isclose(r["gbps"], r["code_bytes"] / (r["time_ms"] * 1e-3) / 1e9)
    assert {r["kernel"] for r in recs if r["grid"] == "baseline"} == {"torch fp16"}  # fp16 once a shape, in the same run
    assert len([r for r in recs if r["grid"] == "baseline"]) == 2


def _with_floors(copy: float, ceiling_of) -> list[dict]:
    """Synthetic timings plus a floor a configuration, whose fp16 / floor is ceiling_of(record)."""
    recs = synthetic_vq(copy)
    out = []
    for r in recs:
        if r["grid"] == "residual" or (r["grid"] == "additive" and r["kernel"] == "additive"):
            c = ceiling_of(r)
            ms = r["fp16_ms"] / c
            keys = (dict(floor_of="residual", main_centroids=r["main_centroids"], residual_centroids=r["residual_centroids"])
                    if r["grid"] == "residual" else dict(floor_of="additive", M=2 if "M=2" in r["scheme"] else 4))
            out.append(bench.gemv_record(bench.STREAM_FLOOR, None, 1, r["in_features"], r["out_features"], ms, r["fp16_ms"], 1_000_000,
                                         None, grid="floor", scheme=r["scheme"], code_bytes=1_000_000, copy_gbps=copy, **keys))
    return recs + out


def test_the_ceiling_table_and_summary(tmp_path):
    prov = {"gpu": "NVIDIA H100 Test", "git_commit": "abc", "date": "2026-01-01T00:00:00+00:00", "command": "trapetum vq", "copy_gbps": 3000.0}
    recs = _with_floors(3000.0, lambda r: 2.0 + r["in_features"] / 4096)
    f16 = 0.042  # and the 2-bit target's shape: ours 2.5x, a kernel that only reads the codes 6x
    recs += [dict(next(r for r in recs if r["grid"] == "additive" and r["scheme"] == "2-bit additive (M=2)"), in_features=4096,
                  out_features=14336, fp16_ms=f16, time_ms=f16 / 2.5, speedup=2.5),
             bench.gemv_record(bench.STREAM_FLOOR, None, 1, 4096, 14336, f16 / 6, f16, 14_680_064, None, grid="floor", floor_of="additive",
                               M=2, scheme="2-bit additive (M=2)", code_bytes=14_680_064, copy_gbps=3000.0)]
    # and 4-bit at the same shape: ours 3.2x (past the 3x target), the read-only kernel 3.5x
    recs += [dict(next(r for r in recs if r["grid"] == "additive" and r["scheme"] == "4-bit additive (M=4)"), in_features=4096,
                  out_features=14336, fp16_ms=f16, time_ms=f16 / 3.2, speedup=3.2),
             bench.gemv_record(bench.STREAM_FLOOR, None, 1, 4096, 14336, f16 / 3.5, f16, 29_360_128, None, grid="floor", floor_of="additive",
                               M=4, scheme="4-bit additive (M=4)", code_bytes=29_360_128, copy_gbps=3000.0)]
    results.save(report.VQ, recs, prov, folder=tmp_path)
    df = report.load_vq(tmp_path)
    f = report.vq_floors(df)
    assert len(f) == 120 + 2 * 3 + 2 and f["ours: speedup"].notna().all()
    row = f[(f["part"] == "residual") & (f["in_features"] == 16384)].iloc[0]
    assert np.isclose(row["fp16 / floor"], 6.0) and np.isclose(row["ours / floor"], row["fp16 / floor"] / row["ours: speedup"])
    s = report.vq_floor_summary(df).set_index("measure")
    ceiling = "ceiling: a kernel that only reads the codes"
    assert s.loc["residual grid: configs faster than fp16", ceiling] == "120"
    assert s.loc["residual grid: configs faster than fp16", "target (issue 3)"] == "114"
    assert s.loc["residual grid: min speedup at in x out >= 4096 x 28672", ceiling] == "3.00x"
    geo = s.loc["residual grid: geometric-mean speedup"]
    assert geo[ceiling] == f"{np.exp(np.mean(np.log([2.25, 2.5, 3, 4, 6]))):.2f}x"
    assert geo["target (issue 3)"] == "3.00x" and geo["configs"] == 120
    add = s.loc["2-bit additive: min speedup at in x out >= 4096 x 14336"]
    assert (add["configs"], add["ours"], add[ceiling], add["met"]) == (1, "2.50x", "6.00x", "no")
    add4 = s.loc["4-bit additive: min speedup at in x out >= 4096 x 14336"]
    assert (add4["configs"], add4["ours"], add4[ceiling], add4["met"], add4["target (issue 3)"]) == (1, "3.20x", "3.50x", "yes", "3.00x")
    fig = report.fig_vq_floor(df)
    assert len([ax for ax in fig.axes if ax.collections]) == 1


def test_no_floors_recorded_leaves_the_tables_empty_and_the_figure_explains(tmp_path):
    prov = {"gpu": "NVIDIA H100 Test", "git_commit": "abc", "date": "2026-01-01T00:00:00+00:00", "command": "trapetum vq", "copy_gbps": 3000.0}
    results.save(report.VQ, synthetic_vq(3000.0), prov, folder=tmp_path)
    df = report.load_vq(tmp_path)
    assert report.vq_floors(df).empty and report.vq_floor_summary(df).empty
    with pytest.raises(ValueError, match="--parts floors"):
        report.fig_vq_floor(df)

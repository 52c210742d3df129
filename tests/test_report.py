"""The chapter's tables and figures (trapetum.report) on synthetic data and on a recorded run.

Fast and CPU-only: no kernel runs, matplotlib draws off screen (Figure objects, no pyplot).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib as mpl

import numpy as np
import pandas as pd
import pytest

from trapetum import report, results

REPO = Path(__file__).resolve().parents[1]
V3 = REPO / "data" / "_runs" / "gemv-v3-h100.json"

LAYERS = [(3072, 768), (4096, 4096), (11008, 4096), (4096, 11008)]
LARGE = [(4096, 14336), (8192, 28672)]
SCHEMES = {16: ("4-bit K=16", 0.5), 64: ("uint8 K=64", 1.0), 256: ("uint8 K=256", 1.0)}  # bytes a weight


def _rec(kernel, K, batch, n_in, n_out, ms, fp16_ms, grid, copy, **extra):
    if kernel == "torch fp16":
        nbytes, scheme = 2 * n_in * n_out, "dense fp16"
    else:
        scheme, per = SCHEMES[K]
        nbytes = int(per * n_in * n_out) + 2 * n_out * K
    nbytes += 2 * batch * (n_in + n_out)
    return {"kernel": kernel, "K": K, "batch": batch, "in_features": n_in, "out_features": n_out, "time_ms": ms,
            "fp16_ms": fp16_ms, "speedup": fp16_ms / ms, "gbps": nbytes / (ms * 1e-3) / 1e9,
            "max_rel_err": None if kernel == "torch fp16" else 3e-4, "scheme": scheme, "grid": grid,
            "copy_gbps": copy, **extra}


def synthetic_records(copy: float, speed: float, floors: bool = False) -> list[dict]:
    """One GPU's gemv.json records: every grid of bench.gemv_suite plus correctness checks; with
    ``floors``, the streaming floors and L2-resident times the suite records since session 18."""
    recs = []

    def fp16(n_in, n_out, b=1):
        ms = 2 * n_in * n_out / (0.8 * copy * 1e9) * 1e3 + 0.004
        if not any(r["kernel"] == "torch fp16" and (r["in_features"], r["out_features"], r["batch"]) == (n_in, n_out, b) for r in recs):
            recs.append(_rec("torch fp16", None, b, n_in, n_out, ms, ms, "baseline", copy))
        return ms

    f = fp16(4096, 4096)
    for K in (16, 64, 256):
        for v, slow in (("lut", 1.0), ("lut32", 1.2), ("naive", 20.0)):
            recs.append(_rec(v, K, 1, 4096, 4096, f / speed * slow * (1 if K == 16 else 1.5), f, "table", copy))
    for s in LAYERS:
        f = fp16(*s)
        recs.append(_rec("lut", 16, 1, *s, f / speed, f, "layers", copy))
    for s in LARGE:
        f = fp16(*s)
        for K in (16, 64, 256):
            recs.append(_rec("lut", K, 1, *s, f / (speed * (1.5 if K == 16 else 1.1)), f, "bandwidth", copy))
    for b in (1, 2, 4, 8, 16, 32):
        f = fp16(*LARGE[0], b)
        if b <= 16:
            recs.append(_rec("lut", 16, b, *LARGE[0], f / speed * b ** 0.8, f, "batch", copy, path="fused"))
        else:
            recs.append(_rec("dequant+cublas", 16, b, *LARGE[0], f * 4, f, "batch", copy))
    if floors:
        for r in [r for r in recs if r["kernel"] == "lut" and r["K"] == 16 and r["batch"] == 1]:
            r["l2_resident_ms"] = r["time_ms"] * 0.95
        for s in dict.fromkeys([(4096, 4096), *LAYERS, *LARGE]):
            f = fp16(*s)
            recs.append(_rec("stream floor", 16, 1, *s, f / 3.5, f, "floor", copy, empty_launch_ms=0.0013))
    recs.append({"kernel": "lut", "K": 16, "scheme": "4-bit K=16", "batch": 1, "in_features": 256,
                 "out_features": 96, "max_rel_err": 1e-4, "passed": True, "grid": "correctness"})
    return recs


def write_run(folder: Path, gpu: str, records: list[dict], copy: float) -> Path:
    prov = {"gpu": gpu, "driver": "1.0", "cuda": "12.0", "torch": "2.0", "numba": "0.1", "numba_cuda": "0.1",
            "git_commit": "abc123", "git_dirty": False, "date": "2026-01-01T00:00:00+00:00",
            "command": "trapetum gemv", "copy_gbps": copy}
    return results.save("gemv", records, prov, folder=folder)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory) -> Path:
    """A data folder with two synthetic GPUs: a bandwidth-poor one that wins big and a rich one."""
    folder = tmp_path_factory.mktemp("data")
    write_run(folder, "NVIDIA Slow GPU", synthetic_records(copy=800.0, speed=2.5), 800.0)
    write_run(folder, "NVIDIA Fast GPU", synthetic_records(copy=3000.0, speed=1.1, floors=True), 3000.0)
    return folder


@pytest.fixture(scope="module")
def df2(two_gpus) -> pd.DataFrame:
    return report.load_gemv(two_gpus)


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Path:
    """The recorded H100 run of kernel v3, placed as data/<slug>/gemv.json in a scratch folder."""
    if not V3.is_file():
        pytest.skip(f"{V3} is not in this checkout")
    folder = tmp_path_factory.mktemp("v3data")
    prov = json.loads(V3.read_text())["provenance"]
    (folder / results.slug(prov["gpu"])).mkdir()
    shutil.copy(V3, folder / results.slug(prov["gpu"]) / "gemv.json")
    return folder


# -- loading -------------------------------------------------------------------------------
def test_load_gemv_raises_clearly_without_data(tmp_path):
    with pytest.raises(report.NoRecordedDataError, match="no GPU has recorded"):
        report.load_gemv(tmp_path)
    with pytest.raises(report.NoRecordedDataError):
        report.provenance_table(tmp_path)


def test_load_gemv_defaults_to_the_package_data_dir(monkeypatch, two_gpus):
    monkeypatch.setattr(results, "DATA_DIR", two_gpus)
    assert set(report.load_gemv()["gpu"]) == {"NVIDIA Slow GPU", "NVIDIA Fast GPU"}


def test_load_fills_copy_bandwidth_from_provenance(tmp_path):
    recs = synthetic_records(copy=1000.0, speed=2.0)
    for r in recs:
        r.pop("copy_gbps", None)
    write_run(tmp_path, "NVIDIA Odd GPU", recs, 1234.0)
    df = report.load_gemv(tmp_path)
    assert (df["copy_gbps"] == 1234.0).all()


# -- tables --------------------------------------------------------------------------------
def test_kernel_table(df2):
    t = report.kernel_table(df2)
    assert list(t.columns) == ["GPU", "Kernel", "Scheme", "Latency (ms)", "vs cuBLAS", "Max rel. err", "GB/s"]
    assert len(t) == 2 * 10  # per GPU: the baseline + {lut, lut32, naive} x 3 codebook sizes
    assert list(t["GPU"].unique()) == ["Slow GPU", "Fast GPU"]  # most bandwidth-limited first
    for gpu, g in t.groupby("GPU"):
        assert g.iloc[0]["Kernel"].startswith("torch fp16 (cuBLAS)")
        assert g.iloc[0]["vs cuBLAS"] == pytest.approx(1.0)
        assert np.isnan(g.iloc[0]["Max rel. err"])
        assert g["Kernel"].str.startswith("naive").sum() == 3 and g["Kernel"].str.startswith("lut32").sum() == 3
        assert g["Kernel"].str.contains("negative result").sum() == 6
    slow = t[(t["GPU"] == "Slow GPU") & (t["Kernel"].str.startswith("lut:")) & (t["Scheme"] == "4-bit K=16")]
    assert slow["vs cuBLAS"].iloc[0] == pytest.approx(2.5)
    html = report.styled(t).to_html()
    assert "2.50x" in html and "–" in html


def test_styled_microseconds_get_one_decimal():
    t = pd.DataFrame({"Time (µs)": [18.5072], "torch fp16 (us)": [42.076001]})
    html = report.styled(t).to_html()
    assert "18.5<" in html and "42.1<" in html and "18.507" not in html and "42.076" not in html


def test_styled_other_floats_get_four_significant_digits():
    t = pd.DataFrame({"no instruction": [1.1, 0.091234], "executed instructions": [13701776.0, np.nan], "count": [3, 4]})
    html = report.styled(t).to_html()
    assert "1.1<" in html and "0.09123<" in html and "13,701,776<" in html and "–" in html and ">3<" in html
    assert "1.100000" not in html and "0.091234" not in html


def test_styled_ratios_of_two_measurements_get_two_decimals():
    t = pd.DataFrame({"numba / C++ mma": [0.914076], "tried / committed": [1.195847]})
    html = report.styled(t).to_html()
    assert "0.91x<" in html and "1.20x<" in html and "0.914" not in html


def test_layer_table_quotes_the_seed_beside_ours(df2):
    t = report.layer_table(df2)
    assert list(t["Layer (in x out)"]) == ["3072 x 768", "4096 x 4096", "11008 x 4096", "4096 x 11008"]
    seed_col = [c for c in t.columns if "reported by the seed (RTX 4090)" in c]
    ours = [c for c in t.columns if "measured here" in c]
    assert len(seed_col) == 1 and len(ours) == 2
    assert list(t[seed_col[0]]) == [report.SEED_004["layers"][s] for s in LAYERS]
    assert t[ours[0]].tolist() == pytest.approx([2.5] * 4)


def test_bandwidth_law_table(df2):
    t = report.bandwidth_law_table(df2)
    assert list(t[("", "GPU")][:2]) == ["Slow GPU", "Fast GPU"]
    assert t[("", "GPU")].str.endswith("(seed)").sum() == len(report.SEED_004["bandwidth_law"])
    # every number sits under a column group that says whose it is
    assert {top for top, _ in t.columns[1:]} == {"measured here", "reported by the seed"}
    M, S = "measured here", "reported by the seed"
    ours, seed = t.iloc[:2], t.iloc[2:]
    assert ours[(M, "copy bandwidth (TB/s)")].tolist() == pytest.approx([0.8, 3.0])
    assert ours[(M, "speedup at 4096 x 4096")].tolist() == pytest.approx([2.5, 1.1])
    assert ours[(M, "speedup at 8192 x 28672")].tolist() == pytest.approx([2.5 * 1.5, 1.1 * 1.5])
    assert ours[(S, "speedup at 4096 x 4096")].isna().all()
    assert seed[(S, "speedup at 4096 x 4096")].tolist() == [r["speedup"] for r in report.SEED_004["bandwidth_law"]]
    assert seed[(S, "bandwidth class (TB/s)")].tolist() == [r["bandwidth_tbps"] for r in report.SEED_004["bandwidth_law"]]
    assert seed[(M, "speedup at 4096 x 4096")].isna().all()
    html = report.styled(t).to_html()
    assert "reported by the seed" in html and "measured here" in html and "2.20x" in html


def test_bandwidth_law_points_ceiling_is_the_byte_ratio(df2):
    p = report.bandwidth_law_points(df2)
    four = p[(p["source"] == "measured here") & (p["scheme"] == "4-bit K=16") & (p["which"] == "seed shape")]
    n = 4096
    want = (2 * n * n + 4 * n) / (n * n / 2 + 2 * n * 16 + 4 * n)
    assert four["ceiling"].tolist() == pytest.approx([want, want], rel=1e-6)


def test_provenance_table(two_gpus):
    t = report.provenance_table(two_gpus)
    assert len(t) == 2
    for c in ("gpu", "driver", "cuda", "torch", "numba", "numba_cuda", "git_commit", "date", "command"):
        assert c in t.columns and t[c].notna().all(), c
    tt = report.provenance_table(two_gpus, transpose=True)
    assert list(tt.columns) == ["field", "Fast GPU", "Slow GPU"]
    assert {"gpu", "driver", "git_commit", "command", "copy GB/s"} <= set(tt["field"])
    report.styled(tt).to_html()


def test_slower_intervals():
    g = pd.DataFrame({"batch": [1, 2, 4, 8, 16], "speedup": [2.0, 1.5, 0.5, 0.4, 0.3]})
    [(lo, hi)] = report.slower_intervals(g)
    assert 2 < lo < 4 and hi is None
    assert report.slower_intervals(g.assign(speedup=2.0)) == []


def test_measure_argv():
    argv = report.measure_argv(out="/x", arch="sm_90", in_features=[4096, 8192], out_features=[14336, 28672],
                               iterations=30, run_cuda_cpp=False, command="papermill ...")
    assert argv[0] == "gemv"
    assert argv[argv.index("--arch") + 1] == "sm_90" and argv[argv.index("--out") + 1] == "/x"
    assert argv[argv.index("--in-features") + 1: argv.index("--in-features") + 3] == ["4096", "8192"]
    assert "--no-cuda-cpp" in argv and argv[-1] == "papermill ..."
    with pytest.raises(ValueError):
        report.measure_argv(in_features=[1, 2], out_features=[3])


# -- figures -------------------------------------------------------------------------------
def _check_figure(fig, min_axes=1):
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) >= min_axes
    assert fig.get_suptitle() or all(ax.get_title() for ax in axes)
    for ax in axes:
        assert ax.get_xlabel(), "x axis without label"
        assert ax.get_title()
        assert ax.lines or ax.collections or ax.patches, "an empty panel"
    assert any(ax.get_ylabel() for ax in axes)
    fig.canvas.draw()  # renders without error
    return axes


def _legend_texts(fig) -> list[str]:
    texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    for ax in fig.axes:
        if ax.get_legend():
            texts += [t.get_text() for t in ax.get_legend().get_texts()]
    return texts


def test_fig_bandwidth_law(df2):
    fig = report.fig_bandwidth_law(df2)
    axes = _check_figure(fig, 2)
    texts = _legend_texts(fig)
    assert any("reported by the seed" in t for t in texts) and any("measured here" in t for t in texts)
    for scheme in ("4-bit K=16", "uint8 K=64", "uint8 K=256"):
        assert any(scheme in t for t in texts)
    annotations = [c.get_text() for c in axes[0].texts]
    assert {"RTX 4090", "A40", "H100 PCIe", "Slow GPU", "Fast GPU"} <= set(annotations)
    assert "TB/s" in axes[0].get_xlabel()


def test_fig_roofline(df2):
    fig = report.fig_roofline(df2)
    axes = _check_figure(fig, 2)
    for ax in axes:
        assert "GB/s" in (axes[0].get_ylabel()) and "MB" in ax.get_xlabel()
        assert ax.get_xscale() == "log"
        ys = [line.get_ydata()[0] for line in ax.lines if len(line.get_xdata()) == 2 and line.get_linestyle() == "-"]
        assert ys, "no copy-bandwidth line"
    assert any("copy bandwidth" in t for t in _legend_texts(fig))


def test_fig_speedup_by_shape(df2):
    fig = report.fig_speedup_by_shape(df2)
    axes = _check_figure(fig, 2)
    texts = _legend_texts(fig)  # one legend under the panels (inside, it covered the small shapes' ceilings)
    assert any("ceiling" in t for t in texts) and any("parity" in t for t in texts) and len(texts) == len(set(texts))
    for ax in axes:
        assert ax.get_legend() is None
        assert len(ax.get_xticklabels()) == len(LAYERS) + len(LARGE)
        assert "Speedup" in ax.get_ylabel()


def test_floor_table_and_figure(df2, tmp_path):
    t = report.floor_table(df2)
    # only the GPU that recorded floors; one row a distinct batch-1 shape of the table, layer and large grids
    assert set(t["GPU"]) == {"Fast GPU"}
    assert list(t["Shape"]) == [report.shape_label(s) for s in sorted(dict.fromkeys([(4096, 4096), *LAYERS, *LARGE]), key=lambda s: (s[0] * s[1], s[0]))]
    assert np.allclose(t["fp16 / floor"], 3.5)
    # synthetic speeds: 1.1x fp16 on the table and layer shapes, 1.65x on the large ones
    want = [3.5 / (1.65 if s in [report.shape_label(x) for x in LARGE] else 1.1) for s in t["Shape"]]
    assert np.allclose(t["ours / floor"], want) and np.allclose(t["weight in L2 (us)"] / t["4-bit kernel (us)"], 0.95)
    assert np.allclose(t["empty launch (us)"], 1.3)
    # the floors stay out of every other table
    assert "stream floor" not in set(report.kernel_table(df2)["Kernel"])
    fig = report.fig_floor(df2)
    (ax,) = _check_figure(fig, 1)[:1]
    assert len(ax.get_xticklabels()) == len(t)
    write_run(tmp_path, "NVIDIA Slow GPU", synthetic_records(copy=800.0, speed=2.5), 800.0)
    with pytest.raises(ValueError, match="streaming floors"):
        report.floor_table(report.load_gemv(tmp_path))


def test_gemv_targets(df2, tmp_path):
    t = report.gemv_targets(df2)
    # only the GPU that recorded floors, one row a target of issue 2
    assert list(t["GPU"]) == ["Fast GPU"] * len(report.GEMV_TARGETS)
    row = t.set_index("target (issue 2)")
    large = row.loc[report.GEMV_TARGETS[0][0]]  # synthetic: 1.65x at the large shapes, floors at fp16 / 3.5
    assert (large["goal"], large["ours"], large["ceiling"], large["records"], large["met"]) == ("3.30x", "1.65x", "3.50x", len(LARGE), "no")
    assert row.loc[report.GEMV_TARGETS[1][0], "ours"] == "1.10x"
    share = row.loc[report.GEMV_TARGETS[2][0]]
    assert share["goal"] == "85 %" and share["ours"].endswith(" %") and share["ceiling from"] == "stream floor"
    k64 = row.loc[report.GEMV_TARGETS[3][0]]
    assert k64["ours"] == "1.21x" and k64["ceiling from"] == "byte ratio" and 1.8 < float(k64["ceiling"][:-1]) < 2.0
    # the batch rows: batch 8 alone, then the fused batches 2..16 (batch 32 is dequantize + cuBLAS here)
    assert row.loc[report.GEMV_TARGETS[5][0], "ours"] == f"{1.1 / 8 ** 0.8:.2f}x"
    assert row.loc[report.GEMV_TARGETS[6][0], "records"] == 4 and row.loc[report.GEMV_TARGETS[6][0], "ours"] == f"{1.1 / 16 ** 0.8:.2f}x"
    # a GPU fast enough meets the large-shape target; runs without floors give no rows
    write_run(tmp_path, "NVIDIA Quick GPU", synthetic_records(copy=3000.0, speed=3.0, floors=True), 3000.0)
    quick = report.gemv_targets(report.load_gemv(tmp_path)).set_index("target (issue 2)")
    assert quick.loc[report.GEMV_TARGETS[0][0], "met"] == "yes" and quick.loc[report.GEMV_TARGETS[5][0], "met"] == "no"
    slow = tmp_path / "slow"
    write_run(slow, "NVIDIA Slow GPU", synthetic_records(copy=800.0, speed=2.5), 800.0)
    assert report.gemv_targets(report.load_gemv(slow)).empty
    # for scale: cuBLAS's own share of the copy bandwidth at 4096 x 4096 (synthetic: 80 % of it plus 4 us of launch)
    note = report.fp16_share_note(report.load_gemv(slow))
    share = 2 * 4096 * 4096 / (2 * 4096 * 4096 / (0.8 * 800e9) + 4e-6) / 800e9
    assert f"reaches {share:.0%} on the Slow GPU of the measured copy bandwidth" in note and "are 29.4 MB" in note
    assert report.fp16_share_note(report.load_gemv(slow), shape=(123, 456)) == ""


def test_fig_batch(df2):
    fig = report.fig_batch(df2)
    axes = _check_figure(fig, 2)
    for ax in axes:
        assert "µs" in ax.get_ylabel() and "Batch" in ax.get_xlabel()
        assert len(ax.lines) >= 3  # fp16, fused, dequant+cublas
    assert any("dequant+cublas" in t for t in _legend_texts(fig))
    t = report.batch_table(df2)
    assert set(t["Path"]) <= {"dequantize + cuBLAS", "fused: lut"} | {f"fused: {v}" for v in report.FAMILY_LABELS.values()}
    assert ((t["vs fp16"] - t["torch fp16 (µs)"] / t["Time (µs)"]).abs() < 1e-9).all() and len(t) == len(t.drop_duplicates())
    assert (t.loc[t["Path"] == "dequantize + cuBLAS", "Plan"] == "").all()


def test_plan_label():
    assert report.plan_label({"warps": 16.0, "ksplit": 2.0, "walk": 4.0}) == "16 warps, 2 K-slices, 4 row groups a block"
    assert report.plan_label({"warps": 8, "ksplit": 1, "walk": float("nan")}) == "8 warps, 1 K-slice"  # a run before walking
    assert report.plan_label({"warps": 8, "ksplit": 1, "walk": 1}) == "8 warps, 1 K-slice"
    assert report.plan_label({"warps": None}) == report.plan_label({}) == ""


# -- the recorded H100 run -------------------------------------------------------------------
def test_everything_on_the_recorded_v3_run(v3):
    df = report.load_gemv(v3)
    assert len(report.kernel_table(df)) == 10
    t = report.layer_table(df)
    assert len(t) == 4 and t.filter(like="measured here").notna().all().all()
    b = report.bandwidth_law_table(df)
    assert len(b) == 1 + len(report.SEED_004["bandwidth_law"])
    assert ("measured here", "speedup at 16384 x 53248") in b.columns
    assert len(report.provenance_table(v3)) == 1
    for f in (report.fig_bandwidth_law, report.fig_roofline, report.fig_speedup_by_shape, report.fig_batch):
        _check_figure(f(df))


def test_cuda_cpp_kernels_join_the_tables_and_figures(df2):
    """Records of the CUDA C++ counterpart (kernels/) need only kernel, K, shape and timings."""
    base = df2[(df2["kernel"] == "lut") & (df2["grid"] == "table") & (df2["K"] == 16)]
    extra = base.assign(kernel="cuda_cpp_4bit", scheme=None, time_ms=base["time_ms"] * 0.9,
                        speedup=base["speedup"] / 0.9, gbps=base["gbps"] / 0.9)
    df = pd.concat([df2, extra], ignore_index=True)
    t = report.kernel_table(df)
    cpp = t[t["Kernel"].str.startswith("cuda_cpp_4bit")]
    assert len(cpp) == 2 and set(cpp["Scheme"]) == {"4-bit K=16"}
    p = report.bandwidth_law_points(df)
    assert (p["kernel"] == "cuda_cpp_4bit").sum() == 2
    texts = _legend_texts(report.fig_bandwidth_law(df))
    assert any("cuda_cpp_4bit" in x for x in texts)
    _check_figure(report.fig_roofline(df), 2)
    # one colour a scheme, so the C++ bars of the same scheme are told apart by their hatching
    bars = [b for ax in report.fig_speedup_by_shape(df).axes for b in ax.patches if b.get_facecolor() == mpl.colors.to_rgba(report._color("4-bit K=16"))]
    assert {b.get_hatch() or "" for b in bars} == {"", "//"}


def test_numba_and_both_cuda_cpp_designs_side_by_side(df2):
    base = df2[(df2["kernel"] == "lut") & (df2["grid"] == "table") & (df2["K"] == 16)]
    lut = base.assign(kernel="cuda_cpp_4bit", variant="lut", scheme=None, time_ms=base["time_ms"] * 2)
    mma = base.assign(kernel="cuda_cpp_4bit", variant="mma", scheme=None, time_ms=base["time_ms"] * 0.5)
    dual = base.assign(kernel="cuda_cpp_4bit", variant="dual", scheme=None, time_ms=base["time_ms"] * 1.25)
    df = report._normalise(pd.concat([df2, lut, mma], ignore_index=True))
    assert report._normalise(df)["kernel"].str.endswith("_mma_mma").sum() == 0  # idempotent
    t = report.numba_vs_cuda_cpp(df)
    assert len(t) == 2  # one shape on each of two GPUs
    assert t["numba / C++ lut"].tolist() == pytest.approx([0.5, 0.5])
    assert t["numba / C++ mma"].tolist() == pytest.approx([2.0, 2.0])
    assert t["C++ dual (ms)"].isna().all()  # a run before the C++ dual kernel existed
    t = report.numba_vs_cuda_cpp(report._normalise(pd.concat([df2, lut, mma, dual], ignore_index=True)))
    assert t["numba / C++ dual"].tolist() == pytest.approx([0.8, 0.8]) and "cuda_cpp_4bit_dual" in report.KERNEL_LABELS
    with pytest.raises(ValueError, match="CUDA C\\+\\+ twin"):
        report.numba_vs_cuda_cpp(df2)


def test_cpp_dual_runs_set_each_commit_of_the_program_beside_numbas_recorded_pick(df2, tmp_path):
    import json

    assert report.cpp_dual_runs(df2, tmp_path).empty  # no such run recorded
    (tmp_path / "_runs").mkdir()
    numba_us = 1e3 * float(df2[(df2["kernel"] == "lut") & (df2["grid"] == "table") & (df2["K"] == 16) & (df2["gpu"] == "NVIDIA Fast GPU")]["time_ms"].iloc[0])

    def run(commit, date, us):
        recs = [{"variant": "dual", "batch": 1, "in_features": 4096, "out_features": 4096, "time_ms": us / 1e3, "passed": True},
                {"variant": "dual", "batch": 2, "in_features": 4096, "out_features": 4096, "time_ms": 1.0, "passed": True},
                {"variant": "mma", "batch": 1, "in_features": 4096, "out_features": 4096, "time_ms": 1.0, "passed": True},
                {"variant": "dual", "batch": 1, "in_features": 64, "out_features": 64, "time_ms": 1.0, "passed": False}]
        prov = {"gpu": "NVIDIA Fast GPU", "git_commit": commit, "date": date}
        (tmp_path / "_runs" / f"cpp-dual-{commit}-fast.json").write_text(json.dumps({"provenance": prov, "records": recs}))

    run("bbbbbbbb", "2026-02-01", 2 * numba_us)
    run("aaaaaaaa", "2026-01-01", 3 * numba_us)
    t = report.cpp_dual_runs(df2, tmp_path)
    assert list(t.columns) == ["GPU", "in x out", "C++ dual at aaaaaaa (us)", "C++ dual at bbbbbbb (us)", "numba pick, gemv.json (us)",
                               "newest C++ / numba"]  # oldest first; batch 2, mma and a failed check are not rows
    assert len(t) == 1 and t["in x out"][0] == "4096 x 4096" and t["newest C++ / numba"][0] == pytest.approx(2.0)


def test_decode_chapter_reads_every_run_and_keeps_the_newest_per_model(tmp_path):
    import json

    from trapetum import results

    def run(name, date, models):
        prov = results.provenance(command="bench")
        prov.update(gpu="NVIDIA H100 80GB HBM3", date=date)
        recs = [{"model": m, "scheme": s, "path": "graphed", "tok_s": t, "fp16_tok_s": 100.0, "vram_gb": v * (2 if "13b" in m else 1),
                 "j_per_token": 1.0, "oom": False, "bits_per_weight_codes": b}
                for m, t in models for s, b, v in (("fp16", 16.0, 4.0), ("4-bit K=16", 4.0, 1.0))]
        (tmp_path / "h100").mkdir(exist_ok=True)
        (tmp_path / "h100" / name).write_text(json.dumps({"provenance": prov, "records": recs}))

    run("decode.20260101T000000.json", "2026-01-01", [("llama-2-7b", 100.0), ("llama-2-13b", 50.0)])
    run("decode.json", "2026-02-01", [("llama-2-13b", 60.0)])
    df = report.load_decode(tmp_path)
    assert sorted(df.groupby("model")["tok_s"].max().items()) == [("llama-2-13b", 60.0), ("llama-2-7b", 100.0)]
    # a later run of another path adds rows; it does not hide the older run's paths
    run("decode.20260301T000000.json", "2026-03-01", [("llama-2-7b", 150.0)])
    p = tmp_path / "h100" / "decode.20260301T000000.json"
    d = json.loads(p.read_text())
    for r in d["records"]:
        r["path"] = "compiled"
    p.write_text(json.dumps(d))
    both = report.load_decode(tmp_path)
    assert sorted(both[both["model"] == "llama-2-7b"]["path"].unique()) == ["compiled", "graphed"]
    # a fused run of the same model and path is its own row, not a newer copy of the unfused one
    run("decode.20260401T000000.json", "2026-04-01", [("llama-2-7b", 170.0)])
    p = tmp_path / "h100" / "decode.20260401T000000.json"
    d = json.loads(p.read_text())
    for r in d["records"]:
        r.update(path="compiled", fused=True, vram_gb=r["vram_gb"] * 3)
    p.write_text(json.dumps(d))
    t = report.decode_table(report.load_decode(tmp_path))
    assert sorted(t[t["Model (random weights)"] == "llama-2-7b"]["Path"].unique()) == [
        "compiled", "compiled" + report.FUSED_SUFFIX, "graphed"]
    fused = t[t["Path"].str.endswith(report.FUSED_SUFFIX)]
    assert sorted(fused["VRAM vs fp16"].round(2)) == [0.25, 1.0]  # over the fused fp16 model's peak of the same run (12 GB)
    t = report.decode_table(df)
    assert len(t) == 4 and set(t["vs fp16"].round(2)) == {0.6, 1.0}
    # "vs fastest fp16": a fused-step row of the same run divides by fp16's fastest graphed path
    step = df[df["file"] == df["file"].iloc[0]].copy()
    step["path"], step["tok_s"] = "fused-step", step["tok_s"] * np.where(step["scheme"] == "fp16", 0.5, 2.0)
    t2 = report.decode_table(pd.concat([df, step], ignore_index=True))
    s = t2[t2["Path"] == "fused-step"].set_index("Scheme")
    assert s.loc["4-bit K=16", "vs fastest fp16"] == pytest.approx(2.0)  # over fp16 graphed, not fp16 fused-step
    assert s.loc["fp16", "vs fastest fp16"] == pytest.approx(0.5)
    # each model's VRAM over its own fp16 model's, from the same run: 7B and 13B do not mix
    assert sorted(t["VRAM vs fp16"].round(2)) == [0.25, 0.25, 1.0, 1.0]
    assert t["share of bandwidth bound"].isna().all()  # no GEMV run of this GPU: no copy bandwidth
    d = df.assign(weight_bytes_per_token=1e9, copy_gbps=1000.0)
    bw = report.decode_table(d)["share of bandwidth bound"]
    assert sorted(bw.round(2)) == sorted((d["tok_s"] * 1e9 / 1e12).round(2))
    _check_figure(report.fig_decode(df))
    pareto = _check_figure(report.fig_decode_pareto(df), 2)
    assert sorted(pareto[0].lines[0].get_xdata()) == [4.0, 16.0]  # one point per scheme, at its bits per weight
    # a scheme's LM-head variant is the same family: one point, the faster of the two, and one label
    head = df[df["scheme"] == "4-bit K=16"].assign(scheme="4-bit K=16, LM head 4-bit K=16", tok_s=lambda x: x["tok_s"] * 1.1)
    pareto = _check_figure(report.fig_decode_pareto(pd.concat([df, head], ignore_index=True)), 2)
    line = pareto[0].lines[0]
    assert line.get_label().endswith("llama-2-13b")  # lines in (GPU, model) order
    assert sorted(line.get_xdata()) == [4.0, 16.0] and max(line.get_ydata()) == pytest.approx(head.set_index("model").loc["llama-2-13b", "tok_s"])
    assert sorted(t.get_text() for t in pareto[0].texts) == ["4-bit K=16", "fp16"]
    with pytest.raises(report.NoRecordedDataError):
        report.load_decode(tmp_path / "none")


def test_decode_targets_take_each_targets_best_graphed_row(tmp_path):
    prov = results.provenance(command="bench")
    prov.update(gpu="NVIDIA H100 80GB HBM3", date="2026-01-01T00:00:00+00:00")

    def rec(model, scheme, path, tok_s, vram, kb=None, fp16=None, sb=None):
        return {"model": model, "scheme": scheme, "path": path, "fused": True, "tok_s": tok_s, "vram_gb": vram,
                "fp16_tok_s": fp16, "fp16_vram_gb": 10.0 if fp16 else None, "j_per_token": 1.0, "oom": False,
                "fraction_of_kernel_bound": kb, "fraction_of_step_bound": sb, "weight_bytes_per_token": 2e9 if "70b" in model else 1e9}

    recs = [rec("llama-2-7b", "fp16", "compiled", 100.0, 10.0, 0.9, 100.0),
            rec("llama-2-7b", "4-bit K=16", "compiled", 200.0, 3.2, 0.8, 100.0),
            rec("llama-2-7b", "4-bit K=16, LM head 4-bit K=16", "fused-step", 240.0, 2.9, 0.8, sb=0.9),
            rec("llama-2-13b", "fp16", "compiled", 50.0, 20.0, 0.9, 50.0),
            rec("llama-2-13b", "4-bit K=16", "compiled", 120.0, 6.0, 0.83, 50.0),  # no step bound: the kernel bound's share
            rec("llama-2-7b", "4-bit K=16", "eager", 999.0, 1.0),  # not a graphed path: never a target's row
            rec("llama-2-7b", "2-bit additive (M=2)", "fused-step", 300.0, 2.0, 0.75),
            rec("llama-2-70b", "fp16", "graphed", None, None) | {"oom": True},
            rec("llama-2-70b", "2-bit additive (M=2)", "compiled", 60.0, 20.0, 0.5),
            rec("llama-2-70b", "2-bit additive (M=2), LM head 4-bit K=16", "fused-step", 55.0, 19.0, 0.45, sb=0.88)]
    results.save("decode", recs, prov, folder=tmp_path)
    df = report.load_decode(tmp_path).assign(copy_gbps=300.0)
    t = report.decode_targets(df).set_index("target (issue 4)")
    assert list(t.index) == [x[0] for x in report.DECODE_TARGETS] and set(t["GPU"]) == {"H100 80GB HBM3"}
    four = t.loc[report.DECODE_TARGETS[0][0]]  # the fused-step row: 240 / 100, its kernel bound 240 / 0.8 / 100
    assert (four["ours"], four["kernel bound"], four["met"]) == ("2.40x", "3.00x", "yes") and "fused-step" in four["row"]
    two = t.loc[report.DECODE_TARGETS[1][0]]
    assert (two["ours"], two["kernel bound"], two["met"]) == ("3.00x", "4.00x", "no")
    vram = t.loc[report.DECODE_TARGETS[2][0]]
    assert (vram["goal"], vram["ours"], vram["kernel bound"], vram["met"]) == ("at most 30 %", "29 %", "–", "yes")
    assert (t.loc[report.DECODE_TARGETS[3][0], "ours"], t.loc[report.DECODE_TARGETS[3][0], "met"]) == ("2.40x", "yes")
    bw = t.loc[report.DECODE_TARGETS[4][0]]  # 60 tok/s x 2 GB / 300 GB/s = 40 %; at the kernel bound 80 %
    assert (bw["ours"], bw["kernel bound"], bw["met"]) == ("40 %", "80 %", "no")
    # the fastest 4-bit row's (fused-step, 240 tok/s) share of its own kernels' bound (90 %, not the
    # fastest plans' 80 %), not the compiled row's
    kern = t.loc[report.DECODE_TARGETS[5][0]]
    assert (kern["ours"], kern["kernel bound"], kern["met"]) == ("90 %", "–", "yes") and "fused-step" in kern["row"]
    k13 = t.loc[report.DECODE_TARGETS[6][0]]  # a compiled row runs the kernels the kernel bound times: its 83 %
    assert (k13["ours"], k13["met"]) == ("83 %", "no") and "compiled" in k13["row"]
    k7 = t.loc[report.DECODE_TARGETS[7][0]]  # the 2-bit fused-step row has no step bound: its kernel bound's share
    assert (k7["ours"], k7["met"]) == ("75 %", "no")
    # 70B: no fp16 fits, so the fastest row is picked by tok/s (the compiled 60, not the fused step's 55 at 88 %)
    k70 = t.loc[report.DECODE_TARGETS[8][0]]
    assert (k70["ours"], k70["met"]) == ("50 %", "no") and "compiled" in k70["row"]
    # a faster row measured without its kernel bound: nothing to say of it, not the slower row's share
    recs.append(rec("llama-2-70b", "2-bit additive (M=2), LM head 4-bit K=16", "fused-step", 70.0, 19.0))
    recs.remove(recs[-2])
    results.save("decode", recs, prov, folder=tmp_path)
    k70 = report.decode_targets(report.load_decode(tmp_path).assign(copy_gbps=300.0)).set_index("target (issue 4)").loc[report.DECODE_TARGETS[8][0]]
    assert (k70["ours"], k70["met"]) == ("–", "–") and "fused-step" in k70["row"]


def test_decode_repeats_spread_runs_of_the_same_sources_and_mark_a_target_inside_the_spread(tmp_path):
    # three runs of one source tree (two commits: data alone changed between them) and one of another tree
    runs = [("aaa1111", "src-a", "2026-01-01T00:00:00+00:00", 218.0, 510.0), ("aaa1111", "src-a", "2026-01-01T01:00:00+00:00", 233.0, 509.0),
            ("bbb2222", "src-a", "2026-01-01T02:00:00+00:00", 219.0, 523.0), ("ccc3333", "src-b", "2025-12-31T00:00:00+00:00", 217.0, 541.0)]
    for commit, sid, date, fp16, k16 in runs:
        prov = results.provenance(command="bench")
        prov.update(gpu="NVIDIA H200", date=date, git_commit=commit, source_id=sid)
        recs = [{"model": "llama-2-7b", "scheme": s, "path": "compiled" if s == "fp16" else "fused-step", "fused": True, "tok_s": v,
                 "vram_gb": 3.0, "fp16_tok_s": None, "j_per_token": 1.0, "oom": False} for s, v in (("fp16", fp16), ("4-bit K=16", k16))]
        results.save("decode", recs, prov, folder=tmp_path)
    rep = report.decode_repeats(tmp_path)
    k = rep[rep["Scheme"] == "4-bit K=16"].iloc[0]  # src-b ran once: no row of its own
    assert len(rep[rep["Scheme"] == "4-bit K=16"]) == 1 and k["runs"] == 3 and k["runs (commit)"] == "aaa1111, bbb2222"
    assert (k["tok/s: lowest"], k["tok/s: highest"]) == (509.0, 523.0)
    assert k["vs fastest fp16: lowest"] == pytest.approx(509 / 233) and k["vs fastest fp16: highest"] == pytest.approx(523 / 219)
    df = report.load_decode(tmp_path)
    row = report.decode_targets(df, rep).set_index("target (issue 4)").loc[report.DECODE_TARGETS[0][0]]
    # the newest run (523 / 219 = 2.39x) meets 2.3x, one repeat (509 / 233 = 2.18x) did not
    assert (row["ours"], row["met"], row["repeats"]) == ("2.39x", "yes, not in every repeat", "2.18-2.39x (3 runs)")
    assert "repeats" not in report.decode_targets(df).columns
    assert report.decode_repeats(tmp_path / "none").empty


def test_decode_step_profile_splits_a_token_into_its_parts():
    prof = {"wall_us": 1000.0, "kernel_us": 950.0, "gaps_us": 50.0,
            "rows": [["trapetum::additive::stream_kernel::_3clocals_3e::kernel[abi:v1]", 80.0, 500.0],
                     ["trapetum::additive::additive_kernel::_3clocals_3e::kernel[abi:v2]", 80.0, 300.0],
                     ["trapetum::attention::attention_kernel::_3clocals_3e::kernel[abi:v3]", 80.0, 100.0],
                     ["trapetum::gemv::lut_kernel::_3clocals_3e::kernel[abi:v4]", 1.0, 40.0],
                     ["trapetum::greedy::greedy_kernel::_3clocals_3e::kernel[abi:v5]", 1.0, 10.0]]}
    base = {"gpu_label": "H100", "model": "llama-2-70b", "scheme": "2-bit additive (M=2)", "tok_s": 1e3}
    df = pd.DataFrame([base | {"path": "fused-step", "profile": json.dumps(prof), "step_kernel_ms_per_token": 0.8,
                               "kernel_ms_per_token": 0.7},
                       base | {"path": "fused-step", "profile": json.dumps(prof), "step_kernel_ms_per_token": np.nan,
                               "kernel_ms_per_token": 0.7, "model": "llama-2-7b"},  # no step bound: the kernel bound
                       base | {"path": "compiled", "profile": json.dumps(prof)},  # only the fused step is profiled
                       base | {"path": "fused-step", "profile": None}])
    t = report.decode_step_profile(df)
    assert len(t) == 2
    r = t.iloc[0]
    assert (r["own kernels in the step (us)"], r["attention (us)"], r["other kernels (us)"], r["between kernels (us)"]) == (840.0, 100.0, 10.0, 50.0)
    assert r["own kernels alone (us)"] == pytest.approx(800.0) and t.iloc[1]["own kernels alone (us)"] == pytest.approx(700.0)
    parts = ["own kernels in the step (us)", "attention (us)", "other kernels (us)", "between kernels (us)"]
    assert r[parts].sum() == pytest.approx(r["token (us)"])
    assert report.decode_step_profile(df.drop(columns="profile")).empty


def test_measure_auto_follows_the_gpu(monkeypatch):
    import torch

    monkeypatch.delenv("TRAPETUM_RENDER_ONLY", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert report.should_measure("auto") and not report.should_measure(False)
    monkeypatch.setenv("TRAPETUM_RENDER_ONLY", "1")
    assert not report.should_measure("auto") and report.should_measure(True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRAPETUM_RENDER_ONLY")
    assert not report.should_measure("auto")
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        report.should_measure("yes")


def test_real_model_check_table_judges_each_path_by_its_tolerance(tmp_path):
    from trapetum.decode import CHECK_TOL

    assert report.decode_check_table(report.load_decode_checks(tmp_path)).columns.tolist() == ["Real-model check"]
    prov = results.provenance(command="check")
    prov.update(gpu="NVIDIA H100 80GB HBM3")
    rows = [("fused-step", 32, 0.005, 0.001), ("graphed", 32, 0.0, 0.001), ("compiled", 31, 0.004, 0.001), ("fused-step", 32, 0.02, 0.01)]
    recs = [{"model": f"m{i // 3}", "scheme": "4-bit K=16", "path": p, "tokens": 32, "matching_prefix": n,
             "max_rel_logit_diff": e, "tol": t, "passed": n == 32 and e <= t} for i, (p, n, e, t) in enumerate(rows)]
    results.save("decode-check", recs, prov, folder=tmp_path)
    t = report.decode_check_table(report.load_decode_checks(tmp_path))
    assert t["Path vs eager"].tolist() == ["graphed", "compiled", "fused-step", "fused-step"]  # path order within a model
    assert t["Tolerance"].tolist() == [CHECK_TOL["graphed"], CHECK_TOL["compiled"], CHECK_TOL["fused-step"], CHECK_TOL["fused-step"]]
    # a token mismatch fails whatever the logits; a logit gap over the path's tolerance fails
    assert t["Passed"].tolist() == ["yes", "no", "yes", "no"]
    assert t["Greedy tokens equal"].tolist()[1] == "31 / 32"


def test_a_decode_row_keeps_its_own_runs_fp16_baseline_after_a_newer_fp16_run(tmp_path):
    # Run 1: fp16 compiled 100 tok/s (10 GB) beside a 4-bit fused-step row; run 2 (newer) measures
    # fp16 compiled again (160) with another scheme. The newer fp16 row replaces run 1's in the table,
    # but run 1's 4-bit row still divides by run 1's fp16, and its VRAM by run 1's fastest fp16 path's.
    def run(date, fp16_tok_s, scheme, tok_s):
        prov = results.provenance(command="bench")
        prov.update(gpu="NVIDIA H100 80GB HBM3", date=date)
        recs = [{"model": "llama-2-7b", "scheme": "fp16", "path": "compiled", "fused": True, "tok_s": fp16_tok_s,
                 "vram_gb": 10.0, "fp16_vram_gb": 10.0, "fp16_tok_s": fp16_tok_s, "j_per_token": 1.0, "oom": False},
                {"model": "llama-2-7b", "scheme": scheme, "path": "fused-step", "fused": True, "tok_s": tok_s,
                 "vram_gb": 3.0, "fp16_vram_gb": None, "fp16_tok_s": None, "j_per_token": 0.5, "oom": False}]
        return results.save("decode", recs, prov, folder=tmp_path)

    run("2026-01-01T00:00:00+00:00", 100.0, "4-bit", 250.0)
    run("2026-01-02T00:00:00+00:00", 160.0, "4-bit, 4-bit head", 400.0)  # the first run is kept aside under its date
    t = report.decode_table(report.load_decode(tmp_path)).set_index("Scheme")
    assert t.loc["fp16", "tok/s"] == 160.0  # the newest fp16 row is shown
    assert t.loc["4-bit", "vs fastest fp16"] == pytest.approx(2.5)  # its own run's fp16: 250 / 100
    assert t.loc["4-bit, 4-bit head", "vs fastest fp16"] == pytest.approx(2.5)  # 400 / 160
    assert t.loc["4-bit", "VRAM vs fp16"] == pytest.approx(0.3)


def test_tile_trials_puts_each_tried_change_beside_the_committed_kernel(tmp_path):
    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "efb7d87aaa", "date": "2026-11-27T07:30"}
    ring = [{"kind": "check", "passed": True},
            {"kind": "time", "n_in": 4096, "n_out": 14336, "batch": 64, "fp16_us": 44.0, "staged_us": 50.0, "ring_best_us": 60.0,
             "ring_best_plan": "4 warps, ring 3"}]
    (tmp_path / "_runs" / "tile-ring-efb7d87-h100.json").write_text(json.dumps({"provenance": prov, "records": ring}))
    red = [{"kind": "check", "passed": True}, {"kind": "check", "passed": True},
           {"kind": "time", "n_in": 4096, "n_out": 14336, "batch": 8, "fp16_us": 42.0, "old_us": 20.0, "new_best_us": 25.0,
            "new_best_plan": "16 warps"}]
    (tmp_path / "_runs" / "tile-red-finish-9a450ae-h100.json").write_text(
        json.dumps({"provenance": {**prov, "git_commit": "9a450aebbb", "date": "2026-11-27T08:00"}, "records": red}))
    t = report.tile_trials(tmp_path)
    assert list(t["batch"]) == [64, 8] and list(t["probe"]) == ["efb7d87 (1/1 checks)", "9a450ae (2/2 checks)"]
    assert list(t["committed (us)"]) == [50.0, 20.0] and list(t["tried plan"]) == ["4 warps, ring 3", "16 warps"]
    assert np.allclose(t["tried / committed"], [1.2, 1.25]) and t["in x out"][0] == "4096 x 14336"
    assert report.tile_trials(tmp_path / "nothing").empty


def test_a_run_timing_the_fused_step_both_ways_keeps_both_rows(tmp_path):
    import json

    def run(name, date, programmatic):
        prov = results.provenance(command="bench")
        prov.update(gpu="NVIDIA H200", date=date)
        recs = [{"model": "llama-2-7b", "scheme": "fp16", "path": "compiled", "fused": True, "tok_s": 200.0, "vram_gb": 14.0,
                 "j_per_token": 2.0, "oom": False, "fp16_tok_s": 200.0}]
        recs += [{"model": "llama-2-7b", "scheme": "2-bit additive (M=2)", "path": "fused-step", "fused": True, "tok_s": 500.0 + 50 * bool(p), "vram_gb": 2.4,
                  "j_per_token": 0.4, "oom": False, "fp16_tok_s": None, **({} if p is None else {"programmatic": p})} for p in programmatic]
        (tmp_path / "h200").mkdir(exist_ok=True)
        (tmp_path / "h200" / name).write_text(json.dumps({"provenance": prov, "records": recs}))

    run("decode.20260101T000000.json", "2026-01-01", [None])  # an older run: serial, with no field
    run("decode.json", "2026-02-01", [True, False])
    t = report.decode_table(report.load_decode(tmp_path))
    step = t[t["Path"].str.startswith("fused-step")].set_index("Path")["tok/s"]
    assert step.to_dict() == {report.SERIAL_STEP + report.FUSED_SUFFIX: 500.0, "fused-step" + report.FUSED_SUFFIX: 550.0}
    best = report.decode_targets(report.load_decode(tmp_path))
    assert best["row"].str.contains(r"fused-step, fused").any() and not best["row"].str.contains("serial").any()
    # a run whose only fused-step row is serial (a GPU before sm_90) keeps the plain name: that is how the step runs there
    run("decode.json", "2026-03-01", [False])
    t = report.decode_table(report.load_decode(tmp_path))
    assert list(t[t["Path"].str.startswith("fused-step")]["tok/s"]) == [500.0]


def test_programmatic_probe_sets_serial_and_programmatic_side_by_side(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()
    recs = [{"kind": "check", "passed": True, "name": "fused step, programmatic vs serial vs eager", "tokens_equal_pdl_serial": True,
             "max_abs_logit_diff_pdl_serial": 0.0, "tokens_matching_eager": 32},
            {"kind": "time", "name": "wall", "pdl_us": [1750.0], "serial_us": [1850.0], "pdl_median_us": 1750.0, "serial_median_us": 1850.0},
            {"kind": "time", "programmatic": True, "tok_s": 558.0}, {"kind": "time", "programmatic": False, "tok_s": 530.0}]
    prov = {"gpu": "NVIDIA H200", "git_commit": "946656c3ea", "date": "2026-11-28", "dependents_released": "after its main loop"}
    (tmp_path / "_runs" / "pdl-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    (tmp_path / "_runs" / "pdl-probe-y-h200.json").write_text(json.dumps({"provenance": prov, "records": recs[1:]}))  # no check: no row
    t = report.programmatic_probe(tmp_path)
    assert len(t) == 1 and t["commit"][0] == "946656c" and t["next launch released"][0] == "after its main loop"
    assert t["serial / programmatic"][0] == pytest.approx(1850 / 1750) and t["tok/s, programmatic"][0] == 558.0
    assert t["same tokens and logits"][0] and t["tokens as eager"][0] == "32/32"
    assert t["model"][0] == report.PROBE_MODEL  # a probe that names no model: session 49's 2-bit one
    assert report.programmatic_probe(tmp_path / "nothing").empty


def test_cluster_decode_ab_sets_each_run_of_a_model_side_by_side(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()

    def run(tok_s, step, frac, fp16=127.0):
        return [{"scheme": "fp16", "path": "compiled", "tok_s": fp16},
                {"scheme": "A2", "path": "fused-step", "tok_s": tok_s, "step_implied_tok_s": step, "fraction_of_step_bound": frac}]

    def write(name, runs, date):  # a results file whose records each name their decode process
        prov = {"gpu": "NVIDIA H200", "git_commit": "de2bff3aa", "date": date}
        recs = [dict(r, run=k) for k, rs in runs.items() for r in rs]
        (tmp_path / "_runs" / name).write_text(json.dumps({"provenance": prov, "records": recs}))
    write("cluster-decode-ab-x-h200.json", {"70b-global": run(114.1, 119.4, 0.956), "13b-c16": run(355.5, 409.0, 0.869),
                                            "13b-global": run(374.8, 391.3, 0.958), "7b-c8": run(584.3, 674.7, 0.866),
                                            "7b-new": [{"scheme": "fp16", "tok_s": 220.0}]}, "2026-11-29T18:00")
    both = run(374.9, None, None)  # --programmatic both, no kernel times: a row each way, no step bound
    both.append({"scheme": "A2", "path": "fused-step", "programmatic": False, "tok_s": 338.2})
    write("cluster-decode-ab-y-h200.json", {"13b-global": both}, "2026-11-29T19:00")
    t = report.cluster_decode_ab(tmp_path)
    assert list(t["model"]) == ["Llama-2-7B"] + ["Llama-2-13B"] * 4 + ["Llama-2-70B"]  # by size; a run with no fused step left out
    assert t["plans"][1] == report.CLUSTER_RUNS["13b-c16"] and t["tok/s"][2] == 374.8 and t["commit"][0] == "de2bff3"
    assert t["torch fp16 tok/s"][0] == 127.0 and t["share of step bound"][5] == 0.956
    serial = t[t["launches"] == "serial"]
    assert len(serial) == 1 and serial["tok/s"].iloc[0] == 338.2 and np.isnan(serial["step bound tok/s"].iloc[0])
    assert (t["launches"] == "programmatic").sum() == 5
    assert report.cluster_decode_ab(tmp_path / "nothing").empty


def test_programmatic_variants_sets_each_against_the_serial_step(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()
    rec = {"kind": "time", "median_us": {"serial": 2300.0, "loop": 2420.0, "lut-serial": 2225.0}, "same_tokens": True}
    prov = {"gpu": "NVIDIA H200", "git_commit": "e43378dabc", "date": "2026-11-28", "model": "7B 4-bit",
            "variants": {"serial": "every launch serial", "loop": "lut after its loop"}}
    (tmp_path / "_runs" / "pdl-variants-x-h200.json").write_text(json.dumps({"provenance": prov, "records": [rec]}))
    no_serial = {"kind": "time", "median_us": {"loop": 2420.0}}
    (tmp_path / "_runs" / "pdl-variants-y-h200.json").write_text(json.dumps({"provenance": prov, "records": [no_serial]}))
    t = report.programmatic_variants(tmp_path)
    assert list(t["launches"]) == ["every launch serial", "lut after its loop", "lut-serial"]  # unnamed: its key
    assert t["serial / this"].tolist() == pytest.approx([1.0, 2300 / 2420, 2300 / 2225])
    assert set(t["model"]) == {"7B 4-bit"} and set(t["commit"]) == {"e43378d"} and t["same tokens"].all()
    assert report.programmatic_variants(tmp_path / "nothing").empty


def test_dual_step_probe_sets_lut_or_dual_against_lut_only(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H200", "git_commit": "718e57cabc", "date": "2026-11-28", "model": "7B 4-bit"}
    recs = [{"kind": "check", "first_mismatch": 11, "top2_gap_at_mismatch_lut": 0.0, "top2_gap_at_mismatch_lut_dual": 0.0234,
             "max_abs_logit_diff_before_mismatch": 0.082}]
    recs += [{"kind": "time", "family": f, "round": r, "token_us": us} for f, r, us in
             (("lut", 0, 2224.0), ("lut", 1, 2218.0), ("lut+dual", 0, 2010.0), ("lut+dual", 1, 2006.0))]
    (tmp_path / "_runs" / "dual-step-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    no_check = {"provenance": prov, "records": recs[1:]}  # timed but never compared: left out
    (tmp_path / "_runs" / "dual-step-probe-y-h200.json").write_text(json.dumps(no_check))
    t = report.dual_step_probe(tmp_path)
    assert list(t["fused GEMVs"]) == list(report.DUAL_STEP_FAMILIES.values())
    assert t["token (us)"].tolist() == pytest.approx([2221.0, 2008.0])
    assert t["lut only / this"].tolist() == pytest.approx([1.0, 2221.0 / 2008.0])
    assert set(t["first differing token"]) == {"11"} and set(t["top-2 logit gap there (lut / lut or dual)"]) == {"0 / 0.0234"}
    assert set(t["model"]) == {"7B 4-bit"} and set(t["rounds"]) == {2}
    assert report.dual_step_probe(tmp_path / "nothing").empty


def test_dual_launch_probe_sets_each_variant_against_its_probes_first(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H200", "git_commit": "37f7ae0abc", "date": "2026-11-29", "model": "7B 4-bit"}
    early = [{"kind": "check", "tokens_equal": True, "max_abs_logit_diff": 0.0}]
    early += [{"kind": "time", "family": f, "round": r, "token_us": us} for f, r, us in
              (("serial", 0, 1954.0), ("early", 0, 1809.0), ("serial", 1, 1952.0), ("early", 1, 1807.0), ("serial", 2, 1953.0))]
    (tmp_path / "_runs" / "dual-early-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": early}))
    oproj = [{"kind": "check", "tokens_equal": False, "max_abs_logit_diff": 0.04},
             {"kind": "time", "family": "o on lut", "round": 0, "token_us": 1805.0}]
    (tmp_path / "_runs" / "dual-oproj-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": oproj}))
    t = report.dual_launch_probe(tmp_path)  # the o_proj probe never timed its second variant: left out
    assert list(t["variant"]) == list(report.DUAL_LAUNCH_PROBES["_runs/dual-early-probe-*.json"].values())
    assert t["token (us)"].tolist() == pytest.approx([1953.0, 1808.0]) and t["rounds"].tolist() == [3, 2]
    assert t["first / this"].tolist() == pytest.approx([1.0, 1953.0 / 1808.0])
    assert t["same greedy tokens"].all() and set(t["commit"]) == {"37f7ae0"}
    oproj.append({"kind": "time", "family": "o on dual", "round": 0, "token_us": 1800.0})
    (tmp_path / "_runs" / "dual-oproj-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": oproj}))
    t = report.dual_launch_probe(tmp_path)
    assert t["token (us)"].tolist()[2:] == pytest.approx([1805.0, 1800.0]) and not t["same greedy tokens"].iloc[3]
    assert report.dual_launch_probe(tmp_path / "nothing").empty


# -- the served input rotation ----------------------------------------------------------------------
def _rotation_files(tmp_path):
    runs = tmp_path / "_runs"
    runs.mkdir(parents=True, exist_ok=True)
    prov = {"gpu": "NVIDIA H200", "git_commit": "abcdef0123", "date": "2026-11-30T00:00:00+00:00"}
    recs = [{"kind": "rotation", "n_in": 4096, "m": 1, "p": 4096, "batch": 1, "time_ms": 0.006, "max_rel_err": 3e-4, "finite": True},
            {"kind": "layer", "model": "7B", "layer": "o", "n_in": 4096, "n_out": 4096, "fp16_ms": 0.0135, "K16_ms": 0.015,
             "K16_rot_ms": 0.0225, "A2_ms": 0.02, "A2_rot_ms": 0.03, "K16_rot_max_rel_err": 4e-4, "A2_rot_max_rel_err": 3e-4}]
    (runs / "rotation-probe-v1-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    old = {**prov, "git_commit": "0000000aaa", "date": "2026-11-29T00:00:00+00:00", "format_version": 1}
    base = {"model": "llama-2-7b", "path": "fused-step", "fused": True, "K": 16}
    rows = [{**base, "scheme": "4-bit K=16", "rotate": False, "tok_s": 500.0},
            {**base, "scheme": "4-bit K=16, inputs rotated", "rotate": True, "tok_s": 100.0,
             "profile": json.dumps({"rows": [["trapetum::hadamard::rotate_kernel", 128.0, 5000.0], ["trapetum::gemv::x", 128, 1.0]]})}]
    (runs / "rotation-decode-k16-v1-h200.json").write_text(json.dumps({"provenance": old, "records": rows}))
    return prov, base


def test_the_rotation_tables_read_the_probes_and_pair_each_rotated_run_with_its_own_plain_row(tmp_path):
    prov, base = _rotation_files(tmp_path)
    p = report.rotation_probe(tmp_path)
    assert p.to_dict("records") == [{"GPU": "H200", "commit": "abcdef0", "kernel": "v1", "inputs": 4096, "pre-operation": "-",
                                     "m x p": "1 x 4096", "batch": 1, "launch (us)": pytest.approx(6.0), "max rel. error": 3e-4,
                                     "all written": True}]
    # an A/B probe names each row's kernel and pre-operation; it times no layer, so the layer table keeps the older probe
    ab = [{"kind": "rotation", "version": v, "pre": "rms", "n_in": 4096, "m": 1, "p": 4096, "batch": 1, "time_ms": t,
           "max_rel_err": 3e-4, "finite": True} for v, t in (("v3", 0.008), ("v4", 0.004))]
    (tmp_path / "_runs" / "rotation-probe-v4-h200.json").write_text(json.dumps(
        {"provenance": {**prov, "date": "2026-12-01T00:00:00+00:00"}, "records": ab}))
    p = report.rotation_probe(tmp_path)
    assert p[["kernel", "pre-operation"]].values.tolist() == [["v1", "-"], ["v3", "rms"], ["v4", "rms"]]
    lay = report.rotation_layers(tmp_path).iloc[0]
    assert lay["4-bit K=16: rotated / plain"] == pytest.approx(1.5) and lay["2-bit additive, rotated (us)"] == pytest.approx(30.0)
    assert lay["max rel. error (rotated)"] == 4e-4
    # the recorded run (newer): its rotated row beside its own plain row, not the older file's
    df = pd.DataFrame([{**base, "scheme": "4-bit K=16", "rotate": False, "tok_s": 540.0, "file": "decode.json", "gpu_label": "H200",
                        "git_commit": "1234567", "date": "2026-11-30"},
                       {**base, "scheme": "4-bit K=16, inputs rotated", "rotate": True, "tok_s": 270.0, "file": "decode.json",
                        "gpu_label": "H200", "git_commit": "1234567", "date": "2026-11-30", "profile": None}])
    t = report.rotation_decode(df, tmp_path)
    assert t["run (commit)"].tolist() == ["0000000", "1234567"]  # oldest first
    assert t["rotated / plain"].tolist() == [pytest.approx(0.2), pytest.approx(0.5)]
    assert t["rotation launches (us a token)"].iloc[0] == pytest.approx(5000.0) and pd.isna(t["rotation launches (us a token)"].iloc[1])
    assert t["rotation launches a token"].iloc[0] == 128.0
    assert report.rotation_summary(t) == ("As served now: llama-2-7b 4-bit K=16 on the H200 (1234567), every projection's inputs "
                                          "at run time, keeps 50% of its tok/s.")
    t.loc[1, "rotation launches (us a token)"] = 740.0  # of a 3704 us token
    assert report.rotation_summary(t).endswith("keeps 50% of its tok/s, its rotation launches 20% of the rotated token.")
    assert report.rotation_decode(df[df["rotate"] == False], tmp_path / "none").empty and report.rotation_summary(pd.DataFrame()) == ""  # noqa: E712
    # a run that a newer one replaced (kept aside as decode.<date>.json) keeps its row: each kernel version's run stays,
    # its rotated row paired with its own plain row even where the newer run replaced that plain row
    kept = results.provenance(command="bench")
    kept.update(gpu="NVIDIA H200", git_commit="5555555", date="2026-11-29T12:00:00+00:00")
    base = {**base, "vram_gb": 4.0}
    results.save("decode", [{**base, "scheme": "4-bit K=16", "rotate": False, "tok_s": 520.0},
                            {**base, "scheme": "4-bit K=16, inputs rotated", "rotate": True, "tok_s": 312.0}], kept, folder=tmp_path)
    newer = dict(kept, git_commit="6666666", date="2026-11-30T12:00:00+00:00")
    results.save("decode", [{**base, "scheme": "4-bit K=16", "rotate": False, "tok_s": 530.0}], newer, folder=tmp_path)
    t = report.rotation_decode(report.load_decode(tmp_path), tmp_path)
    assert t["run (commit)"].tolist() == ["0000000", "5555555"] and t["rotated / plain"].iloc[1] == pytest.approx(0.6)


def test_the_rotation_tradeoff_sets_each_modes_speed_beside_its_served_accuracy(tmp_path):
    prov, base = _rotation_files(tmp_path)
    acc = tmp_path / "accuracy"
    acc.mkdir()
    ref = {"scheme": "reference", "ppl": 20.0}
    for name, mode, ppl, cal in (("none", "none", 80.0, "a"), ("inputs", "inputs", 60.0, "b"), ("stream", "stream", 70.0, "c"),
                                 ("stream-paired", "stream", 71.0, "d")):
        recs = [ref, {"scheme": "additive", "ppl": ppl, "rotate_mode": mode, "bits_per_weight": 2.153, "calibration_sha256_16": cal}]
        (acc / f"smollm2-135m-served-a2-{name}.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    a = report.served_rotation_accuracy(tmp_path)
    assert sorted(a["mode"]) == ["inputs", "none", "stream", "stream"] and a["vs reference (%)"].max() == pytest.approx(300.0)
    from trapetum import pipelines

    note = pipelines.served_rotation_note(acc, "smollm2-135m")
    assert "unrotated 80.00 (+300%, smollm2-135m-served-a2-none.json)" in note and note.count("rotate='stream'") == 2
    assert pipelines.served_rotation_note(tmp_path, "smollm2-135m") is None
    prof = json.dumps({"rows": [["trapetum::hadamard::rotate_kernel", 32.0, 400.0]]})
    df = pd.DataFrame([{**base, "scheme": "4-bit K=16", "rotate": False, "tok_s": 540.0},
                       {**base, "scheme": "4-bit K=16, stream rotated", "rotate": "stream", "tok_s": 432.0, "profile": prof}]
                      ).assign(file="decode.json", gpu_label="H200", git_commit="1234567", date="2026-11-30")
    t = report.rotation_tradeoff(report.rotation_decode(df, tmp_path), a)
    assert t["Rotation"].tolist() == ["none", report.ROTATION_MODES["stream"], report.ROTATION_MODES["stream+o"],
                                      report.ROTATION_MODES["inputs"]]
    none, stream, o, inputs = (t.iloc[i] for i in range(4))
    assert none["7B 4-bit K=16: tok/s kept"] == 1.0 and none["SmolLM2 2-bit additive, served: PPL"] == "80.00"
    assert stream["7B 4-bit K=16: tok/s kept"] == pytest.approx(0.8) and stream["run-time rotations a 7B token"] == 32.0
    assert stream["speed runs (commit)"] == "1234567" and none["speed runs (commit)"] == "–"
    assert stream["SmolLM2 2-bit additive, served: PPL"] == "71.00, 70.00" and stream["vs reference"] == "+255 %, +250 %"  # by date, then file
    assert pd.isna(o["7B 4-bit K=16: tok/s kept"]) and o["SmolLM2 2-bit additive, served: PPL"] == "–"  # neither measured
    assert inputs["7B 4-bit K=16: tok/s kept"] == pytest.approx(0.2)  # the older probe file's v1 row: the only inputs row
    assert pd.isna(inputs["7B 2-bit additive: tok/s kept"])
    assert report.rotation_tradeoff(pd.DataFrame(columns=t.columns), report.served_rotation_accuracy(tmp_path / "no")).empty

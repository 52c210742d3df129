"""The chapter "Vector codebooks": its tables and figures on synthetic data, and the seed tables it quotes."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trapetum import bench, report, results

REPO = Path(__file__).resolve().parents[1]
SEEDS = REPO.parent / "shared" / "seeds"


def _rec(kernel, n_in, n_out, ms, fp16_ms, grid, nbytes, copy, **extra):
    return {"kernel": kernel, "batch": 1, "in_features": n_in, "out_features": n_out, "time_ms": ms, "fp16_ms": fp16_ms,
            "speedup": fp16_ms / ms, "gbps": nbytes / (ms * 1e-3) / 1e9, "max_rel_err": 4e-4, "grid": grid,
            "copy_gbps": copy, **extra}


def synthetic_vq(copy: float) -> list[dict]:
    recs = []
    g = bench.RESIDUAL_GRID
    for n_in in g["in_features"]:
        for n_out in g["out_features"]:
            f = 2 * n_in * n_out / (0.9 * copy * 1e9) * 1e3 + 0.004
            recs.append(_rec("torch fp16", n_in, n_out, f, f, "baseline", 2 * n_in * n_out, copy, scheme="dense fp16"))
            for m in g["mains"]:
                for r in g["residuals"]:
                    bits = (np.log2(m) + np.log2(r)) / 8
                    ms = n_in * n_out * bits / 8 / (0.6 * copy * 1e9) * 1e3 + 0.006
                    recs.append(_rec("residual", n_in, n_out, ms, f, "residual", n_in * n_out * bits / 8, copy,
                                     main_centroids=m, residual_centroids=r, vector_len=8, bits_per_weight=bits,
                                     scheme=f"residual {m}+{r}"))
    for n_in, n_out in bench.ADDITIVE_SHAPES[:3]:
        f = 2 * n_in * n_out / (0.9 * copy * 1e9) * 1e3
        for kernel, M, speed in (("additive", 2, 4.0), ("additive", 4, 2.5), ("aqlm package 2x8", 2, 1.5)):
            recs.append(_rec(kernel, n_in, n_out, f / speed, f, "additive", n_in * n_out * M / 8, copy,
                             scheme=f"{2 * M // 2}-bit additive (M={M})", bits_per_weight=M))
    recs.append({"kernel": "residual", "grid": "correctness", "in_features": 256, "out_features": 96, "max_rel_err": 1e-4, "passed": True})
    return recs


@pytest.fixture(scope="module")
def vq(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prov = {"gpu": "NVIDIA H100 Test", "driver": "1", "cuda": "12", "torch": "2", "numba": "0", "numba_cuda": "0",
            "git_commit": "abc", "date": "2026-01-01T00:00:00+00:00", "command": "trapetum vq", "copy_gbps": 3000.0,
            "failures": [], "residual_correctness_failures": "3 checks over tolerance", "aqlm_package": "built"}
    results.save(report.VQ, synthetic_vq(3000.0), prov, folder=folder)
    df = report.load_vq(folder)
    df.attrs["folder"] = folder
    return df


def test_load_vq_raises_clearly_without_data(tmp_path):
    with pytest.raises(report.NoRecordedDataError, match="trapetum vq"):
        report.load_vq(tmp_path)


def test_residual_grid_table_has_all_120_configs_beside_the_seeds(vq):
    t = report.residual_grid_table(vq)
    assert len(t) == 120 and list(t["count"]) == list(range(1, 121))
    seed_col = next(c for c in t.columns if "seed 000" in c)
    assert "reported by the seed" in seed_col
    assert t[seed_col].notna().all()  # every config of ours has the seed's number beside it
    row = t[(t["in_features"] == 1024) & (t["out_features"] == 1024) & (t["main"] == 4096) & (t["residual"] == 256)].iloc[0]
    assert row[seed_col] == pytest.approx(0.0132 / 0.0135, rel=1e-6)  # seed 000 row 1: torch / vptq
    assert t[next(c for c in t.columns if "seed 001" in c)].notna().sum() == 120  # by shape, for every config


def test_residual_summary_counts_and_geomean(vq):
    s = report.residual_summary(vq)
    ours = s[s["source"].str.startswith("ours")].iloc[0]
    d = vq[vq["grid"] == "residual"]
    assert ours["configs"] == 120
    assert ours["faster than fp16"] == int((d["speedup"] > 1).sum())
    assert ours["geometric-mean speedup"] == pytest.approx(float(np.exp(np.log(d["speedup"]).mean())))
    large = d[d["in_features"] * d["out_features"] >= 4096 * 28672]
    assert ours["min speedup at in x out >= 4096 x 28672"] == pytest.approx(large["speedup"].min())
    seed = s[s["source"].str.contains("seed 000")].iloc[0]
    assert seed["configs"] == 120 and seed["faster than fp16"] < 60  # the seed's VPTQ kernel is mostly slower


def test_fig_residual_heatmap(vq):
    fig = report.fig_residual_heatmap(vq)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 8  # 4 (main, residual) configs x (ours, seed)
    assert sum("seed" in ax.get_title() for ax in panels) == 4
    assert sum(ax.get_title().endswith("run abc") for ax in panels) == 4  # ours: which run measured the panel
    for ax in panels:
        assert np.isfinite(ax.images[0].get_array()).sum() == 30
    fig.canvas.draw()


def test_fig_residual_heatmap_has_a_row_for_each_gpu(tmp_path):
    for gpu, copy in (("NVIDIA H200", 4300.0), ("NVIDIA H100 Test", 3000.0)):
        prov = {"gpu": gpu, "git_commit": gpu[-4:], "date": "2026-01-01T00:00:00+00:00", "command": "trapetum vq", "copy_gbps": copy}
        results.save(report.VQ, synthetic_vq(copy), prov, folder=tmp_path)
    df = report.load_vq(tmp_path)
    panels = [ax for ax in report.fig_residual_heatmap(df).axes if ax.images]
    assert len(panels) == 12  # 4 configs x (H100, H200, seed)
    rows = [ax.get_title().split("\n")[0] for ax in panels[::4]]  # the first config's column, top to bottom
    assert rows == [f"ours, {report.gpu_label('NVIDIA H100 Test')}", f"ours, {report.gpu_label('NVIDIA H200')}",
                    "VPTQ, reported by seed 000 (H100)"]
    h200 = [ax for ax in panels if "H200" in ax.get_title()]
    assert len(h200) == 4 and all(ax.get_title().endswith("run H200") for ax in h200)  # each row its own run
    one = [ax for ax in report.fig_residual_heatmap(df, gpu="NVIDIA H200").axes if ax.images]
    assert len(one) == 8 and not any("H100 Test" in ax.get_title() for ax in one)


def test_fp16_baseline_inversions_flag_a_baseline_slower_than_a_larger_shape(vq):
    assert report.fp16_baseline_inversions(vq).empty  # the synthetic baselines grow with the shape
    d = vq.copy()
    slow = (d["grid"] == "baseline") & (d["in_features"] == 2048) & (d["out_features"] == 1024)
    assert slow.sum() >= 1
    d.loc[slow, "time_ms"] = 10 * d[(d["grid"] == "baseline") & (d["in_features"] == 16384) & (d["out_features"] == 1024)]["time_ms"].max()
    t = report.fp16_baseline_inversions(d)
    assert t["shape (in x out)"].tolist() == ["2048 x 1024"] and t.loc[0, "larger shape"] == "4096 x 1024"
    assert t.loc[0, "fp16 (µs)"] > t.loc[0, "its fp16 (µs)"]


def test_additive_table_and_figure(vq):
    t = report.additive_table(vq)
    assert set(t["kernel"]) == {"ours (numba)", "aqlm package"}
    assert set(t[t["kernel"] == "aqlm package"]["table"]) == {""}
    ours = t[t["kernel"] == "ours (numba)"]["table"]
    assert set(ours) <= {"fp32, tensor cores", "fp16, tensor cores", "fp32, multiply-adds"} and "" not in set(ours)
    assert (t["% of copy"] > 0).all()
    assert set(t[t["kernel"] == "aqlm package"]["plan"]) == {""}
    lab = report.additive_plan_label
    assert lab({"plan": "additive chunk: 8 warps, a chunk a block"}) == "chunk: 8 warps, a chunk a block"
    assert lab({"plan": "additive: 8 warps, RB 16, K-split 2, fp16 table"}) == "8 warps, RB 16, K-split 2, fp16 table"
    assert lab({"plan": "rows256 w8 cps4"}) == "rows256 w8 cps4" and lab({"plan": float("nan")}) == ""
    fig = report.fig_additive(vq)
    bars = [p for ax in fig.axes for p in ax.patches]
    assert len(bars) == 9
    fig.canvas.draw()


def test_additive_table_labels():
    lab = report.additive_table_label
    assert lab({"kernel": "additive", "build": "mma", "table": "fp16"}) == "fp16, tensor cores"
    assert lab({"kernel": "additive", "build": "stream", "table": "fp16"}) == "fp16, tensor cores (streaming kernel)"
    assert lab({"kernel": "additive", "build": "stream", "table": "fp16",
                "plan": "additive chunk: 8 warps, a chunk a block, 512 rows a block in tiles of 32"}) == "fp16, tensor cores (chunk kernel)"
    assert lab({"kernel": "additive", "build": "fma", "table": float("nan")}) == "fp32, multiply-adds"  # runs before fp16 tables
    assert lab({"kernel": "cuda_cpp_additive", "plan": "rows256 w8 cps4 spb1 ks16 lut16"}) == "fp16, tensor cores"
    assert lab({"kernel": "cuda_cpp_additive", "plan": "rows256 w8 cps4 spb1 ks16 lut32"}) == "fp32, tensor cores"
    assert lab({"kernel": "aqlm package 2x8", "plan": None}) == ""


@pytest.mark.skipif(not SEEDS.is_dir(), reason="../shared/seeds is not beside this checkout")
@pytest.mark.parametrize("which", ["000", "001"])
def test_seed_tables_match_the_seed_texts(which):
    text = next(SEEDS.glob(f"{which}_*.txt")).read_text()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    header, body = rows[0], [r for r in rows[1:] if not set("".join(r)) <= set("- ")]
    name = report.SEED_VPTQ[which][0]
    with open(report.SEEDS_DIR / name) as f:
        ours = list(csv.DictReader(f))
    assert len(ours) == len(body)
    for r, b in zip(ours, body):
        src = dict(zip(header, b))
        assert (r["in_features"], r["out_features"], r["vptq_ms"], r["torch_ms"], r["ratio"]) == (
            src["in_features"], src["out_features"], src["vptq (ms)"], src["torch (ms)"], src["ratio"])
        assert r["main_centroids"] == src.get("main_centroids", "")


def test_vq_run_notes_surface_what_went_wrong(vq):
    notes = report.vq_run_notes(vq.attrs["folder"])
    assert set(notes["what"]) == {"residual_correctness_failures", "aqlm_package"}  # empty lists are not news
    assert "3 checks" in notes.set_index("what").loc["residual_correctness_failures", "note"]


def test_additive_side_by_side(vq):
    t = report.additive_side_by_side(vq)
    assert len(t) == 3
    assert t["ours (numba) vs aqlm package"].round(6).tolist() == [round(4.0 / 1.5, 6)] * 3  # synthetic: 4x vs 1.5x fp16


def test_each_part_comes_from_its_newest_run(tmp_path):
    # A residual-only run after a full run: the chapter takes the additive table from the old run;
    # the residual grid from the new run where it measured, from the old run where it stopped before
    # (each row keeps its commit); the kernel's checks come from the new run; the version table shows both runs.
    old_prov = {"gpu": "NVIDIA H100 Test", "git_commit": "old", "date": "2026-01-01T00:00:00+00:00", "copy_gbps": 3000.0,
                "command": "trapetum vq",
                "additive_correctness_failures": "CUDA_ERROR_INVALID_VALUE"}
    results.save(report.VQ, synthetic_vq(3000.0), old_prov, folder=tmp_path)
    new = [dict(r, time_ms=r["time_ms"] / 2, speedup=r["speedup"] * 2, variant="table", main_placement="shared",
                build="mma" if r["in_features"] == 1024 else "fma")
           for r in synthetic_vq(3000.0) if r["grid"] == "residual" and r["in_features"] <= 4096]
    new += [r for r in synthetic_vq(3000.0) if r["grid"] == "correctness"]
    new_prov = dict(old_prov, git_commit="new", date="2026-01-02T00:00:00+00:00", partial="stopped before the end")
    del new_prov["additive_correctness_failures"]
    results.save(report.VQ, new, new_prov, folder=tmp_path)
    df = report.load_vq(tmp_path)
    commits = df.groupby("grid")["git_commit"].agg(set).to_dict()
    assert commits["additive"] == {"old"} and commits["correctness"] == {"new"}
    res = df[df["grid"] == "residual"]
    assert len(res) == 120 and not res.duplicated(["in_features", "out_features", "main_centroids", "residual_centroids"]).any()
    assert (res["git_commit"] == "new").sum() == 3 * 6 * 4 and (res[res["git_commit"] == "old"]["in_features"] > 4096).all()
    s = report.residual_summary(df)
    assert s.loc[0, "configs"] == 120 and s.loc[0, "runs (commit: configs)"] == "new: 72, old: 48"
    titles = [ax.get_title() for ax in report.fig_residual_heatmap(df).axes if ax.images and "ours" in ax.get_title()]
    assert all(t.endswith("run new, old") for t in titles)
    v = report.residual_versions(tmp_path)
    assert v["commit"].tolist() == ["old", "new"] and v["configs"].tolist() == [120, 72]
    assert v["kernel"].str.startswith("gather").tolist() == [True, False] and "tensor-core" in v.loc[1, "kernel"]
    assert np.isclose(v.loc[1, "4096 x 4096 (4096+256)"], 2 * v.loc[0, "4096 x 4096 (4096+256)"])
    assert np.isnan(v.loc[1, "16384 x 53248 (4096+256)"])  # not reached by the new run
    choices = report.residual_choices(df)
    assert set(choices["kernel chosen"]) == {"table, codebook in shared", "gather, codebook in (not recorded)",
                                             "table, built on tensor cores, codebook in shared"}
    assert set(choices["GPU"]) == {report.gpu_label("NVIDIA H100 Test")}  # picks are per GPU: each tunes on its own
    notes = report.vq_run_notes(tmp_path).set_index("what")["note"]  # both runs the chapter shows speak
    assert "INVALID_VALUE" in notes["additive_correctness_failures"] and "stopped" in notes["partial"]
    # a second process of the same commit (the grid split over GPUs) finishes more configurations: one entry
    more = [dict(r, time_ms=r["time_ms"] / 2, speedup=r["speedup"] * 2)
            for r in synthetic_vq(3000.0) if r["grid"] == "residual" and r["in_features"] == 8192]
    results.save(report.VQ, more, dict(new_prov, date="2026-01-03T00:00:00+00:00"), folder=tmp_path)
    assert report.residual_summary(report.load_vq(tmp_path)).loc[0, "runs (commit: configs)"] == "new: 96, old: 24"


def test_additive_queue_trial_puts_each_probe_beside_the_static_plan(tmp_path):
    import json

    def probe(commit, date, q_us, failed=0):
        recs = [{"kind": "check", "passed": i >= failed} for i in range(4)]
        for n_in, n_out, static_us in ((4096, 4096, 8.0), (4096, 14336, 16.0)):
            recs.append({"kind": "time", "n_in": n_in, "n_out": n_out, "M": 2, "us": static_us,
                         "plan": "{'cps': 4, 'queue': 0, 'RB': 8}"})
            for q, f in ((16, 1.5), (24, q_us)):  # two queue plans: the faster one counts
                recs.append({"kind": "time", "n_in": n_in, "n_out": n_out, "M": 2, "us": static_us * f,
                             "plan": f"{{'cps': 4, 'queue': {q}}}"})
        return {"provenance": {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": commit, "date": date}, "records": recs}

    (tmp_path / "_runs").mkdir()
    # written newest first: the columns still come oldest first, by the provenance's date
    for name, d in (("additive-queue-b-h100.json", probe("bbb", "2026-11-25T10:00", 1.1)),
                    ("additive-queue-a-h100.json", probe("aaa", "2026-11-25T09:00", 1.25, failed=1))):
        (tmp_path / "_runs" / name).write_text(json.dumps(d))
    t = report.additive_queue_trial(tmp_path)
    assert list(t.columns) == ["GPU", "in x out", "M", "static grid, tuned (us)",
                               "aaa (3/4 checks): fastest queue plan / static", "bbb (4/4 checks): fastest queue plan / static"]
    assert list(t["in x out"]) == ["4096 x 4096", "4096 x 14336"] and list(t["static grid, tuned (us)"]) == [8.0, 16.0]
    assert np.allclose(t.iloc[:, 4], 1.25) and np.allclose(t.iloc[:, 5], 1.1)
    assert report.additive_queue_trial(tmp_path / "nothing").empty


def test_staging_costs_pivot_methods_and_refuse_a_wrong_copy(tmp_path):
    import json

    recs = [{"S": S, "G": G, "variant": v, "us": 1.0 + S / 65536 + G / 1000 + (0.5 if "cluster" in v else 0), "ok": None if S == 0 else True}
            for S in (0, 65536) for G in (32, 128) for v in (("ca",) if S == 0 else ("ca", "bulk", "bulk cluster 2"))]
    (tmp_path / "_runs").mkdir()
    f = tmp_path / "_runs" / "stage-probe-h100.json"
    f.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H100 80GB HBM3"}, "records": recs}))
    t = report.staging_costs(tmp_path)
    ca, bulk, mc = (report.STAGING_METHODS[k] + " (us)" for k in ("ca", "bulk", "bulk cluster 2"))
    assert list(t.columns) == ["GPU", "KiB a block", "blocks", ca, bulk, mc]
    assert list(t["KiB a block"]) == [0, 0, 64, 64] and list(t["blocks"]) == [32, 128, 32, 128]
    assert np.isnan(t.loc[0, bulk]) and t.loc[3, ca] == 1.0 + 1 + 0.128 and t.loc[3, mc] == t.loc[3, ca] + 0.5
    (tmp_path / "_runs" / "stage-probe-h200.json").write_text(json.dumps({"provenance": {"gpu": "NVIDIA H200"}, "records": recs}))
    assert len(report.fig_staging(tmp_path).axes) == 2 * 2  # a panel a GPU and grid size
    (tmp_path / "_runs" / "stage-probe-h200.json").unlink()
    recs[-1]["ok"] = False  # a method that staged wrong data is an error, not a timing
    f.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H100 80GB HBM3"}, "records": recs}))
    with pytest.raises(ValueError, match="staged wrong data"):
        report.staging_costs(tmp_path)
    assert report.staging_costs(tmp_path / "nothing").empty
    with pytest.raises(ValueError, match="no staging probe"):
        report.fig_staging(tmp_path / "nothing")


def test_cluster_codebook_probe_sets_shared_staging_beside_local(tmp_path):
    import json

    recs = [{"CS": 1, "stage": "whole codebook a block", "gathers_a_thread": 32, "us": 4.0, "ok": True},
            {"CS": 2, "stage": "whole codebook a block", "gathers_a_thread": 16, "us": 4.1, "ok": True},
            {"CS": 2, "stage": "1/2 of it a block", "gathers_a_thread": 16, "us": 5.5, "ok": True}]
    (tmp_path / "_runs").mkdir()
    f = tmp_path / "_runs" / "dsmem-probe-h100.json"
    f.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H100 80GB HBM3"}, "records": recs}))
    t = report.cluster_codebook_probe(tmp_path)
    local, shared = "whole codebook a block, local gathers (us)", "1 / cluster of it a block, gathers across the cluster (us)"
    assert list(t["blocks a cluster"]) == [1, 2] and list(t[local]) == [4.0, 4.1]
    assert np.isnan(t.loc[0, shared]) and t.loc[1, shared] == 5.5
    recs[2]["ok"] = False
    f.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H100 80GB HBM3"}, "records": recs}))
    with pytest.raises(ValueError, match="gathered sums were wrong"):
        report.cluster_codebook_probe(tmp_path)
    assert report.cluster_codebook_probe(tmp_path / "nothing").empty


def test_residual_parts_trial_sets_the_fastest_parts_plan_beside_the_fastest_without(tmp_path):
    import json

    def best(us, parts):
        return {"best_us": us, "parts": parts, "ksplit": 2, "warps": 4, "rc": 1}

    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False},
            {"kind": "time", "Nm": 8192, "Nr": 512, "n_in": 2048, "n_out": 1024, "fp16_us": [5.0, 6.0],
             "best_plain": best(6.5, 1), "best_parts": best(6.0, 4)}]
    (tmp_path / "_runs").mkdir()
    (tmp_path / "_runs" / "residual-parts-probe-x-h100.json").write_text(json.dumps(
        {"provenance": {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abcdef0123", "date": "2026-11-27"}, "records": recs}))
    r = report.residual_parts_trial(tmp_path).iloc[0]
    assert (r["probe"], r["config"], r["in x out"]) == ("abcdef0 (1/2 checks)", "8192 + 512", "2048 x 1024")
    assert r["torch fp16 (us)"] == 5.5 and r["parts / without"] == 6.0 / 6.5 and r["fastest parts plan"].startswith("4 parts, K-split 2")
    assert report.residual_parts_trial(tmp_path / "nothing").empty


def test_cluster_and_lane_split_trials_read_their_probes(tmp_path):
    import json

    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "98adb3761b", "date": "2026-11-27"}
    for name, key, best in (("residual-cluster-1024out-x-h100.json", "best_cluster", {"cluster": 2, "ksplit": 2}),
                            ("residual-lanes-probe-x-h100.json", "best_lanes", {"lanes": 4, "ksplit": 1})):
        recs = [{"kind": "check", "passed": True},
                {"kind": "time", "Nm": 4096, "Nr": 512, "n_in": 2048, "n_out": 1024, "fp16_us": [5.8, 5.9],
                 "best_plain": {"best_us": 5.9, "lanes": 1, "cluster": 0, "ksplit": 2, "warps": 4, "rc": 2},
                 key: {"best_us": 4.5, "warps": 4, "rc": 2, **best}}]
        (tmp_path / "_runs" / name).write_text(json.dumps({"provenance": prov, "records": recs}))
    c, lanes = report.residual_cluster_trial(tmp_path).iloc[0], report.residual_lanes_trial(tmp_path).iloc[0]
    assert c["fastest a cluster plan"] == "clusters of 2, 4 warps, rc 2" and c["a cluster / without"] == 4.5 / 5.9
    assert lanes["probe"] == "98adb37 (1/1 checks)" and lanes["fastest a lane split plan"] == "4 groups of 8 rows, 4 warps, rc 2"
    assert lanes["without a lane split (us)"] == 5.9 and lanes["torch fp16 (us)"] == 5.85
    assert report.residual_lanes_trial(tmp_path / "nothing").empty


def test_additive_stream_probe_takes_each_shapes_fastest_plan(tmp_path):
    import json

    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False}]
    for ks, us in ((1, 20.0), (2, 16.5), (4, 18.0)):
        recs.append({"kind": "time", "kernel": "stream", "in_features": 4096, "out_features": 14336, "time_us": us, "fp16_us": 42.0,
                     "plan": {"warps": 16, "ksplit": ks, "slots": 2}})
    recs.append({"kind": "time", "kernel": "table (tuned)", "in_features": 4096, "out_features": 14336, "time_us": 16.2, "fp16_us": 42.0,
                 "plan": "additive: 8 warps"})
    recs.append({"kind": "time", "kernel": "stream", "in_features": 4096, "out_features": 4096, "time_us": 9.0, "fp16_us": 16.5,
                 "plan": {"warps": 8, "ksplit": 6, "slots": 3}})  # 6 K-slices asked of 8 chunks: slices of 2, so 4 ran
    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abcdef123", "date": "2026-11-27T05:00"}
    (tmp_path / "_runs" / "additive-stream-v2-h100.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    t = report.additive_stream_probe(tmp_path)
    assert list(t["in x out"]) == ["4096 x 14336", "4096 x 4096"]
    assert list(t["streaming (us)"]) == [16.5, 9.0] and list(t["fastest streaming plan"]) == ["16 warps, K-split 2, 2 code slots",
                                                                                             "8 warps, K-split 4, 3 code slots"]
    assert t["table kernel, tuned (us)"][0] == 16.2 and np.isnan(t["table kernel, tuned (us)"][1])
    assert np.isclose(t["streaming: speedup"][0], 42.0 / 16.5) and t["probe"][0] == "abcdef1 (1/2 checks)"
    assert report.additive_stream_probe(tmp_path / "nothing").empty


def test_additive_chunk_probe_sets_the_fastest_chunk_plan_beside_the_previous_pick(tmp_path):
    import json

    recs = [{"kind": "check", "passed": True}] * 3
    for name, label, ms in (("old", "additive: 8 warps, RB 16, K-split 16, fp16 table", 0.0164),
                            ("chunk0", "additive chunk: 8 warps, a chunk a block, 256 rows a block in tiles of 16", 0.0154),
                            ("chunk3", "additive chunk: 8 warps, a chunk a block, 512 rows a block in tiles of 32", 0.0128)):
        recs.append({"kind": "time", "name": name, "label": label, "in_features": 4096, "out_features": 14336, "time_ms": ms,
                     "fp16_ms": 0.042})
    recs.append({"kind": "time", "name": "old", "label": "x", "in_features": 4096, "out_features": 4096, "time_ms": 0.008,
                 "fp16_ms": 0.016})  # no chunk plan timed at this shape: no row
    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "1d524d4aa", "date": "2026-11-27T23:00"}
    (tmp_path / "_runs" / "chunk-probe-x-h100.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    t = report.additive_chunk_probe(tmp_path)
    assert list(t["in x out"]) == ["4096 x 14336"] and t["probe"][0] == "1d524d4 (3/3 checks)"
    assert t["fastest chunk plan"][0] == "8 warps, a chunk a block, 512 rows a block in tiles of 32"
    assert t["previous pick"][0] == "8 warps, RB 16, K-split 16, fp16 table"
    assert np.isclose(t["chunk (us)"][0], 12.8) and np.isclose(t["previous / chunk"][0], 0.0164 / 0.0128)
    assert np.isclose(t["chunk: speedup"][0], 0.042 / 0.0128)
    assert report.additive_chunk_probe(tmp_path / "nothing").empty


def test_chunk_runs_trial_sets_each_plan_against_the_fastest_of_a_chunk_a_block(tmp_path):
    import json

    def rec(w, r, ch, cl, ms, pre="", post=""):
        return {"kind": "time", "in_features": 11008, "out_features": 4096, "pre": pre, "post": post, "time_ms": ms, "fp16_ms": 0.027,
                "plan": str({"kernel": "chunk", "warps": w, "tile": 4, "rows": r, "chunks": ch, "cluster": cl})}

    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False},
            rec(8, 256, 1, False, 0.0126), rec(16, 512, 1, False, 0.0139), rec(8, 256, 3, True, 0.0186),
            rec(8, 256, 1, False, 0.0137, "silu", "add"), rec(8, 128, 3, True, 0.0226, "silu", "add"),
            {"kind": "time", "in_features": 4096, "out_features": 4096, "pre": "", "post": "", "time_ms": 0.01, "fp16_ms": 0.013,
             "plan": str({"kernel": "chunk", "warps": 8, "tile": 4, "rows": 256, "chunks": 2, "cluster": False})}]  # no single: no row
    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H200", "git_commit": "81eab30aa"}
    (tmp_path / "_runs" / "chunk-runs-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    t = report.chunk_runs_trial(tmp_path)
    assert list(t["operation"]) == ["plain"] * 3 + ["silu + add"] * 2 and set(t["probe"]) == {"81eab30 (1/2 checks)"}
    assert list(t["chunks a block"]) == [1, 1, 3, 1, 3] and list(t["finish"]) == ["global", "global", "cluster", "global", "cluster"]
    assert np.allclose(t["/ fastest of a chunk a block"], [1.0, 0.0139 / 0.0126, 0.0186 / 0.0126, 1.0, 0.0226 / 0.0137])
    assert t["plan"][4] == "8 warps, 128 rows a block, tiles of 16" and np.isclose(t["time (us)"][2], 18.6)
    assert report.chunk_runs_trial(tmp_path / "nothing").empty


def test_additive_stream_skeleton_puts_each_variant_in_a_column(tmp_path):
    import json

    recs = [{"kind": "check", "passed": True}]
    for probe, us in (("full", 16.6), ("skeleton", 13.0), ("empty", 1.3), ("nobuild", 13.8)):
        recs.append({"kind": "time", "in_features": 4096, "out_features": 14336, "ksplit": 2, "slots": 2, "probe": probe,
                     "time_us": us, "fp16_us": 43.2})
    recs.append({"kind": "time", "in_features": 4096, "out_features": 14336, "ksplit": 1, "slots": 3, "probe": "full", "time_us": 19.0,
                 "fp16_us": 43.2})
    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "date": "2026-11-27T05:30"}
    (tmp_path / "_runs" / "additive-stream-skeleton-h100.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    t = report.additive_stream_skeleton(tmp_path)
    assert list(t.columns) == ["GPU", "in x out", "torch fp16 (us)", "K-split", "code slots", "full kernel (us)", "no table build (us)",
                               "neither: codes streamed, barriers, sums (us)", "empty launch (us)"]  # the parts' order, "no lookups" absent
    assert list(t["K-split"]) == [2, 1] and t["full kernel (us)"].tolist() == [16.6, 19.0] and np.isnan(t["empty launch (us)"][1])
    assert report.additive_stream_skeleton(tmp_path / "nothing").empty


def _chunk_probe_file(tmp_path, name, recs):
    import json

    (tmp_path / "_runs").mkdir(exist_ok=True)
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "82e5276aa", "date": "2026-11-28T02:20"}
    (tmp_path / "_runs" / name).write_text(json.dumps({"provenance": prov, "records": recs}))


def _plan(w, t, r, cluster=None):
    p = {"kernel": "chunk", "warps": w, "tile": t, "rows": r}
    return str(p if cluster is None else dict(p, cluster=cluster))


def test_chunk_ablation_puts_each_stage_left_out_in_a_column(tmp_path):
    recs = [{"kind": "check", "passed": True}]
    for abl, ms in (("full", 0.0131), ("noload", 0.0094), ("nofinish", 0.0108), ("nobuild", 0.0110)):
        recs.append({"kind": "time", "in_features": 4096, "out_features": 14336, "plan": _plan(8, 8, 512), "ablation": abl,
                     "time_ms": ms, "fp16_ms": 0.042})
    _chunk_probe_file(tmp_path, "chunk-ablation-x-h100.json", recs)
    t = report.chunk_ablation(tmp_path)
    assert list(t.columns) == ["GPU", "in x out", "plan", "torch fp16 (us)", "full kernel (us)", "no table build (us)",
                               "no code loads (us)", "no K-slice finish (us)"]  # in CHUNK_PARTS' order; those not timed absent
    assert t["plan"][0] == "8 warps, 512 rows a block, tiles of 32" and np.isclose(t["no code loads (us)"][0], 9.4)
    assert report.chunk_ablation(tmp_path / "nothing").empty


def test_chunk_cluster_probe_sets_the_fastest_plan_of_each_finish_side_by_side(tmp_path):
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False}]
    for plan, cl, ms in ((_plan(8, 8, 512, True), True, 0.0128), (_plan(16, 4, 1024, True), True, 0.0122),
                         (_plan(8, 8, 512), False, 0.0128), (_plan(8, 4, 256), False, 0.0152)):
        recs.append({"kind": "time", "in_features": 4096, "out_features": 14336, "plan": plan, "cluster": cl, "time_ms": ms,
                     "fp16_ms": 0.0433})
    recs.append({"kind": "time", "in_features": 4096, "out_features": 4096, "plan": _plan(8, 4, 256), "cluster": False,
                 "time_ms": 0.0076, "fp16_ms": 0.0163})  # no cluster plan timed there: no row
    _chunk_probe_file(tmp_path, "cluster-finish-probe-x-h100.json", recs)
    t = report.chunk_cluster_probe(tmp_path)
    assert list(t["in x out"]) == ["4096 x 14336"] and t["probe"][0] == "82e5276 (1/2 checks)"
    assert t["fastest, cluster finish"][0] == "16 warps, 1024 rows a block, tiles of 16"
    assert t["fastest, global finish"][0] == "8 warps, 512 rows a block, tiles of 32"
    assert np.isclose(t["global / cluster"][0], 0.0128 / 0.0122) and np.isclose(t["best: speedup"][0], 0.0433 / 0.0122)
    assert report.chunk_cluster_probe(tmp_path / "nothing").empty


def test_rms_global_probe_sets_both_rms_launches_against_the_plain_one(tmp_path):
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False}]
    for name, pre, ms in (("deferred", "", 0.0506), ("deferred", "rms", 0.0545), ("whole row", "rms", 0.0584)):
        recs.append({"kind": "time", "in_features": 8192, "out_features": 57344, "name": f"{name} 8w 8t 1024r {pre or 'plain'}",
                     "plan": _plan(8, 8, 1024), "pre": pre, "time_ms": ms, "fp16_ms": 0.25})
    _chunk_probe_file(tmp_path, "rms-global-probe-x-h200.json", recs)
    t = report.rms_global_probe(tmp_path)
    assert len(t) == 1 and t["in x out"][0] == "8192 x 57344" and t["probe"][0] == "82e5276 (1/2 checks)"
    assert np.isclose(t["penalty before (us)"][0], 7.8) and np.isclose(t["penalty now (us)"][0], 3.9)
    assert report.rms_global_probe(tmp_path / "nothing").empty


def test_finish_probe_sets_the_four_versions_side_by_side(tmp_path):
    recs = [{"kind": "check", "passed": True}]
    for v, ms in (("e8ac594", 0.03445), ("e8+sum_splits", 0.04008), ("04bc3b8", 0.04003), ("new", 0.03109)):
        recs.append({"kind": "time", "what": "70B down", "in_features": 28672, "out_features": 8192, "variant": v, "pre": "silu",
                     "post": "add", "plan": _plan(8, 8, 1024), "fw": 4, "time_ms": ms, "fp16_ms": 0.11166})
    _chunk_probe_file(tmp_path, "finish-probe-x-h200.json", recs)
    t = report.finish_probe(tmp_path)
    assert len(t) == 1 and t["fused"][0] == "silu / add" and t["rows a thread"][0] == 4 and t["probe"][0] == "82e5276 (1/1 checks)"
    assert np.isclose(t["+ sum_splits tail (us)"][0], 40.08) and np.isclose(t["+ wide finish (us)"][0], 31.09)
    assert np.isclose(t["speedup now"][0], 0.11166 / 0.03109)
    assert report.finish_probe(tmp_path / "nothing").empty


def test_restage_probe_sets_the_versions_side_by_side_and_lut_finish_probe_reads_the_lut_rows(tmp_path):
    recs = [{"kind": "check", "passed": True}, {"kind": "not run", "plan": "refused"}]  # a check never run is not counted
    for v, ms in (("e33ce3d", 0.01933), ("d4029ca", 0.02208), ("new", 0.01833)):
        recs.append({"kind": "time", "what": "70B qkv", "in_features": 8192, "out_features": 10240, "variant": v, "pre": "rms",
                     "post": "", "plan": _plan(16, 4, 1024), "fw": 2, "nsplit": 16, "time_ms": ms, "fp16_ms": 0.04765})
    for v, ms in (("d4029ca", 0.0319), ("new", 0.0261)):
        recs.append({"kind": "time", "what": "lut K16 batch 8", "in_features": 4096, "out_features": 4096, "variant": v, "batch": 8,
                     "plan": "LaunchPlan(warps=8, ksplit=8, cps=16, shared_bytes=16384, RB=2, stages=2, kernel='lut', walk=1)",
                     "time_ms": ms, "fp16_ms": 0.014})
    _chunk_probe_file(tmp_path, "restage-probe-x-h200.json", recs)
    t = report.restage_probe(tmp_path)
    assert len(t) == 1 and t["layer"][0] == "70B qkv" and t["rows a thread"][0] == 2 and t["K-slices"][0] == 16
    assert t["probe"][0] == "82e5276 (1/1 checks)" and t["fused"][0] == "rms / -"
    assert np.isclose(t["restage a branch (e33ce3d) (us)"][0], 19.33) and np.isclose(t["the probe's commit (us)"][0], 18.33)
    assert np.isclose(t["speedup"][0], 0.04765 / 0.01833)
    u = report.lut_finish_probe(tmp_path)
    assert len(u) == 1 and u["batch"][0] == 8 and u["plan"][0] == "8 warps, RB 2, K-split 8, stages 2"
    assert np.isclose(u["saved (us)"][0], 5.8)
    assert report.restage_probe(tmp_path / "nothing").empty and report.lut_finish_probe(tmp_path / "nothing").empty


def test_chunk_stages_and_rows_probe_read_their_probes(tmp_path):
    recs = [{"kind": "check", "passed": True}]
    for abl, ms in (("full", 0.04816), ("nobuild", 0.04130), ("notiles", 0.01799), ("noload", 0.04446)):
        recs.append({"kind": "time", "what": "70B gate_up plain", "in_features": 8192, "out_features": 57344, "pre": "", "post": "",
                     "plan": _plan(8, 8, 1024), "ablation": abl, "time_ms": ms})
    _chunk_probe_file(tmp_path, "chunk-stages-70b-x-h200.json", recs)
    t = report.chunk_stages(tmp_path)
    assert list(t.columns) == ["GPU", "layer", "in x out", "fused", "plan", "full kernel (us)", "no table build (us)",
                               "no tile loop (us)", "no code loads (us)", "probe"]
    assert t["layer"][0] == "70B gate_up" and np.isclose(t["no code loads (us)"][0], 44.46)
    recs = [{"kind": "check", "passed": True}]
    for rows, blocks, ms in ((1024, 896, 0.05232), (4096, 224, 0.04803)):
        recs.append({"kind": "time", "what": "70B gate_up", "in_features": 8192, "out_features": 57344, "pre": "rms", "post": "",
                     "plan": _plan(8, 8, rows), "blocks": blocks, "time_ms": ms})
    _chunk_probe_file(tmp_path, "rows-probe-x-h200.json", recs)
    u = report.rows_probe(tmp_path)
    assert list(u["blocks"]) == [896, 224] and np.isclose(u["over the decode's plan"][1], 0.04803 / 0.05232)
    assert u["plan"][1] == "8 warps, 4096 rows a block, tiles of 32"
    assert report.chunk_stages(tmp_path / "nothing").empty and report.rows_probe(tmp_path / "nothing").empty


def test_hsum_probe_pairs_the_fp32_and_fp16_sums_of_one_plan(tmp_path):
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False}]
    for v, ms in (("7126cd0", 0.05192), ("new", 0.05106)):
        recs.append({"kind": "time", "what": "70B gate_up", "in_features": 8192, "out_features": 57344, "variant": v, "pre": "rms",
                     "post": "", "plan": _plan(8, 8, 1024), "time_ms": ms})
    _chunk_probe_file(tmp_path, "hsum-probe-x-h200.json", recs)
    t = report.hsum_probe(tmp_path)
    assert len(t) == 1 and t["probe"][0] == "82e5276 (1/2 checks)" and t["fused"][0] == "rms / -"
    assert np.isclose(t["fp32 sums, 7126cd0 (us)"][0], 51.92) and np.isclose(t["fp16 / fp32 sums"][0], 0.05106 / 0.05192)
    assert report.hsum_probe(tmp_path / "nothing").empty


def _versions_of_7b_qkv(ms_by_variant: dict, checks=(True,)) -> list[dict]:
    # a versions probe's records: its checks, then 7B qkv's cluster plan timed once a version
    recs = [{"kind": "check", "passed": c} for c in checks]
    return recs + [{"kind": "time", "what": "7B qkv (cluster)", "in_features": 4096, "out_features": 12288, "variant": v, "pre": "rms",
                    "post": "", "plan": _plan(8, 8, 1024, True), "time_ms": ms} for v, ms in ms_by_variant.items()]


def test_static_sums_probe_puts_three_versions_of_a_plan_in_one_row(tmp_path):
    recs = _versions_of_7b_qkv({"034c66f": 0.01089, "a32db5e": 0.01081, "new": 0.01142})
    _chunk_probe_file(tmp_path, "cluster-static-probe-x-h200.json", recs)
    t = report.static_sums_probe(tmp_path)
    assert len(t) == 1 and t["probe"][0] == "82e5276 (1/1 checks)" and t["plan"][0] == "8 warps, 1024 rows a block, tiles of 32"
    assert np.isclose(t["a32db5e / 034c66f"][0], 0.01081 / 0.01089) and np.isclose(t["fetch / a32db5e"][0], 0.01142 / 0.01081)
    assert report.static_sums_probe(tmp_path / "nothing").empty


def test_fetch_probe_puts_three_versions_of_a_plan_in_one_row(tmp_path):
    recs = _versions_of_7b_qkv({"a32db5e": 0.01095, "fx": 0.01107, "new": 0.01156}, checks=(True, False))
    _chunk_probe_file(tmp_path, "fetch-probe-x-h200.json", recs)
    t = report.fetch_probe(tmp_path)
    assert len(t) == 1 and t["probe"][0] == "82e5276 (1/2 checks)" and t["fused"][0] == "rms / -"
    assert t["two halves (us)"][0] == pytest.approx(11.07) and t["halves / burst"][0] == pytest.approx(0.01107 / 0.01156)
    assert t["halves / a32db5e"][0] == pytest.approx(0.01107 / 0.01095) and list(t.columns)[-1] == "probe"
    assert report.fetch_probe(tmp_path / "nothing").empty


def test_cluster16_probe_sets_the_fastest_cluster_plan_beside_the_global_one(tmp_path):
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False, "error": "refused"}]
    base = {"kind": "time", "what": "13B qkv", "in_features": 5120, "out_features": 15360, "M": 2, "pre": "rms", "post": ""}
    recs += [dict(base, variant="global", plan=_plan(8, 4, 512), time_ms=0.01615),
             dict(base, variant="c16", plan=_plan(8, 4, 512, True), time_ms=0.01497),
             dict(base, variant="c16", plan=_plan(8, 8, 1024, True), time_ms=0.01511),
             dict(base, what="13B o", variant="global", plan=_plan(8, 8, 512), time_ms=0.00869)]  # no cluster timed: no row
    _chunk_probe_file(tmp_path, "c16-probe-x-h200.json", recs)
    t = report.cluster16_probe(tmp_path)
    assert len(t) == 1 and t["layer"][0] == "13B qkv" and t["fastest cluster plan"][0] == "8 warps, 512 rows a block, tiles of 16"
    assert t["cluster / global"][0] == pytest.approx(0.01497 / 0.01615) and t["probe"][0] == "82e5276 (1/2 checks)"
    assert report.cluster16_probe(tmp_path / "nothing").empty


def test_m4_chunk_probe_sets_the_fastest_chunk_plan_beside_the_table_plan(tmp_path):
    table = str({"warps": 8, "RB": 32, "ksplit": 64, "build": "mma", "table": "fp16"})
    recs = [{"kind": "check", "passed": True}]
    for plan, ms in ((table, 0.2347), (_plan(8, 8, 2048), 0.1440), (_plan(8, 8, 4096), 0.1550)):
        recs.append({"kind": "time", "in_features": 16384, "out_features": 53248, "M": 4, "plan": plan, "time_ms": ms,
                     "fp16_ms": 0.4338 if ms > 0.15 else 0.4337})
    recs.append({"kind": "time", "in_features": 4096, "out_features": 4096, "M": 4, "plan": table, "time_ms": 0.011, "fp16_ms": 0.013})
    _chunk_probe_file(tmp_path, "m4-probe-x-h200.json", recs)
    t = report.m4_chunk_probe(tmp_path)
    assert len(t) == 1, "a shape with no chunk plan timed has no row"
    assert t["chunk plan"][0] == "8 warps, 2048 rows a block, tiles of 32" and np.isclose(t["chunk kernel (us)"][0], 144.0)
    assert np.isclose(t["chunk: fp16 / it"][0], 0.4337 / 0.1440) and np.isclose(t["table: fp16 / it"][0], 0.4337 / 0.2347)
    assert report.m4_chunk_probe(tmp_path / "nothing").empty


def test_splits_probe_pairs_the_two_forms_of_a_plan_across_processes(tmp_path):
    plan = str({"warps": 8, "RB": 32, "ksplit": 64, "build": "mma", "table": "fp16"})
    for v, ms in (("head", 0.03016), ("fix", 0.02422)):
        _chunk_probe_file(tmp_path, f"splits-probe-{v}-x-h200.json", [
            {"kind": "check", "passed": True},
            {"kind": "time", "variant": v, "in_features": 14336, "out_features": 4096, "M": 4, "plan": plan, "time_ms": ms, "fp16_ms": 0.032}])
    t = report.splits_probe(tmp_path)
    assert len(t) == 1 and t["plan"][0] == "8 warps, 32 rows a block, K-split 64"
    assert np.isclose(t["unclamped / clamped"][0], 0.02422 / 0.03016) and np.isclose(t["torch fp16 (us)"][0], 32.0)
    assert report.splits_probe(tmp_path / "nothing").empty


def test_chunk_rms_probe_pairs_plain_and_rms_launches_of_one_plan(tmp_path):
    recs = [{"kind": "check", "passed": True}]
    for fin, pre, ms in (("global", "", 0.0128), ("global", "rms", 0.0142), ("cluster", "", 0.0121), ("cluster", "rms", 0.0127)):
        recs.append({"kind": "time", "in_features": 4096, "out_features": 12288, "name": f"{fin} 8w 4t 512r {pre or 'plain'}",
                     "plan": _plan(8, 4, 512, fin == "cluster"), "pre": pre, "time_ms": ms, "fp16_ms": 0.036})
    _chunk_probe_file(tmp_path, "cluster-rms-probe-x-h100.json", recs)
    t = report.chunk_rms_probe(tmp_path)
    assert len(t) == 1 and t["plan"][0] == "8 warps, 512 rows a block, tiles of 16"
    assert np.isclose(t["global: rms penalty (us)"][0], 1.4) and np.isclose(t["cluster: rms penalty (us)"][0], 0.6)
    assert report.chunk_rms_probe(tmp_path / "nothing").empty


def test_residual_buffers_trial_compares_one_and_two_table_buffers(tmp_path):
    import json

    def t(variant, buffers, G, us, n_in=4096):
        return {"kind": "time", "Nm": 4096, "Nr": 256, "n_in": n_in, "n_out": 28672, "variant": variant, "buffers": buffers,
                "G": G, "us": us, "fp16_us": 60.0}

    (tmp_path / "_runs").mkdir()
    prov = {"gpu": "NVIDIA H200", "git_commit": "cfba674abc", "date": "2026-11-30"}
    probe = [{"kind": "check", "passed": True}, t("table", 1, 8, 42.0), t("table", 1, 8, 44.0), t("table", 2, 4, 50.0),
             t("split", 1, 0, 43.0), t("split", 1, 0, 45.0), t("split", 1, 0, 9.0, n_in=1024)]  # a shape without tables: no row
    same = [t("table", 1, 4, 47.0), t("table", 2, 4, 50.0), t("table", 1, 8, 42.5), t("table", 1, 2, 60.0)]
    for name, recs in (("residual-db-probe-x-h200.json", probe), ("residual-db-sameg-x-h200.json", same)):
        (tmp_path / "_runs" / name).write_text(json.dumps({"provenance": prov, "records": recs}))
    d = report.residual_buffers_trial(tmp_path)
    assert len(d) == 2 and d["probe"].tolist() == ["cfba674 (1/1 checks)", "cfba674 (0/0 checks)"]
    a, b = d.iloc[0], d.iloc[1]
    assert (a["one buffer, fastest (us)"], a["its G"], a["two buffers, fastest (us)"], a["G"]) == (42.0, 8, 50.0, 4)
    assert np.isnan(a["one buffer, two-buffer G (us)"]) and a["split, fastest (us)"] == 43.0 and a["two / one, fastest"] == 50.0 / 42.0
    assert (b["one buffer, fastest (us)"], b["one buffer, two-buffer G (us)"], b["two / one, same G"]) == (42.5, 47.0, 50.0 / 47.0)
    assert np.isnan(b["split, fastest (us)"]) and b["in x out"] == "4096 x 28672" and b["codebooks"] == "4096+256"
    assert report.residual_buffers_trial(tmp_path / "nothing").empty


def _finish_probes(tmp_path):
    import json

    def t(us, **kw):
        return {"kind": "time", "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": 28672, "fp16_us": 56.0, "us": us,
                "variant": "table", "plan": "{'RB': 8}"} | kw

    def tl(**kw):  # two blocks of one row-group; the second summed the K-slices
        blocks = {"block_x": [0, 0], "block_y": [0, 1], "sm": [3, 4], "start": [0, 100], "prologue": [2000, 2100],
                  "steps": [20000, 21000], "finish": [21000, 30000]}
        return {"kind": "timeline", "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": 28672, "plan": "{'RB': 8}"} | kw | {"blocks": blocks}

    (tmp_path / "_runs").mkdir()
    summed = {"summed": [False, True]}
    probes = {"residual-fin-probe-a-h200.json": ("aaaaaaa1", [{"kind": "check", "passed": True}, t(42.0, finish="rows", ksplit=16),
                                                              t(44.0, finish="rows", ksplit=32), t(36.0, finish="wide", ksplit=16),
                                                              t(44.5, finish="split", variant="split"),
                                                              tl(wide=False) | {"blocks": tl()["blocks"] | summed},
                                                              tl(wide=True) | {"blocks": tl()["blocks"] | summed}]),
              "residual-rb-probe-b-h200.json": ("bbbbbbb2", [t(36.5, finish_loads=8, RB=8), t(37.0, finish_loads=16, RB=8),
                                                             t(35.0, finish_loads=16, RB=7, plan="{'RB': 7}"),
                                                             t(14.0, finish_loads=16, RB=7, Nr=512)]),
              "residual-fan-probe-c-h200.json": ("ccccccc3", [t(37.0, fanin=64, RB=8), t(37.4, fanin=4, RB=8), t(34.6, fanin=64, RB=7),
                                                              t(34.9, fanin=4, RB=7), t(44.3, fanin=None, variant="split", RB=1),
                                                              tl(fanin=4, plan="{'RB': 7}") | {"blocks": tl()["blocks"] | {"sums": [1, 2]}},
                                                              tl(fanin=4, n_out=14336)])}
    for i, (name, (commit, recs)) in enumerate(probes.items()):
        prov = {"gpu": "NVIDIA H200", "git_commit": commit, "date": f"2026-11-30T0{i}"}
        (tmp_path / "_runs" / name).write_text(json.dumps({"provenance": prov, "records": recs}))


def test_residual_finish_trial_names_each_probes_variants(tmp_path):
    _finish_probes(tmp_path)
    d = report.residual_finish_trial(tmp_path)
    assert d["probe"].tolist() == ["aaaaaaa (1/1 checks)", "bbbbbbb (0/0 checks)", "bbbbbbb (0/0 checks)", "ccccccc (0/0 checks)"]
    a = d.iloc[0]  # v3's fastest K-split; the wide finish; the split plan
    assert (a[report.TABLE_FINISH_V3], a[report.TABLE_FINISH_WIDE], a["split"]) == (42.0, 36.0, 44.5)
    assert a["fastest table variant x fp16"] == 56.0 / 36.0
    b = d.iloc[1]
    assert (b[report.TABLE_FINISH_WIDE], b[report.TABLE_FINISH_WIDE8], b[report.TABLE_FINISH_WIDE8 + ", RB 7"]) == (36.5, 37.0, 35.0)
    assert np.isnan(b[report.TABLE_FINISH_V3]) and d.iloc[2]["codebooks"] == "4096+512"
    c = d.iloc[3]  # fanin 64 is one level at every K-split the probe timed
    assert (c[report.TABLE_FINISH_WIDE], c[report.TABLE_FINISH_TWO], c[report.TABLE_FINISH_WIDE + ", RB 7"], c[report.TABLE_FINISH_TWO + ", RB 7"]) == (37.0, 37.4, 34.6, 34.9)
    assert list(d.columns[-2:]) == ["split", "fastest table variant x fp16"]
    assert report.residual_finish_trial(tmp_path / "nothing").empty


def test_residual_timelines_and_their_figure(tmp_path):
    _finish_probes(tmp_path)
    tl = report.residual_timelines(tmp_path)
    assert [label for label, _ in tl] == [f"{report.TABLE_FINISH_V3} (aaaaaaa)", f"{report.TABLE_FINISH_WIDE} (aaaaaaa)",
                                         f"{report.TABLE_FINISH_TWO}, RB 7 (ccccccc)"]  # the 14336-output timeline is another shape's
    b = tl[0][1]
    assert b["sums"].tolist() == [0, 2] and b["finish"].tolist() == [21.0, 30.0]  # "summed" read as sums; us
    assert tl[2][1]["sums"].tolist() == [1, 2]
    fig = report.fig_residual_timeline(tmp_path)
    assert len(fig.axes) == 3 and fig.axes[0].get_title(loc="left").startswith(report.TABLE_FINISH_V3)
    assert report.residual_timelines(tmp_path, shape=(1024, 1024)) == []


def test_residual_finish_runs_put_the_runs_side_by_side(tmp_path):
    base = {"gpu": "NVIDIA H200", "command": "trapetum vq", "copy_gbps": 4000.0}
    grid = [r for r in synthetic_vq(4000.0) if r["grid"] == "residual" and r["main_centroids"] == 4096 and r["residual_centroids"] == 256]
    for commit, date, f in (("57969e4aaa", "2026-11-30T09:54:00+00:00", 1.0), ("a1128cfbbb", "2026-11-30T10:25:00+00:00", 0.5),
                            ("0ther00ccc", "2026-11-30T11:00:00+00:00", 0.25)):  # the last: a commit the table does not show
        recs = [dict(r, time_ms=r["time_ms"] * f) for r in grid if r["out_features"] >= 14336 and (f < 1 or r["in_features"] != 1024)]
        results.save(report.VQ, recs, dict(base, git_commit=commit, date=date), folder=tmp_path)
    t = report.residual_finish_runs(tmp_path).set_index("in x out")
    assert t.columns.tolist() == ["torch fp16, a1128cf 10:25 (us)", "ours, 57969e4 09:54 (us)", "ours, a1128cf 10:25 (us)"]
    assert t.index[:2].tolist() == ["1024 x 14336", "2048 x 14336"] and len(t) == 15  # by outputs, then inputs
    assert np.isnan(t.loc["1024 x 14336", "ours, 57969e4 09:54 (us)"])  # not measured by that run
    assert np.isclose(t.loc["4096 x 28672", "ours, a1128cf 10:25 (us)"] * 2, t.loc["4096 x 28672", "ours, 57969e4 09:54 (us)"])
    assert report.residual_finish_runs(tmp_path, gpu="NVIDIA H100").empty


def test_residual_bank_trial_timelines_and_ncu_read_their_files(tmp_path):
    import json

    def t(us, build, RB=8, fanin=0, variant="table", **kw):
        return {"kind": "time", "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": 28672, "fp16_us": 56.0, "us": us, "variant": variant,
                "build": build, "RB": RB, "fanin": fanin} | kw

    blocks = {"block_x": [0, 0], "block_y": [0, 1], "sm": [3, 4], "start": [0, 100], "prologue": [2000, 2100],
              "steps": [20000, 21000], "finish": [21000, 30000], "sums": [0, 2]}
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": True},
            t(37.0, "mma"), t(35.0, "mma", RB=7), t(31.5, "banked"), t(30.0, "banked", RB=7), t(34.0, "banked", fanin=4),
            t(44.0, "", RB=1, variant="split"), t(20.0, "banked", n_in=4096, n_out=4096), t(21.0, "mma", n_in=4096, n_out=4096),
            {"kind": "timeline", "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": 28672, "build": "mma", "plan": "{'RB': 8}", "blocks": blocks},
            {"kind": "timeline", "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": 28672, "build": "banked", "plan": "{'RB': 7}", "blocks": blocks},
            {"kind": "timeline", "Nm": 4096, "Nr": 512, "n_in": 4096, "n_out": 28672, "build": "banked", "plan": "{'RB': 7}", "blocks": blocks}]
    (tmp_path / "_runs" / "ncu").mkdir(parents=True)
    prov = {"gpu": "NVIDIA H200", "git_commit": "63f9440abc", "date": "2026-11-30T12:00"}
    (tmp_path / "_runs" / "residual-bank-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    d = report.residual_bank_trial(tmp_path)
    assert d["probe"].tolist() == ["63f9440 (2/2 checks)"] * 2 and d["in x out"].tolist() == ["4096 x 28672", "4096 x 4096"]
    a = d.iloc[0]
    assert (a["v3 tensor-core table"], a["v3 tensor-core table, RB 7"], a["v6 banked fp16 table, RB 7"], a["split"]) == (37.0, 35.0, 30.0, 44.0)
    assert a["v6 banked fp16 table, two levels"] == 34.0
    assert np.isclose(a["fastest v6 / fastest v3"], 30.0 / 35.0) and np.isclose(a["fastest v6 x fp16"], 56.0 / 30.0)
    assert np.isclose(d.iloc[1]["fastest v6 / fastest v3"], 20.0 / 21.0)
    tl = report.residual_bank_timelines(tmp_path)
    assert [label for label, _ in tl] == ["v3 tensor-core table (63f9440)", "v6 banked fp16 table, RB 7 (63f9440)"]
    assert tl[1][1]["finish"].tolist() == [21.0, 30.0]
    fig = report.fig_residual_timeline(tmp_path, timelines=tl)
    assert len(fig.axes) == 2 and fig.axes[1].get_title(loc="left").startswith("v6 banked")
    ncu = """    Duration                         us        35.23
    Executed Instructions                           inst   13,701,776
    Warp Cycles Per Issued Instruction             cycle         8.25
          The memory access pattern for shared loads might not be optimal and causes on average a 1.9 - way bank
          conflict across all 1067008 shared load requests.This results in 917490 bank conflicts,  which represent
          The memory access pattern for shared stores might not be optimal and causes on average a 2.4 - way bank
          conflict across all 349312 shared store requests.This results in 496202 bank conflicts,  which represent
"""
    (tmp_path / "_runs" / "ncu" / "residual-banked-63f9440-h200.txt").write_text(ncu)
    n = report.residual_bank_ncu(tmp_path)
    assert len(n) == 1 and n["kernel"][0] == "v6 banked fp16 table, RB 7"
    assert (n["duration (us)"][0], n["executed instructions"][0], n["warp cycles per issued instruction"][0]) == (35.23, 13701776.0, 8.25)
    assert (n["load bank conflict (ways)"][0], n["shared load requests"][0], n["store bank conflict (ways)"][0]) == (1.9, 1067008, 2.4)
    assert report.residual_bank_trial(tmp_path / "nothing").empty and report.residual_bank_ncu(tmp_path / "nothing").empty


def test_residual_bank_variants_and_stalls_read_their_files(tmp_path):
    import json

    def t(version, us, RB=8, n_out=28672):
        return {"kind": "time", "version": version, "Nm": 4096, "Nr": 256, "n_in": 4096, "n_out": n_out, "RB": RB, "ksplit": 16,
                "fp16_us": 56.0, "us": us}

    (tmp_path / "_runs" / "ncu").mkdir(parents=True)
    for name, commit, recs in (("v7-687cf73", "687cf73abc", [t("v7", 33.0), t("v6", 31.0), t("v7", 31.5, RB=7), t("v6", 30.0, RB=7)]),
                               ("prescale-a4d1c1b", "a4d1c1bdef", [t("pre", 29.4, RB=7), t("v6", 30.0, RB=7), t("pre", 10.0, n_out=4096), t("v6", 10.5, n_out=4096)]),
                               ("b32-633f9e1", "633f9e1abc", [t("b32", 25.6, RB=7), t("main", 29.5, RB=7)])):
        recs = [{"kind": "check", "passed": True}] + recs
        prov = {"gpu": "NVIDIA H200", "git_commit": commit, "date": f"2026-11-30T1{len(name) % 3}:00"}
        (tmp_path / "_runs" / f"residual-banked-variant-probe-{name}-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    d = report.residual_bank_variants(tmp_path)
    assert len(d) == 5 and set(d["probe"]) == {"687cf73 (1/1 checks)", "a4d1c1b (1/1 checks)", "633f9e1 (1/1 checks)"}
    v7 = d[d["change"].str.startswith("v7")].set_index("plan")
    assert np.isclose(v7.loc["RB 8, K-split 16", "changed / before"], 33.0 / 31.0) and v7.loc["RB 7, K-split 16", "before (us)"] == 30.0
    pre = d[d["change"].str.startswith("x prescaled")].set_index("in x out")
    assert np.isclose(pre.loc["4096 x 4096", "changed / before"], 10.0 / 10.5) and (pre["changed / before"] < 1).all()
    b32 = d[d["change"].str.startswith("build")].iloc[0]  # timed against the main branch of its day, not v6 by name
    assert (b32["before (us)"], b32["changed (us)"]) == (29.5, 25.6)

    def ncu(vals):
        return "".join(f"    smsp__average_warps_issue_stalled_{k}_per_issue_active.ratio      inst     {v}\n" for k, v in vals.items())

    (tmp_path / "_runs" / "ncu" / "residual-stalls-banked-x-h200.txt").write_text(ncu({"mio_throttle": 0.33, "no_instruction": 1.10, "wait": 1.25, "gmma": 0}))
    (tmp_path / "_runs" / "ncu" / "residual-stalls-v3rb7-x-h200.txt").write_text(ncu({"mio_throttle": 2.88, "no_instruction": 0.09, "wait": 1.19, "gmma": 0}))
    (tmp_path / "_runs" / "ncu" / "residual-stalls-b32build-x-h200.txt").write_text(
        ncu({"mio_throttle": 0.28, "no_instruction": 1.18, "wait": 1.05, "gmma": 0}) + "    Executed Instructions                           inst   10,502,800\n")
    s = report.residual_bank_stalls(tmp_path, top=3).set_index(report.STALL_REASON)
    assert s.index.tolist() == ["mio throttle", "wait", "no instruction", report.EXECUTED]
    assert (s.loc["no instruction", "v6 banked fp16 table, RB 7"], s.loc["mio throttle", "v3 tensor-core table, RB 7"]) == (1.10, 2.88)
    assert s.loc[report.EXECUTED, "v6, 32-bit build offsets, RB 7"] == 10.5 and np.isnan(s.loc[report.EXECUTED, "v6 banked fp16 table, RB 7"])
    assert report.residual_bank_variants(tmp_path / "nothing").empty and report.residual_bank_stalls(tmp_path / "nothing").empty
    # other reports by a name -> glob mapping (the small layer's, flushed and warm)
    (tmp_path / "_runs" / "ncu" / "residual-small-split-8192-512-1024x14336-warm-c-h200.txt").write_text(ncu({"no_instruction": 0.14, "wait": 0.62}))
    (tmp_path / "_runs" / "ncu" / "residual-small-split-8192-512-1024x14336-flushed-c-h200.txt").write_text(ncu({"no_instruction": 2.63, "wait": 0.62}))
    small = report.residual_bank_stalls(tmp_path, files=report.NCU_SMALL_STALLS).set_index(report.STALL_REASON)
    assert small.columns.tolist() == ["split (8192+512), caches flushed", "split (8192+512), caches warm"]
    assert small.loc["no instruction"].tolist() == [2.63, 0.14]
    # and the large layer's two banked plans, each both ways
    for tag, mode, v in (("banked16-4096-256", "warm", 0.33), ("banked8-8192-512", "warm", 2.69), ("banked8-8192-512", "flushed", 3.90)):
        (tmp_path / "_runs" / "ncu" / f"residual-large-{tag}-4096x28672-{mode}-c-h200.txt").write_text(ncu({"long_scoreboard": v, "wait": 1.0}))
    large = report.residual_bank_stalls(tmp_path, files=report.NCU_LARGE_STALLS).set_index(report.STALL_REASON)
    assert large.columns.tolist() == ["banked G = 16 (4096+256), caches warm", "banked G = 8 (8192+512), caches flushed",
                                      "banked G = 8 (8192+512), caches warm"]
    assert large.loc["long scoreboard"].tolist() == [0.33, 3.90, 2.69]


def test_residual_bank_g8_sets_the_new_build_beside_the_old_and_split(tmp_path):
    import json

    def t(version, us, build="banked", RB=8, n_out=14336):
        return {"kind": "time", "version": version, "Nm": 8192, "Nr": 512, "n_in": 16384, "n_out": n_out, "variant": "split" if build is None else "table",
                "build": build, "G": 8 if build else 0, "RB": RB, "ksplit": 32, "fp16_us": 117.8, "us": us}

    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False},
            t("new", 86.4), t("new", 83.7, RB=7), t("3be045b", 108.6), t("new", 106.0, build=None, RB=1)]
    # a later probe that timed the older build at both RBs: before is read at the RB where after was best
    recs2 = [t("new", 80.0, n_out=28672), t("new", 75.0, RB=7, n_out=28672), t("main", 85.0, n_out=28672), t("main", 83.0, RB=7, n_out=28672),
             t("new", 90.0, build=None, RB=1, n_out=28672)]
    (tmp_path / "_runs").mkdir()
    for name, commit, date, rr in (("4577014", "4577014abc", "2026-11-30T18:20", recs), ("unroll-b9661d7", "b9661d7abc", "2026-12-01T03:00", recs2)):
        (tmp_path / "_runs" / f"residual-banked-g8-build-probe-{name}-h200.json").write_text(
            json.dumps({"provenance": {"gpu": "NVIDIA H200", "git_commit": commit, "date": date}, "records": rr}))
    d = report.residual_bank_g8(tmp_path)
    assert len(d) == 2
    r = d.iloc[0]
    assert r["probe"] == "4577014 (1/2 checks)" and r["its RB"] == 7 and r["after, best RB (us)"] == 83.7
    assert r["before (us)"] == 108.6 and r["before: build, RB"] == "3be045b, RB 8" and r["split, heuristic plan (us)"] == 106.0
    assert np.isclose(r["after: speedup over fp16"], 117.8 / 83.7) and np.isclose(r["split: speedup over fp16"], 117.8 / 106.0)
    assert np.isclose(r["after / before"], 83.7 / 108.6)
    r = d.iloc[1]
    assert r["probe"] == "b9661d7 (0/0 checks)" and r["before (us)"] == 83.0 and r["before: build, RB"] == "main, RB 7"
    assert np.isclose(r["after / before"], 75.0 / 83.0)
    assert report.residual_bank_g8(tmp_path / "nothing").empty


def test_residual_choices_and_versions_name_the_banked_table():
    df = pd.DataFrame([{"grid": "residual", "time_ms": 0.03, "speedup": 1.9, "in_features": 4096, "out_features": n, "main_centroids": 4096,
                        "residual_centroids": 256, "variant": v, "build": b, "main_placement": "shared", "gpu": "NVIDIA H200"}
                       | ({"spread": sp} if sp is not None else {})
                       for n, v, b, sp in ((28672, "table", "banked", None), (14336, "table", "mma", None), (1024, "split", None, None),
                                           (8192, "table", "banked", True), (4096, "table", "banked", False))])
    c = report.residual_choices(df).set_index("kernel chosen")
    assert c.loc["table, banked fp16 (v6), codebook in shared", "out 28672"] == 1  # (a record from before spread was recorded)
    assert c.loc["table, banked fp16 (v6), codebook in shared", "out 4096"] == 1
    assert c.loc["table, banked fp16 (v6), finish spread, codebook in shared", "out 8192"] == 1
    assert c.loc["table, built on tensor cores, codebook in shared", "out 14336"] == 1
    assert report._residual_kernel_label(df) == "per shape: split or table (tensor-core or banked fp16), tuned"


def test_fp16_run_spread_counts_verdicts_against_every_recorded_fp16_time(tmp_path):
    prov = {"gpu": "NVIDIA H200", "driver": "1", "cuda": "12", "torch": "2", "numba": "0", "numba_cuda": "0",
            "git_commit": "a", "date": "2026-01-01T00:00:00+00:00", "command": "trapetum vq", "copy_gbps": 4000.0}

    def run(fp16_small, ours_small, date, commit):
        recs = []
        for n_in, n_out, f, ms in ((1024, 4096, fp16_small, ours_small), (4096, 28672, 50e-3, 20e-3)):
            for m, r in ((4096, 256), (8192, 512)):
                recs.append(_rec("residual", n_in, n_out, ms, f, "residual", 1e6, 4000.0, main_centroids=m, residual_centroids=r,
                                 vector_len=8, bits_per_weight=2.5))
        results.save(report.VQ, recs, dict(prov, date=date, git_commit=commit), folder=tmp_path)

    run(5.0e-3, 5.1e-3, "2026-01-01T00:00:00+00:00", "old")  # slower than its fp16
    run(5.5e-3, 5.2e-3, "2026-01-02T00:00:00+00:00", "new")  # the newest: faster than its own fp16, not than the old run's
    summary, detail = report.fp16_run_spread(report.load_vq(tmp_path), tmp_path)
    r = summary.iloc[0]
    assert r["configs"] == 4 and r["faster than fp16 of its own run"] == 4
    assert r["faster than the fastest fp16 recorded"] == 2 and r["faster than the slowest fp16 recorded"] == 4
    assert r["fp16 timings a shape"] == "2-2"
    assert len(detail) == 2 and set(detail["in x out"]) == {"1024 x 4096"}
    assert detail["speedup range over the runs"].tolist() == ["0.96-1.06"] * 2
    # no run files in the folder: both empty, not an error
    assert all(t.empty for t in report.fp16_run_spread(report.load_vq(tmp_path), tmp_path / "none"))


def test_residual_bank_walk_pairs_each_layer_and_rb_with_its_faster_walking_finish(tmp_path):
    import json

    def t(version, us, RB=7, ksplit=16, blocks=0, fanin=0):
        return {"kind": "time", "version": version, "Nm": 8192, "Nr": 512, "n_in": 4096, "n_out": 28672, "RB": RB, "ksplit": ksplit,
                "blocks": blocks, "fanin": fanin, "fp16_us": 56.8, "us": us}

    (tmp_path / "_runs").mkdir()
    recs = [{"kind": "check", "passed": True}, {"kind": "check", "passed": False},
            t("one", 44.7), t("walk8", 51.8, ksplit=64, blocks=2, fanin=8), t("walk4", 52.3, ksplit=64, blocks=2, fanin=4),
            t("one", 46.5, RB=8), t("walk4", 55.0, RB=8, ksplit=64, blocks=2, fanin=4)]
    prov = {"gpu": "NVIDIA H200", "git_commit": "e1925ffabc", "date": "2026-11-30T22:00"}
    (tmp_path / "_runs" / "residual-banked-walk-probe-x-h200.json").write_text(json.dumps({"provenance": prov, "records": recs}))
    d = report.residual_bank_walk(tmp_path).set_index("RB")
    assert d["probe"].unique().tolist() == ["e1925ff (1/2 checks)"]
    assert (d.loc[7, "walking (us)"], d.loc[7, "finish runs of"], d.loc[7, "its K-split"]) == (51.8, 8, 16)
    assert d.loc[7, "row-groups a block"] == 4  # 896 row-blocks of 32 rows, 112 a row-group at RB 7: 8, over 2 blocks
    assert np.isclose(d.loc[8, "walking / a block a row-group"], 55.0 / 46.5) and d.loc[8, "finish runs of"] == 4
    assert report.residual_bank_walk(tmp_path / "nothing").empty

"""The command line on a machine without a GPU: a clear error, not a crash deep in a kernel."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module", params=["gemv", "vq"])
def gemv_without_gpu(request, run_without_simulator, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return run_without_simulator(["-m", "trapetum.cli", request.param, "--quiet", "--out", str(out)]), out


def test_gemv_without_gpu_fails_with_NoGPUError(gemv_without_gpu):
    p, _ = gemv_without_gpu
    assert p.returncode != 0, p.stdout
    assert "NoGPUError" in p.stderr, p.stderr[-2000:]
    assert "GPU" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]


def test_gemv_without_gpu_writes_no_results(gemv_without_gpu):
    _, out = gemv_without_gpu
    assert not any(out.rglob("*")), sorted(map(str, out.rglob("*")))


def test_cli_requires_a_subcommand(run_without_simulator):
    p = run_without_simulator(["-m", "trapetum.cli"])
    assert p.returncode == 2 and "gemv" in p.stderr


def test_python_m_trapetum_is_the_same_command_line(run_without_simulator):
    p = run_without_simulator(["-m", "trapetum", "gemv", "--help"])
    assert p.returncode == 0 and "--checks-only" in p.stdout, p.stderr[-2000:]
    assert run_without_simulator(["-m", "trapetum"]).returncode == 2


def test_generate_is_handed_to_trapetum_decode(capsys):
    from trapetum import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    assert "python -m trapetum.decode" in capsys.readouterr().out


@pytest.mark.parametrize("parts", ["bogus", "residual,bogus", ","])
def test_vq_parts_must_name_known_parts(parts, capsys):
    from trapetum import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["vq", "--parts", parts])
    assert e.value.code == 2
    assert "additive,residual" in capsys.readouterr().err


def test_vq_parts_parse():
    from trapetum import cli

    assert cli._parts("residual") == ("residual",)
    assert cli._parts(" additive , residual ") == ("additive", "residual")
    assert cli._parts("floors") == ("floors",) and "floors" in cli.VQ_PARTS


@pytest.fixture
def fake_gpu_run(monkeypatch):
    """`trapetum vq` with the GPU, the clock-bound measurements and the provenance faked: what the
    command keeps, skips and writes is real."""
    import torch

    from trapetum import bench, residual, results

    calls = {"sweeps": 0, "copy": 0, "skip": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    commit = {"sha": "abc1234"}
    monkeypatch.setattr(results, "provenance", lambda command=None, **extra: {
        "gpu": "Fake GPU", "git_commit": commit["sha"], "date": "2026-11-23T00:00:00+00:00", "command": command or "x", **extra})

    def sweep(*a, **k):
        calls["sweeps"] += 1
        return [{"grid": "correctness", "kernel": "residual", "max_rel_err": 1e-4}]

    def copy_bandwidth():
        calls["copy"] += 1
        return {"copy_gbps": 3000.0}

    def suite(grid, skip_residual=frozenset(), floors=None, skip_floor=frozenset(), skip_additive=frozenset(), **k):
        calls["skip"], calls["skip_additive"] = set(skip_residual), set(skip_additive)
        calls["grid"], calls["floors"], calls["skip_floor"], calls["additive_shapes"] = grid, floors, set(skip_floor), k["additive_shapes"]
        jobs = [(kernel, M, i, o) for i, o in k["additive_shapes"]
                for kernel, M in [("additive", 2), ("additive", 4)] + ([(bench.AQLM_PACKAGE, None)] if k["aqlm"] else [])]
        recs = [{"grid": "additive", "kernel": kernel, "M": M, "in_features": i, "out_features": o, "time_ms": 1.0}
                for kernel, M, i, o in jobs if (kernel, M, i, o) not in skip_additive]
        todo = [c for c in bench.residual_configs(grid) if c not in skip_residual]
        recs += [{"grid": "residual", "kernel": "residual", "in_features": i, "out_features": o, "main_centroids": m,
                  "residual_centroids": r, "time_ms": 1.0} for i, o, m, r in todo]
        recs += [{"grid": "floor", "kernel": bench.STREAM_FLOOR, "time_ms": 0.5, **j} for j in bench.floor_jobs(**floors)] if floors else []
        for rec in recs:
            k["on_record"](rec)
        return recs, {"failures": []}

    monkeypatch.setattr(residual, "correctness_sweep", sweep)
    monkeypatch.setattr(bench, "copy_bandwidth", copy_bandwidth)
    monkeypatch.setattr(bench, "vq_suite", suite)
    return calls, commit


def test_vq_resume_keeps_the_first_process_and_measures_the_rest(fake_gpu_run, tmp_path):
    from trapetum import bench, cli

    calls, commit = fake_gpu_run
    out = tmp_path / "out"
    partial = out / "fake-gpu" / "vq_gemv.partial.jsonl"
    grid = bench.RESIDUAL_GRID
    first = [(i, o, m, r) for m in grid["mains"] for r in grid["residuals"] for o in grid["out_features"] for i in grid["in_features"]][:7]
    partial.parent.mkdir(parents=True)
    lines = [{"provenance": {"gpu": "Fake GPU", "git_commit": "abc1234", "date": "2026-11-22T00:00:00+00:00", "command": "first"}},
             {"grid": "correctness", "kernel": "residual", "max_rel_err": 2e-4}, {"copy": {"copy_gbps": 2900.0}}]
    lines += [{"grid": "residual", "kernel": "residual", "in_features": i, "out_features": o, "main_centroids": m,
               "residual_centroids": r, "time_ms": 2.0} for i, o, m, r in first]
    partial.write_text("".join(json.dumps(d) + "\n" for d in lines))
    saved = tmp_path / "first.jsonl"
    saved.write_text(partial.read_text())

    commit["sha"] = "def5678"
    with pytest.raises(ValueError, match="git_commit"):
        cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(out), "--resume", str(saved)])
    commit["sha"] = "abc1234"
    assert cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(out), "--resume", str(saved)]) == 0
    assert calls["sweeps"] == 0 and calls["copy"] == 0  # both were in the first process's file
    assert calls["skip"] == set(first)
    d = json.loads((out / "fake-gpu" / "vq_gemv.json").read_text())
    res = [r for r in d["records"] if r["grid"] == "residual"]
    assert len(res) == 120 and len({(r["in_features"], r["out_features"], r["main_centroids"], r["residual_centroids"]) for r in res}) == 120
    assert sum(r["time_ms"] == 2.0 for r in res) == 7 and all(r["copy_gbps"] == 2900.0 for r in res)
    prov = d["provenance"]
    assert prov["date"] == "2026-11-22T00:00:00+00:00" and prov["command"] == "first"
    assert "two processes" in prov["resumed"] and "kept 8 records" in prov["resumed"] and "partial" not in prov


def test_vq_resume_completes_the_additive_table_shape_by_shape(fake_gpu_run, tmp_path, monkeypatch):
    from trapetum import bench, cli

    calls, _ = fake_gpu_run
    cpp = []
    monkeypatch.setattr(bench, "run_cuda_cpp", lambda *a, **k: cpp.append(k) or [
        {"kernel": "cuda_cpp_additive", "M": 2, "in_features": 4096, "out_features": 4096, "time_ms": 3.0}])
    shapes = bench.ADDITIVE_SHAPES
    first = [("additive", 2, *s) for s in shapes[:3]] + [("additive", 4, *s) for s in shapes[:2]] + [(bench.AQLM_PACKAGE, None, *shapes[0])]
    lines = [{"provenance": {"gpu": "Fake GPU", "git_commit": "abc1234", "date": "2026-11-22T00:00:00+00:00", "command": "first"}},
             {"grid": "correctness", "kernel": "additive", "max_rel_err": 2e-4}, {"copy": {"copy_gbps": 2900.0}}]
    lines += [{"grid": "baseline", "kernel": "torch fp16", "in_features": i, "out_features": o, "time_ms": 0.1} for i, o in shapes[:3]]
    lines += [{"grid": "additive", "kernel": kernel, "M": M, "in_features": i, "out_features": o, "time_ms": 2.0} for kernel, M, i, o in first]
    saved = tmp_path / "first.jsonl"
    saved.write_text("".join(json.dumps(d) + "\n" for d in lines))
    out = tmp_path / "out"
    assert cli.main(["vq", "--parts", "additive", "--quiet", "--out", str(out), "--resume", str(saved)]) == 0
    assert cpp == [{"program": "gemv_additive_2bit"}]  # no C++ record in the partial yet
    assert calls["skip_additive"] == set(first)
    d = json.loads((out / "fake-gpu" / "vq_gemv.json").read_text())
    add = [r for r in d["records"] if r["grid"] == "additive" and r["kernel"] != "cuda_cpp_additive"]
    assert len(add) == 3 * len(shapes) and len({bench.additive_key(r) for r in add}) == len(add)
    assert {bench.additive_key(r) for r in add if r["time_ms"] == 2.0} == set(first)
    # Resumed again from that run's partial, which now holds the C++ records too: nothing is measured twice.
    partial = out / "fake-gpu" / "vq_gemv.partial.jsonl"
    again = tmp_path / "again.jsonl"
    again.write_text(partial.read_text())
    assert cli.main(["vq", "--parts", "additive", "--quiet", "--out", str(out), "--resume", str(again)]) == 0
    assert len(cpp) == 1 and len(calls["skip_additive"]) == 3 * len(shapes) + 1
    d = json.loads((out / "fake-gpu" / "vq_gemv.json").read_text())
    assert len([r for r in d["records"] if r["grid"] == "additive"]) == 3 * len(shapes) + 1
    # ... and its provenance does not claim a second process measured a part of it
    assert "nothing left to measure" in d["provenance"]["resumed"] and "two processes" not in d["provenance"]["resumed"]


def test_additive_key_matches_a_job_to_its_record_read_back():
    from trapetum import bench

    rec = bench.gemv_record("additive", 256, 1, 4096, 11008, 1.0, 2.0, 1, 0.0, M=4, grid="additive")
    assert bench.additive_key(json.loads(json.dumps(rec))) == ("additive", 4, 4096, 11008)
    assert bench.additive_key(dict(rec, M=4.0)) == ("additive", 4, 4096, 11008)
    aqlm = bench.gemv_record(bench.AQLM_PACKAGE, None, 1, 4096, 4096, 1.0, 2.0, 1, 0.0, grid="additive")
    assert bench.additive_key(aqlm) == ("aqlm package 2x8", None, 4096, 4096)


def test_vq_suite_skips_the_additive_jobs_already_measured(monkeypatch):
    from trapetum import additive, bench

    timed = {"fp16": [], "additive": [], "aqlm": [], "built": 0}
    monkeypatch.setattr(bench, "time_fp16", lambda n_in, n_out, b: timed["fp16"].append((n_in, n_out)) or 0.1)
    monkeypatch.setattr(additive, "time_additive", lambda n_in, n_out, M, b, f: timed["additive"].append((M, n_in, n_out)) or
                        bench.gemv_record("additive", 256, b, n_in, n_out, 0.05, f, 1, 0.0, M=M))
    monkeypatch.setattr(bench, "aqlm_package_available", lambda: timed.update(built=timed["built"] + 1))
    monkeypatch.setattr(bench, "time_aqlm_package", lambda n_in, n_out, f: timed["aqlm"].append((n_in, n_out)) or
                        bench.gemv_record(bench.AQLM_PACKAGE, None, 1, n_in, n_out, 0.04, f, 1, 0.0))
    a, b, c = (4096, 4096), (4096, 11008), (11008, 4096)
    skip = {("additive", 2, *a), ("additive", 4, *a), (bench.AQLM_PACKAGE, None, *a), ("additive", 4, *b)}
    grid = dict(bench.RESIDUAL_GRID, in_features=())
    recs, extra = bench.vq_suite(grid=grid, additive_shapes=(a, b, c), progress=False, skip_additive=skip)
    assert timed["fp16"] == [b, c]  # a's jobs were all done: no fp16 beside nothing
    assert timed["additive"] == [(2, *b), (2, *c), (4, *c)] and timed["aqlm"] == [b, c] and timed["built"] == 1
    assert extra["aqlm_package"] == "built" and extra["failures"] == []
    assert {bench.additive_key(r) for r in recs if r["grid"] == "additive"} == {
        ("additive", 2, *b), ("additive", 2, *c), ("additive", 4, *c), (bench.AQLM_PACKAGE, None, *b), (bench.AQLM_PACKAGE, None, *c)}
    assert all(r["fp16_ms"] == 0.1 for r in recs) and len([r for r in recs if r["grid"] == "baseline"]) == 2
    # No job of the package left: it is not built (it compiles on import); fp16 only where ours remain.
    timed.update(fp16=[], additive=[], aqlm=[], built=0)
    skip |= {(bench.AQLM_PACKAGE, None, *s) for s in (b, c)} | {("additive", 2, *c), ("additive", 4, *c)}
    recs, extra = bench.vq_suite(grid=grid, additive_shapes=(a, b, c), progress=False, skip_additive=skip)
    assert timed == {"fp16": [b], "additive": [(2, *b)], "aqlm": [], "built": 0} and "not checked" in extra["aqlm_package"]
    assert [bench.additive_key(r) for r in recs if r["grid"] == "additive"] == [("additive", 2, *b)]


def test_vq_resume_refuses_other_sources_under_the_same_commit(fake_gpu_run, tmp_path, monkeypatch):
    # A device copy's git metadata can name a stale commit: the sources' fingerprint must match too.
    from trapetum import cli, results

    saved = tmp_path / "first.jsonl"
    saved.write_text(json.dumps({"provenance": {"gpu": "Fake GPU", "git_commit": "abc1234", "source_id": "s1", "date": "d", "command": "c"}})
                     + "\n")
    monkeypatch.setattr(results, "provenance", lambda command=None, **extra: {
        "gpu": "Fake GPU", "git_commit": "abc1234", "source_id": "s2", "date": "d2", "command": command or "x", **extra})
    with pytest.raises(ValueError, match="source_id"):
        cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path), "--resume", str(saved)])


def test_vq_measures_a_subset_of_the_residual_grid(fake_gpu_run, tmp_path):
    from trapetum import bench, cli

    calls, _ = fake_gpu_run
    assert cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path), "--out-features", "1024",
                     "--codebooks", "4096+512,8192+256"]) == 0
    assert bench.residual_configs(calls["grid"]) == [(i, 1024, m, r) for m, r in ((4096, 512), (8192, 256))
                                                      for i in bench.RESIDUAL_GRID["in_features"]]
    d = json.loads((tmp_path / "fake-gpu" / "vq_gemv.json").read_text())
    assert len([r for r in d["records"] if r["grid"] == "residual"]) == 10
    assert cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path), "--in-features", "2048,4096"]) == 0
    assert len(bench.residual_configs(calls["grid"])) == 2 * 6 * 4
    for bad, match in ((["--in-features", "1000"], "not divisible by 256"), (["--codebooks", "4096+300"], "Nr must be one of")):
        with pytest.raises(ValueError, match=match):
            cli.main(["vq", "--parts", "residual", "--quiet", "--out", str(tmp_path), *bad])
    for bad in (["--out-features", "0"], ["--out-features", "a"], ["--codebooks", "4096"], ["--codebooks", "4096+256+1"]):
        with pytest.raises(SystemExit):
            cli.main(["vq", "--parts", "residual", "--quiet", "--out", str(tmp_path), *bad])


def test_vq_floors_alone_cover_both_parts_configurations(fake_gpu_run, tmp_path):
    from trapetum import bench, cli

    calls, _ = fake_gpu_run
    assert cli.main(["vq", "--parts", "floors", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path)]) == 0
    assert calls["floors"] == dict(grid=bench.RESIDUAL_GRID, additive_shapes=bench.ADDITIVE_SHAPES)
    assert calls["grid"]["in_features"] == () and calls["additive_shapes"] == ()  # neither part timed
    assert cli.main(["vq", "--parts", "residual", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path)]) == 0
    assert calls["floors"] is None
    assert cli.main(["vq", "--parts", "residual,floors", "--quick", "--no-cuda-cpp", "--quiet", "--out", str(tmp_path)]) == 0
    assert calls["floors"]["grid"] == calls["grid"] and calls["floors"]["additive_shapes"] == bench.ADDITIVE_SHAPES[:3]


def test_vq_resume_refuses_a_file_that_is_not_a_partial_run(fake_gpu_run, tmp_path):
    from trapetum import cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"records": []}\n')
    with pytest.raises(ValueError, match="provenance line"):
        cli.main(["vq", "--parts", "residual", "--quiet", "--out", str(tmp_path), "--resume", str(bad)])


def test_gemv_checks_only_then_resume_times_on_top_of_the_sweep(fake_gpu_run, monkeypatch, tmp_path):
    from trapetum import bench, cli

    calls, commit = fake_gpu_run
    sweeps = []
    monkeypatch.setattr(bench, "correctness_sweep", lambda *a, **k: sweeps.append(1) or [{"kernel": "lut", "max_rel_err": 1e-4, "passed": True}])
    monkeypatch.setattr(bench, "gemv_suite", lambda **k: [{"grid": "batch", "kernel": "lut", "time_ms": 0.05}])
    out = tmp_path / "out"
    assert cli.main(["gemv", "--checks-only", "--no-cuda-cpp", "--quiet", "--out", str(out), "--command", "first"]) == 0
    partial = out / "fake-gpu" / "gemv.partial.jsonl"
    assert partial.exists() and not (out / "fake-gpu" / "gemv.json").exists() and sweeps == [1] and calls["copy"] == 1
    commit["sha"] = "def5678"
    with pytest.raises(ValueError, match="git_commit"):
        cli.main(["gemv", "--no-cuda-cpp", "--quiet", "--out", str(out), "--resume", str(partial)])
    commit["sha"] = "abc1234"
    assert cli.main(["gemv", "--no-cuda-cpp", "--quiet", "--out", str(out), "--resume", str(partial)]) == 0
    assert sweeps == [1] and calls["copy"] == 1  # neither ran again
    d = json.loads((out / "fake-gpu" / "gemv.json").read_text())
    assert [r["grid"] for r in d["records"]] == ["batch", "correctness"] and all(r["copy_gbps"] == 3000.0 for r in d["records"][:1])
    assert d["provenance"]["command"] == "first" and "two processes" in d["provenance"]["resumed"]
    # a partial with no sweep in it is refused
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"provenance": {"gpu": "Fake GPU", "git_commit": "abc1234"}}) + "\n")
    with pytest.raises(ValueError, match="checks-only"):
        cli.main(["gemv", "--no-cuda-cpp", "--quiet", "--out", str(out), "--resume", str(empty)])

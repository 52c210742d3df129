"""The results-file contract: provenance, no silent overwrites, strict JSON, readers that refuse bad files."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from trapetum import results as R
from trapetum.results import ResultsFileError

PROV_KEYS = ("gpu", "driver", "cuda", "torch", "numba", "numba_cuda", "git_commit", "date", "command")


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, which Python's json accepts but JSON does not."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def prov(gpu="NVIDIA H100 80GB HBM3", date="2026-01-02T03:04:05+00:00", **extra):
    p = R.provenance(command="pytest", **extra)
    p.update(gpu=gpu, date=date)
    return p


RECORDS = [{"kernel": "lut", "K": 16, "time_ms": 0.01}, {"kernel": "naive", "K": 16, "time_ms": 0.2}]


def test_provenance_has_the_keys_a_reader_needs():
    p = R.provenance(command="trapetum gemv --quiet", copy_gbps=3000.0)
    missing = [k for k in PROV_KEYS if k not in p]
    assert not missing, f"provenance lacks {missing}"
    assert p["command"] == "trapetum gemv --quiet"
    assert p["copy_gbps"] == 3000.0
    assert p["torch"] == torch.__version__.split("+")[0] or p["torch"] == torch.__version__
    assert p["numba"] and p["numba_cuda"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", p["date"])
    strict_json(json.dumps(p))  # serialisable as it stands


def test_provenance_records_the_command_line_by_default(monkeypatch):
    monkeypatch.setattr("sys.argv", ["trapetum", "gemv", "--out", "my dir"])
    assert R.provenance()["command"] == "trapetum gemv --out 'my dir'"


def test_provenance_falls_back_to_the_commit_given_in_the_environment(monkeypatch):
    monkeypatch.setattr(R, "_git", lambda *a: None)  # a tree copied without .git
    monkeypatch.setenv("TRAPETUM_GIT_COMMIT", "abc123")
    p = R.provenance(command="x")
    assert p["git_commit"] == "abc123" and p["git_dirty"] is None


def test_source_id_names_the_commit_whose_files_ran(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "trapetum").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "trapetum" / "gemv.py").write_text("K = 16\n")
    (tmp_path / "kernels" / "k.cu").write_text("// a kernel\n")
    (tmp_path / "notes.md").write_text("not code\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    sid = R.source_id(tmp_path)
    assert R.commit_of(sid, tmp_path) == first
    # files that are not sources (notes, caches) do not change it; a source edit does, until committed
    (tmp_path / "notes.md").write_text("edited\n")
    (tmp_path / "trapetum" / "__pycache__").mkdir()
    (tmp_path / "trapetum" / "__pycache__" / "gemv.cpython-311.pyc").write_bytes(b"\0")
    assert R.source_id(tmp_path) == sid
    (tmp_path / "kernels" / "k.cu").write_text("// a faster kernel\n")
    edited = R.source_id(tmp_path)
    assert edited != sid and R.commit_of(edited, tmp_path) is None
    git("add", "-A")
    git("commit", "-q", "-m", "two")
    assert R.commit_of(edited, tmp_path) != first and R.commit_of(sid, tmp_path) == first
    assert R.provenance(command="x")["source_id"] == R.source_id()


def test_plan_source_id_ignores_only_the_modules_that_read_and_record_results(tmp_path):
    (tmp_path / "trapetum").mkdir()
    for name in ("gemv.py", "report.py", "results.py", "cli.py", "bench.py"):
        (tmp_path / "trapetum" / name).write_text(f"# {name}\n")
    sid, pid = R.source_id(tmp_path), R.plan_source_id(tmp_path)
    assert sid != pid
    # a chapter's table or the command line edited: the plans stay, the provenance changes
    for name in ("report.py", "results.py", "cli.py"):
        (tmp_path / "trapetum" / name).write_text("# edited\n")
        assert R.plan_source_id(tmp_path) == pid and R.source_id(tmp_path) != sid
        sid = R.source_id(tmp_path)
    for name in ("gemv.py", "bench.py"):  # a kernel or its timing edited: both change
        (tmp_path / "trapetum" / name).write_text("# edited\n")
        assert R.plan_source_id(tmp_path) != pid and R.source_id(tmp_path) != sid
        sid, pid = R.source_id(tmp_path), R.plan_source_id(tmp_path)


def test_save_writes_gpu_folder_and_round_trips(tmp_path):
    path = R.save("gemv", RECORDS, prov(), folder=tmp_path)
    assert path == tmp_path / "nvidia-h100-80gb-hbm3" / "gemv.json"
    p, df = R.read(path)
    assert p["gpu"] == "NVIDIA H100 80GB HBM3"
    assert df.to_dict("records") == RECORDS


def test_save_without_gpu_goes_to_cpu_folder(tmp_path):
    assert R.save("t", RECORDS, prov(gpu=None), folder=tmp_path).parent.name == "cpu"


def test_save_twice_keeps_the_first_run_and_says_so(tmp_path, capsys):
    first = R.save("gemv", RECORDS[:1], prov(date="2026-01-02T03:04:05+00:00"), folder=tmp_path)
    capsys.readouterr()
    second = R.save("gemv", RECORDS, prov(date="2026-02-03T04:05:06+00:00"), folder=tmp_path)
    assert second == first
    aside = first.parent / "gemv.20260102T030405.json"
    assert aside.is_file(), sorted(p.name for p in first.parent.iterdir())
    assert str(aside) in capsys.readouterr().out
    assert R.read(aside)[1].to_dict("records") == RECORDS[:1]
    assert R.read(second)[1].to_dict("records") == RECORDS


def test_save_never_loses_a_run_with_the_same_date(tmp_path):
    same = "2026-01-02T03:04:05+00:00"
    for i in range(4):
        R.save("gemv", [{"run": i}], prov(date=same), folder=tmp_path)
    files = sorted((tmp_path / "nvidia-h100-80gb-hbm3").glob("gemv*.json"))
    runs = sorted(int(R.read(f)[1]["run"][0]) for f in files)
    assert runs == [0, 1, 2, 3], [f.name for f in files]


def test_save_moves_aside_an_unreadable_old_file(tmp_path):
    folder = tmp_path / "nvidia-h100-80gb-hbm3"
    folder.mkdir()
    (folder / "gemv.json").write_text("{ broken")
    R.save("gemv", RECORDS, prov(), folder=tmp_path)
    kept = [p for p in folder.glob("gemv.*.json")]
    assert len(kept) == 1 and kept[0].read_text() == "{ broken"


def test_a_failed_save_leaves_the_previous_file_in_place(tmp_path):
    first = R.save("gemv", RECORDS, prov(), folder=tmp_path)
    with pytest.raises(TypeError):
        R.save("gemv", [{"kernel": object()}], prov(), folder=tmp_path)  # not JSON-serialisable
    # the book reads <gpu>/gemv.json: a save that failed must not have moved it away
    assert first.is_file() and R.read(first)[1].to_dict("records") == RECORDS


def test_save_refuses_empty_records(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        R.save("gemv", [], prov(), folder=tmp_path)
    assert not any(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("bad", [{}, {"date": "2026-01-01"}, None])
def test_save_refuses_provenance_not_from_provenance(tmp_path, bad):
    with pytest.raises(ValueError, match="provenance must come from"):
        R.save("gemv", RECORDS, bad, folder=tmp_path)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -float("inf"), np.float32("nan"), np.float64("nan"), torch.tensor(float("nan"))],
    ids=["nan", "inf", "-inf", "np.float32", "np.float64", "torch-0d"],
)
def test_non_finite_record_values_are_written_as_null(tmp_path, value):
    path = R.save("gemv", [{"kernel": "lut", "max_rel_err": value, "ok": 1.5}], prov(), folder=tmp_path)
    d = strict_json(path.read_text())
    assert d["records"] == [{"kernel": "lut", "max_rel_err": None, "ok": 1.5}]


def test_numpy_scalars_in_records_become_plain_json(tmp_path):
    path = R.save("gemv", [{"K": np.int64(16), "ms": np.float32(0.5), "passed": np.bool_(True)}], prov(), folder=tmp_path)
    assert strict_json(path.read_text())["records"] == [{"K": 16, "ms": 0.5, "passed": True}]


def test_non_finite_provenance_values_are_written_as_null(tmp_path):
    # e.g. a copy-bandwidth measurement that failed: the file must still be strict JSON.
    path = R.save("gemv", RECORDS, prov(copy_gbps=float("nan")), folder=tmp_path)
    d = strict_json(path.read_text())
    assert d["provenance"]["copy_gbps"] is None


# -- read / load ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content",
    [
        {"records": [{"a": 1}]},
        {"provenance": {"gpu": "x"}},
        {"provenance": {"gpu": "x"}, "records": {"a": 1}},
        {"provenance": "x", "records": []},
        [1, 2, 3],
    ],
    ids=["no-provenance", "no-records", "records-not-list", "provenance-not-dict", "not-a-dict"],
)
def test_read_refuses_files_off_the_contract(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ResultsFileError, match="needs a 'provenance' dict and a 'records' list"):
        R.read(path)


@pytest.mark.parametrize("text", ["{ not json", "", "NaN-ish ]"])
def test_read_refuses_non_json(tmp_path, text):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ResultsFileError, match="not a readable JSON results file"):
        R.read(path)


def test_read_refuses_a_missing_file(tmp_path):
    with pytest.raises(ResultsFileError, match="not a readable JSON"):
        R.read(tmp_path / "absent.json")


def test_load_concatenates_gpus_and_adds_provenance_columns(tmp_path):
    R.save("gemv", RECORDS, prov(gpu="NVIDIA H100 80GB HBM3", driver="580.1"), folder=tmp_path)
    R.save("gemv", RECORDS[:1], prov(gpu="NVIDIA H200", driver="580.2"), folder=tmp_path)
    R.save("gemv", [{"kernel": "old"}], prov(gpu="NVIDIA H200", date="2025-01-01T00:00:00+00:00"), folder=tmp_path)  # moved aside
    R.save("gemv", RECORDS[1:], prov(gpu="NVIDIA H200", driver="580.2"), folder=tmp_path)
    R.save("other", [{"kernel": "not gemv"}], prov(gpu="NVIDIA A100"), folder=tmp_path)
    df = R.load("gemv", folder=tmp_path)
    assert len(df) == 3
    for col in ("gpu", "driver", "cuda", "torch", "numba_cuda", "git_commit", "date", "gpu_slug"):
        assert col in df.columns, col
    by_gpu = df.groupby("gpu_slug")["kernel"].apply(list).to_dict()
    assert by_gpu == {"nvidia-h100-80gb-hbm3": ["lut", "naive"], "nvidia-h200": ["naive"]}
    assert set(df["gpu"]) == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    assert df.loc[df["gpu_slug"] == "nvidia-h200", "driver"].tolist() == ["580.2"]


def test_load_of_nothing_is_an_empty_frame(tmp_path):
    df = R.load("gemv", folder=tmp_path)
    assert isinstance(df, pd.DataFrame) and df.empty


def test_load_refuses_a_broken_file(tmp_path):
    (tmp_path / "gpu-a").mkdir()
    (tmp_path / "gpu-a" / "gemv.json").write_text('{"records": []}')
    with pytest.raises(ResultsFileError):
        R.load("gemv", folder=tmp_path)


@pytest.mark.parametrize("name, want", [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("  H200 (SXM) ", "h200-sxm")])
def test_slug(name, want):
    assert R.slug(name) == want


def test_slug_refuses_names_with_nothing_usable():
    with pytest.raises(ValueError, match="cannot make a folder name"):
        R.slug("!!!")


def test_adopt_brings_a_run_in_and_keeps_the_older_one(tmp_path):
    remote = R.save("decode", RECORDS, prov(date="2026-02-03T04:05:06+00:00"), folder=tmp_path / "remote")
    local = tmp_path / "data"
    R.save("decode", RECORDS[:1], prov(date="2026-01-02T03:04:05+00:00"), folder=local)
    path = R.adopt(remote, folder=local)
    assert path == local / "nvidia-h100-80gb-hbm3" / "decode.json"
    assert R.read(path)[1].to_dict("records") == RECORDS
    assert (path.parent / "decode.20260102T030405.json").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": []}')
    with pytest.raises(ValueError, match="not a Trapetum results file"):
        R.adopt(bad, folder=local)


def test_adopt_partial_keeps_what_a_stopped_run_measured(tmp_path):
    lines = [json.dumps({"provenance": prov()}), json.dumps({"copy": {"copy_gbps": 3000.0}}),
             json.dumps({"kernel": "a", "time_ms": 1.0}), json.dumps({"kernel": "b", "time_ms": 2.0})]
    src = tmp_path / "vq_gemv.partial.jsonl"
    src.write_text("\n".join(lines) + "\n")
    path = R.adopt_partial(src, folder=tmp_path / "data")
    p, df = R.read(path)
    assert path.name == "vq_gemv.json" and list(df["kernel"]) == ["a", "b"] and (df["copy_gbps"] == 3000.0).all()
    assert p["copy_gbps"] == 3000.0 and "2 records" in p["partial"]
    src.write_text(lines[2] + "\n")
    with pytest.raises(ValueError, match="provenance"):
        R.adopt_partial(src, folder=tmp_path / "data")


def test_invocation_gives_a_module_run_back_as_python_m():
    pkg = R.PACKAGE_ROOT
    argv = [str(pkg / "decode.py"), "bench", "--arch", "llama-2-7b", "--command", "a b"]
    assert R.invocation(argv) == "python -m trapetum.decode bench --arch llama-2-7b --command 'a b'"
    assert R.invocation([str(pkg / "__main__.py"), "gemv"]) == "python -m trapetum gemv"
    assert R.invocation(["/usr/local/bin/trapetum", "gemv", "--arch", "sm_90"]) == "/usr/local/bin/trapetum gemv --arch sm_90"
    assert R.invocation([".dev/probe.py", "x"]) == ".dev/probe.py x"  # a script outside the package: as given

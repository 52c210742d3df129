"""The plan cache: tuned plans survive the process, only for the same sources, and a bad file costs a re-tune, not a crash."""
import json

import pytest

from trapetum import additive, gemv, residual, results, tuning
from trapetum.tuning import PlanCache

KEY = ("NVIDIA H100 80GB HBM3", "lut", ("lut", "mma"), 16, 1, 4096, 14336, "", "")


@pytest.fixture
def plan_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "plans.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    return path


def test_plans_round_trip_through_the_file(plan_file):
    plans = {
        gemv.LaunchPlan: gemv.LaunchPlan(warps=16, ksplit=2, cps=64, shared_bytes=1024, RB=2, stages=3, kernel="mma", walk=1),
        additive.AdditivePlan: additive.AdditivePlan(warps=8, RB=32, cps=4, ksplit=32, bt=1, shared_bytes=65536, build="mma", table="fp16"),
        additive.StreamPlan: additive.StreamPlan(warps=16, ksplit=1, slots=2, qpb=27, QW=2, cps=16, nch=16, shared_bytes=200000),
        residual.ResidualPlan: residual.ResidualPlan(warps=8, ksplit=1, cps=8, RB=1, main="shared", shared_bytes=70000, static_bytes=24, kind="split", rc=2, lanes=2),
    }
    writer = PlanCache("mixed", *plans)
    for i, p in enumerate(plans.values()):
        writer[KEY + (i,)] = p
    assert plan_file.is_file()
    reader = PlanCache("mixed", *plans)  # a later process: nothing in memory
    for i, p in enumerate(plans.values()):
        assert KEY + (i,) in reader
        assert reader[KEY + (i,)] == p
    assert reader.loaded == len(plans)
    assert reader.get(KEY + (99,)) is None
    with pytest.raises(KeyError):
        reader[KEY + (99,)]


def test_families_share_one_file_and_keep_each_others_plans(plan_file):
    a, b = PlanCache("lut", gemv.LaunchPlan), PlanCache("other", gemv.LaunchPlan)
    pa = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    pb = gemv.LaunchPlan(warps=8, ksplit=2, cps=8, shared_bytes=0)
    a[KEY] = pa
    b[KEY] = pb  # re-reads the file before writing: a's plan stays
    doc = json.loads(plan_file.read_text())
    assert set(doc["plans"]) == {"lut", "other"}
    assert PlanCache("lut", gemv.LaunchPlan)[KEY] == pa
    assert PlanCache("other", gemv.LaunchPlan)[KEY] == pb


def test_plans_of_other_sources_are_ignored(plan_file):
    PlanCache("lut", gemv.LaunchPlan)[KEY] = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    doc = json.loads(plan_file.read_text())
    assert doc["plan_source_id"] == results.plan_source_id()
    doc["plan_source_id"] = "0" * 64  # tuned by other code: its fastest plan may differ, or not fit
    plan_file.write_text(json.dumps(doc))
    assert KEY not in PlanCache("lut", gemv.LaunchPlan)


def test_a_version_1_file_is_tuned_again(plan_file):
    # version 1 named the whole tree's sources (report.py included) under "source_id"
    PlanCache("lut", gemv.LaunchPlan)[KEY] = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    doc = json.loads(plan_file.read_text())
    plan_file.write_text(json.dumps({"format_version": 1, "source_id": doc["plan_source_id"], "plans": doc["plans"]}))
    assert KEY not in PlanCache("lut", gemv.LaunchPlan)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"plans": 3}'])
def test_an_unreadable_file_warns_and_is_replaced(plan_file, text):
    plan_file.parent.mkdir(parents=True)
    plan_file.write_text(text)
    cache = PlanCache("lut", gemv.LaunchPlan)
    with pytest.warns(UserWarning, match="ignoring the plan cache"):
        assert KEY not in cache
    p = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    with pytest.warns(UserWarning, match="ignoring the plan cache"):
        cache[KEY] = p
    assert PlanCache("lut", gemv.LaunchPlan)[KEY] == p  # the next process reads the rewritten file


def test_unknown_plan_types_and_fields_are_tuned_again(plan_file):
    PlanCache("lut", gemv.LaunchPlan)[KEY] = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    doc = json.loads(plan_file.read_text())
    (k, entry), = doc["plans"]["lut"].items()
    doc["plans"]["lut"][k + "x"] = {"type": "GonePlan", "fields": {}}
    doc["plans"]["lut"][k] = {**entry, "fields": {**entry["fields"], "gone": 1}}
    plan_file.write_text(json.dumps(doc))
    cache = PlanCache("lut", gemv.LaunchPlan)
    assert KEY not in cache


def test_off_keeps_plans_in_memory_only(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() is None
    cache = PlanCache("lut", gemv.LaunchPlan)
    p = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    cache[KEY] = p
    assert cache[KEY] == p
    assert not any(tmp_path.rglob("*.json"))
    assert KEY not in PlanCache("lut", gemv.LaunchPlan)
    assert results.provenance("x")["plan_cache"] == "off"


def test_default_path_and_provenance(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() == tmp_path / "trapetum" / "plans.json"
    assert results.provenance("x")["plan_cache"] == str(tmp_path / "trapetum" / "plans.json")


def test_an_unwritable_place_warns_once_and_keeps_the_plan(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(tuning.ENV, str(blocker / "plans.json"))  # its folder is a file
    cache = PlanCache("lut", gemv.LaunchPlan)
    p = gemv.LaunchPlan(warps=4, ksplit=1, cps=8, shared_bytes=0)
    with pytest.warns(UserWarning, match="cannot write the plan cache"):
        cache[KEY] = p
    assert cache[KEY] == p
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache[KEY + (1,)] = p  # warned once per file


def test_bad_plans_and_types_are_refused(plan_file):
    with pytest.raises(TypeError, match="dataclass"):
        PlanCache("lut", dict)
    with pytest.raises(TypeError, match="LaunchPlan"):
        PlanCache("lut", gemv.LaunchPlan)[KEY] = residual.ResidualPlan(warps=8, ksplit=1, cps=8, RB=1, main="shared", shared_bytes=0, static_bytes=0)


def test_every_gemv_family_tunes_through_a_plan_cache():
    assert isinstance(gemv._TUNED, PlanCache) and set(gemv._TUNED.types) == {"LaunchPlan"}
    assert isinstance(additive._TUNED, PlanCache) and set(additive._TUNED.types) == {"AdditivePlan", "StreamPlan"}
    assert isinstance(residual._TUNED, PlanCache) and set(residual._TUNED.types) == {"ResidualPlan"}


def test_the_plans_command_lists_and_clears(plan_file, capsys):
    from trapetum.cli import main

    assert main(["plans"]) == 0 and f"{plan_file}: 0 plans" in capsys.readouterr().out  # no file yet
    PlanCache("lut", gemv.LaunchPlan)[KEY] = gemv.LaunchPlan(warps=4, ksplit=2, cps=8, shared_bytes=0)
    assert main(["plans"]) == 0
    out = capsys.readouterr().out
    assert f"{plan_file}: 1 plans" in out and "LaunchPlan(" in out and "ksplit=2" in out and "other sources" not in out
    assert main(["plans", "--clear"]) == 0 and f"removed {plan_file}" in capsys.readouterr().out
    assert not plan_file.exists() and KEY not in PlanCache("lut", gemv.LaunchPlan)
    assert main(["plans", "--clear"]) == 0 and "no plan file" in capsys.readouterr().out


def test_the_plans_command_names_a_stale_or_broken_file(plan_file, capsys, monkeypatch):
    from trapetum.cli import main

    PlanCache("lut", gemv.LaunchPlan)[KEY] = gemv.LaunchPlan(warps=4, ksplit=2, cps=8, shared_bytes=0)
    doc = json.loads(plan_file.read_text())
    plan_file.write_text(json.dumps({**doc, "plan_source_id": "0" * 64}))
    assert main(["plans"]) == 0 and "tuned by other sources" in capsys.readouterr().out
    plan_file.write_text("{broken")
    assert main(["plans"]) == 2 and "--clear" in capsys.readouterr().err
    monkeypatch.setenv(tuning.ENV, "off")
    assert main(["plans"]) == 0 and "=off" in capsys.readouterr().out


def test_no_home_directory_keeps_plans_in_memory(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(tuning.Path, "home", staticmethod(no_home))
    assert tuning.cache_path() is None and results.provenance("x")["plan_cache"] == "off"

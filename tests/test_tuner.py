"""bench.pick_fastest, the tuners' shared choice, with the GPU timings replaced by a script."""
from __future__ import annotations

import pytest

from trapetum import bench


@pytest.fixture
def timings(monkeypatch):
    """Each candidate's successive timings (ms) come from ``script[plan]``; calls are logged."""
    script, log = {}, []
    monkeypatch.setattr(bench, "warm_gpu", lambda device: log.append("warm"))

    def fake_time_graph(launchers, **kw):
        plan = launchers[0]
        log.append(plan)
        return script[plan].pop(0)

    monkeypatch.setattr(bench, "time_graph", fake_time_graph)
    return script, log


def test_the_fastest_after_a_recheck_wins(timings):
    script, log = timings
    # "b" looks fastest once (a lucky timing) and is slower on its recheck; "c" is steadily fast.
    script.update(a=[5.0, 5.0], b=[1.0, 9.0], c=[2.0, 2.0], d=[3.0, 3.0], e=[8.0])
    best = bench.pick_fastest(list("abcde"), lambda p: [p], "cuda")
    assert best == "b"  # its faster median is kept: a recheck never makes a candidate worse ...
    assert log == ["warm", "a", "b", "c", "d", "e", "d", "c", "b"]  # ... and only the three fastest are re-timed, reversed


def test_a_slow_first_timing_among_the_fastest_is_forgiven(timings):
    script, log = timings
    # "a" is timed first, while something else loads the GPU: 2.5, then 1.5 on its recheck; "d" is
    # outside the three fastest and is timed once
    script.update(a=[2.5, 1.5], b=[2.0, 2.0], c=[2.2, 2.2], d=[3.5])
    assert bench.pick_fastest(list("abcd"), lambda p: [p], "cuda") == "a"
    assert log.count("d") == 1


def test_candidates_that_cannot_launch_are_skipped_or_raised(timings):
    script, _ = timings
    script.update(a=[2.0, 2.0], c=[1.0, 1.0])

    def launchers(p):
        if p == "b":
            raise RuntimeError("too much shared memory")
        return [p]

    skipped = []
    assert bench.pick_fastest(list("abc"), launchers, "cuda", on_error=lambda p, e: skipped.append(p)) == "c"
    assert skipped == ["b"]
    script.update(a=[2.0], c=[1.0])
    with pytest.raises(RuntimeError, match="shared memory"):
        bench.pick_fastest(list("abc"), launchers, "cuda")
    assert bench.pick_fastest(["b"], launchers, "cuda", on_error=lambda p, e: None) is None


def test_tune_log_prints_each_timing(timings, monkeypatch, capsys):
    script, _ = timings
    script.update(a=[2.0, 2.0], b=[1.0, 1.0])
    bench.pick_fastest(list("ab"), lambda p: [p], "cuda")
    assert capsys.readouterr().err == ""  # off unless asked for
    script.update(a=[2.0, 2.0], b=[1.0, 1.0])
    monkeypatch.setenv("TRAPETUM_TUNE_LOG", "1")
    assert bench.pick_fastest(list("ab"), lambda p: [p], "cuda") == "b"
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[1].strip() for ln in lines] == ["a", "b", "a", "b"]  # both, then the rechecks, fastest last
    assert lines[0].startswith("tune: a: 2000.00 us, ") and lines[0].endswith(" s")

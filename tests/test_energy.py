"""The energy meter with a fake power source; the gCO2 projection; NVML missing."""
from __future__ import annotations

import sys

import pytest

from trapetum.energy import (
    EnergyReading,
    NVMLUnavailable,
    PowerMeter,
    gco2_per_1k_tokens,
    nvml_power_source,
    projections,
)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_mean_power_and_j_per_token():
    watts = iter([100.0, 300.0] + [200.0] * 10_000)
    clock = FakeClock()
    m = PowerMeter(source=lambda: next(watts), interval_s=0.001, clock=clock)
    with m:
        clock.t = 2.0  # the window: 2 s
    r = m.reading
    assert r.seconds == 2.0 and r.samples >= 2
    assert 100 <= r.mean_w <= 300
    assert r.joules == pytest.approx(r.mean_w * 2.0)
    assert r.j_per_token(100) == pytest.approx(r.mean_w * 2.0 / 100)


def test_constant_power_is_exact():
    clock = FakeClock()
    m = PowerMeter(source=lambda: 250.0, interval_s=0.001, clock=clock).start()
    clock.t = 4.0
    r = m.stop()
    assert r.mean_w == 250.0 and r.j_per_token(1000) == pytest.approx(1.0)


def test_short_window_still_has_samples():
    r = PowerMeter(source=lambda: 50.0, interval_s=10.0).start().stop()
    assert r.samples == 2 and r.mean_w == 50.0


def test_a_source_returning_none_is_an_error_not_zero():
    vals = iter([10.0, None])
    m = PowerMeter(source=lambda: next(vals, None), interval_s=0.001)
    with pytest.raises(NVMLUnavailable, match="None"):
        with m:
            import time

            time.sleep(0.05)
        m.stop()


@pytest.mark.parametrize("bad", [float("nan"), -5.0])
def test_bad_readings_are_rejected(bad):
    with pytest.raises(ValueError, match="W"):
        PowerMeter(source=lambda: bad).start()


def test_meter_misuse():
    with pytest.raises(ValueError, match="interval_s"):
        PowerMeter(source=lambda: 1.0, interval_s=0)
    m = PowerMeter(source=lambda: 1.0)
    with pytest.raises(RuntimeError, match="without start"):
        m.stop()
    m.start()
    with pytest.raises(RuntimeError, match="already running"):
        m.start()
    m.stop()
    with pytest.raises(ValueError, match="positive"):
        EnergyReading(1.0, 1.0, 1).j_per_token(0)


def test_gco2_is_a_labelled_projection():
    # Seed 004's fp16 row: 5.45 J/token -> 0.076 (FR, 50 g/kWh) and 0.61 (US, 400 g/kWh) g per 1k tokens.
    assert gco2_per_1k_tokens(5.45, 50) == pytest.approx(0.0757, abs=1e-4)
    p = projections(5.45)
    assert p["gco2_per_1k_US_projection"] == pytest.approx(0.606, abs=1e-3)
    assert all(k.endswith("_projection") for k in p)
    assert projections(None) == {k: None for k in p}


def test_nvml_absent_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NVMLUnavailable, match="pynvml"):
        nvml_power_source()
    with pytest.raises(NVMLUnavailable):
        PowerMeter()

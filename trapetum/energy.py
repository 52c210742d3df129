"""Energy per token from GPU power sampling, as seed 004 defines it.

A background thread reads the board power (NVML ``nvmlDeviceGetPowerUsage``, milliwatts)
every ``interval_s`` over the generation window; the window is also sampled once at its start
and once at its end, so a window shorter than the interval still has readings.

    J/token = mean W x s/token          (the measurement)
    gCO2 / 1k tokens = J/token x 1000 / 3.6e6 kWh x grid intensity   (a projection, not a measurement)

The power NVML reports is the driver's own running average (about a one-second window on
recent data-centre GPUs), so windows much shorter than a second are smeared; decode windows
of 512 tokens last several seconds.

NVML can be absent (no driver, no ``pynvml``) or report no reading (some boards and vGPUs:
``NVML_ERROR_NOT_SUPPORTED``, or ``None`` through a wrapper): both raise :class:`NVMLUnavailable`
with the reason, never a silent zero.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

# gCO2 per kWh: France-like (nuclear/hydro) and US-like grid mixes, as seed 004 projects them.
GRID_INTENSITY = {"FR": 50.0, "US": 400.0}
J_PER_KWH = 3.6e6


class NVMLUnavailable(RuntimeError):
    """No power reading: NVML or pynvml is missing, or the GPU does not report power."""


def nvml_power_source(device_index: int | None = None) -> Callable[[], float]:
    """A zero-argument function returning the GPU's power draw in watts.

    The GPU is found by the PCI bus id torch reports, so CUDA_VISIBLE_DEVICES remapping does not
    make NVML read a different board; without torch's CUDA it falls back to NVML index 0.
    """
    try:
        import pynvml
    except ImportError as e:
        raise NVMLUnavailable("energy needs pynvml (pip install nvidia-ml-py)") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NVMLUnavailable(f"NVML did not initialise (no NVIDIA driver?): {e}") from e
    handle = None
    try:
        import torch

        if torch.cuda.is_available():
            idx = torch.cuda.current_device() if device_index is None else device_index
            p = torch.cuda.get_device_properties(idx)
            bus = getattr(p, "pci_bus_id", None)
            if bus is not None:
                busid = f"{getattr(p, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(busid)
    except Exception:  # noqa: BLE001 - fall back to the index below
        handle = None
    try:
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index or 0)
        first = pynvml.nvmlDeviceGetPowerUsage(handle)
    except pynvml.NVMLError as e:
        raise NVMLUnavailable(f"NVML has no power reading for this GPU: {e}") from e
    if first is None:
        raise NVMLUnavailable("NVML returned None for the power draw (not supported on this GPU or driver)")

    def read() -> float:
        mw = pynvml.nvmlDeviceGetPowerUsage(handle)
        if mw is None:
            raise NVMLUnavailable("NVML returned None for the power draw")
        return mw / 1000.0

    return read


@dataclass
class EnergyReading:
    mean_w: float
    seconds: float
    samples: int

    @property
    def joules(self) -> float:
        return self.mean_w * self.seconds

    def j_per_token(self, tokens: int) -> float:
        if tokens <= 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        return self.mean_w * self.seconds / tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "joules": self.joules}


class PowerMeter:
    """``with PowerMeter() as m: ...`` then ``m.reading``: mean power over the block.

    ``source``: a function returning watts (default: NVML for the current GPU). Tests pass a
    fake. ``clock``: seconds (default ``time.perf_counter``); the window's length is measured
    with it, so give the meter the same window the tokens are counted over.
    """

    def __init__(self, source: Callable[[], float] | None = None, interval_s: float = 0.02, clock: Callable[[], float] = time.perf_counter):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.source = source if source is not None else nvml_power_source()
        self.interval_s = interval_s
        self.clock = clock
        self._samples: list[float] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = None
        self.reading: EnergyReading | None = None

    def _read(self) -> None:
        w = self.source()
        if w is None:
            raise NVMLUnavailable("the power source returned None (no reading on this GPU)")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"the power source returned {w} W")
        self._samples.append(w)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._read()
            except BaseException as e:  # noqa: BLE001 - reported by stop()
                self._error = e
                return

    def start(self) -> "PowerMeter":
        if self._thread is not None:
            raise RuntimeError("this PowerMeter is already running")
        self._samples, self._error, self.reading = [], None, None
        self._stop.clear()
        self._read()
        self._t0 = self.clock()
        self._thread = threading.Thread(target=self._run, name="trapetum-power", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> EnergyReading:
        if self._thread is None:
            raise RuntimeError("PowerMeter.stop() without start()")
        seconds = self.clock() - self._t0
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        self._read()
        self.reading = EnergyReading(sum(self._samples) / len(self._samples), seconds, len(self._samples))
        return self.reading

    def __enter__(self) -> "PowerMeter":
        return self.start()

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.stop()
        else:  # keep the original exception; just end the thread
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        return False


def gco2_per_1k_tokens(j_per_token: float, grid_g_per_kwh: float) -> float:
    """A projection: the energy of 1000 tokens at a grid's carbon intensity. Not a measurement."""
    return j_per_token * 1000 / J_PER_KWH * grid_g_per_kwh


def projections(j_per_token: float | None) -> dict:
    """gCO2 per 1k tokens at each GRID_INTENSITY, keyed so a table cannot mistake them for measurements."""
    if j_per_token is None:
        return {f"gco2_per_1k_{k}_projection": None for k in GRID_INTENSITY}
    return {f"gco2_per_1k_{k}_projection": gco2_per_1k_tokens(j_per_token, g) for k, g in GRID_INTENSITY.items()}

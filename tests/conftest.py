"""Shared test setup.

The suite runs the numba.cuda kernels in numba's CUDA simulator (every CUDA thread a Python
thread), so it needs no GPU. The simulator is chosen when numba is first imported, so the
variable is set here, before anything imports numba or trapetum. ``setdefault`` lets a GPU
run opt out with ``NUMBA_ENABLE_CUDASIM=0``.
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    sys.path.insert(0, str(Path(__file__).parent))
    import sim_scheduler  # noqa: E402

    sim_scheduler.install()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def _env_without_simulator() -> dict:
    """This process's environment minus NUMBA_ENABLE_CUDASIM, for a child that must see the real (absent) GPU."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU even where the tests happen to run on a GPU machine
    return env


@pytest.fixture(scope="session")
def run_without_simulator():
    """``run(args)``: ``python <args>`` in a child with the simulator off and no GPU visible."""

    def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], env=_env_without_simulator(), cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    return run

"""The chapters under papermill, as a reader reruns them: render-only from data/, and a clear
error when asked to measure on a machine without a GPU."""
from __future__ import annotations

from pathlib import Path

import papermill as pm
import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ["gemv", "vq_gemv", "decode"]


@pytest.fixture
def no_gpu_env(monkeypatch):
    # The kernel inherits this environment: no simulator, no visible GPU, as on a reader's laptop.
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_renders_the_recorded_data_under_papermill(chapter, tmp_path, no_gpu_env):
    out = tmp_path / f"{chapter}.ipynb"
    nb = pm.execute_notebook(str(REPO / "notebooks" / f"{chapter}.ipynb"), str(out), kernel_name="python3",
                             cwd=str(tmp_path), progress_bar=False)  # default measure="auto": no GPU, so render
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, f"{chapter}: no figure was rendered"


def test_asking_the_gemv_chapter_to_measure_without_a_gpu_fails_clearly(tmp_path, no_gpu_env):
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(REPO / "notebooks" / "gemv.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                            parameters={"measure": True, "arch": "sm_86"}, cwd=str(tmp_path), progress_bar=False)
    assert e.value.ename == "NoGPUError" and "CUDA GPU" in e.value.evalue


@pytest.mark.parametrize("chapter", sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb")))
def test_each_notebook_matches_its_jupytext_pair(chapter):
    # notebooks/<chapter>.py is the reviewable text of <chapter>.ipynb (jupytext, py:percent); an edit
    # to one side only leaves a reader of the other with a different chapter. Fix: jupytext --sync.
    import jupytext

    def body(text):  # the header's jupytext_version is the writer's, not the chapter's
        return [line for line in text.splitlines() if "jupytext_version:" not in line]

    nb = jupytext.read(REPO / "notebooks" / f"{chapter}.ipynb")
    pair = REPO / "notebooks" / f"{chapter}.py"
    assert pair.exists(), f"notebooks/{chapter}.py is missing: jupytext --set-formats ipynb,py:percent notebooks/{chapter}.ipynb"
    assert body(jupytext.writes(nb, fmt="py:percent")) == body(pair.read_text()), (
        f"notebooks/{chapter}.ipynb and notebooks/{chapter}.py differ: edit one, then jupytext --sync both")

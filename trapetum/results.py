"""Results files: the contract every measuring notebook of the book follows.

One JSON file per measuring run, ``data/<gpu-slug>/<name>.json``, holding

* ``provenance``: GPU, driver, CUDA, torch, numba, numba-cuda, git commit, date, command;
* ``records``: a flat list of dicts, one per measurement, so ``pandas.DataFrame(records)``
  reads it directly.

A new run never silently overwrites an older one: the older file is moved aside to
``<name>.<its date>.json`` and the move is reported.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pandas as pd

from .tuning import cache_path

PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent
DATA_DIR = REPO_ROOT / "data"

FORMAT_VERSION = 1


class ResultsFileError(ValueError):
    """A results file is missing its provenance or records, or is not JSON."""


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not s:
        raise ValueError(f"cannot make a folder name from {name!r}")
    return s


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str, cwd: Path | str = REPO_ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


SOURCE_DIRS = ("trapetum", "kernels")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


def _blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (sha1 of "blob <size>\\0" + bytes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# Modules that read recorded results, write their provenance or parse the command line that starts a run,
# and nothing a kernel, its launch or its timing runs: a change to them leaves every tuned plan as it was
# (plan_source_id).
PLAN_NEUTRAL = ("trapetum/report.py", "trapetum/results.py", "trapetum/cli.py", "trapetum/__main__.py")


def _source_id_of(entries, skip=()) -> str:
    lines = sorted(f"{path} {blob}" for path, blob in entries
                   if path.split("/", 1)[0] in SOURCE_DIRS and path.endswith(SOURCE_SUFFIXES) and path not in skip)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _source_entries(root: Path) -> list[tuple[str, str]]:
    return [(f.relative_to(root).as_posix(), _blob_id(f.read_bytes()))
            for d in SOURCE_DIRS if (root / d).is_dir() for f in (root / d).rglob("*") if f.is_file()]


def source_id(root: Path | str = REPO_ROOT) -> str:
    """A fingerprint of the code that measures: the package's and kernels/' sources as they are on disk
    (each file's git blob id, by path). The device machine's copy of the tree may carry a stale .git,
    so its HEAD can name another commit than the one whose files ran; this names the files themselves.
    :func:`commit_of` finds the commit with the same sources."""
    return _source_id_of(_source_entries(Path(root)))


def plan_source_id(root: Path | str = REPO_ROOT) -> str:
    """:func:`source_id` without :data:`PLAN_NEUTRAL`'s modules: the sources a tuned plan depends on
    (:mod:`trapetum.tuning`). Editing a chapter's table or figure then keeps a GPU's plan cache, which
    took minutes to tune; a kernel change still discards it."""
    return _source_id_of(_source_entries(Path(root)), skip=PLAN_NEUTRAL)


def commit_of(sid: str, repo: Path | str = REPO_ROOT, max_count: int = 500) -> str | None:
    """The newest of the repository's last ``max_count`` commits whose sources have :func:`source_id`
    ``sid`` (None: the run's code was never committed as it ran, or is older). RuntimeError where
    ``repo`` is not a git repository."""
    commits = _git("rev-list", f"--max-count={max_count}", "HEAD", cwd=repo)
    if commits is None:
        raise RuntimeError(f"git cannot list the commits of {repo}")
    for commit in commits.split():
        tree = _git("ls-tree", "-r", "--full-tree", commit, "--", *SOURCE_DIRS, cwd=repo) or ""
        entries = [(line.split("\t", 1)[1], line.split()[2]) for line in tree.splitlines() if "\t" in line]
        if _source_id_of(entries) == sid:
            return commit
    return None


def gpu_info() -> dict:
    """Name, driver, CUDA runtime and SM count of the current GPU (None fields without one)."""
    info = {"gpu": None, "driver": None, "cuda": None, "sm_count": None, "l2_bytes": None}
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return info
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = p.name
        info["sm_count"] = p.multi_processor_count
        info["l2_bytes"] = getattr(p, "L2_cache_size", None)
        info["compute_capability"] = f"{p.major}.{p.minor}"
        try:
            import pynvml

            pynvml.nvmlInit()
            drv = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:  # noqa: BLE001 - NVML is optional provenance, never fatal
            pass
    return info


def invocation(argv: list[str] | None = None) -> str:
    """This process's command line (``sys.argv``) as one would type it again. ``python -m
    trapetum.decode ...`` puts the module's file path in argv[0]; that comes back as the -m form."""
    argv = [str(a) for a in (sys.argv if argv is None else argv)]
    if argv and argv[0].endswith(".py"):
        try:
            rel = Path(argv[0]).resolve().relative_to(PACKAGE_ROOT)
        except ValueError:  # a script outside the package: as given
            rel = None
        if rel is not None:
            module = ".".join((PACKAGE_ROOT.name,) + rel.with_suffix("").parts)
            argv = ["python", "-m", module.removesuffix(".__main__")] + argv[1:]
    return shlex.join(argv)


def provenance(command: str | None = None, **extra) -> dict:
    """Everything a reader needs to trace a number back to the run that produced it."""
    # The device machine gets a copy of the tree whose .git (if any) may be stale: a commit the
    # caller passes in wins over what git says there.
    commit = os.environ.get("TRAPETUM_GIT_COMMIT") or _git("rev-parse", "HEAD")
    dirty = None if os.environ.get("TRAPETUM_GIT_COMMIT") else _git("status", "--porcelain", "--untracked-files=no")
    prov = {
        **gpu_info(),
        "torch": _version("torch"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "numpy": _version("numpy"),
        "trapetum": _version("trapetum"),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "source_id": source_id(),  # the sources that ran, whatever the checkout's .git says (commit_of)
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else invocation(),
        "format_version": FORMAT_VERSION,
        # plans may come from an earlier process's tuning (trapetum.tuning); "off": tuned in this one
        "plan_cache": str(plan_cache) if (plan_cache := cache_path()) is not None else "off",
    }
    prov.update(extra)
    return prov


def _clean(v):
    # JSON has no NaN/Inf: store them as null so every reader parses the file.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        return _clean(v.item())
    return v


def save(name: str, records: list[dict], prov: dict, folder: Path | str | None = None) -> Path:
    """Write ``<folder>/<gpu-slug>/<name>.json``; an older file is moved aside, not overwritten."""
    if not records:
        raise ValueError("refusing to write a results file with no records")
    if not isinstance(prov, dict) or "date" not in prov or "command" not in prov:
        raise ValueError("provenance must come from trapetum.results.provenance()")
    gpu = prov.get("gpu") or "cpu"
    out_dir = Path(folder if folder is not None else DATA_DIR) / slug(gpu)
    # Serialize before touching any file: a record that is not JSON must leave the old run in place.
    text = json.dumps(
        {"provenance": {k: _clean(v) for k, v in prov.items()},
         "records": [{k: _clean(v) for k, v in r.items()} for r in records]},
        indent=1, allow_nan=False) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    if path.exists():
        try:
            old_date = json.loads(path.read_text())["provenance"]["date"]
        except Exception:  # noqa: BLE001 - a broken old file still must not be lost
            old_date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        stamp = re.sub(r"[^0-9T]", "", old_date)[:15]
        aside = out_dir / f"{name}.{stamp}.json"
        n = 1
        while aside.exists():
            aside = out_dir / f"{name}.{stamp}-{n}.json"
            n += 1
        path.rename(aside)
        print(f"results: kept the previous run as {aside}")
    path.write_text(text)
    return path


def adopt(path: Path | str, folder: Path | str | None = None) -> Path:
    """Bring a results file written on another machine (``<out>/<gpu>/<name>.json``) into ``folder``
    (default data/) under the same name, keeping the run it replaces aside as :func:`save` does."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        prov, records = data["provenance"], data["records"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a Trapetum results file: {e}") from None
    return save(path.name.split(".")[0], records, prov, folder=folder)


def write_partial(name: str, gpu: str, prov: dict, copy: dict, records: list[dict], folder: Path | str | None = None) -> Path:
    """Start ``<folder>/<gpu>/<name>.partial.jsonl`` (the format :func:`read_partial` reads): the
    provenance, the copy bandwidth where there is one, then ``records``; a run appends its later
    records a line each."""
    path = Path(folder if folder is not None else DATA_DIR) / slug(gpu) / f"{name}.partial.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"provenance": prov}] + ([{"copy": copy}] if copy else []) + list(records)
    path.write_text("".join(_partial_line(d) for d in lines))
    return path


def append_partial(path: Path | str, record: dict) -> None:
    """Add one record to a partial results file started by :func:`write_partial`."""
    with Path(path).open("a") as f:
        f.write(_partial_line(record))


def _partial_line(d: dict) -> str:
    return json.dumps(d, default=str) + "\n"


def read_partial(path: Path | str) -> tuple[dict, dict, list[dict]]:
    """A run's ``<name>.partial.jsonl`` (its provenance, the copy bandwidth, then one record a line)
    as (provenance, copy bandwidth or {}, records)."""
    path = Path(path)
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a partial results file: {e}") from None
    if not lines or not isinstance(lines[0], dict) or "provenance" not in lines[0]:
        raise ValueError(f"{path} does not start with a provenance line")
    records, copy = [], {}
    for d in lines[1:]:
        if "copy" in d and len(d) == 1:
            copy = d["copy"]
        else:
            records.append(d)
    return dict(lines[0]["provenance"]), copy, records


def adopt_partial(path: Path | str, folder: Path | str | None = None) -> Path:
    """A run stopped part way (``<name>.partial.jsonl``) saved as ``<name>.json``, its provenance
    saying it is partial and how many records it holds."""
    path = Path(path)
    prov, copy, records = read_partial(path)
    for r in records:
        r.update(copy)
    prov.update(copy, partial=f"stopped before the end: {len(records)} records kept, written as they were measured")
    return save(path.name.split(".")[0], records, prov, folder=folder)


def read(path: Path | str) -> tuple[dict, pd.DataFrame]:
    """Read one results file; raise ResultsFileError if it does not follow the contract."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFileError(f"{path}: not a readable JSON results file ({e})") from e
    if not isinstance(d, dict) or not isinstance(d.get("records"), list) or not isinstance(d.get("provenance"), dict):
        raise ResultsFileError(f"{path}: a results file needs a 'provenance' dict and a 'records' list")
    return d["provenance"], pd.DataFrame(d["records"])


def load(name: str, folder: Path | str | None = None, every_run: bool = False) -> pd.DataFrame:
    """All GPUs' latest ``<name>.json`` as one DataFrame, with gpu/driver/date/commit/command
    columns and the file each record came from; ``every_run`` also reads the runs kept aside
    (``<name>.<date>.json``)."""
    root = Path(folder if folder is not None else DATA_DIR)
    frames = []
    paths = root.glob(f"*/{name}.json") if not every_run else (
        p for p in root.glob(f"*/{name}*.json") if p.name == f"{name}.json" or p.name.startswith(f"{name}."))
    for path in sorted(paths):
        prov, df = read(path)
        if df.empty:
            continue
        for key in ("gpu", "driver", "cuda", "torch", "numba_cuda", "git_commit", "source_id", "date", "command"):
            df[key] = prov.get(key)
        df["gpu_slug"] = path.parent.name
        df["file"] = f"{path.parent.name}/{path.name}"
        frames.append(df)
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)

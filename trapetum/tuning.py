"""Tuned launch plans, kept across processes.

Each GEMV family (:class:`trapetum.gemv.LutGemv`, :class:`trapetum.additive.AdditiveGemv`,
:class:`trapetum.residual.ResidualGemv`) times its candidate plans the first time a process meets a
GPU model and shape, and every candidate compiles its own kernel: a 70B model's first decode spends
minutes tuning. A :class:`PlanCache` keeps the winners in memory and in one JSON file, so the next
process compiles only the plans it launches.

Where the file lives: ``$TRAPETUM_PLAN_CACHE`` if set (``off`` keeps plans in memory only), else
``plans.json`` under ``$XDG_CACHE_HOME/trapetum`` (``~/.cache/trapetum``). The file names the
package sources that tuned it (:func:`trapetum.results.plan_source_id`: every source but the modules
that only read and record results): plans tuned by other code are ignored, never trusted, since a
kernel change can move the fastest plan or the shared memory a plan needs. A file that cannot be read is ignored with a warning (and replaced at the next write); one
that cannot be written leaves the plans in memory. Results files record the cache in use
(:func:`trapetum.results.provenance`), since their plans may then come from an earlier process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path

ENV = "TRAPETUM_PLAN_CACHE"
FORMAT_VERSION = 2  # 2: "plan_source_id" (1 named the whole tree, so a chapter's edit discarded the plans)
_OFF = ("off", "0", "none", "false")
_WARNED: set = set()  # files this process could not write (warned once each)


def cache_path() -> Path | None:
    """The plan file this process reads and writes, or None where ``TRAPETUM_PLAN_CACHE=off``."""
    v = os.environ.get(ENV, "").strip()
    if v.lower() in _OFF:
        return None
    if v:
        return Path(v).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no home directory (some containers): plans stay in memory
            return None
    return Path(base) / "trapetum" / "plans.json"


def _source_id() -> str:
    from .results import plan_source_id

    return plan_source_id()


def _load(path: Path) -> dict:
    """The plan file as its JSON object; ValueError where it cannot be read or is not a plan cache."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(str(e)) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("plans", {}), dict):
        raise ValueError("not a plan cache (expected an object with 'plans')")
    return doc


def _tuned_by(doc: dict, sid: str) -> bool:
    """Whether the sources ``sid`` (and this file format) wrote ``doc``: only then are its plans used."""
    return doc.get("format_version") == FORMAT_VERSION and doc.get("plan_source_id") == sid


def _read(path: Path, sid: str) -> dict:
    """The file's plans by family ({} where it is absent, unreadable or from other sources)."""
    if not path.is_file():
        return {}
    try:
        doc = _load(path)
    except ValueError as e:
        warnings.warn(f"ignoring the plan cache {path}: {e}; plans will be tuned again", stacklevel=3)
        return {}
    return doc["plans"] if _tuned_by(doc, sid) else {}


class PlanCache:
    """Tuned plans of one GEMV family (a dict from the tuner's key tuple to a plan dataclass of
    ``types``), backed by :func:`cache_path`'s file. Keys are tuples of str / int / tuples (the GPU
    model's name first), stored as their repr."""

    def __init__(self, family: str, *types: type):
        if not types or not all(dataclasses.is_dataclass(t) for t in types):
            raise TypeError("a PlanCache stores dataclass plans: name their types")
        self.family = family
        self.types = {t.__name__: t for t in types}
        self._mem: dict = {}
        self._disk: dict | None = None  # this family's entries of the file, read on first use
        self._disk_path: Path | None = None
        self._sid: str | None = None
        self.loaded = 0  # plans this process took from the file

    def _entries(self, path: Path) -> dict:
        if self._disk is None or self._disk_path != path:
            self._sid = self._sid or _source_id()
            self._disk = _read(path, self._sid).get(self.family, {})
            self._disk_path = path
        return self._disk

    def _decode(self, entry):
        try:
            cls = self.types[entry["type"]]
            return cls(**entry["fields"])
        except (KeyError, TypeError):
            return None  # a plan type or field this code does not know: tune again

    def get(self, key: tuple):
        """The plan tuned for ``key`` (in this process, or in the file), or None."""
        if key in self._mem:
            return self._mem[key]
        path = cache_path()
        if path is None:
            return None
        entry = self._entries(path).get(repr(key))
        plan = self._decode(entry) if isinstance(entry, dict) else None
        if plan is not None:
            self._mem[key] = plan
            self.loaded += 1
        return plan

    def __contains__(self, key: tuple) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: tuple):
        plan = self.get(key)
        if plan is None:
            raise KeyError(key)
        return plan

    def __setitem__(self, key: tuple, plan) -> None:
        if type(plan).__name__ not in self.types:
            raise TypeError(f"{self.family} plans are {sorted(self.types)}, got {type(plan).__name__}")
        self._mem[key] = plan
        path = cache_path()
        if path is not None:
            self._write(path, repr(key), {"type": type(plan).__name__, "fields": dataclasses.asdict(plan)})

    def clear(self) -> None:
        """Forget the plans of this process (the file stays)."""
        self._mem.clear()
        self._disk = None

    def _write(self, path: Path, k: str, entry: dict) -> None:
        # Re-read first, so plans that other processes wrote meanwhile stay; the write is a rename, so
        # a reader never sees half a file.
        self._sid = self._sid or _source_id()
        plans = _read(path, self._sid)
        plans.setdefault(self.family, {})[k] = entry
        self._disk, self._disk_path = plans[self.family], path
        doc = {"format_version": FORMAT_VERSION, "plan_source_id": self._sid, "plans": plans}
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".plans-", suffix=".json", delete=False) as f:
                tmp = f.name
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if path not in _WARNED:
                _WARNED.add(path)
                warnings.warn(f"cannot write the plan cache {path}: {e}; plans stay in this process only "
                              f"(set {ENV}=off to stop trying)", stacklevel=3)


def cached_plans() -> tuple[Path | None, bool, list[dict]]:
    """What the plan file holds: (its path or None where off, whether it was tuned by these sources,
    one row per plan: family, key, type, fields)."""
    path = cache_path()
    if path is None or not path.is_file():
        return path, False, []
    try:
        doc = _load(path)
        rows = [{"family": fam, "key": k, "type": e["type"], "fields": e["fields"]} for fam, entries in doc.get("plans", {}).items()
                for k, e in entries.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"the plan cache {path} cannot be read ({e}); `trapetum plans --clear` removes it") from e
    return path, _tuned_by(doc, _source_id()), rows


def clear_file() -> Path | None:
    """Remove the plan file (the next tuning starts over); its path, or None if there was none."""
    path = cache_path()
    if path is None or not path.exists():
        return None
    path.unlink()
    return path

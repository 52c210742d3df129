"""The two dependency lists agree, and the pins the project relies on are in place."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ENV = yaml.safe_load((REPO / "environment.yml").read_text())


def norm(req: str) -> str:
    """A requirement string in one canonical spelling: normalized name, sorted extras and specifiers."""
    r = Requirement(req)
    extras = f"[{','.join(sorted(canonicalize_name(e) for e in r.extras))}]" if r.extras else ""
    spec = ",".join(sorted(str(s) for s in r.specifier))
    marker = f"; {r.marker}" if r.marker else ""
    url = f" @ {r.url}" if r.url else ""
    return f"{canonicalize_name(r.name)}{extras}{spec}{url}{marker}"


def pip_section() -> list[str]:
    pips = [d["pip"] for d in ENV["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1, "environment.yml needs exactly one pip: section"
    return [p for p in pips[0] if p.strip() not in ("-e .", "-e.")]


def pyproject_requirements() -> list[str]:
    project = PYPROJECT["project"]
    extras = project.get("optional-dependencies", {})
    return project["dependencies"] + [r for group in extras.values() for r in group]


def by_name(reqs) -> dict[str, Requirement]:
    return {canonicalize_name(Requirement(r).name): Requirement(r) for r in reqs}


def test_environment_installs_the_package_itself():
    pips = next(d["pip"] for d in ENV["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert "-e ." in [p.strip() for p in pips]
    assert "pip" in ENV["dependencies"]


def test_environment_pip_section_equals_pyproject():
    env, proj = pip_section(), pyproject_requirements()
    env_set, proj_set = {norm(r) for r in env}, {norm(r) for r in proj}
    assert env_set == proj_set, (
        f"only in environment.yml: {sorted(env_set - proj_set)}; only in pyproject.toml: {sorted(proj_set - env_set)}"
    )


@pytest.mark.parametrize("source", ["environment.yml", "pyproject.toml"])
def test_no_package_listed_twice(source):
    reqs = pip_section() if source == "environment.yml" else pyproject_requirements()
    names = [canonicalize_name(Requirement(r).name) for r in reqs]
    assert len(names) == len(set(names)), f"duplicates: {sorted({n for n in names if names.count(n) > 1})}"


def test_norm_tells_different_pins_apart():
    assert norm("Numba_CUDA == 0.30.4") == norm("numba-cuda==0.30.4")
    assert norm("numpy<2.5,>=1.26") == norm("numpy>=1.26,<2.5")
    assert norm("numpy>=1.26,<2.5") != norm("numpy>=1.26")


REQS = by_name(pyproject_requirements())


def test_jupyter_book_is_pinned_below_2():
    spec = REQS["jupyter-book"].specifier
    assert not spec.contains("2.0.0", prereleases=True) and not spec.contains("2.0.0a1", prereleases=True)
    assert spec.contains("1.0.4")


def test_numpy_is_capped_below_2_5():
    # numba-cuda 0.30.4 calls np.row_stack, which numpy 2.5 removed.
    spec = REQS["numpy"].specifier
    assert not spec.contains("2.5.0", prereleases=True) and not spec.contains("2.5.0rc1", prereleases=True)
    assert spec.contains("2.4.6")


@pytest.mark.parametrize("name", ["numba-cuda", "numba"])
def test_numba_is_pinned_exactly(name):
    specs = list(REQS[name].specifier)
    assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, str(REQS[name])


@pytest.mark.parametrize("name", ["numpy", "numba", "numba-cuda", "jupyter-book", "torch"])
def test_installed_versions_satisfy_the_pins(name):
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed in this environment")
    assert REQS[name].specifier.contains(Version(have).public, prereleases=True), f"{name} {have} does not satisfy {REQS[name]}"


# -- CI ---------------------------------------------------------------------------------------
CI_RUN = REPO / ".ci" / "run"
MAKEFILE = REPO / "Makefile"
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))
TORCH_PIN = "torch==2.13.0"


def ci_run_scripts() -> list[Path]:
    """.ci/run and, when it calls make, the Makefile that does its installing."""
    if not CI_RUN.is_file():
        return []
    text = CI_RUN.read_text()
    return [CI_RUN] + ([MAKEFILE] if re.search(r"^\s*make\b", text, re.M) and MAKEFILE.is_file() else [])


CI_FILES = [p for p in dict.fromkeys([*ci_run_scripts(), MAKEFILE, *WORKFLOWS]) if p.is_file()]


def install_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(r"\bpip3?\b.*\binstall\b", line)]


def torch_installs(text: str) -> list[str]:
    """The torch requirements the `pip install` lines of a script name (quotes stripped)."""
    found = []
    for line in install_lines(text):
        for tok in line.replace('"', " ").replace("'", " ").split():
            if re.fullmatch(r"torch(\[[^\]]*\])?([=<>!~].*)?", tok):
                found.append(tok)
    return found


def extras_installed(text: str) -> set[str]:
    """The extras of the package itself that `pip install -e ".[a,b]"` lines ask for."""
    out = set()
    for line in install_lines(text):
        for group in re.findall(r"\.\[([^\]]+)\]", line):
            out |= {canonicalize_name(e.strip()) for e in group.split(",")}
    return out


def test_ci_script_parsers():
    assert torch_installs("pip install torch==2.13.0 --index-url x\npip install -e '.[book]'") == ["torch==2.13.0"]
    assert torch_installs("python -m pip install 'torch>=2.4' torchvision") == ["torch>=2.4"]
    assert torch_installs("echo torch==1.0") == []
    assert extras_installed('$(BIN)/pip install -q -e ".[book,test, accuracy]"') == {"book", "test", "accuracy"}


def test_ci_installs_torch_exactly_pinned():
    assert CI_FILES, "no CI script found (.ci/run, Makefile or .github/workflows/*.yml)"
    installs = {p.relative_to(REPO).as_posix(): torch_installs(p.read_text()) for p in CI_FILES}
    assert any(installs.values()), f"no CI script installs torch: {installs}"
    for path, toks in installs.items():
        assert all(t == TORCH_PIN for t in toks), f"{path} installs {toks}, want exactly {TORCH_PIN}"
    if CI_RUN.is_file():
        via_run = [t for p in ci_run_scripts() for t in torch_installs(p.read_text())]
        assert TORCH_PIN in via_run, f".ci/run (or the Makefile it runs) must install {TORCH_PIN}"


@pytest.mark.parametrize("script", [p.relative_to(REPO).as_posix() for p in CI_FILES] or ["(none)"])
def test_ci_installs_only_extras_pyproject_defines(script):
    if script == "(none)":
        pytest.skip("no CI script in this checkout")
    defined = {canonicalize_name(e) for e in PYPROJECT["project"].get("optional-dependencies", {})}
    asked = extras_installed((REPO / script).read_text())
    # pip only warns about an unknown extra and installs without it
    assert asked <= defined, f"{script} installs extras {sorted(asked - defined)} that pyproject.toml does not define"

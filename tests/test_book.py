"""Build the Jupyter Book and check every page of the table of contents in a real browser.

    python -m pytest tests/test_book.py -m book

The ``built_book`` fixture runs ``jupyter-book build book -W --keep-going`` from a clean
``book/_build`` (warnings are errors, so a failing notebook cell fails the build). With
``TRAPETUM_BOOK_BUILT=1`` it reuses an existing ``book/_build/html`` instead, so CI can build
once and test the result.

Each toc page is then opened in headless Chromium (Playwright's sync API driving the system
Chromium; ``TRAPETUM_CHROMIUM`` overrides its path): it must load with an <h1>, every <img>
must have decoded (naturalWidth > 0) from a non-empty local file, no output cell may hold a
traceback, math must have been typeset by the offline MathJax, and the page may not reach for
the network. A full-page screenshot lands in ``book/_build/screenshots/<page>.png``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml

pytestmark = pytest.mark.book

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
BUILD = BOOK / "_build"
HTML = BUILD / "html"
SHOTS = BUILD / "screenshots"
BUILD_TIMEOUT_S = int(os.environ.get("TRAPETUM_BOOK_TIMEOUT", "3600"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Known upstream bug (jupyter-book 1.x + sphinx-thebe 0.3): the thebe config <script> is emitted
# twice per page, and the second `const` declaration throws. Thebe is off; nothing else breaks.
BENIGN_JS_ERRORS = ("Identifier 'THEBE_JS_URL' has already been declared",)
ERROR_LINE = re.compile(r"(?m)^\s*(Traceback \(most recent call last\)|[A-Za-z_][\w.]*(Error|Exception): )")


def toc_pages() -> list[str]:
    """Every document of _toc.yml (root first), as paths relative to book/ without suffix."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    pages = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                pages.append(node["file"])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key) or []:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk({k: v for k, v in toc.items() if k != "root"})
    return [re.sub(r"\.(ipynb|md|rst)$", "", p) for p in pages]


PAGES = toc_pages()


def jupyter_book_cmd() -> list[str]:
    """The jupyter-book of the interpreter running the tests (its console script sits beside it)."""
    here = Path(sys.executable).parent
    for name in ("jupyter-book", "jupyter-book.exe"):
        if (here / name).exists():
            return [str(here / name)]
    # No console script (unusual installs): call the click entry point in this interpreter.
    return [sys.executable, "-c", "import sys; from jupyter_book.cli.main import main; sys.exit(main())"]


def find_chromium() -> str | None:
    env = os.environ.get("TRAPETUM_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def built_book() -> Path:
    if os.environ.get("TRAPETUM_BOOK_BUILT") == "1":
        assert (HTML / "index.html").is_file(), (
            f"TRAPETUM_BOOK_BUILT=1 but {HTML}/index.html does not exist: build the book first "
            "(jupyter-book build book -W --keep-going) or unset TRAPETUM_BOOK_BUILT"
        )
        return HTML
    shutil.rmtree(BUILD, ignore_errors=True)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # notebooks use %matplotlib inline; an inherited Agg would drop figures
    cmd = [*jupyter_book_cmd(), "build", "book", "-W", "--keep-going"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    BUILD.mkdir(parents=True, exist_ok=True)
    log = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    (BUILD / "build.log").write_text(log)
    assert proc.returncode == 0, (
        f"`{' '.join(cmd)}` exited {proc.returncode} after {time.time() - t0:.0f} s; "
        f"full log in {BUILD / 'build.log'}; tail:\n{log[-6000:]}"
    )
    return HTML


def test_build_produces_every_toc_page(built_book):
    missing = [p for p in PAGES if not (built_book / f"{p}.html").is_file()]
    assert not missing, f"toc pages without built html: {missing}"
    assert (built_book / "index.html").is_file()
    # Math must be served locally (sphinx-mathjax-offline), not from a CDN.
    assert list((built_book / "_static").rglob("tex-chtml*.js")), "offline MathJax is not in _static"


@pytest.fixture(scope="module")
def browser(built_book):
    exe = find_chromium()
    if exe is None:
        pytest.skip("no Chromium found (looked at $TRAPETUM_CHROMIUM, /usr/bin/chromium and PATH): browser checks need one")
    from playwright.sync_api import sync_playwright  # a test dependency: fail loudly if missing

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


IMAGES_JS = """() => Array.from(document.images).map(i => ({
    src: i.currentSrc || i.src, w: i.naturalWidth, complete: i.complete, alt: i.alt}))"""

OUTPUTS_JS = """() => Array.from(document.querySelectorAll(
    '.cell_output, .output, div.traceback, .output.traceback, .output.error')).map(e => ({
    cls: e.className, text: e.innerText}))"""


@pytest.mark.parametrize("page", PAGES)
def test_page_renders(browser, built_book, page):
    path = built_book / f"{page}.html"
    assert path.is_file(), f"{path} was not built"
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    pg = ctx.new_page()
    external, page_errors = [], []

    def route(r):
        url = r.request.url
        if url.startswith(("file:", "data:", "blob:", "about:")):
            r.continue_()
        else:
            external.append(url)
            r.abort()

    pg.route("**/*", route)
    pg.on("pageerror", lambda e: None if str(e) in BENIGN_JS_ERRORS else page_errors.append(str(e)))
    try:
        pg.goto(path.as_uri(), wait_until="load", timeout=60_000)
        # Make lazy images load, then wait until every image has finished (or failed) loading.
        pg.evaluate("() => document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; })")
        pg.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)

        title = pg.title()
        assert "404" not in title and "not found" not in title.lower(), f"{page}: error page ({title!r})"
        h1 = [t.strip() for t in pg.locator("h1").all_inner_texts() if t.strip()]
        assert h1, f"{page}: no <h1> with text"

        imgs = pg.evaluate(IMAGES_JS)
        for img in imgs:
            assert img["w"] > 0, f"{page}: image did not decode: {img}"
            src = urlparse(img["src"])
            if src.scheme == "file":
                f = Path(unquote(src.path))
                assert f.is_file() and f.stat().st_size > 0, f"{page}: image file missing or empty: {f}"
            else:
                assert src.scheme == "data", f"{page}: image not served from the book: {img['src']}"

        for out in pg.evaluate(OUTPUTS_JS):
            assert "traceback" not in out["cls"].split() and "error" not in out["cls"].split(), (
                f"{page}: error output cell ({out['cls']}):\n{out['text'][:2000]}"
            )
            m = ERROR_LINE.search(out["text"] or "")
            assert m is None, f"{page}: output cell shows an error ({m.group(0).strip()!r}):\n{out['text'][:2000]}"

        # Math (if any) must have been typeset by MathJax, which only the local copy can do offline.
        if pg.locator(".math").count():
            pg.wait_for_selector("mjx-container", state="attached", timeout=30_000)

        shot = SHOTS / f"{page}.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(shot), full_page=True)
        assert shot.is_file() and shot.stat().st_size > 0, f"{page}: empty screenshot {shot}"

        assert not external, f"{page}: the page requested the network (must render offline): {external}"
        assert not page_errors, f"{page}: JavaScript errors: {page_errors}"
    finally:
        ctx.close()

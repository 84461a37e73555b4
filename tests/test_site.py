"""The documentation site (issue 33): ``make docs``'s Sphinx build, run as part of the suite
so that a broken reference fails CI, and the built site opened in a real browser.

* The build (``sphinx -b html -n -W --keep-going``, as ``make docs-html``) succeeds, from
  scratch into a folder of its own, and gives every public name its own page, the CLI
  reference the parsers' own ``--help``. (How long it takes is a benchmark, not a test:
  benchmarks/README.md, "The documentation site".)
* The checks that make a broken reference fail it are on: a tiny project built with the
  site's own ``conf.py`` fails on a link to a missing page, to a missing heading and on a
  docstring-style reference to a name with no page (the bug each guards, planted).
* Headless Chromium (Debian's ``chromium``, driven by playwright's Python API; no browser
  is downloaded) loads the landing page and ``bnswap.convert``'s page, checks their
  headings, searches ``convert`` with the search box, and saves screenshots under
  ``build/docs/``. Skipped, with the reason, where no Chromium is installed.

The doctests of the docstrings run in ``tests/test_docs.py``, not here: once.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import importlib.util
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest
import torch

import bnswap

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUT = ROOT / "build" / "docs"
CHROMIUM = "/usr/bin/chromium"
#: A guard against a hung build (its ``--help`` subprocesses), not a time goal: the build
#: takes about 30 s on 2 quiet cores and several minutes on a loaded CI machine.
BUILD_TIMEOUT_S = 900

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None
    or importlib.util.find_spec("myst_parser") is None
    or importlib.util.find_spec("furo") is None,
    reason="the docs extra (Sphinx, furo, myst-parser) is not installed here: the main .venv "
    "has it (make setup installs '.[docs]')",
)


def _sphinx(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m sphinx`` as ``make docs-html`` runs it, in its own session, killed whole
    (the CLI directive's ``--help`` processes too) past its timeout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-b",
        "html",
        "-n",
        "-W",
        "--keep-going",
        "-q",
        *extra,
        str(src),
        str(out),
    ]
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    ) as p:
        try:
            stdout, stderr = p.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            pytest.fail(f"the docs build ran past {BUILD_TIMEOUT_S} s")
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once per run from scratch: into a fresh folder of this run's (no
    doctree or environment pickle of an earlier build, or of another run building at the
    same time, is read back; ``-E`` says so to Sphinx too), so the result depends on the
    sources alone."""
    html_dir = tmp_path_factory.mktemp("site") / "html"
    r = _sphinx(DOCS, html_dir, "-E")
    assert r.returncode == 0, f"the docs build failed:\n{r.stderr[-6000:]}"
    return html_dir


def _api_names() -> list[str]:
    """The names docs/api.md's autosummary tables list, fully qualified."""
    names, module = [], None
    for line in (DOCS / "api.md").read_text().splitlines():
        m = re.match(r"\.\. (?:current)?module:: (\S+)", line)
        if m:
            module = m.group(1)
        elif re.match(r"   [A-Za-z_][\w.]*$", line) and module:
            names.append(f"{module}.{line.strip()}")
    return names


def test_every_public_name_is_in_the_api_reference():
    listed = set(_api_names())
    assert {f"bnswap.{n}" for n in bnswap.__all__ if n != "BNSwap"} <= listed, sorted(
        {f"bnswap.{n}" for n in bnswap.__all__} - listed
    )
    assert "bnswap.lightning.BNSwap" in listed  # bnswap.BNSwap is bnswap.lightning's
    for name in (
        "bnswap.programs.convert",
        "bnswap.programs.plan",
        "bnswap.sync.to_sync_batch_norm",
        "bnswap.sync.sync_batch_norm_forward",
        "bnswap.ort.wrap",
    ):
        assert name in listed


def test_every_guide_is_in_the_toctree():
    """Each Markdown page of docs/ is reachable from the landing page (one line each)."""
    index = (DOCS / "index.md").read_text()
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    entries = set(re.findall(r"^([\w-]+)$", index, flags=re.M))
    assert pages <= entries, sorted(pages - entries)


def test_site_builds_with_a_page_per_public_name(site):
    pages = {"bnswap.Plan": "bnswap.Plan-class"}  # conf.py's autosummary_filename_map
    for name in _api_names():
        page = site / "generated" / f"{pages.get(name, name)}.html"
        assert page.is_file(), f"no page for {name}"
    convert = (site / "generated" / "bnswap.convert.html").read_text()
    assert "Examples" in convert and "sync_batchnorm" in convert
    # bnswap.BatchNorm1d/2d/3d: stock's signature, and no "Bases: object" (they build
    # torch's own class's instances)
    for n in ("1d", "2d", "3d"):
        layer = (site / "generated" / f"bnswap.BatchNorm{n}.html").read_text()
        sig = html.unescape(
            re.sub(
                r"<[^>]+>", "", re.search(r'<dt class="sig[^>]*>(.*?)</dt>', layer, re.S).group(1)
            )
        )
        assert "num_features, eps=1e-05, momentum=0.1" in sig and "*args" not in sig, sig
        assert "Bases:" not in layer
        assert (
            inspect.signature(getattr(bnswap, f"BatchNorm{n}")).parameters
            == inspect.signature(getattr(torch.nn, f"BatchNorm{n}")).parameters
        )
    cli = (site / "cli.html").read_text()
    for sub in ("plan", "convert", "train", "compare"):
        assert f"usage: bnswap {sub}" in cli or f"usage: bnswap [options] {sub}" in cli, sub
    # the README is the landing page; its links into docs/ point at the pages
    index = (site / "index.html").read_text()
    assert 'href="performance.html"' in index and 'href="api.html"' in index
    # the Install guide holds the install commands: torch first, pinned by a constraints
    # file, then bnswap from a checkout or its wheel; the landing page links there
    install = html.unescape(re.sub(r"<[^>]+>", "", (site / "install.html").read_text()))
    assert "whl/cpu" in install and "-c constraints.txt" in install and ".whl" in install
    assert 'href="install.html"' in index


def _cli_blocks(site: Path) -> list[str]:
    """The literal blocks of the CLI reference page, as text."""
    page = (site / "cli.html").read_text(encoding="utf-8")
    return [
        html.unescape(re.sub(r"<[^>]+>", "", b))
        for b in re.findall(r"<pre>(.*?)</pre>", page, re.S)
    ]


def test_cli_reference_shows_the_trainer_options_once(site):
    """``train``'s help in full; ``validate`` / ``test`` / ``predict`` (the same ~450 lines
    of Lightning's Trainer options) only their usage's first line and what differs."""
    blocks = _cli_blocks(site)
    full = [b for b in blocks if "--trainer.gradient_clip_algorithm GRADIENT" in b]
    assert len(full) == 1 and full[0].startswith("usage: bnswap [options] train"), len(full)
    for sub, own in (
        ("validate", "--verbose"),
        ("test", "--verbose"),
        ("predict", "--return_predictions"),
    ):
        (block,) = [b for b in blocks if b.startswith(f"usage: bnswap [options] {sub} ")]
        assert "every option of `bnswap train --help`" in block and own in block, block
        assert "--ckpt_path" in block and len(block.splitlines()) < 80, block
    assert sum(len(b.splitlines()) for b in blocks) < 900


def test_cli_reference_shows_no_rest_markup(site):
    """The CLI reference reads as plain text: no reST role (``:class:`...```, Lightning's
    ``:paramref:`~lightning...```) and no inline literal (````"auto"````), neither from the
    help bnswap writes (option-group titles from its Trainer's docstrings, ``compare``'s
    Args) nor from Lightning's own docstrings, which ``_ext/bnswap_cli.py`` turns into
    the text they stand for. The same pattern finds the markup in ``train``'s raw help."""
    roles = re.compile(r":\w+:`|``")
    text = "\n".join(_cli_blocks(site))
    assert "--trainer.max_time" in text
    assert roles.findall(text) == [], [
        text[m.start() - 40 : m.end() + 40] for m in roles.finditer(text)
    ]
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import bnswap_cli
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    raw = bnswap_cli._help("train")
    assert len(roles.findall(raw)) > 10 and roles.findall(bnswap_cli.plain_text(raw)) == []


class _Anchors(html.parser.HTMLParser):
    """The ids (and ``<a name>``) of one HTML page and its ``href``s."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.ids.update(v for k, v in attrs if k == "id" and v)
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if a.get("href"):
            self.hrefs.append(a["href"])


def broken_fragments(site: Path) -> list[str]:
    """Every internal ``href`` with a ``#fragment`` in the built HTML whose target page has
    no such id (``page.html: href``), as a browser would resolve it."""
    pages = {}
    for f in site.rglob("*.html"):
        parser = _Anchors()
        parser.feed(f.read_text(encoding="utf-8"))
        pages[f.resolve()] = parser
    broken = []
    for f, parser in pages.items():
        for href in parser.hrefs:
            url = urllib.parse.urlsplit(href)
            if url.scheme or url.netloc or not url.fragment:
                continue
            target = (f.parent / urllib.parse.unquote(url.path)).resolve() if url.path else f
            fragment = urllib.parse.unquote(url.fragment)
            if target not in pages or fragment not in pages[target].ids:
                broken.append(f"{f.relative_to(site.resolve())}: {href}")
    return broken


def test_every_internal_anchor_resolves(site, tmp_path):
    """An ``href="page.html#id"`` lands on an element of that page (sphinx -n checks the
    references it resolves, not the ids the pages end up with: a ``.. module::`` placed
    after other content of its section left ``api.html#module-bnswap.sync`` pointing at
    nothing). The check itself, on a planted page: a missing id is reported."""
    assert broken_fragments(site) == []
    (tmp_path / "a.html").write_text(
        '<p id="here"><a href="b.html#gone">x</a>'
        '<a href="#here">y</a><a href="https://x.org/#z">z</a></p>'
    )
    (tmp_path / "b.html").write_text('<a name="kept" href="a.html#here">k</a>')
    assert broken_fragments(tmp_path) == ["a.html: b.html#gone"]


PLANTED = {
    "a link to a missing page": ("[gone](missing.md)", "missing"),
    "a link to a missing heading": ("[gone](#no-such-heading)", "no-such-heading"),
    "a reference to a name with no page": (
        "{py:func}`bnswap.not_a_function`",
        "bnswap.not_a_function",
    ),
    # in a docstring, as autodoc renders it: a typo in a bnswap module's name, an attribute
    # of a name that conf.py's nitpick_ignore_regex lets through (Module), must fail too
    "a docstring's reference to a missing bnswap function": (
        "```{eval-rst}\n.. autofunction:: planted.bad_function\n```",
        "bnswap.functional.nonexistent",
    ),
    "a docstring's reference to a missing attribute": (
        "```{eval-rst}\n.. autofunction:: planted.bad_attribute\n```",
        "Module.bogus",
    ),
}

PLANTED_MODULE = '''
def fine():
    """See :func:`bnswap.documented` and :class:`torch.nn.Module`."""

def bad_function():
    """See :func:`bnswap.functional.nonexistent`."""

def bad_attribute():
    """See :class:`Module.bogus`."""
'''


@pytest.mark.parametrize("what", PLANTED)
def test_a_broken_reference_fails_the_build(what, tmp_path):
    """The site's own conf.py (nitpicky, myst's cross-reference checks) under -W: the
    planted link fails the build, naming it; the same page without it builds."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"exec(open({str(DOCS / 'conf.py')!r}).read())\n"
        f"HERE = __import__('pathlib').Path({str(DOCS)!r})\n"
        f"sys.path.insert(0, {str(src)!r})\n"
    )
    shutil.copytree(DOCS / "_ext", src / "_ext")
    shutil.copytree(DOCS / "_static", src / "_static")
    (src / "planted.py").write_text(PLANTED_MODULE)
    page = (
        "# Title\n\n## A heading\n\nSee [it](#a-heading), [the page](index.md) and "
        "{py:func}`bnswap.documented`.\n\n```{eval-rst}\n.. py:function:: bnswap.documented()\n"
        "\n.. autofunction:: planted.fine\n```\n\n"
    )
    (src / "index.md").write_text(page)
    assert _sphinx(src, tmp_path / "ok").returncode == 0
    text, needle = PLANTED[what]
    (src / "index.md").write_text(page + text + "\n")
    r = _sphinx(src, tmp_path / "broken")
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-3000:]


# --- the browser -----------------------------------------------------------------------

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def served(site):
    """The built site over http on localhost (a file:// page may not load the search
    index), in a thread of this process."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"no Chromium at {CHROMIUM}: apt-get install chromium "
    "(.ci/run installs it); no browser can be downloaded",
)
@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None,
    reason="playwright is not installed (the docs extra has it)",
)
@pytest.mark.timeout(120)
def test_the_site_in_headless_chromium(served):
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)  # the screenshots' folder
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{served}/index.html")
            assert page.locator("article h1").first.inner_text().strip() == "bnswap"
            assert page.title().startswith("bnswap")
            page.screenshot(path=str(OUT / "landing.png"))

            page.goto(f"{served}/generated/bnswap.convert.html")
            assert page.locator("article h1").first.inner_text().strip() == "bnswap.convert"
            assert page.locator("dt.sig").first.inner_text().startswith("bnswap.convert(")
            page.screenshot(path=str(OUT / "api-convert.png"))

            box = page.locator("input[name=q]").first  # the sidebar's search box
            box.fill("convert")
            box.press("Enter")
            page.wait_for_url(re.compile(r"search\.html\?q=convert"))
            results = page.locator("#search-results ul.search li a")
            results.first.wait_for(timeout=30_000)
            hrefs = [a.get_attribute("href") for a in results.all()]
            assert any("generated/bnswap.convert.html" in (h or "") for h in hrefs), hrefs
            page.screenshot(path=str(OUT / "search-convert.png"))
        finally:
            browser.close()
    for shot in ("landing.png", "api-convert.png", "search-convert.png"):
        assert (OUT / shot).stat().st_size > 10_000, shot


# what the page shows past furo's content column, and the tables whose box scrolls
_OVERFLOW_JS = """() => {
  const content = document.querySelector('div.content');
  const tables = [...document.querySelectorAll('article .table-wrapper')]
    .filter(w => w.scrollWidth > w.clientWidth)
    .map(w => `${w.scrollWidth - w.clientWidth} px: ${w.textContent.trim().slice(0, 50)}`);
  return {over: content.scrollWidth - content.clientWidth, tables};
}"""


@pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"no Chromium at {CHROMIUM}: apt-get install chromium "
    "(.ci/run installs it); no browser can be downloaded",
)
@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None,
    reason="playwright is not installed (the docs extra has it)",
)
@pytest.mark.timeout(300)
def test_every_page_fits_the_window_at_1280_px(served, site):
    """Each page of the site, guides and API pages, in Chromium at 1280 x 900: nothing
    reaches past furo's content column (``div.content``: the article and its margins, into
    which furo's headings reach by design), and no table scrolls inside its box (furo's
    ``.table-wrapper`` hides a wide table's last columns until scrolled, with no scroll bar
    shown: ``_static/bnswap.css`` and ``_ext/bnswap_wrap.py`` make tables wrap to the
    column). Code blocks may scroll: they are not checked."""
    from playwright.sync_api import sync_playwright

    pages = sorted(
        p.relative_to(site).as_posix()
        for p in [*site.glob("*.html"), *site.glob("generated/*.html")]
        if p.name not in ("search.html", "genindex.html")
    )
    assert "index.html" in pages and len(pages) > 40, pages
    bad = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for name in pages:
                page.goto(f"{served}/{name}")
                r = page.evaluate(_OVERFLOW_JS)
                if r["over"] > 0 or r["tables"]:
                    bad[name] = r
        finally:
            browser.close()
    assert bad == {}, bad


def test_links_read_as_words_not_file_names(site):
    """A link on the site names its target in words (``[Recipes](recipes.md)``), not by
    its file (``[recipes.md](recipes.md)``, ``[docs/qat.md](docs/qat.md)``), which means
    nothing to a reader of the site or of the installed wheel."""
    named = re.compile(r"^[\w./-]+\.(md|py|rst|html)$")
    found = []
    for f in sorted(site.glob("*.html")):
        for text in re.findall(r"<a [^>]*>(.*?)</a>", f.read_text(encoding="utf-8"), re.S):
            text = html.unescape(re.sub(r"<[^>]+>", "", text)).strip()
            if named.match(text):
                found.append(f"{f.name}: {text}")
    assert found == []


def test_api_pages_name_no_private_base_class(site):
    """The API pages list public bases only: ``bnswap.lightning.BNSwap`` shows Lightning's
    ``Callback``, not the private ``_BNSwapBase`` it shares with its ``pytorch_lightning``
    twin (``conf.py``'s ``autodoc-process-bases`` handler)."""
    callback = (site / "generated" / "bnswap.lightning.BNSwap.html").read_text()
    bases = re.search(r"<p>Bases: (.*?)</p>", callback, re.S)
    assert bases and "Callback" in bases.group(1), bases
    pages = [site / "api.html", *sorted((site / "generated").glob("*.html"))]
    assert [f.name for f in pages if "_BNSwapBase" in f.read_text()] == []

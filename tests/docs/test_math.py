"""The site typesets its formulas without a network: KaTeX is vendored in docs/assets/katex.

The site is built once per module from the real mkdocs.yml (INHERIT), without the CLI-reference hook
and mkdocstrings, which do not touch math and cost ~15 s; the math pipeline (pymdownx.arithmatex, the
theme, extra_javascript and extra_css) is the real one. A headless Chromium then opens the built
pages from disk (file://, so nothing could be fetched even if the machine were online):

* one math page of the site, to check that the theme loads KaTeX and every formula on it is typeset;
* one scratch page holding every formula of every page, typeset by the same docs/javascripts/katex.js,
  so that a formula KaTeX cannot parse (a MathJax-only macro, a typo) fails here instead of showing
  up as red TeX source on the site.

The browser tests skip only when no Chromium is installed; .ci/run installs it.
"""

import html
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATH_PAGE = "concepts/all-reduce/index.html"  # inline and displayed formulas
# What pymdownx.arithmatex (generic mode) writes: the TeX, HTML-escaped, with no markup inside.
ARITHMATEX = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("site")
    config = tmp / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {ROOT / 'docs'}\nplugins: []\nhooks: []\n")
    out = tmp / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(config), "-d", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium on PATH (looked for chromium, chromium-browser, google-chrome): "
                "`apt-get install -y chromium` to run the browser checks (.ci/run does)")


def _dom_after_scripts(browser: str, page: Path, profile: Path) -> str:
    """The page's DOM once its scripts have run. A private profile: parallel runs must not share one."""
    proc = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                           "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                           "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "</html>" in proc.stdout, f"{browser} failed on {page}:\n{proc.stderr[-3000:]}"
    return proc.stdout


class _Formulas(HTMLParser):
    """Each .arithmatex element of a DOM: the classes of its first child, the KaTeX errors inside it and
    the text a reader sees (KaTeX's MathML copy, which repeats the TeX source for screen readers, left out)."""

    VOID = {"br", "img", "input", "meta", "link", "hr", "wbr", "col", "area", "base", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.formulas: list[dict] = []
        self._stack: list[tuple[str, bool]] = []  # (tag, opens a formula)
        self._current = None
        self._hidden = 0  # inside its MathML

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if self._current is not None:
            if self._current["first_child"] is None:
                self._current["first_child"] = classes
            if "katex-error" in classes:
                self._current["errors"].append(dict(attrs).get("title", "katex-error"))
            if tag == "math" or self._hidden:
                self._hidden += tag not in self.VOID
        if tag in self.VOID:
            return
        opens = self._current is None and "arithmatex" in classes
        if opens:  # docs/javascripts/katex.js marks a formula KaTeX refused with KaTeX's error class
            errors = [dict(attrs).get("title", "katex-error")] if "katex-error" in classes else []
            self._current = {"tag": tag, "first_child": None, "errors": errors, "text": ""}
        self._stack.append((tag, opens))

    def handle_endtag(self, tag):
        if tag in self.VOID or not self._stack:
            return
        _, opens = self._stack.pop()
        if self._hidden:
            self._hidden -= 1
        if opens:
            self.formulas.append(self._current)
            self._current = None

    def handle_data(self, data):
        if self._current is not None and not self._hidden:
            self._current["text"] += data


def _formulas(dom: str) -> list[dict]:
    parser = _Formulas()
    parser.feed(dom)
    return parser.formulas


def _unrendered(formulas: list[dict]) -> list[str]:
    """Formulas that are not KaTeX output, or that KaTeX could not parse, or that still show TeX."""
    bad = []
    for f in formulas:
        typeset = bool({"katex", "katex-display"} & set(f["first_child"] or ()))
        raw = any(d in f["text"] for d in ("\\(", "\\)", "\\[", "\\]", "$$"))
        if not typeset or f["errors"] or raw:
            bad.append(f"{'; '.join(f['errors']) or 'not typeset'}: {f['text'].strip()[:120]!r}")
    return bad


def test_the_site_loads_nothing_from_the_network(site):
    """Every script, stylesheet and image a page loads is a file of the site (CDNs, Google Fonts: none)."""
    ref = re.compile(r'<(?:script|img)\b[^>]*\bsrc="([^"]+)"|<link\b[^>]*\brel="stylesheet"[^>]*\bhref="([^"]+)"')
    pages = list(site.rglob("*.html"))
    assert pages
    problems = set()
    for page in pages:
        for src, href in ref.findall(page.read_text()):
            url = html.unescape(src or href)
            if urlsplit(url).scheme or url.startswith("//"):
                problems.add(f"{page.relative_to(site)} loads {url}")
            # 404.html is served at any depth, so mkdocs writes its URLs from the site's root.
            elif not ((site if url.startswith("/") else page.parent) / urlsplit(url).path.lstrip("/")).is_file():
                problems.add(f"{page.relative_to(site)} loads {url}, which is not in the site")
    css = site / "assets" / "katex" / "katex.min.css"
    fonts = set(re.findall(r"url\((fonts/[^)]+\.woff2)\)", css.read_text()))
    assert fonts, "katex.min.css names no woff2 fonts"
    problems |= {f"{css.relative_to(site)} uses {font}, which is not in the site"
                 for font in fonts if not (css.parent / font).is_file()}
    assert not problems, "\n".join(sorted(problems))


def test_a_math_page_shows_typeset_formulas(site, browser, tmp_path):
    page = site / MATH_PAGE
    expected = len(ARITHMATEX.findall(page.read_text()))
    assert expected > 10, f"{MATH_PAGE} is meant to be a page with math; pick another for MATH_PAGE"
    formulas = _formulas(_dom_after_scripts(browser, page, tmp_path / "profile"))
    assert len(formulas) == expected
    assert {f["tag"] for f in formulas} == {"span", "div"}, "the page should have inline and displayed formulas"
    bad = _unrendered(formulas)
    assert not bad, f"{len(bad)} of {expected} formulas on {MATH_PAGE} were not typeset:\n" + "\n".join(bad[:20])


def test_katex_typesets_every_formula_of_the_site(site, browser, tmp_path):
    sections, expected = [], 0
    for page in sorted(site.rglob("*.html")):
        found = ARITHMATEX.findall(page.read_text())
        if found:
            expected += len(found)
            body = "\n".join(f'<{tag} class="arithmatex">{tex}</{tag}>' for tag, tex in found)
            sections.append(f'<section id="{page.relative_to(site).as_posix()}">\n{body}\n</section>')
    assert expected > 100, "the docs have far more formulas than this; has the arithmatex markup changed?"
    scratch = site / "every-formula.html"
    scratch.write_text(
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        '<link rel="stylesheet" href="assets/katex/katex.min.css"></head><body>\n'
        + "\n".join(sections)
        # docs/javascripts/katex.js runs on the theme's document$ signal; a stand-in that fires at once.
        + '\n<script src="assets/katex/katex.min.js"></script>\n'
          '<script>window.document$ = {subscribe: (typeset) => typeset()};</script>\n'
          '<script src="javascripts/katex.js"></script>\n</body></html>\n')
    dom = _dom_after_scripts(browser, scratch, tmp_path / "profile")
    bad, seen = [], 0
    for page, body in re.findall(r'<section id="([^"]*)">(.*?)</section>', dom, re.S):
        formulas = _formulas(body)
        seen += len(formulas)
        bad += [f"{page}: {b}" for b in _unrendered(formulas)]
    assert seen == expected
    assert not bad, f"{len(bad)} of {expected} formulas were not typeset by KaTeX:\n" + "\n".join(bad[:30])

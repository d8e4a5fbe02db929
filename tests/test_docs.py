"""The README stays short, and the README and docs/ point only at things that exist.

- README.md is under 300 lines: the detail lives in docs/.
- Every relative link and image in README.md and docs/*.md resolves to a file or folder of the
  repository, and a `#anchor` to a heading of the target page (GitHub's rule for heading ids).
- Every repository path written in code spans (`gasloc_lightning/...`, `benchmarks/...`, `tests/...`,
  `docs/...`, `conf/...`, `notebooks/...`, and `strategies/x.py` inside the package) exists, and every
  dotted module path (`gasloc_lightning.comm.flat`) names a module, or a name found in one.
- No image is shown on two pages: a plot lives on one page, and the others link to it.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"(!?)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s*(```|~~~)")
TOP_DIRS = ("gasloc_lightning", "benchmarks", "tests", "docs", "conf", "notebooks")
REPO_PATH = re.compile(r"^(?:%s)/[\w./-]*$" % "|".join(TOP_DIRS))
SUB_PACKAGES = sorted(p.parent.name for p in (ROOT / "gasloc_lightning").glob("*/__init__.py"))
PACKAGE_FILE = re.compile(r"^(?:%s)/\w+\.py$" % "|".join(SUB_PACKAGES))  # strategies/schedule.py
MODULE_PATH = re.compile(r"^gasloc_lightning(?:\.\w+)+$")


def _prose(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's id for a heading: links and code marks dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    anchors = set()
    for _, line in _prose(page):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


def _links(page: Path):
    for number, line in _prose(page):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, bool(match.group(1)), match.group(2)


def _code_spans(page: Path):
    for number, line in _prose(page):
        for match in CODE_SPAN.finditer(line):
            for token in match.group(2).split():
                yield number, token.strip(".,;:()'\"")


def test_the_readme_is_under_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into a docs/ page and link it"


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for page in PAGES:
        for number, _, target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            file = (page.parent / unquote(path)).resolve() if path else page
            if not file.is_relative_to(ROOT) or not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{where} (no heading with that id in {file.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _module_exists(dotted: str) -> bool:
    """``gasloc_lightning.a.b`` is a module or package, or ``b`` is a name in module ``gasloc_lightning.a``."""
    parts = dotted.split(".")
    if parts[:2] == ["gasloc_lightning", "conf"]:  # conf/ ships as gasloc_lightning.conf
        return (ROOT / "conf").joinpath(*parts[2:]).exists() or len(parts) == 2
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            return cut == len(parts) or re.search(rf"\b{re.escape(parts[cut])}\b", source.read_text()) is not None
    return False


def test_every_path_and_module_named_in_the_docs_exists():
    missing = []
    for page in PAGES:
        for number, token in _code_spans(page):
            where = f"{page.relative_to(ROOT)}:{number}: {token}"
            if REPO_PATH.match(token) and not (ROOT / token).exists():
                missing.append(where)
            elif PACKAGE_FILE.match(token) and not (ROOT / "gasloc_lightning" / token).exists():
                missing.append(where)
            elif MODULE_PATH.match(token) and not _module_exists(token):
                missing.append(where)
    assert not missing, "paths or modules that do not exist:\n" + "\n".join(missing)


def test_no_image_is_shown_on_two_pages():
    shown: dict[Path, list[str]] = {}
    for page in PAGES:
        for number, image, target in _links(page):
            if image and not re.match(r"^[a-z]+:", target):
                shown.setdefault((page.parent / target).resolve(), []).append(f"{page.relative_to(ROOT)}:{number}")
    twice = {str(path.relative_to(ROOT)): where for path, where in shown.items() if len(where) > 1}
    assert not twice, f"images shown more than once (show each on one page, link to it elsewhere): {twice}"


@pytest.mark.parametrize("heading, slug", [
    ("Measured: churn with 8 workers (`benchmarks/churn.py`)", "measured-churn-with-8-workers-benchmarkschurnpy"),
    ("The paper's claims at small scale", "the-papers-claims-at-small-scale"),
    ("What `make demo` prints", "what-make-demo-prints"),
    ("5c. Streamed rounds: fragments", "5c-streamed-rounds-fragments"),
])
def test_heading_ids_follow_githubs_rule(heading, slug):
    assert _slug(heading) == slug

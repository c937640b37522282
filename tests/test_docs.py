"""The guides in docs/: their python blocks run, and every relative link resolves.

Each page's python blocks run in order in one namespace per page, so a page
defines everything it uses. Links from README.md and the guides to files in
the repository, and to headings in them, must point at something that exists.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"

GUIDES = {
    "auditing.md",
    "correlated-noise.md",
    "data.md",
    "design.md",
    "distributed.md",
    "examples.md",
    "huggingface.md",
    "performance.md",
    "pieces.md",
    "precision.md",
    "privacy-and-randomness.md",
    "sharded.md",
    "training.md",
    "tuning.md",
    "writing-a-loss.md",
}

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """Each ```python block of ``page`` with the number of lines before it."""
    text = page.read_text()
    return [
        (text.count("\n", 0, match.start(1)), match.group(1))
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    ]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of ``page`` (outside code blocks); repeats get -1, -2, ..."""
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code that are not web or mail addresses."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    return [
        target
        for target in LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I)
    ]


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or heading, does not exist."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    return broken


def test_the_guides_are_there():
    names = {page.name for page in PAGES}
    assert names >= GUIDES, f"missing guides: {sorted(GUIDES - names)}"


def test_the_readme_links_every_guide():
    linked = {Path(target.partition("#")[0]).name for target in relative_links(README)}
    assert {page.name for page in PAGES} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_python_blocks_run(page):
    blocks = python_blocks(page)
    assert blocks, f"{page.name} shows no code"
    namespace: dict = {}
    for offset, block in blocks:  # padded so that a traceback names the page's own line
        exec(compile("\n" * offset + block, str(page), "exec"), namespace)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_github_slugs():
    assert github_slug("What `make demo` shows") == "what-make-demo-shows"
    assert github_slug("Flat, per-layer and normalized clipping") == (
        "flat-per-layer-and-normalized-clipping"
    )
    assert github_slug("A gradient penalty: derivatives with respect to the input") == (
        "a-gradient-penalty-derivatives-with-respect-to-the-input"
    )
    assert github_slug("snake_case stays") == "snake_case-stays"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Real heading\n\n```sh\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#real-heading) [web](https://example.com/x.md) `[code](none.md)`\n"
        "[no file](missing.md) [no heading](other.md#not-a-heading) [self](#nowhere)\n"
    )
    assert [entry.split(":")[0] for entry in broken_links(page)] == [
        "missing.md",
        "other.md#not-a-heading",
        "#nowhere",
    ]

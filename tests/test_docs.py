"""Every python block of each page in docs/ runs, in order, in one namespace per page."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def test_the_guides_are_there():
    names = {page.name for page in PAGES}
    assert {"data.md", "precision.md", "writing-a-loss.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_python_blocks_run(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks, f"{page.name} shows no code"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)

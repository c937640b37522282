"""README.md is a short doorway, and its python blocks run, in order, in one namespace."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    text = README.read_text()
    matches = list(re.finditer(r"```python\n(.*?)```", text, flags=re.S))
    assert len(matches) >= 2
    namespace: dict = {}
    for match in matches:  # padded so that a traceback names the README's own line
        block = "\n" * text.count("\n", 0, match.start(1)) + match.group(1)
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_stays_short():
    # the details live in docs/; the README shows what dpfunc is and where to read on
    assert len(README.read_text().splitlines()) < 300

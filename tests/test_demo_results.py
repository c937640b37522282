"""What the docs print is what the demo does.

docs/digits.json is the records file that ``python examples/digits.py --out docs`` writes
(``make demo`` writes the same file to results/). README.md's ``make demo`` paragraph and
docs/examples.md's table must quote it, and its private rows must come out again from the
demo's own code (about 5 s): a change that moves them (a noise draw, a calibration, the
clipping) fails here until the demo is rerun with ``--out docs`` and the docs are updated.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "digits.json"
README = ROOT / "README.md"
EXAMPLES_MD = ROOT / "docs" / "examples.md"
RERUN = "rerun `python examples/digits.py --out docs` and quote docs/digits.json in the docs"
TEST_IMAGES = 360  # one test image moves an accuracy by 1/360


def records() -> list[dict]:
    return json.loads(RESULTS.read_text())


def private(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["target_epsilon"] is not None]


def readme_paragraph() -> str:
    paragraphs = re.split(r"\n\s*\n", README.read_text())
    found = [p for p in paragraphs if p.startswith("`make demo`") and "test accuracy" in p]
    assert len(found) == 1, "README.md needs one paragraph on `make demo`'s test accuracy"
    return " ".join(found[0].split())


def test_results_file_has_the_demos_rows():
    rows = records()
    assert [r["target_epsilon"] for r in rows] == [1.0, 3.0, 8.0, None]
    for r in private(rows):
        assert r["epsilon"] <= r["target_epsilon"]  # the demo refuses anything else
        assert len(r["accuracies"]) == len(r["seeds"]) >= 2


def test_readme_quotes_the_results():
    text, rows = readme_paragraph(), records()
    quoted = re.findall(r"(\d\.\d{3}) ± (\d\.\d{3})", text)
    expected = [(f"{r['accuracy']:.3f}", f"{r['accuracy_std']:.3f}") for r in private(rows)]
    assert quoted == expected, f"README.md quotes {quoted}, docs/digits.json holds {expected}"
    epsilons = [f"{r['target_epsilon']:g}" for r in private(rows)]
    assert f"at epsilon {', '.join(epsilons[:-1])} and {epsilons[-1]} " in text
    base = re.search(r"(\d\.\d{3}) without privacy", text)
    assert base and base.group(1) == f"{rows[-1]['accuracy']:.3f}"
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    assert f"{words[len(rows[0]['seeds'])]} fixed seeds" in text


def test_examples_md_table_quotes_the_results():
    text = EXAMPLES_MD.read_text()
    section = text.split("## What `make demo` shows", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")][2:]  # no header
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    expected = []
    for r in records():
        epsilon = "inf (non-private)" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        delta = "-" if r["epsilon"] is None else f"{r['delta']:.0e}".replace("e-0", "e-")
        sigma = f"{r['noise_multiplier']:.2f}" if r["noise_multiplier"] else "0"
        accuracy = f"{r['accuracy']:.3f} ± {r['accuracy_std']:.3f}"
        expected.append([epsilon, delta, sigma, accuracy, f"{r['seconds']:.1f}"])
    assert cells == expected, f"docs/examples.md's table is not docs/digits.json's: {RERUN}"


@pytest.fixture(scope="module")
def demo():
    """examples/digits.py as a module, with its data and features, on the demo's threads."""
    pytest.importorskip("sklearn")
    saved_path, saved_modules = list(sys.path), dict(sys.modules)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import digits  # examples/digits.py (it imports examples/report.py)
    finally:
        sys.path[:] = saved_path
        for name in ("digits", "report"):  # leave no top-level 'report' behind
            if name not in saved_modules:
                sys.modules.pop(name, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(digits.THREADS)
    try:
        (x_train, y_train), (x_test, y_test) = digits.load_images()
        featurize = digits.featurize
        yield digits, (featurize(x_train), y_train), (featurize(x_test), y_test)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_private_rows_reproduce(demo, target):
    digits, train_set, test_set = demo
    record = next(r for r in records() if r["target_epsilon"] == target)
    assert digits.SCHEDULE[target] == (record["steps"], record["learning_rate"]), RERUN
    assert record["seeds"] == digits.SEEDS, RERUN
    got = digits.run_budget(
        train_set, test_set, target, record["seeds"], record["steps"], record["learning_rate"]
    )
    assert got["noise_multiplier"] == pytest.approx(record["noise_multiplier"], rel=1e-6), RERUN
    assert got["epsilon"] == pytest.approx(record["epsilon"], rel=1e-6), RERUN
    # another CPU may round a near tie the other way: one test image per seed, no more
    assert got["accuracies"] == pytest.approx(record["accuracies"], abs=1.5 / TEST_IMAGES), RERUN

# dpfunc: `make install` once (idempotent), then `make test` / `make demo`.
# `make test-wheel` is what CI runs: the suite against the built wheel, installed
# into a fresh virtual environment, with no source tree on the path.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := test,bench,examples,secure,hf,trl
WHEEL_VENV ?= build/wheel-venv
WHEEL_TESTS ?= build/wheel-tests
DOCS_VENV ?= build/docs-venv
SPHINXOPTS ?=

.PHONY: install test test-wheel test-torch test-heavy lint docs bench demo clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

test: install
	$(PY) -m pytest dpfunc tests -q

# Compiled Hugging Face steps against eager: minutes of compiling, left out of `test`.
test-heavy: install
	$(PY) -m pytest tests -q -m heavy

# The wheel as users get it: built, installed (not editable) into a new venv, and
# tested from a copy of tests/, examples/ and the docs that holds no dpfunc/ source.
test-wheel:
	rm -rf build  # setuptools' build/lib too: it could carry a deleted module into the wheel
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip wheel --quiet --no-deps -w build/dist .
	$(WHEEL_VENV)/bin/python -m pip install --quiet -r requirements-dev.txt
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls build/dist/dpfunc-*.whl)[$(EXTRAS)]"
	mkdir -p $(WHEEL_TESTS)
	cp -r tests examples docs README.md pyproject.toml $(WHEEL_TESTS)/
	cd $(WHEEL_TESTS) && DPFUNC_TEST_INSTALLED=1 $(abspath $(WHEEL_VENV))/bin/python -P -m pytest \
		--pyargs dpfunc tests -q -p no:cacheprovider

# The same on another torch: `make test-torch TORCH=2.6.0` (see .ci/test-torch; a CUDA
# build of several GB for most versions, run on the CPU).
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=x.y.z"; exit 2; }
	.ci/test-torch $(TORCH)

lint: install
	$(VENV)/bin/ruff check dpfunc tests examples bench
	$(VENV)/bin/ruff format --check dpfunc tests examples bench

# The API reference (docs/api) from the docstrings of the package as built: the wheel
# goes into $(DOCS_VENV) beside the pinned CPU torch and the `docs` extra (sphinx), and
# autodoc imports it from there; any warning fails the build. Open build/api/index.html.
# CI runs it in the venv of test-wheel: `make docs DOCS_VENV=build/wheel-venv`.
# SPHINXOPTS=-n adds nitpicky mode: references to torch, to type aliases and to internal
# modules, which the reference does not hold, are then reported too.
docs:
	test -x $(DOCS_VENV)/bin/python || python3 -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet -r requirements-dev.txt
	rm -rf build/lib build/docs-dist  # a stale build/lib could carry a deleted module into the wheel
	$(DOCS_VENV)/bin/python -m pip wheel --quiet --no-deps -w build/docs-dist .
	$(DOCS_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall \
		"$$(ls build/docs-dist/dpfunc-*.whl)"
	$(DOCS_VENV)/bin/python -m pip install --quiet -c requirements-dev.txt \
		"$$(ls build/docs-dist/dpfunc-*.whl)[docs,hf]"
	rm -rf build/api
	$(DOCS_VENV)/bin/sphinx-build -W --keep-going $(SPHINXOPTS) -b html docs/api build/api

bench: install
	$(PY) bench/run.py
	$(PY) bench/noise.py
	$(PY) bench/functional.py
	$(PY) bench/trainer.py
	$(PY) bench/hf.py
	$(PY) bench/correlated.py

demo: install
	$(PY) examples/digits.py

clean:
	rm -rf $(VENV) build results .pytest_cache .hypothesis

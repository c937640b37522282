# dpfunc: `make install` once (idempotent), then `make test` / `make demo`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint bench demo clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e ".[test,bench,examples,secure,hf]"
	touch $(STAMP)

test: install
	$(PY) -m pytest dpfunc tests -q

lint: install
	$(VENV)/bin/ruff check dpfunc tests examples bench
	$(VENV)/bin/ruff format --check dpfunc tests examples bench

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
	rm -rf $(VENV) results .pytest_cache .hypothesis

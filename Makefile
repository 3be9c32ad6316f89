# trioshed: two commands on a fresh machine, `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve test lint bench bench-full bench-speculation fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[bundled,test,bench]'
	$(PY) -m trioshed.runner.provision
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m trioshed serve --demo-model

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Open-ended search, fresh random seeds each run (make test runs the same tests seeded):
# schemathesis against /openapi.json of a real server (100 examples per operation; make test
# runs 3 with seed 1) and the hypothesis property tests (make test: derandomized).
fuzz: $(STAMP)
	TRIOSHED_FUZZ_EXAMPLES=100 $(PY) -m pytest -q -s tests/test_fuzz.py
	$(PY) -m pytest -q -p no:cacheprovider --hypothesis-profile=fuzz --hypothesis-show-statistics tests/test_sched_property.py tests/test_placement.py

lint: $(STAMP)
	$(VENV)/bin/ruff check trioshed tests bench
	$(VENV)/bin/mypy trioshed

bench: $(STAMP)
	$(PY) -m bench.compare --quick

bench-full: $(STAMP)
	$(PY) -m bench.compare --full

bench-speculation: $(STAMP)
	$(PY) -m bench.speculation --rounds 2 --tokens 128 --arms plain,ngram-simple,ngram-simple-n4 --trioshed

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

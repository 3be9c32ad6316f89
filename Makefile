# trioshed: two commands on a fresh machine, `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Every version comes from uv.lock: uv reads it, pip reads its export in requirements/.
# INSTALLER=auto (uv where it runs, installed from PyPI when missing; else pip), uv or pip.
INSTALLER ?= auto
INSTALL := PYTHON=$(PYTHON) VENV=$(VENV) INSTALLER=$(INSTALLER) packaging/install.sh
STAMP  := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve
PYTEST_ARGS ?=

.PHONY: install serve test lint lock image bench bench-full bench-speculation soak fuzz clean

# make serve installs what serving needs (the server, the bundled llama-server, the demo model);
# make install and make test add the extras (tests, lint, bench).
$(SERVE_STAMP): pyproject.toml uv.lock requirements/serve.txt packaging/install.sh
	$(INSTALL) serve

$(STAMP): pyproject.toml uv.lock requirements/dev.txt packaging/install.sh
	$(INSTALL) dev

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(PY) -m trioshed serve --demo-model

# The newest releases pyproject.toml allows, into uv.lock and requirements/*.txt: commit all three.
# KEEP=1 keeps the pins there are and only adds what pyproject.toml added.
lock:
	PYTHON=$(PYTHON) KEEP=$(KEEP) packaging/install.sh lock

# The container image (Containerfile): trioshed from the lock with the bundled llama-server, as a
# non-root user on a read-only root. IMAGE=name:tag, BASE=a Debian 12 image (default: Debian's,
# else one made here from Debian's packages), EXTRA_PACKAGES=mesa-vulkan-drivers for AMD/Intel GPUs.
image:
	packaging/container/build.sh

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Open-ended search, fresh random seeds each run (make test runs the same tests seeded):
# schemathesis against /openapi.json of a real server (100 examples per operation; make test
# runs 3 with seed 1) and the hypothesis property tests (make test: derandomized).
fuzz: $(STAMP)
	TRIOSHED_FUZZ_EXAMPLES=100 $(PY) -m pytest -q -s tests/e2e/test_fuzz.py
	$(PY) -m pytest -q -p no:cacheprovider --hypothesis-profile=fuzz --hypothesis-show-statistics tests/core/test_sched_property.py tests/core/test_placement.py

lint: $(STAMP)
	$(VENV)/bin/ruff check trioshed tests bench
	$(VENV)/bin/mypy trioshed

bench: $(STAMP)
	$(PY) -m bench.compare --quick

bench-full: $(STAMP)
	$(PY) -m bench.compare --full

bench-speculation: $(STAMP)
	$(PY) -m bench.speculation --rounds 5 --tokens 192 --arms plain --transcript --trioshed

# 15 minutes of mixed load and scheduled faults on real children; every request accounted for
# (SOAK_ARGS="--minutes 3" for a shorter run)
SOAK_ARGS ?=
soak: $(STAMP)
	$(PY) -m bench.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# make demo: set up, then run the main job.  make test: set up, then run the tests.
# Set-up is idempotent: a second run only checks the stamp.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.offload-setup

.PHONY: setup demo test test-all bench-io clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py offload/optim/adam_native.c Makefile
	@sh scripts/install-libaio.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/offload demo

# The default suite on two workers, a test file each at a time: most of its time is
# spent waiting on the disk and on the processes the tests start, not on a core.
# test-all runs one test at a time: some of its heavier tests measure peak memory.
test: setup
	@sh scripts/install-chromium.sh
	$(PY) -m pytest -q -n 2 --dist loadfile

test-all: setup
	@sh scripts/install-chromium.sh
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q -m "slow or not slow"

bench-io: setup
	$(VENV)/bin/offload bench io --path ./offload-bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis offload-swap offload-bench

# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: demo test test-gpu test-gpu-smoke api-docs bench wheel clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/pallas-flex demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not gpu" tests

# The GPU suite: every test marked `gpu` — the `pallas` backend of the shared suites in
# tests/ (forward, backward, decode, paged, ragged, cascade, Mosaic GPU, fault injection)
# and tests/gpu (issue 15's dtype x head dim x layout x op x shared-memory-budget matrix,
# issue 23's captured-array gradients). The GPU machine has no .venv: this target runs
# $(PYTHON) with jax, flax and pytest installed system-wide, and PYTHONPATH=. (no install,
# no xdist needed).
#
# RUNTIME (H100): compiling is nearly all of it, ~95 min of test time one shard after
# another. No single pytest process fits the device tool's 10 minutes, so the target runs
# GPU_SHARDS (14) pytest shards, balanced by their estimated cost
# (PALLAS_FLEX_TEST_SHARD=i/n, tests/selection.py). All 14 at once took 520-575 s per
# shard on the H100 machine's 16 cores (saturated; 16 shards ran slower), past the device
# tool's 10 minutes with its start. 7 shards at once took 430-540 s each on 2026-11-27
# (260-360 s earlier: the suite grew), 4 at once 380-400 s. On the H200 machine
# (2026-11-29) 5 at once took 271-318 s and 9 at once 379-482 s: run it as two calls,
# GPU_FIRST=0 GPU_LAST=4, then 5..13, each within 10 minutes (three on the H100:
# 0..4, 5..9, 10..13). Hosts differ: on another H200 host the same day every cell took
# ~1.5x as long and shards 0..4 were not done in 400 s; a slow host needs three calls
# there too. On nvidia-h200-x2 (2 GPUs, 32 cores; GPU_DEVICES=2, 2026-11-30) all 14 at
# once did not fit either: 3 shards were done in 415-459 s, the other 11 had run 53-80 of
# their ~69-80 tests when a 470 s timeout stopped them (900 passed, none failed): there
# too, two calls. Each
# process allocates device memory as it goes and frees it after each test
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform): with JAX's caching allocator, 14 processes holding their peaks ran the GPU out of memory.
#
# The shards' logs are joined in $(GPU_OUT)/test-gpu.log and their per-cell records
# (compile seconds, pass/fail, errors) in $(GPU_OUT)/results.json: two files, as the
# device tool returns at most 8 from $OUT. The latest whole run's records are kept in
# tests/gpu/results/h100-gpu-suite.json.
#
# On the device machine: `make test-gpu PYTHON=python3 GPU_OUT=$OUT`.
# One process runs everything, but takes over an hour:
#   PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests
# and any -k selection of it (GPU_PYTEST_ARGS='-k ...' passes one to the shards; a shard
# left with no test exits 5, which counts as a pass).
GPU_SHARDS ?= 14
GPU_FIRST ?= 0
GPU_LAST ?= $(shell echo $$(($(GPU_SHARDS) - 1)))
GPU_OUT ?= build/gpu-results
GPU_PYTEST_ARGS ?=
# On a machine of several GPUs, GPU_DEVICES=n puts shard i on GPU i % n (all 14 shards in
# one call on a 4-GPU machine of 64 cores).
GPU_DEVICES ?=
# Tests with no gpu test whose imports the GPU machine lacks (nbformat, nbclient, pdoc).
GPU_IGNORE = --ignore=tests/test_notebooks.py --ignore=tests/test_api_reference.py

test-gpu:
	@rm -rf $(GPU_OUT)/shards && mkdir -p $(GPU_OUT)/shards; pids=""; \
	for i in $$(seq $(GPU_FIRST) $(GPU_LAST)); do \
	  $(if $(GPU_DEVICES),CUDA_VISIBLE_DEVICES=$$(($$i % $(GPU_DEVICES)))) \
	  PYTHONPATH=. XLA_PYTHON_CLIENT_ALLOCATOR=platform PALLAS_FLEX_TEST_SHARD=$$i/$(GPU_SHARDS) \
	    PALLAS_FLEX_RESULTS=$(GPU_OUT)/shards/shard$$i.json \
	    $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider $(GPU_IGNORE) tests $(GPU_PYTEST_ARGS) \
	    > $(GPU_OUT)/shards/shard$$i.log 2>&1 & \
	  pids="$$pids $$!"; \
	done; \
	status=0; for pid in $$pids; do wait $$pid; rc=$$?; \
	  [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=1; done; \
	for i in $$(seq $(GPU_FIRST) $(GPU_LAST)); do echo "== shard $$i/$(GPU_SHARDS)"; \
	  cat $(GPU_OUT)/shards/shard$$i.log; done > $(GPU_OUT)/test-gpu.log; \
	grep -h -e "^FAILED" -e "^ERROR" -e " in [0-9.]*s" $(GPU_OUT)/shards/shard*.log; \
	PYTHONPATH=. $(PYTHON) -c "from tests.gpu.conftest import merge_results; \
	  merge_results('$(GPU_OUT)/shards', '$(GPU_OUT)/results.json')" && \
	rm -rf $(GPU_OUT)/shards; \
	exit $$status

# A quick check of every kernel family in one device call (~130 tests: the first test of
# each gpu test function and slices of the two matrices, tests/selection.py's _smoke),
# in 6 shards: `make test-gpu-smoke PYTHON="timeout 400 python3" GPU_OUT=$OUT` (H100,
# 2026-12-07: 131 passed, shards 153-259 s; tests/gpu/results/h100-gpu-smoke.json). Not a
# substitute for the whole suite; add GPU_PYTEST_ARGS='-k ...' for a change's own tests.
test-gpu-smoke:
	PALLAS_FLEX_GPU_SMOKE=1 $(MAKE) test-gpu GPU_SHARDS=6

# The API reference, from the docstrings (tests/test_api_reference.py builds it too).
api-docs: $(VENV)/.installed
	$(PY) -m pdoc -o build/api pallas_flex pallas_flex.nn

bench: $(VENV)/.installed
	$(VENV)/bin/pallas-flex bench

# A wheel for a machine without this checkout, such as Colab (upload it and point the
# notebooks' install cell at it): dist/pallas_flex-<version>-py3-none-any.whl. Needs only
# pip (it fetches setuptools for the build). build/lib and build/bdist.* go first:
# setuptools copies whatever build/lib holds into the wheel, modules deleted since the
# last build included.
wheel:
	rm -rf build/lib build/bdist.* dist/pallas_flex-*.whl
	$(PYTHON) -m pip wheel -q --no-deps -w dist .
	@ls dist/pallas_flex-*.whl

clean:
	rm -rf $(VENV) build dist *.egg-info

# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: demo test test-gpu bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/pallas-flex demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not gpu" tests

# GPU suites (tests/gpu, marker `gpu`): issue 15's dtype x head dim x layout x op x
# shared-memory-budget matrix and issue 23's captured-array gradients. The GPU machine has
# no .venv: this target runs $(PYTHON) with jax, flax and pytest installed system-wide,
# and PYTHONPATH=. (no install, no xdist needed).
#
# RUNTIME (H100; an estimate from ~2 s per compiled 16-bit program and ~4 s per float32
# one, not yet measured): about 33 min one test after another (test_dtype_matrix.py
# ~20 min: 504 cells, ~374 distinct programs; test_captured_gradients.py ~13 min: 203
# tests), which no single pytest process fits in 10 minutes. So the target runs
# GPU_SHARDS (6) pytest processes at once, each a shard of the tests balanced by their
# estimated compile time (PALLAS_FLEX_TEST_SHARD=i/n, tests/gpu/conftest.py): ~6-7 min
# of wall time, compiling being single-threaded CPU work (16 cores on the H100 machine).
# The shards' logs are joined in $(GPU_OUT)/test-gpu.log and their per-cell records
# (compile seconds, pass/fail, errors) in $(GPU_OUT)/results.json: two files, as the
# device tool returns at most 8 from $OUT.
#
# On the device machine (no .venv; use `make test-gpu PYTHON=python3 GPU_OUT=$OUT`), or,
# if make is missing there, the same as one shell command:
#   fail=0; pids=; for i in 0 1 2 3 4 5; do PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLEX_TEST_SHARD=$i/6 PALLAS_FLEX_RESULTS=$OUT/shard$i.json python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu >/tmp/shard$i.log 2>&1 & pids="$pids $!"; done; for p in $pids; do wait $p || fail=1; done; tail -n 5 /tmp/shard*.log; exit $fail
# One process runs everything, but takes ~33 min by the estimate:
#   PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu
# and any -k selection of it (GPU_PYTEST_ARGS='-k ...' passes one to the shards).
GPU_SHARDS ?= 6
GPU_OUT ?= build/gpu-results
GPU_PYTEST_ARGS ?=

test-gpu:
	@rm -rf $(GPU_OUT)/shards && mkdir -p $(GPU_OUT)/shards; pids=""; \
	for i in $$(seq 0 $$(($(GPU_SHARDS) - 1))); do \
	  PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLEX_TEST_SHARD=$$i/$(GPU_SHARDS) \
	    PALLAS_FLEX_RESULTS=$(GPU_OUT)/shards/shard$$i.json \
	    $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests/gpu $(GPU_PYTEST_ARGS) \
	    > $(GPU_OUT)/shards/shard$$i.log 2>&1 & \
	  pids="$$pids $$!"; \
	done; \
	status=0; for pid in $$pids; do wait $$pid || status=1; done; \
	for i in $$(seq 0 $$(($(GPU_SHARDS) - 1))); do echo "== shard $$i/$(GPU_SHARDS)"; \
	  cat $(GPU_OUT)/shards/shard$$i.log; done > $(GPU_OUT)/test-gpu.log; \
	grep -h -e "^FAILED" -e "^ERROR" -e " in [0-9.]*s" $(GPU_OUT)/shards/shard*.log; \
	PYTHONPATH=. $(PYTHON) -c "from tests.gpu.conftest import merge_results; \
	  merge_results('$(GPU_OUT)/shards', '$(GPU_OUT)/results.json')" && \
	rm -rf $(GPU_OUT)/shards; \
	exit $$status

bench: $(VENV)/.installed
	$(VENV)/bin/pallas-flex bench

clean:
	rm -rf $(VENV) build *.egg-info

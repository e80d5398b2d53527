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
# RUNTIME (H100): about 53 min one test after another, from compile times measured
# there with an earlier version of the suite (benchmarks/results/
# 2026-11-24-h100-training-dtypes-and-captured-gradients.json): test_dtype_matrix.py
# ~26 min (504 cells, ~374 distinct programs; the rest reuse an identical executable),
# test_captured_gradients.py ~27 min (203 tests), compiling being nearly all of it. No
# single pytest process fits 10 minutes, so the target runs GPU_SHARDS (8) pytest
# processes at once, each a shard of the tests balanced by their estimated compile time
# (PALLAS_FLEX_TEST_SHARD=i/n, tests/gpu/conftest.py): ~400 s of estimated work per
# shard, ~7-8 min of wall time (compiling is mostly single-threaded CPU work; the H100
# machine has 16 cores). Raise GPU_SHARDS if a run comes close to the limit.
#
# The shards' logs are joined in $(GPU_OUT)/test-gpu.log and their per-cell records
# (compile seconds, pass/fail, errors) in $(GPU_OUT)/results.json: two files, as the
# device tool returns at most 8 from $OUT.
#
# On the device machine (no .venv; use `make test-gpu PYTHON=python3 GPU_OUT=$OUT`), or,
# if make is missing there, the same as one shell command:
#   mkdir -p /tmp/gpu; fail=0; pids=; for i in 0 1 2 3 4 5 6 7; do PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLEX_TEST_SHARD=$i/8 PALLAS_FLEX_RESULTS=/tmp/gpu/shard$i.json python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu >/tmp/gpu/shard$i.log 2>&1 & pids="$pids $!"; done; for p in $pids; do wait $p; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ] || fail=1; done; tail -n 5 /tmp/gpu/shard*.log; PYTHONPATH=$PWD python3 -c "from tests.gpu.conftest import merge_results; merge_results('/tmp/gpu', '$OUT/results.json')"; exit $fail
# One process runs everything, but takes ~53 min by the estimate:
#   PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu
# and any -k selection of it (GPU_PYTEST_ARGS='-k ...' passes one to the shards; a shard
# left with no test exits 5, which counts as a pass).
GPU_SHARDS ?= 8
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
	status=0; for pid in $$pids; do wait $$pid; rc=$$?; \
	  [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=1; done; \
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

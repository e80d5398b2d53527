# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/pallas-flex demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not gpu" tests

bench: $(VENV)/.installed
	$(VENV)/bin/pallas-flex bench

clean:
	rm -rf $(VENV) build *.egg-info

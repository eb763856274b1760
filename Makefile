# make demo: set up .venv and train llama-tiny with ragged-fsdp on CPU (torch gloo processes + JAX host devices).
# make test: set up .venv and run ruff + the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,experiments]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

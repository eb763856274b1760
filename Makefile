# make demo: set up .venv and train llama-tiny with ragged-fsdp on CPU (torch gloo processes + JAX host devices).
# make test: set up .venv and run ruff + the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup install-into-env clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,experiments]"
	touch $(STAMP)

# A GPU machine or cluster whose environment has its own CUDA torch (>= 2.11) and JAX (with its CUDA plugin):
# install the project into it (PYTHON=that environment's python), pinned to the torch and JAX it has, so pip
# adds only what is missing and replaces neither (experiments/env_pins.py; no .venv, no constraints.txt).
install-into-env:
	$(PYTHON) -m experiments.env_pins > .env-pins.txt
	$(PYTHON) -m pip install -c .env-pins.txt -e .; status=$$?; rm -f .env-pins.txt; exit $$status

demo: $(STAMP)
	$(PY) -m experiments.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The suite runs as two pytest processes, one per core: the in-process JAX tests with the JAX training runs'
# launches, and the rest. Measured together on idle 2-core machines: 10.3 and 11.0 minutes, 11.2 with ruff
# (Intel Xeon with AVX-512, where a pure-Python loop of 2e7 adds takes 1.7 s; 2026-12-06); 21.9 and 23.1 on
# an AMD EPYC where that loop takes 4.8 s (2026-12-04, before that day's cuts): hosts vary by 2x or more.
# Each prints its slowest tests, for balancing. The JAX half's output is printed after the other's.
JAX_HALF := tests/jax_backend tests/experiments/test_train_jax.py tests/experiments/test_train_jax_moe.py
test: $(STAMP) lint
	@$(PY) -m pytest -q --durations=15 $(JAX_HALF) > .pytest-jax.log 2>&1 & jax=$$!; \
	$(PY) -m pytest -q --durations=15 $(addprefix --ignore=,$(JAX_HALF)); rest=$$?; \
	wait $$jax; status=$$?; echo "--- the JAX half: $(JAX_HALF)"; cat .pytest-jax.log; rm -f .pytest-jax.log; \
	test $$rest -eq 0 -a $$status -eq 0

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points, each self-bootstrapping: `make run` (the default tiny GLM-5 run on CPU) and
# `make test` (`make test-quick`: the one-process tests only). The venv is (re)built when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
ARGS   ?=
# make test-quick: two pytest workers (its tests each keep one core busy; CI has two). make test
# runs one: its multi-rank runs fill both cores, and two workers' ranks on them ran it slower
QUICK_WORKERS ?= -n 2

.PHONY: run test test-quick bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(PY) -m model_providers.glm5.model.dsa.kernels.dsa_cpu
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(PY) -m pretrain.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

# the one-process tests that launch nothing heavy (config, model, kernels, data): a first check in
# a few minutes; `make test` runs these and the heavy ones (subprocess runs, Triton interpreter,
# the fused kernel's other vector width, multi-rank, end-to-end)
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(QUICK_WORKERS) tests/unit -m "not heavy" $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# Two entry points, each self-bootstrapping: `make run` (the default tiny GLM-5 run on CPU) and
# `make test` (`make test-quick`: the one-process tests only). The venv is (re)built when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
ARGS   ?=
# two pytest workers on CI's two cores: one multi-rank run at a time, one-process tests beside it
# (tests/support/core_gate.py); a test file's tests stay on one worker, which keeps the session's
# shared runs (parity references, the Slurm cluster) made once
WORKERS ?= -n 2 --dist loadfile

.PHONY: run test test-quick bench

# --no-compile: pip byte-compiles every installed module (41 s of a 90 s install on 2 cores);
# Python compiles the few hundred a run imports on first use instead
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev]'
	$(PY) -m model_providers.glm5.model.dsa.kernels.dsa_cpu
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(PY) -m pretrain.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(WORKERS) $(ARGS)

# the one-process tests that launch nothing heavy (config, model, kernels, data): a first check in
# a few minutes; `make test` runs these and the heavy ones (subprocess runs, Triton interpreter,
# the fused kernel's other vector width, multi-rank, end-to-end)
test-quick: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(WORKERS) tests/unit -m "not heavy" $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

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

.PHONY: run test test-quick bench gpu-check gpu-wheels

# Bytecode: pip compiles module by module on one core (41 s of a 90 s install on 2 cores), so it
# installs with --no-compile and compileall then writes every .pyc on all cores (16 s). The .pyc
# must be there: where PYTHONDONTWRITEBYTECODE is set (as on our 2-core machines) Python never caches
# what it compiles, and every process would spend ~5 s of CPU compiling torch and megatron anew.
# quiet=2: a few files of the libraries' own tests are newer-Python syntax, as pip also skips.
# megatron-core 0.17+ declares Python >= 3.12, yet megatron.core runs on 3.11 (a test compiles and
# imports it: tests/unit/parallel/test_megatron_core_install.py). On 3.11 its sdist (no cp311 wheel)
# is built alone past that floor, with pinned build tools and no build isolation; on 3.12+ the
# install below takes its wheel the ordinary way. The version is pyproject.toml's pin.
MEGATRON_CORE := $(shell sed -n 's/^ *"\(megatron-core==[^"]*\)".*/\1/p' pyproject.toml)
MEGATRON_BUILD := setuptools==84.2.1 pybind11==3.1.0

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile $(MEGATRON_BUILD) && \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
	    --no-build-isolation --ignore-requires-python '$(MEGATRON_CORE)'; fi
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[dev]'
	$(PY) -c "import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)" $(VENV)/lib
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

# GPU nodes (docs/gpus.md). `make gpu-wheels PYTHON_VERSION=3.12` (where a package index is
# reachable): wheels/ holds what the GPU path needs that a CUDA PyTorch image lacks, for the node's
# Python. `make gpu-check` (on the node, no index): the machine's own Python (GPU_PYTHON) with its
# torch, Triton and numpy, the rest from wheels/ into .gpu-packages, then the one GPU check --
# environment, the tiny GLM-5 in dense / warm-up / sparse DSA mode, every Triton kernel against
# its reference and flash SDPA, a real-width GLM-5 slice against the planner (<= 8 minutes on an
# H200); ARGS="--json PATH --budget-s N", ARGS="--device cpu" for the emulation and interpreter
PYTHON_VERSION ?= 3.12
GPU_PYTHON     ?= python3
gpu-wheels:
	$(PYTHON) -m benchmarks.gpu_check.wheelhouse --python-version $(PYTHON_VERSION)

gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check.node $(ARGS)

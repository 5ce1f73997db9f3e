# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The CPU build of torch is installed first and pinned: a bare `torch` requirement with no torch
# installed would pull a multi-GB CUDA build. The library itself only asks for torch>=2.6.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# the development environment's other packages come through uv, which fetches in parallel (a
# clean `make install` in a third of pip's time); the torch pin, already installed by pip, keeps
# uv from choosing another torch. What pip alone installs is checked by `make fresh-install`.
UV_PIN ?= uv==0.13.9
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo lint test suite wheels fresh-install fresh-venv fresh-check bench bench-venv notebooks clean

LLAMA_LLMS := integrations/llama_index/llama-index-llms-kvshift
LLAMA_MEMORY := integrations/llama_index/llama-index-memory-kvshift

$(VENV)/.installed: pyproject.toml integrations/langchain/pyproject.toml $(LLAMA_LLMS)/pyproject.toml $(LLAMA_MEMORY)/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN) $(UV_PIN)
	$(VENV)/bin/uv pip install --quiet --python $(PY) "$(TORCH_PIN)" -e ".[test,lint]" -e "integrations/langchain[test]" -e "$(LLAMA_LLMS)[test]" -e "$(LLAMA_MEMORY)[test]"
	$(VENV)/bin/kvshift models install smollm2-135m-instruct gemma-3-270m
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvshift demo

# ruff (rules chosen in pyproject.toml) and mypy over the package, the integrations and the benchmarks
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# `make test` (CI's .ci/run) checks lint, the suite, then what pip alone installs. Lint, the suite
# and the fresh install's pip work run side by side (mypy and pip use one core each, and the
# suite's two workers leave one idle while the other finishes its last file); each target's output
# is printed whole when it ends. Two workers of one thread each (a test file stays on one worker,
# so its module fixtures load once): most of a test's time is one core's Python and small kernels.
# The README's quick starts run once, in fresh-check, from the wheels a user would install; the
# suite leaves out its own run of them (tests/test_readme.py runs them under a plain `pytest`).
# The wheels are built first: the suite's packaging test builds from the same source folders.
TEST_WORKERS ?= 2
FRESH ?= $(or $(TMPDIR),/tmp)/kvshift-fresh-$(shell printf %s "$(CURDIR)" | cksum | cut -d" " -f1)
test: wheels
	$(MAKE) -j3 --output-sync=target lint suite fresh-venv
	$(MAKE) fresh-check

suite: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--deselect tests/test_readme.py::test_a_readme_block_runs_as_written

# the four distributions as a PEP 517 build makes them (sdist, then the wheel from it; uv's build
# frontend, which keeps the build backend's environment between builds), checked as PyPI checks them
DIST ?= dist
DISTRIBUTIONS := . integrations/langchain $(LLAMA_LLMS) $(LLAMA_MEMORY)
wheels: install
	$(VENV)/bin/uv pip install --quiet --python $(PY) twine
	rm -rf $(DIST)
	for folder in $(DISTRIBUTIONS); do $(VENV)/bin/uv build --quiet --out-dir $(DIST) $$folder || exit 1; done
	$(VENV)/bin/twine check --strict $(DIST)/*

# a fresh venv with the CPU torch pin and the four installed by name from the wheelhouse, `kvshift
# models install`: the default model answers offline and the README's quick starts run as written
fresh-install: wheels
	PYTHON=$(PYTHON) TORCH_PIN=$(TORCH_PIN) .ci/fresh-install $(DIST)

# the same in two steps, in $(FRESH) (outside the checkout): the venv from the wheelhouse `make
# wheels` left (beside the suite in `make test`), then the checks
fresh-venv:
	STEPS=venv PYTHON=$(PYTHON) TORCH_PIN=$(TORCH_PIN) .ci/fresh-install $(DIST) $(FRESH)

fresh-check:
	STEPS=check .ci/fresh-install $(DIST) $(FRESH)

# llama.cpp, the peer of benchmarks/decode.py, in a venv of its own: built from PyPI's source
# distribution (minutes on 2 cores), never a dependency of the package or of its tests
BENCH_VENV ?= .bench-venv
LLAMA_CPP_PIN ?= llama-cpp-python==0.3.36
$(BENCH_VENV)/.installed:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet "$(LLAMA_CPP_PIN)"
	touch $@

bench-venv: $(BENCH_VENV)/.installed

bench: install bench-venv
	$(PY) benchmarks/decode.py --llama-python $(BENCH_VENV)/bin/python
	$(PY) benchmarks/ttft.py
	$(PY) benchmarks/fidelity.py --datasets locomo,memorybank-exchanges,memorybank-facts
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/store.py
	$(PY) benchmarks/resume.py
	$(PY) benchmarks/long_memory.py
	$(PY) benchmarks/writeback.py
	$(PY) benchmarks/recall.py
	$(PY) benchmarks/turns.py
	$(PY) benchmarks/locomo.py
	$(PY) benchmarks/frameworks.py
	$(VENV)/bin/kvshift bench --plot-only

# rebuild examples/*.ipynb from their scripts, executed on this machine (outputs and figures)
notebooks: install
	$(PY) examples/notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache

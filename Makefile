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

.PHONY: install demo lint test wheels fresh-install bench notebooks clean

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

# the suite runs after lint, so CI (.ci/run: `make test`) checks both, then what pip alone installs.
# Two workers of one thread each (a test file stays on one worker, so its module fixtures load once):
# most of a test's time is one core's Python and small kernels, so two of them share two cores well.
# The README's quick starts run once, in fresh-install, from the wheels a user would install; the
# suite leaves out its own run of them (tests/test_readme.py runs them under a plain `pytest`).
TEST_WORKERS ?= 2
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--deselect tests/test_readme.py::test_a_readme_block_runs_as_written
	$(MAKE) fresh-install

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

bench: install
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

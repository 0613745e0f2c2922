# `make demo`: venv + install + the offline CPU demo.   `make test`: both venvs + pytest (which
# builds the docs with mkdocs --strict).   `make docs`: the documentation site into site/
# (`.venv/bin/mkdocs serve` to read it).   `make mutation`: every semantic mutant of the package
# against the tests (slow; see docs/architecture.md; `make test` runs a few of them,
# tests/test_mutants_killed.py).
VENV   ?= .venv
PYTHON ?= python3
# The CPU wheel; with a CUDA build already in your own environment, `pip install -e .` keeps it.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# Where this machine keeps the CPU torch wheel, pip prefers it to PyPI's CUDA build of the same
# version (a user config's find-links is not always there, e.g. under another HOME).
TORCH_WHEELS ?= /opt/wheels
FIND_LINKS   := $(if $(wildcard $(TORCH_WHEELS)/torch-*.whl),--find-links $(TORCH_WHEELS))
# vLLM's `speculators` package pins torch/transformers apart from ours, so the tests that load our
# exports with its classes run it from a venv of its own.
SPECULATORS_VENV  ?= .venv-speculators
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.installed

export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test docs venv speculators-venv bench mutation clean

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	# One pip command with torch pinned, so pip never swaps in a multi-GB CUDA build; the other
	# packages at the exact versions the suite passes with (pyproject.toml only declares ranges).
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(FIND_LINKS) -c constraints.txt "$(TORCH)" -e ".[test,plots,docs]"
	touch $(STAMP)

venv: $(STAMP)

$(SPECULATORS_STAMP): constraints-speculators.txt Makefile
	$(PYTHON) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(FIND_LINKS) -c constraints-speculators.txt torch==2.13.0 speculators==0.9.0
	# The torchvision/torchaudio wheels it pulls in do not load against the CPU torch and break
	# the transformers import.
	$(SPECULATORS_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio
	touch $(SPECULATORS_STAMP)

speculators-venv: $(SPECULATORS_STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/specdraft demo

# pytest-xdist: TEST_WORKERS processes of one thread each (a CPU each); --dist loadgroup keeps each
# module on one worker (tests/conftest.py groups them: its fixtures are built once) and the modules
# that start 2-rank jobs on one worker together (never two such jobs at once).
TEST_WORKERS ?= 2

test: $(STAMP) $(SPECULATORS_STAMP)
	$(VENV)/bin/ruff check specdraft tests bench
	$(VENV)/bin/ruff format --check specdraft tests bench
	OMP_NUM_THREADS=1 SPECDRAFT_SPECULATORS_PYTHON=$(abspath $(SPECULATORS_VENV))/bin/python $(VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup tests

mutation: $(STAMP) $(SPECULATORS_STAMP)
	OMP_NUM_THREADS=1 SPECDRAFT_SPECULATORS_PYTHON=$(abspath $(SPECULATORS_VENV))/bin/python $(VENV)/bin/python tests/mutation/run.py

# The configuration reference is generated from the schema; tests/test_docs.py fails when it is stale.
docs: $(STAMP)
	$(VENV)/bin/python -m specdraft.commands.config_reference > docs/config-reference.md
	$(VENV)/bin/python -m mkdocs build --strict

# The CPU bench scripts (bench/summary.py's SCRIPTS), then one summary table of their key=value last lines.
bench: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/python bench/summary.py

clean:
	rm -rf $(VENV) $(SPECULATORS_VENV) runs site

# `make demo`: venv + install + the offline CPU demo.   `make test`: venv + install + pytest.
# `make mutation`: semantic mutants of drafts/ and decode/ against the tests (slow; see README).
VENV   ?= .venv
PYTHON ?= python3
# The CPU wheel; with a CUDA build already in your own environment, `pip install -e .` keeps it.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test venv bench mutation clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# One pip command with torch pinned, so pip never swaps in a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/specdraft demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

mutation: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python tests/mutation/run.py

bench: $(STAMP)
	$(VENV)/bin/python bench/target_weights.py
	$(VENV)/bin/python bench/checkpoint.py
	$(VENV)/bin/python bench/acceptance.py

clean:
	rm -rf $(VENV) runs

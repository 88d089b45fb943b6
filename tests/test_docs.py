"""The docs hold as written. docs/adding-a-policy.md's `Recent` and docs/adding-a-task.md's `SVAMP`
are built from the guides' own code blocks, registered in this test process only (the registries
are restored afterwards), and run end to end on a tiny model. Every other Python block of the
README and docs/ runs as the script a user would save (tests/doc_blocks.py), and every shell
command of them is parsed against the CLI, the Makefile and the files it names."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from doc_blocks import (
    ILLUSTRATIVE,
    PYTHON,
    SHELL,
    blocks,
    check_command,
    commands,
    doc_files,
    run_python_block,
)
from engine.policies.base import POLICIES, policy_registry
from evals.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
RUNNER = CliRunner(env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})


def guide_module(guide: str, module_name: str) -> types.ModuleType:
    """Run the one ```python block of ``docs/<guide>`` as the module ``module_name``."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / guide).read_text(encoding="utf-8"),
                        re.S | re.M)
    assert len(blocks) == 1, f"{guide} should hold exactly one python block, the whole file"
    module = types.ModuleType(module_name)
    module.__file__ = str(ROOT / "docs" / guide)
    sys.modules[module_name] = module  # dataclasses and `kvarena list` look the module up
    exec(compile(blocks[0], module.__file__, "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def guides():
    """The guides' policy and task, registered for this module's tests, then unregistered."""
    policy_registry()  # the built-ins first, so the guide's policy is registered after them
    policies, tasks = dict(POLICIES), dict(TASKS)
    try:
        policy = guide_module("adding-a-policy.md", "engine.policies.recent")
        task = guide_module("adding-a-task.md", "evals.tasks.svamp")
        yield policy, task
    finally:
        for registry, saved in ((POLICIES, policies), (TASKS, tasks)):
            registry.clear()
            registry.update(saved)
        for name in ("engine.policies.recent", "evals.tasks.svamp"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=2048)


def invoke(*args: str) -> str:
    result = RUNNER.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_the_guides_register_their_policy_and_task(guides):
    assert POLICIES["recent"] is guides[0].Recent and TASKS["svamp"] is guides[1].SVAMP
    listing = json.loads(invoke("list", "--json"))
    assert listing["policies"]["recent"]["arguments"] == {"budget": None, "budget_ratio": None,
                                                          "fallback_compress": False, "sink": 4}
    assert listing["policies"]["recent"]["fixed_budget"] == "budget"
    assert listing["tasks"]["svamp"]["presets"]["cpu"]["kv_budget"] == 256  # 2048 / 8, in range


def test_the_guide_policy_keeps_sink_and_recent_slots(guides, tiny_dir):
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.stats import never_compressed

    llm = LLM(str(tiny_dir), policy="recent", policy_args={"budget": 16, "sink": 4}, block_size=4)
    kept = []
    original = llm.policy.select

    def spy(view, target_len, timer):
        keep = original(view, target_len, timer)
        kept.append((view.physical_len, keep))
        return keep

    llm.policy.select = spy
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert out.num_output_tokens == 40 and 16 <= out.final_kv_len <= 20
    assert llm.last_stats.compactions == len(kept) >= 1
    assert never_compressed(llm.policy, llm.last_stats.compactions) is None
    for physical_len, keep in kept:
        row = keep[0, 0].tolist()
        assert row == [0, 1, 2, 3, *range(physical_len - 12, physical_len)]


def test_the_guide_policy_keeps_the_soak_contract(guides, tiny_dir):
    from evals.benchmarks import soak as S

    assert "recent" in S.registered_policies()
    result = S.soak_policy(str(tiny_dir), "recent", 4, S.SoakConfig(), 24)
    assert result.violations == [] and result.done == 24 and result.pages_leaked == 0
    assert result.compactions > 0


def test_the_guide_task_evaluates_end_to_end(guides, tiny_dir, tmp_path):
    data = tmp_path / "data" / "svamp"
    data.mkdir(parents=True)
    rows = [{"ID": "a1", "question_concat": "Tom has 3 apples and buys 4 more. How many?", "Answer": 7},
            {"ID": "a2", "question_concat": "A box holds 5 pens; 2 are taken. How many left?",
             "Answer": "3"},
            {"ID": "bad", "question_concat": "No answer here.", "Answer": "many"}]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "runs"
    text = invoke("eval", "-t", "svamp", "--data", str(tmp_path / "data"), "-p", "full",
                  "-p", "recent", "-a", "budget=16", "--block-size", "4", "--max-tokens", "24",
                  "--temperature", "0", "-m", str(tiny_dir), "--out", str(out), "--no-leaderboard",
                  "--threads", "1")
    assert "svamp/full" in text and "svamp/recent" in text
    runs = sorted(p.parent for p in out.rglob("metrics.json"))
    # the labels name the settings given that are not the guide task's preset
    assert [p.name.split("+mt=")[0] for p in runs] == ["full", "recent+budget=16"]
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["samples_done"] == 2, run
        config = json.loads((run / "config.json").read_text())
        assert [s["index"] for s in config["skipped_rows"]] == [2]  # the malformed row, listed
    recent = json.loads((runs[1] / "config.json").read_text())
    assert recent["policy"] == "recent" and recent["policy_args"] == {"budget": 16}


# The guides whose one Python block is a module the reader saves into the package (run above by
# `guide_module`, not as a script).
MODULE_GUIDES = {"adding-a-policy.md", "adding-a-task.md"}


def test_every_doc_block_says_what_it_is():
    """A fence names its language: commands (bash), code (python), or output (text)."""
    unlabelled = [b.where() for doc in doc_files() for b in blocks(doc)
                  if b.lang not in SHELL + PYTHON + ILLUSTRATIVE]
    assert unlabelled == []


def test_every_shell_command_in_the_docs_is_one_the_project_answers(guides):
    """Each command of every bash block, as written: `kvarena` options exist and parse, with
    registered policies, tasks and policy arguments (the guides' own are registered here);
    Makefile targets, scripts and test files exist."""
    checked = []
    for doc in doc_files():
        for block in blocks(doc):
            if block.lang in SHELL:
                for argv in commands(block.code):
                    try:
                        checked.append(check_command(argv, doc))
                    except Exception as e:
                        raise AssertionError(f"{block.where()}: {' '.join(argv)}: {e}") from e
    assert checked.count("make") >= 1 and len([c for c in checked if c.startswith("kvarena")]) > 20
    assert {"kvarena eval", "kvarena bench", "kvarena lm-eval", "kvarena generate", "pytest"} \
        <= set(checked)


@pytest.mark.parametrize("argv", [
    ["kvarena", "eval", "--task", "gsm8k", "--no-such-option", "1"],
    ["kvarena", "eval", "--task", "gsm8k", "--max-tokens", "many"],
    ["kvarena", "eval", "--task", "no-such-task"],
    ["kvarena", "eval", "--task", "gsm8k", "--policy", "no-such-policy"],
    ["kvarena", "eval", "--task", "gsm8k", "--policy", "snapkv", "-a", "no_such_field=1"],
    ["kvarena", "bench", "no-such-bench"],
    ["kvarena", "lm-eval", "-p", "snapkv", "--tasks", "gsm8k", "--no-such-lm-eval-option"],
    ["kvarena", "lm-eval", "-p", "no-such-policy", "--tasks", "gsm8k"],
    ["make", "no-such-target"],
    ["bash", "scripts/no_such_script.sh"],
    [".venv/bin/pytest", "tests/test_no_such_file.py"],
    ["curl", "https://example.com"],
], ids=lambda argv: " ".join(argv[:4]))
def test_a_doc_command_that_the_project_does_not_answer_fails(argv):
    with pytest.raises(AssertionError):
        check_command(argv, ROOT / "README.md")


def test_every_python_block_of_the_docs_runs_as_a_script(tiny_dir, tmp_path):
    """Saved as a file and run in a fresh interpreter on a tiny model: the engine snippet swaps
    policies and the budgets compress; the evaluation snippet writes runs and reads them back."""
    scripts = [b for doc in doc_files() if doc.name not in MODULE_GUIDES
               for b in blocks(doc) if b.lang in PYTHON]
    assert {b.path.name for b in scripts} == {"guide.md"} and len(scripts) == 2
    engine_block, eval_block = scripts
    printed = run_python_block(engine_block, tmp_path, tiny_dir)
    for policy in ("full", "snapkv", "zipage"):
        assert f"{policy}: compress events" in printed
    full, compressed = printed.split("snapkv:", 1)
    assert "full: compress events 0" in full  # FullKV never compresses, the budgets do
    assert re.findall(r"(?:snapkv|zipage): compress events [1-9]", compressed) != []
    printed = run_python_block(eval_block, tmp_path, tiny_dir)
    assert "pass@1" in printed and "fid_agreement" in printed
    runs = sorted(p.parent.name for p in (tmp_path / "runs" / "notebook").rglob("metrics.json"))
    assert len(runs) == 3 and [r.split("+")[0] for r in runs] == ["full", "snapkv", "zipage"]


def test_the_soak_node_ids_the_docs_name_are_the_ones_pytest_collects():
    """A guide's pytest command selects cases that exist: the soak test's node ids are
    ``[<policy>-<mode>]``; a built-in policy's, as pytest itself collects them, give the modes."""
    import subprocess

    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for test, case in re.findall(r"tests/test_soak\.py::(\w+)\[([^\]]*)\]", doc.read_text()):
            named.add((doc.name, test, case))
    assert named, "docs/adding-a-policy.md names the soak test's cases for its policy"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "-p", "no:cacheprovider", "tests/test_soak.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    cases = set(re.findall(r"::(\w+)\[snapkv-(\w+)\]", collected))
    assert {mode for _, mode in cases} == {"eager", "compiled"}
    for doc, test, case in named:
        policy, _, mode = case.rpartition("-")
        assert policy and (test, mode) in cases, f"{doc}: no soak case [{case}] of {test}"

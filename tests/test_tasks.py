"""Task registry, defaults, loaders (fixtures in tests/fixtures/data), prompts, NIAH."""

import base64
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from pathlib import Path

# Never wait on the network: datasets/huggingface_hub read these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

from evals.niah import Haystack, Needle, lcs_recall, score_answer, scores_to_grid, split_sentences
from evals.problem import DataUnavailableError
from evals.tasks import MATH_SYSTEM_PROMPT, TASKS, get_task, render_prompt
from evals.tasks.livecodebench import decode_tests, function_name
from evals.tasks.mixed import CPU_FACTOR

DATA = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Hub access that fails fast (offline, empty cache), whatever was imported before."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


class WordTokenizer:
    """A deterministic stand-in tokenizer: one token per word or punctuation mark."""

    def encode(self, text, add_special_tokens=True):
        return re.findall(r"\w+|[^\w\s]", text)


# --------------------------------------------------------------------------- registry/defaults


def test_registry():
    assert {"gsm8k", "math500", "amc23", "aime24", "livecodebench", "niah", "mixed"} <= set(TASKS)
    with pytest.raises(KeyError, match="known tasks"):
        get_task("gsm9k")
    with pytest.raises(ValueError, match="unknown task 'mixed' option"):
        get_task("mixed", scale=2)
    with pytest.raises(ValueError, match="factor"):
        get_task("mixed", factor=0)


def test_one_value_for_a_list_option_is_a_list_of_one():
    """`--task-arg lengths=1024` parses to the int 1024; every tuple field takes it as (1024,)."""
    from evals.cli import parse_task_args

    niah = get_task("niah", **parse_task_args(["lengths=1024", "depths=50"]))
    assert niah.lengths == (1024,) and niah.depths == (50.0,)
    assert get_task("niah", lengths=[256, 512]).lengths == (256, 512)
    assert get_task("longdoc", lengths=2048).lengths == (2048,)
    assert get_task("mixed", factor=2).factor == 2  # a scalar field stays a scalar


def test_builtin_data_is_found_inside_the_package_from_any_directory(tmp_path, monkeypatch):
    """`--data evals/data/gsm8k_mini.jsonl` (the README's) works outside the clone: a relative
    evals/ path that names nothing from the working directory is read from the package."""
    from evals.tasks.base import PACKAGE_ROOT, builtin_data

    monkeypatch.chdir(tmp_path)
    inside = PACKAGE_ROOT / "evals" / "data" / "gsm8k_mini.jsonl"
    assert builtin_data("evals/data/gsm8k_mini.jsonl") == str(inside)
    assert len(get_task("gsm8k").load("evals/data/gsm8k_mini.jsonl")) == 8
    assert builtin_data(None) is None and builtin_data("openai/gsm8k") == "openai/gsm8k"
    assert builtin_data("evals/data/none.jsonl") == "evals/data/none.jsonl"  # the usual error follows
    own = tmp_path / "evals" / "data" / "gsm8k_mini.jsonl"  # a file of the working directory wins
    own.parent.mkdir(parents=True)
    own.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    assert builtin_data("evals/data/gsm8k_mini.jsonl") == "evals/data/gsm8k_mini.jsonl"
    assert len(get_task("gsm8k").load("evals/data/gsm8k_mini.jsonl")) == 1


def test_table1_order_and_titles_come_from_the_task_classes():
    from evals.tasks import table1_tasks, task_title

    assert table1_tasks() == ("gsm8k", "math500", "amc23", "aime24", "livecodebench")
    assert [task_title(t) for t in ("livecodebench", "niah", "mixed", "unregistered")] == [
        "LiveCode", "NIAH", "Mixed", "unregistered"]


@pytest.mark.parametrize(
    "name, samples, max_tokens, budget",
    [("amc23", 32, 16384, 4096), ("aime24", 32, 32768, 4096), ("math500", 8, 16384, 4096),
     ("gsm8k", 4, 16384, 4096), ("livecodebench", 8, 16384, 8192)],
)
def test_paper_defaults_match_table5(name, samples, max_tokens, budget):
    d = get_task(name).defaults("paper")
    assert (d.samples, d.max_tokens, d.kv_budget, d.block_size, d.temperature) == (
        samples, max_tokens, budget, 256, 0.6)


def test_cpu_preset():
    d = get_task("gsm8k").defaults("cpu")
    assert (d.block_size, d.kv_budget, d.max_tokens, d.samples) == (32, 512, 2048, 1)
    assert get_task("livecodebench").defaults("cpu").kv_budget == 1024
    assert get_task("aime24").defaults("cpu").max_tokens == 2048  # capped
    assert get_task("niah").defaults("cpu").temperature == 0.0
    d = get_task("gsm8k").defaults("cpu-paper")  # the papers' pages and ratios at b = 16
    assert (d.block_size, d.kv_budget, d.max_tokens) == (16, 256, 1024)
    assert get_task("aime24").defaults("cpu-paper").max_tokens == 2048
    args = get_task("gsm8k").policy_args_for(("kara-wo-t2c", "kara"), "cpu-paper")
    assert args == {"window_tokens": 32, "buffer_tokens": 4, "chunk_budget": 2,
                    "max_chunk_gap": 2}
    assert get_task("niah").policy_args_for(("kara",), "cpu-paper")["compress_prompt"] is True
    assert get_task("gsm8k").policy_args_for(("growpage",), "cpu") == {}
    with pytest.raises(ValueError, match="valid scales"):
        get_task("gsm8k").defaults("gpu")


def test_preset_budgets_stay_in_range():
    from evals.tasks.base import PRESET_KV_BUDGET_RANGE

    low, high = PRESET_KV_BUDGET_RANGE
    from evals.tasks import SCALES

    for name in TASKS:
        for scale in SCALES:
            d = get_task(name).defaults(scale)
            assert d.kv_budget is None or low <= d.kv_budget <= high, (name, scale, d.kv_budget)


# --------------------------------------------------------------------------- loaders


def _load(name, data, task=None, **kw):
    """Load, returning (problems, warning messages) so tests can check the skipped-row report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps = (task or get_task(name)).load(data, **kw)
    return ps, [str(w.message) for w in caught]


def test_gsm8k_loader_skips_malformed_rows():
    ps, warned = _load("gsm8k", DATA)  # a data root: finds gsm8k/test.jsonl
    assert [p.gold for p in ps] == ["27", "1234", "180"]
    assert [p.uid for p in ps] == ["gsm8k/0", "gsm8k/1", "gsm8k/6"]
    reasons = {s.index: s.reason for s in ps.skipped}
    assert set(reasons) == {2, 3, 5}
    assert "invalid JSON" in reasons[2] and "####" in reasons[3] and "question" in reasons[5]
    assert len(warned) == 1 and "skipped 3 malformed row(s)" in warned[0]
    assert all(p.grader == "gsm8k" for p in ps)


def test_loader_accepts_file_and_folder_and_limit():
    by_file, _ = _load("gsm8k", DATA / "gsm8k" / "test.jsonl")
    by_folder, _ = _load("gsm8k", DATA / "gsm8k")
    assert [p.uid for p in by_file] == [p.uid for p in by_folder]
    limited, _ = _load("gsm8k", DATA, limit=2)
    assert len(limited) == 2


def test_math500_aime_amc_loaders():
    math500, _ = _load("math500", DATA)
    assert [p.gold for p in math500] == [r"\frac{1}{2}", "[2,3]", "4"]  # "4" from the solution's box
    assert math500[0].uid == "math500/test/prealgebra/1.json" and math500[0].meta["level"] == 1
    assert len(math500.skipped) == 2
    aime, _ = _load("aime24", DATA)
    assert [p.gold for p in aime] == ["025", "204"]
    assert sorted(s.reason.split()[0] for s in aime.skipped) == ["answer", "duplicate"]
    amc, _ = _load("amc23", DATA)
    assert [p.gold for p in amc] == ["27", "2.5"] and amc[1].question.startswith("What is half")
    assert len(amc.skipped) == 1


def test_livecodebench_loader():
    ps, warned = _load("livecodebench", DATA)
    assert [p.uid for p in ps] == ["livecodebench/9001_A", "livecodebench/9002"]
    stdin, func = ps
    assert stdin.meta["testtype"] == "stdin" and stdin.meta["fn_name"] is None
    assert func.meta["testtype"] == "functional" and func.meta["fn_name"] == "pairWithSum"
    assert func.meta["public_only"] and len(func.meta["tests"]) == 2
    reasons = " | ".join(s.reason for s in ps.skipped)
    assert "method name" in reasons and "no test cases" in reasons and "compressed form" in reasons
    assert len(ps.skipped) == 3 and warned


def test_livecodebench_compressed_private_tests_and_unsafe_pickles():
    tests = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert decode_tests(packed, "private") == tests
    evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()  # a global reference
    with pytest.raises(Exception, match="compressed form"):
        decode_tests(evil, "private")
    starter = "# class TreeNode:\n#     def __init__(self, x):\nclass Solution:\n    def solve(self, a):"
    assert function_name(starter) == "solve"


def test_missing_data_gives_a_clear_error(offline_hub, tmp_path):
    with pytest.raises(DataUnavailableError) as e:
        get_task("gsm8k").load()
    msg = str(e.value)
    assert "openai/gsm8k" in msg and "--data" in msg and "test.jsonl" in msg
    with pytest.raises(DataUnavailableError, match="does not exist"):
        get_task("math500").load(tmp_path / "nowhere" / "test.jsonl")
    with pytest.raises(DataUnavailableError, match="tried"):
        get_task("aime24").load(tmp_path)  # an empty directory
    with pytest.raises(DataUnavailableError, match="code_generation_lite"):
        get_task("livecodebench").load()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    with pytest.raises(DataUnavailableError, match="no usable rows"):
        _load("amc23", empty)


def test_hub_loading_calls_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        return [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ps = get_task("gsm8k").load()
    assert calls[-1] == ("openai/gsm8k", "main", "test", {}) and ps.source == "hub:openai/gsm8k"
    assert ps[0].gold == "4"
    get_task("gsm8k").load("someone/gsm8k-copy")  # a hub id given as --data
    assert calls[-1][0] == "someone/gsm8k-copy"
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [])
    with pytest.raises(DataUnavailableError):
        get_task("livecodebench").load()
    assert calls[-1] == (("livecodebench/code_generation_lite", None),
                         {"split": "test", "version_tag": "release_v1"})


def test_mixed_workload(tmp_path):
    paper = get_task("mixed")
    assert [paper.multiplicity(t) for t in ("amc23", "aime24", "gsm8k")] == [32, 32, 1]
    # The full Table 6 workload: 40*32 + 30*32 + 1319*1 = 3559 requests.
    total = sum(n * paper.multiplicity(t) for t, n in (("amc23", 40), ("aime24", 30), ("gsm8k", 1319)))
    assert total == 3559
    small = get_task("mixed", factor=CPU_FACTOR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixtures' malformed rows are tested above
        ps = small.load(DATA)
    by_task = {}
    for p in ps:
        by_task.setdefault(p.task, []).append(p.samples)
    assert by_task == {"amc23": [4, 4], "aime24": [4, 4], "gsm8k": [1, 1, 1]}
    assert {p.grader for p in ps} == {"amc", "aime", "gsm8k"}
    assert get_task("mixed").messages(ps[0])[0]["content"] == MATH_SYSTEM_PROMPT
    with pytest.raises(DataUnavailableError, match="data root"):
        small.load(DATA / "gsm8k" / "test.jsonl")


# --------------------------------------------------------------------------- prompts


def test_math_and_code_messages():
    p = get_task("gsm8k").load(DATA, limit=1)[0]
    msgs = get_task("gsm8k").messages(p)
    assert msgs == [{"role": "system", "content": MATH_SYSTEM_PROMPT},
                    {"role": "user", "content": p.question}]
    assert MATH_SYSTEM_PROMPT == "Please reason step by step, and put your final answer within \\boxed{}."
    lcb = get_task("livecodebench")
    stdin, func, *_ = _load("livecodebench", DATA)[0]
    user = lcb.messages(stdin)[1]["content"]
    assert user.startswith("### Question:\n") and "standard input" in user and "# YOUR CODE HERE" in user
    assert user.rstrip().endswith("### Answer: (use the provided format with backticks)")
    user = lcb.messages(func)[1]["content"]
    assert "def pairWithSum(self" in user and "```python\nclass Solution:" in user


class FakeTokenizer:
    def __init__(self, template):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        self.calls.append(dict(tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kw))
        return "|".join(m["content"] for m in messages) + ("<think>" if kw.get("enable_thinking") else "")


def test_render_prompt_thinking_switch():
    msgs = [{"role": "user", "content": "hi"}]
    qwen = FakeTokenizer("{% if enable_thinking %}...{% endif %}")
    assert render_prompt(qwen, msgs, thinking=True) == "hi<think>"
    assert qwen.calls[-1] == {"tokenize": False, "add_generation_prompt": True, "enable_thinking": True}
    render_prompt(qwen, msgs, thinking=False)
    assert qwen.calls[-1]["enable_thinking"] is False
    render_prompt(qwen, msgs)
    assert "enable_thinking" not in qwen.calls[-1]
    plain = FakeTokenizer("{{ messages }}")
    with pytest.raises(ValueError, match="enable_thinking"):
        render_prompt(plain, msgs, thinking=True)
    render_prompt(plain, msgs, thinking=False)  # nothing to switch off: fine
    assert "enable_thinking" not in plain.calls[-1]
    with pytest.warns(UserWarning, match="no chat template"):
        assert render_prompt(FakeTokenizer(None), msgs).endswith("assistant:")


def test_render_prompt_with_a_real_transformers_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", chat_template=template)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_prompt(tok, msgs) == "<system>S</system><user>Q</user><assistant>"
    assert render_prompt(tok, msgs, thinking=False).endswith("<assistant><think></think>")
    assert render_prompt(tok, msgs, thinking=True).endswith("<assistant>")


# --------------------------------------------------------------------------- NIAH


def test_niah_grid_from_essays():
    task = get_task("niah", lengths=(120, 200), depths=(0, 50, 100))
    with pytest.warns(UserWarning, match="malformed file.*empty file"):  # LICENSE files ignored
        ps = task.load(DATA / "niah", tokenizer=WordTokenizer())
    assert [s.reason for s in ps.skipped] == ["empty file"]
    assert len(ps) == 6 and ps[0].uid == "niah/L120_D0"
    needle = task.needle.text
    for p in ps:
        ctx = p.meta["context"]
        assert ctx.count(needle) == 1 and "Public domain" not in ctx
        assert p.meta["prompt_tokens"] <= p.meta["context_length"]
        assert p.meta["prompt_tokens"] >= p.meta["context_length"] - 30  # the budget is used
        before = ctx[: ctx.index(needle)]
        assert before == "" or re.search(r"[.!?]\s*$", before), "needle not at a sentence boundary"
        assert p.gold == "lavender honey" and p.grader == "niah"
    assert ps[0].meta["context"].startswith(needle)
    assert ps[2].meta["context"].rstrip().endswith(needle)
    assert 30 <= ps[1].meta["actual_depth_percent"] <= 50
    msg = task.messages(ps[1])[0]["content"]
    assert "<document>" in msg and task.needle.question in msg


def test_niah_offline_fallback_and_errors(tmp_path):
    task = get_task("niah", lengths=(300,), depths=(50,))
    with pytest.warns(UserWarning, match="generated haystack"):
        ps = task.load(None, tokenizer=WordTokenizer())
    assert len(ps) == 1 and ps.source.startswith("synthetic")
    assert "honey" not in ps[0].meta["context"].replace(task.needle.text, "")
    with pytest.raises(ValueError, match="tokenizer"):
        task.load(None)
    with pytest.raises(DataUnavailableError, match="does not exist"):
        task.load(tmp_path / "missing", tokenizer=WordTokenizer())
    shutil.copy(DATA / "niah" / "essays" / "empty.txt", tmp_path / "only_empty.txt")
    with pytest.raises(DataUnavailableError, match="no usable .txt"):
        task.load(tmp_path, tokenizer=WordTokenizer())
    with pytest.raises(ValueError, match="too small"), pytest.warns(UserWarning, match="generated"):
        get_task("niah", lengths=(10,)).load(None, tokenizer=WordTokenizer())
    with pytest.raises(ValueError, match="depths"):
        get_task("niah", depths=(120,))


def test_niah_short_haystack_is_repeated():
    task = get_task("niah", lengths=(1500,), depths=(50,))
    p = _load("niah", DATA / "niah", tokenizer=WordTokenizer(), task=task)[0][0]  # essays: ~250 tokens
    assert 1400 <= p.meta["prompt_tokens"] <= 1500


def test_niah_scoring_and_grid():
    needle = Needle("The code word is blue falcon.", "What is the code word?", "blue falcon")
    assert score_answer("It is Blue-Falcon!", needle) == (True, 1.0)
    found, score = score_answer("Something blue, I think.", needle)
    assert not found and score == 0.5
    assert lcs_recall("a b c d", "a x c d") == 0.75
    assert split_sentences("One. Two!Three?  Four") == ["One. ", "Two!", "Three?  ", "Four"]
    grader = get_task("niah").grade
    task = get_task("niah", lengths=(200,), depths=(0,))
    p = _load("niah", DATA / "niah", tokenizer=WordTokenizer(), task=task)[0][0]
    r = grader("<think>lavender? no...</think>A spoonful of lavender honey.", p)
    assert r.correct and r.score == 1.0 and r.extracted == "A spoonful of lavender honey."
    r = grader("<think>it is lavender honey</think>I don't know.", p)  # only the final answer counts
    assert not r.correct
    grid = scores_to_grid([
        {"context_length": 512, "depth_percent": 0, "score": 1.0},
        {"context_length": 512, "depth_percent": 0, "score": 0.0},
        {"context_length": 1024, "depth_percent": 50, "score": 1.0},
        (256, 50, 0.25),
    ])
    assert list(grid.columns) == [256, 512, 1024] and list(grid.index) == [0, 50]
    assert grid.loc[0, 512] == 0.5 and grid.loc[50, 256] == 0.25
    assert grid.isna().loc[0, 1024]
    with pytest.raises(KeyError, match="lacks"):
        scores_to_grid([{"context_length": 1, "score": 1}])


def test_haystack_placement_unit():
    hay = Haystack("Aa bb. Cc dd. Ee ff. Gg hh.", WordTokenizer(), max_tokens=100)
    assert hay.total_tokens == 12
    ctx, depth = hay.place(9, 50, "NEEDLE.")  # 3 sentences fit; halfway is after the first
    assert ctx == "Aa bb. NEEDLE. Cc dd. Ee ff. " and depth == pytest.approx(100 / 3)
    ctx, depth = hay.place(12, 100, "NEEDLE.")
    assert ctx == "Aa bb. Cc dd. Ee ff. Gg hh. NEEDLE." and depth == 100
    ctx, depth = hay.place(5, 0, "NEEDLE.")  # never less than one sentence
    assert ctx == "NEEDLE. Aa bb. " and depth == 0


# --------------------------------------------------------------------------- hostile data rows

GOOD = {"question": "What is 2 + 3?", "answer": "#### 5"}


def _rows_file(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_bad_rows_are_rejected_one_by_one_and_the_good_rows_kept(tmp_path):
    deep = '{"question": "q", "answer": "#### 1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    nested = '{"question": "q", "answer": "#### 1", "x": ' + "[" * 40 + "]" * 40 + "}"
    lines = [json.dumps(GOOD),
             deep,                                                    # past the parser's stack
             nested,                                                  # past MAX_ROW_DEPTH
             '{"question": "lone \\ud800 surrogate", "answer": "#### 1"}',
             '{"question": "q", "answer": "#### 1", "\\udfff": 1}',    # in a key
             json.dumps({"question": 5, "answer": "#### 1"}),         # wrong types
             json.dumps({"question": "q", "answer": ["#### 1"]}),
             json.dumps(["a", "list"]),
             json.dumps({**GOOD, "question": "What is 4 + 4?", "answer": "#### 8"})]
    ps, warned = _load("gsm8k", _rows_file(tmp_path / "test.jsonl", lines))
    assert [p.gold for p in ps] == ["5", "8"] and [p.uid for p in ps] == ["gsm8k/0", "gsm8k/8"]
    reasons = {s.index: s.reason for s in ps.skipped}
    assert set(reasons) == {1, 2, 3, 4, 5, 6, 7}
    assert "nested deeper" in reasons[1] and "nested deeper" in reasons[2]
    assert "surrogate" in reasons[3] and "surrogate" in reasons[4]
    assert "question" in reasons[5] and "'answer'" in reasons[6] and "not a JSON object" in reasons[7]
    assert len(warned) == 1


def test_livecodebench_row_of_wrong_types_is_rejected_not_raised(tmp_path):
    good = (DATA / "livecodebench" / "lcb_sample.jsonl").read_text().splitlines()[0]
    row = json.loads(good)
    bad = [{**row, "question_id": "b1", "public_test_cases": 5},
           {**row, "question_id": "b2", "starter_code": ["not", "text"]},
           {**row, "question_id": "b3", "testtype": 5}]
    path = _rows_file(tmp_path / "lcb.jsonl", [json.dumps(b) for b in bad] + [good])
    ps, _ = _load("livecodebench", path)
    assert [p.uid for p in ps] == ["livecodebench/9001_A"] and len(ps.skipped) == 3


def test_an_overlong_line_is_rejected_without_reading_it_whole(tmp_path):
    from evals.tasks.base import MAX_ROW_BYTES, read_rows_file

    # The default bound: a 17 MB question (GSM8K's bound is 16 MiB) is one rejected row.
    huge = json.dumps({"question": "x" * (MAX_ROW_BYTES + (1 << 20)), "answer": "#### 1"})
    path = _rows_file(tmp_path / "test.jsonl", [json.dumps(GOOD), huge, json.dumps(GOOD | {"id": 2})])
    ps, _ = _load("gsm8k", path)
    assert [p.uid for p in ps] == ["gsm8k/0", "gsm8k/2"]
    assert "longer than the" in ps.skipped[0].reason and ps.skipped[0].index == 1

    # read_rows_file holds at most bound + 1 bytes of a line, then skips the rest in chunks.
    import tracemalloc

    small = _rows_file(tmp_path / "small.jsonl", [json.dumps(GOOD), "y" * 20_000_000, json.dumps(GOOD)])
    tracemalloc.start()
    try:
        rows = list(read_rows_file(small, max_row_bytes=4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [type(r).__name__ for _, r in rows] == ["dict", "RowError", "dict"]
    assert "20000001 bytes" in str(rows[1][1])
    assert peak < 4_000_000, peak  # never the 20 MB line in one piece


def test_data_fingerprint_is_the_files_sha256(tmp_path):
    import hashlib

    from evals.problem import data_fingerprint

    a = _rows_file(tmp_path / "a.jsonl", [json.dumps(GOOD)])
    b = _rows_file(tmp_path / "b.jsonl", [json.dumps(GOOD | {"id": 1})])
    assert data_fingerprint([str(a)]) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert data_fingerprint([]) is None
    assert data_fingerprint([str(a), str(b)]) != data_fingerprint([str(b), str(a)])
    ps, _ = _load("gsm8k", a)
    assert ps.files == (str(a),)
    mixed = get_task("mixed", factor=CPU_FACTOR).load(DATA, limit=1)
    assert len(mixed.files) == 3 and all(Path(f).is_file() for f in mixed.files)

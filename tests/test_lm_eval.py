"""lm-evaluation-harness through the engine (evals/lm_eval_adapter.py), offline.

On FullKV the adapter's log-likelihoods match lm-eval's own ``hf`` backend on the same tiny random
checkpoint (fp32 both sides), so a multiple-choice accuracy is identical; generate_until returns
the engine's own greedy outputs; a compressing policy runs through the adapter and its statistics
reach lm-eval's results. Tasks are local YAMLs over jsonl fixtures (tests/fixtures/lm_eval/),
copied to a temporary folder and run from there, so no dataset cache outside it is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

# Before lm_eval/datasets are imported: nothing may try the network.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from engine.config import ConfigError  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from evals.lm_eval_adapter import AdapterError, KvarenaLM, lm_eval_runs, main, parse_policy_args  # noqa: E402
from tiny_models import make_tiny_llama_dir  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
TASKS = ["kvarena_mc", "kvarena_gen", "kvarena_ppl"]
# fp32 on both sides; sums of up to a few hundred token log-probabilities, added in another order.
LL_ATOL = 1e-4
ENGINE = dict(block_size=8, kv_cache_tokens=4096)
EOS_ID = 2  # <|im_end|> in tests/tiny_models.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("lm_eval_model"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The task YAMLs and their data in a temporary folder (data_files are relative to it)."""
    path = tmp_path_factory.mktemp("lm_eval_tasks") / "tasks"
    shutil.copytree(FIXTURES, path)
    return path


@contextlib.contextmanager
def inside(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def task_manager(workspace):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(workspace))


@pytest.fixture(scope="module")
def ours(model_dir):
    return KvarenaLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def hf(model_dir, ours):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4,
                max_length=ours.max_length)


def ll(context, continuation, i=0):
    return Instance("loglikelihood", {}, (context, continuation), i)


def evaluate(lm, task_manager, workspace, tasks):
    with inside(workspace):
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager,
                                       log_samples=True, bootstrap_iters=0)


# -- the engine: a forced continuation is scored to its end ---------------------------------------


def test_forced_tokens_containing_eos_and_a_stop_string_are_scored_to_the_end(model_dir):
    llm = LLM(str(model_dir), **ENGINE)
    stop_text = "fox"
    forced = tuple(llm.tokenizer.encode(" a fox", add_special_tokens=False)) + (EOS_ID, 40, 41)
    out = llm.generate(["The quick brown"], SamplingParams(
        temperature=0.0, max_tokens=len(forced), forced_tokens=forced, logprobs=True,
        stop=(stop_text,)))[0]
    assert out.finish_reason == "forced"
    assert out.token_ids == list(forced) and len(out.token_logprobs) == len(forced)
    # After the forced tokens a request decodes freely again, and EOS stops it as before.
    free = llm.generate(["The quick brown"], SamplingParams(
        temperature=0.0, max_tokens=len(forced) + 4, forced_tokens=forced[:2]))[0]
    assert free.token_ids[:2] == list(forced[:2])


# -- log-likelihoods against lm-eval's hf backend ---------------------------------------------------


def test_loglikelihoods_match_the_hf_backend(ours, hf):
    greedy = ours.llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=5,
                                                                       ignore_eos=True))[0]
    requests = [
        ll("The quick brown fox", " jumps over the lazy dog"),
        ll("Question: what is 2+2?\nAnswer: ", "4"),               # trailing space moves over
        ll("", "hello world"),                                      # empty context: prefix token
        ll("A careful reader", " checks<|im_end|> every step."),    # EOS inside the continuation
        ll("Natalia sold clips.", "\n\nQuestion: next"),             # a stop-like string inside
        ll("The quick brown fox", ours.tok_decode(greedy.token_ids)),  # the greedy continuation
        ll("Compression keeps tokens " * 40, " and growth appends pages"),  # > max_length: truncated
    ]
    mine, theirs = ours.loglikelihood(requests), hf.loglikelihood(requests)
    diffs = [abs(a[0] - b[0]) for a, b in zip(mine, theirs)]
    print("loglikelihood |ours - hf|:", [f"{d:.2e}" for d in diffs])
    assert max(diffs) < LL_ATOL
    assert [a[1] for a in mine] == [b[1] for b in theirs]
    assert mine[5][1] is True  # the engine's own greedy tokens are greedy under scoring


def test_truncated_context_matches_hf_at_a_small_max_length(model_dir):
    from lm_eval.models.huggingface import HFLM

    small = KvarenaLM(str(model_dir), max_length=24, **ENGINE)
    hf = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=2, max_length=24)
    requests = [ll("Paged attention stores keys and values in fixed-size blocks", " of token slots"),
                ll("The quick brown fox jumps over the lazy dog. " * 3, " The end")]
    diffs = [abs(a[0] - b[0]) for a, b in zip(small.loglikelihood(requests), hf.loglikelihood(requests))]
    assert max(diffs) < LL_ATOL
    text = "The quick brown fox jumps over the lazy dog. " * 6
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert small.loglikelihood_rolling(rolling)[0] == pytest.approx(
        hf.loglikelihood_rolling(rolling)[0], abs=LL_ATOL)
    assert small.runs[-1]["request_type"] == "loglikelihood_rolling"
    assert small.runs[-1]["num_requests"] > 1  # several windows, submitted in one engine call


def test_multiple_choice_and_perplexity_tasks_equal_the_hf_backend(ours, hf, task_manager, workspace):
    tasks = ["kvarena_mc", "kvarena_ppl"]
    mine, theirs = (evaluate(lm, task_manager, workspace, tasks) for lm in (ours, hf))
    for metric in ("acc,none", "acc_norm,none"):
        assert mine["results"]["kvarena_mc"][metric] == theirs["results"]["kvarena_mc"][metric]
    diffs = []
    for a, b in zip(mine["samples"]["kvarena_mc"], theirs["samples"]["kvarena_mc"]):
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])  # the same choice per doc
        diffs += [abs(x[0][0] - y[0][0]) for x, y in zip(a["resps"], b["resps"])]
    print(f"kvarena_mc acc {mine['results']['kvarena_mc']['acc,none']} acc_norm "
          f"{mine['results']['kvarena_mc']['acc_norm,none']} (hf "
          f"{theirs['results']['kvarena_mc']['acc,none']}, "
          f"{theirs['results']['kvarena_mc']['acc_norm,none']}), max |ours - hf| {max(diffs):.2e} "
          f"over {len(diffs)} choices; "
          f"bits_per_byte {mine['results']['kvarena_ppl']['bits_per_byte,none']:.6f} "
          f"(hf {theirs['results']['kvarena_ppl']['bits_per_byte,none']:.6f})")
    assert max(diffs) < LL_ATOL
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert mine["results"]["kvarena_ppl"][metric] == pytest.approx(
            theirs["results"]["kvarena_ppl"][metric], rel=1e-5)


# -- generation ------------------------------------------------------------------------------------


def test_generate_until_returns_the_engines_greedy_outputs(ours, task_manager, workspace):
    results = evaluate(ours, task_manager, workspace, ["kvarena_gen"])
    samples = results["samples"]["kvarena_gen"]
    prompts = [ours.tok_encode(s["doc"]["question"]) for s in samples]  # doc_to_text: the question
    engine = ours.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                       stop=("\n", ".")))
    expected = [o.text.split("\n")[0].split(".")[0] for o in engine]
    assert [s["resps"][0][0] for s in samples] == expected
    assert any(expected)


def test_generate_until_stops_seeds_and_lengths(ours):
    gen = {"until": ["fox"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0, "top_p": 0.9}
    reqs = [Instance("generate_until", {}, (p, dict(gen)), i)
            for i, p in enumerate(["The quick brown", "Paged attention", "Let x be"])]
    first = ours.generate_until(reqs)
    again = ours.generate_until(list(reversed(reqs)))[::-1]  # same request, same draw, any order
    assert first == again and all("fox" not in t for t in first)
    seeded = [Instance("generate_until", {}, ("The quick brown", dict(gen, seed=99)), 0)]
    other = ours.generate_until(seeded)
    assert other == ours.generate_until(seeded) and other[0] != first[0]
    ours.generate_until([Instance("generate_until", {}, ("The quick brown", {"max_gen_toks": 5}), 0)])
    assert ours.runs[-1]["output_tokens"] <= 5
    with pytest.raises(AdapterError, match="num_beams"):
        ours.generate_until([Instance("generate_until", {}, ("x", {"num_beams": 4}), 0)])
    with pytest.raises(AdapterError, match="repetition_penalty"):
        ours.generate_until([Instance("generate_until", {}, ("x", {"repetition_penalty": 1.2}), 0)])
    with pytest.raises(AdapterError, match="max_gen_toks"):
        ours.generate_until([Instance("generate_until", {}, ("x", {"max_gen_toks": 10_000}), 0)])


# -- a compressing policy --------------------------------------------------------------------------


def test_a_compressing_policy_runs_and_its_stats_reach_the_results(model_dir, ours, task_manager,
                                                                    workspace):
    snap = KvarenaLM(str(model_dir), policy="snapkv", policy_args="budget=16;window=4", **ENGINE)
    results = evaluate(snap, task_manager, workspace, ["kvarena_mc", "kvarena_gen"])
    stats = results["config"]["kvarena"]
    assert stats["policy"] == "snapkv" and stats["policy_args"]["budget"] == 16
    assert stats["events"].get("prefill_compress", 0) + stats["events"].get("compress", 0) > 0
    assert stats["avg_kv_budget"] is not None and stats["avg_kv_budget"] <= 16 + ENGINE["block_size"]
    assert {r["request_type"] for r in stats["runs"]} == {"loglikelihood", "generate_until"}
    # Compression changes the scores of long contexts: the policy really ran.
    long = [ll("Compression keeps the most important tokens. " * 4, " growth appends a page")]
    assert abs(snap.loglikelihood(long)[0][0] - ours.loglikelihood(long)[0][0]) > 1e-3


def test_policy_args_forms():
    assert parse_policy_args(None) == {}
    assert parse_policy_args({"budget": 8}) == {"budget": 8}
    assert parse_policy_args('{"budget": 8}') == {"budget": 8}
    assert parse_policy_args("budget=8;window=2") == {"budget": "8", "window": "2"}
    assert parse_policy_args(["budget=8"]) == {"budget": "8"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_policy_args("budget")


# -- `kvarena lm-eval` -----------------------------------------------------------------------------


def test_cli_arguments_pass_through_to_lm_eval():
    ours, runs = lm_eval_runs(["--tasks", "a,b", "-m", "some/dir", "--limit", "3", "-p", "snapkv",
                               "-a", "budget=64", "--policy-arg", "window=8",
                               "--model_args", "kv_cache_tokens=2048", "--log_samples"])
    ((label, argv),) = runs
    assert label == "snapkv+budget=64+window=8"
    assert argv[:7] == ["run", "--tasks", "a,b", "--limit", "3", "--model_args",
                        "kv_cache_tokens=2048"]
    assert argv[7:12] == ["--log_samples", "--device", "auto", "--model", "kvarena"]
    assert json.loads(argv[-1]) == {"pretrained": "some/dir", "policy": "snapkv",
                                    "policy_args": {"budget": "64", "window": "8"}}
    with pytest.raises(AdapterError, match="-M"):
        lm_eval_runs(["-M", "hf", "--tasks", "a"])


def test_cli_gives_each_policy_its_own_output_directory(tmp_path):
    _, runs = lm_eval_runs(["--tasks", "a", "-p", "full", "-p", "zipage", "-a", "zipage:budget=64",
                            "--output_path", str(tmp_path / "out")])
    assert [label for label, _ in runs] == ["full", "zipage+budget=64"]
    outputs = [argv[argv.index("--output_path") + 1] for _, argv in runs]
    assert outputs == [str(tmp_path / "out" / "full"), str(tmp_path / "out" / "zipage+budget=64")]
    _, runs = lm_eval_runs(["--tasks", "a", "-o", "res.json", "--output_path=x"])
    argv = runs[0][1]
    assert argv[argv.index("-o") + 1] == "full/res.json" and "--output_path=x/full" in argv


@pytest.mark.parametrize("args, message", [
    (["-p", "nope"], "unknown policy 'nope'"),
    (["-p", "zipage", "-a", "budgte=64"], "unknown argument(s) ['budgte'] for policy 'zipage'"),
    (["-p", "zipage", "-a", "budget=-3"], "budget must be a positive number"),
    (["-p", "full", "-p", "snapkv", "-a", "sink=8"], "--policy-arg sink: none of the policies"),
])
def test_cli_rejects_bad_policies_before_lm_eval_starts(args, message):
    from typer.testing import CliRunner

    from cli import app

    wide = CliRunner(env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    result = wide.invoke(app, ["lm-eval", "--tasks", "a", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1  # the one error line, as kvarena eval's

def test_cli_writes_lm_evals_results_json_with_engine_stats(model_dir, workspace, tmp_path, capsys):
    out = tmp_path / "out"
    with inside(workspace):
        main(["--model", str(model_dir), "-p", "zipage", "-a", "budget=16", "-a", "window=4",
              "--include_path", str(workspace), "--tasks", "kvarena_mc", "--limit", "4",
              "--model_args", "block_size=8,kv_cache_tokens=2048", "--output_path", str(out),
              "--log_samples", "--threads", "1"])
    files = sorted(out.rglob("results_*.json"))
    assert len(files) == 1 and sorted(out.rglob("samples_kvarena_mc_*.jsonl"))
    assert files[0].relative_to(out).parts[0] == "zipage+budget=16+window=4"  # one directory per policy
    results = json.loads(files[0].read_text())
    assert results["results"]["kvarena_mc"]["sample_len"] == 4
    stats = results["config"]["kvarena"]
    assert stats["policy"] == "zipage" and stats["block_size"] == 8
    assert stats["num_requests"] == sum(len(json.loads(line)["resps"])
                                        for f in out.rglob("samples_*.jsonl")
                                        for line in f.read_text().splitlines())
    assert "kvarena_mc" in capsys.readouterr().out  # lm-eval's table is printed

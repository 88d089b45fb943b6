"""`kvarena list` and the help texts come from the policy and task registries."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from engine.policies.base import policy_fields, policy_registry
from engine.policies.fixed_budget import FixedBudgetPolicy
from engine.policies.snapkv import SnapKV
from evals.run.sweep import fixed_budget_policies
from evals.tasks import TASKS, get_task

POLICIES = policy_registry()  # every registered policy, built-ins included

# Wide, colourless output, so rich never wraps a name across lines.
RUNNER = CliRunner(env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})


def invoke(*args: str) -> str:
    result = RUNNER.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def listing() -> dict:
    return json.loads(invoke("list", "--json"))


def test_list_shows_every_policy_with_its_fields_and_defaults():
    policies = listing()["policies"]
    assert list(policies) == list(POLICIES)
    for name, cls in POLICIES.items():
        fields = policy_fields(cls)
        assert list(policies[name]["arguments"]) == list(fields), name
        built = cls()  # every field has a default: the listing shows what a bare build uses
        for key, shown in policies[name]["arguments"].items():
            value = getattr(built, key)
            assert shown == (list(value) if isinstance(value, tuple) else value), (name, key)
        assert policies[name]["summary"], name
    assert policies["zipage"]["arguments"]["budget"] is None
    assert policies["growpage-fixed"]["fixed_budget"] == "budget"
    assert policies["growpage"]["fixed_budget"] is None and policies["full"]["arguments"] == {}


def test_list_shows_every_task_with_its_presets_and_options():
    tasks = listing()["tasks"]
    assert list(tasks) == list(TASKS)
    for name in TASKS:
        for scale in ("paper", "cpu"):
            assert tasks[name]["presets"][scale] == dataclasses.asdict(get_task(name).defaults(scale))
    assert tasks["gsm8k"]["presets"]["paper"]["kv_budget"] == 4096
    assert tasks["gsm8k"]["presets"]["cpu"]["kv_budget"] == 512
    assert tasks["niah"]["options"]["lengths"] == [256, 512, 1024, 2048]
    assert tasks["livecodebench"]["title"] == "LiveCode"


def test_list_as_tables_names_everything():
    text = invoke("list")
    for name in [*POLICIES, *TASKS]:
        assert name in text
    assert "window=16" in text and "paper: samples=4 max_tokens=16384" in text


def test_list_prints_whole_values_without_markup_at_80_columns():
    from cli import policy_rows, task_rows

    narrow = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}).invoke(app, ["list"])
    assert narrow.exit_code == 0, narrow.output
    assert "\u2026" not in narrow.output and "`" not in narrow.output  # no ellipsis, no RST quotes
    data = listing()
    cells = {row[0]: row for row in task_rows(data)}
    assert "lengths=256,512,1024,2048" in cells["niah"][2].splitlines()
    assert "gsm8k/test.jsonl" in cells["gsm8k"][3] and "`" not in cells["gsm8k"][3]
    assert all("`" not in row[2] for row in policy_rows(data))
    assert "`" not in json.dumps(data)


HEAVY_MODULES = ("torch", "transformers", "pandas", "matplotlib", "lm_eval", "ray", "numpy", "datasets")


def test_top_level_help_imports_nothing_heavy():
    """`kvarena --help` (and building every command) loads none of the heavy libraries: each
    command imports what it needs when it runs, and help texts list the registries only when a
    command's own help page is shown."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['kvarena', '--help']\n"
            "import cli\n"
            "try:\n    cli.app()\nexcept SystemExit:\n    pass\n"
            f"print('LOADED', sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY_MODULES)!r}))")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "eval" in done.stdout and "leaderboard" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "LOADED []", done.stdout[-500:]


def test_help_lists_come_from_the_registries():
    for command in ("eval", "sweep"):
        text = invoke(command, "--help")
        assert all(name in text for name in TASKS), command
    assert all(name in invoke("eval", "--help") for name in POLICIES)
    sweep_help = invoke("sweep", "--help")
    line = next(ln for ln in sweep_help.splitlines() if "Fixed-budget policy:" in ln)
    assert all(name in line for name in fixed_budget_policies())
    assert "growpage," not in line and "growpage-random" not in line


def test_fixed_budget_policies_follow_the_budget_field(monkeypatch):
    fixed = fixed_budget_policies()
    # Derived from the registry, so a newly registered policy never breaks this test: every policy
    # built on FixedBudgetPolicy, and any other with a `budget` field, is swept by that field;
    # the GrowPage family without one (its initial capacity is not a budget) is not.
    for name, cls in POLICIES.items():
        expected = "budget" if "budget" in policy_fields(cls) else None
        assert fixed.get(name) == expected, name
        if issubclass(cls, FixedBudgetPolicy):
            assert fixed.get(name) == "budget", name
    assert {"zipage", "snapkv", "chunkkv", "growpage-fixed"} <= set(fixed)
    assert not {"full", "growpage", "growpage-random", "kara"} & set(fixed)

    @dataclasses.dataclass
    class Mine(SnapKV):
        name = "mine-fixed"

    monkeypatch.setitem(POLICIES, "mine-fixed", Mine)
    assert fixed_budget_policies()["mine-fixed"] == "budget"
    assert listing()["policies"]["mine-fixed"]["arguments"]["budget"] is None


def test_one_message_for_an_unknown_name_with_the_closest_names():
    from engine.config import ConfigError, unknown_name
    from engine.policies.base import build_policy

    assert unknown_name("task", "math5000", TASKS) == (
        f"unknown task 'math5000' (did you mean 'math500'?); known tasks: {sorted(TASKS)}")
    assert "did you mean" not in unknown_name("task", "zzz", TASKS)
    with pytest.raises(ConfigError, match=r"did you mean 'growpage' or 'growpage-\w+'"):
        build_policy("growpag")
    with pytest.raises(KeyError, match="did you mean 'niah'"):
        get_task("naih")


def test_only_fullkv_never_compresses():
    assert [name for name, cls in POLICIES.items() if not cls.compresses] == ["full"]


@pytest.mark.parametrize("args, message", [
    (["sweep", "-t", "gsm8k", "-p", "growpage", "--budgets", "64"], "fixed-budget policy"),
    (["eval", "-t", "gsm8k", "-p", "nope"], "unknown policy 'nope'; known policies"),
    (["eval", "-t", "gsm8k", "-p", "snapk"], "unknown policy 'snapk' (did you mean 'snapkv'?)"),
    (["eval", "-t", "gsm9k"], "unknown task 'gsm9k' (did you mean 'gsm8k'?)"),
    (["sweep", "-t", "gsm8k", "-p", "zipag", "--budgets", "64"], "did you mean 'zipage'?"),
    (["eval", "-t", "gsm8k", "-p", "full", "-p", "snapkv", "--label", "x"],
     "--label names one run directory per task: give one --policy with it"),
    (["eval", "-t", "gsm8k", "--label", "../x"], "label must be a directory name"),
])
def test_usage_errors_exit_2_with_the_valid_choices(args, message, tmp_path):
    result = RUNNER.invoke(app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--temperature", "-1"], "temperature must be a finite number"),
    (["--threads", "0"], "--threads must be an integer in [1, 1024]"),
    (["--seed", str(10**23)], "seed must be an integer in [0, 4294967295]"),
    (["--seed", "-1"], "seed must be an integer"),
    (["--kv-cache-tokens", "10000000000000"], "kv_cache_tokens must be an integer in [1, 2147483647]"),
    (["--max-num-seqs", "100000000000"], "max_num_seqs must be an integer in [1, 2147483647]"),
    (["--max-tokens", "0"], "max_tokens must be an integer"),
    (["--samples", "100000000"], "samples must be an integer in [1, 1000000]"),
    (["--block-size", "2048"], "block_size must be an integer in [1, 1024]"),
    (["--grading-workers", "100000"], "grading_workers must be an integer in [1, 1024]"),
    (["--out", ""], "out must name a results directory"),
    (["--out", "   "], "out must name a results directory"),
])
def test_absurd_eval_values_get_a_one_line_error_before_anything_loads(args, message, tmp_path,
                                                                       monkeypatch):
    import engine.models.loader as loader

    monkeypatch.setattr(loader, "resolve_model", lambda *a, **k: pytest.fail("the model loaded"))
    out = ["--out", str(tmp_path)] if "--out" not in args else []
    result = RUNNER.invoke(app, ["eval", "-t", "gsm8k", *out, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("where", ["/proc/kvarena-x/results", "file/results", "/dev/null/results"])
def test_out_where_mkdir_fails_gets_a_one_line_error(where, tmp_path, monkeypatch):
    import engine.models.loader as loader

    if where.startswith("/proc") and not Path("/proc/self").is_dir():
        pytest.fail("this test needs Linux's /proc (mkdir below it fails with ENOENT)")
    (tmp_path / "file").write_text("a file, not a directory")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loader, "resolve_model", lambda *a, **k: pytest.fail("the model loaded"))
    result = RUNNER.invoke(app, ["eval", "-t", "gsm8k", "--out", where])
    assert result.exit_code == 2, result.output
    assert "cannot be written" in result.output and "cannot create" in result.output
    assert "Traceback" not in result.output
    assert len([ln for ln in result.output.splitlines() if ln.strip()]) == 1
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


def generate(tiny_dir, *args: str) -> str:
    return invoke("generate", "the quick brown fox", "-m", str(tiny_dir), "--no-chat",
                  "--block-size", "4", "--threads", "1", *args)


def test_generate_shows_compress_events_and_kept_kv(tiny_dir):
    text = generate(tiny_dir, "-p", "zipage", "-a", "budget=24", "--max-tokens", "32")
    line = next(ln for ln in text.splitlines() if ln.startswith("compress events"))
    events, kept, context = map(int, re.search(r"events (\d+) .* held at the end (\d+) of (\d+) context",
                                               line).groups())
    assert events >= 1 and 24 <= kept <= 28 < context, line  # budget + at most one write page
    assert "avg KV budget 24" in line, line
    assert "never compressed" not in text
    # The line before names its per-head figures as averages, so two "kept" never read alike.
    summary = next(ln for ln in text.splitlines() if " tok/s, " in ln)
    assert re.search(r"average KV slots per head: allocated \d+ / kept \d+", summary), summary


def test_generate_warns_when_a_compressing_policy_never_compressed(tiny_dir):
    text = generate(tiny_dir, "-p", "snapkv", "-a", "budget=256", "--max-tokens", "4")
    assert "compress events 0" in text and "policy snapkv never compressed" in text
    assert "never compressed" not in generate(tiny_dir, "--max-tokens", "4")  # FullKV by design


def test_never_compressed_is_one_rule_for_every_command():
    from engine.policies.base import build_policy
    from engine.stats import never_compressed

    assert never_compressed(build_policy("full", {}), 0) is None
    assert never_compressed(build_policy("zipage", {"budget": 64}), 3) is None
    message = never_compressed(build_policy("zipage", {"budget": 64}), 0, kv_context=40.0)
    assert "zipage never compressed" in message and "40 tokens" in message and "budget 64" in message


def _command_paths(command, path=()):
    """Every command path of the CLI: (), ("generate",), ..., ("bench", "soak"), ..."""
    yield path
    if hasattr(command, "list_commands"):
        ctx = type(command).context_class(command)
        for name in command.list_commands(ctx):
            yield from _command_paths(command.get_command(ctx, name), (*path, name))


def test_help_metavars_read_as_words():
    from typer.main import get_command

    paths = [p for p in _command_paths(get_command(app)) if p != ("lm-eval",)]  # argparse's help
    assert ("generate",) in paths and ("bench", "soak") in paths
    for path in paths:
        text = invoke(*path, "--help")
        # No Python type anywhere: not for arguments, flags, lists, nor click's own --help.
        assert not re.search(r"<(list\[|bool>|str>|int>|float>|Path>)", text), path
    generate = invoke("generate", "--help")
    assert re.search(r"prompts\.\.\. +TEXT", generate) and re.search(r"--help +Show", generate)
    text = invoke("eval", "--help")
    assert all(word in text for word in ("NAME", "KEY=VALUE", "MODEL", "PATH", "DIR", " N "))


def test_list_columns_are_labelled():
    text = invoke("list")
    assert "description" in text and "arguments (default)" in text and "options (--task-arg)" in text


def test_eval_prints_each_message_once_per_command():
    import io

    from rich.console import Console
    from rich.progress import Progress

    from evals.cli import RichHooks

    buffer = io.StringIO()
    hooks = RichHooks(Progress(console=Console(file=buffer, width=200)))
    for _ in range(3):  # e.g. NIAH's "no --data" note, from the run of each of three policies
        hooks.on_message("niah: no --data given")
    hooks.on_message("loading model with policy zipage")
    assert buffer.getvalue().count("no --data") == 1 and "policy zipage" in buffer.getvalue()


def test_new_runs_go_to_the_untracked_runs_folder():
    """eval, sweep and bench write below runs/ unless told otherwise (results/ is the tracked
    reference tree), and git ignores runs/."""
    from evals.benchmarks.common import RESULTS_DIR
    from evals.run.settings import RUNS_DIR, EvalSettings

    assert EvalSettings(task="gsm8k").out == RUNS_DIR == "runs"
    assert RESULTS_DIR == Path(RUNS_DIR) / "benchmarks"
    for command, option in (("eval", "--out"), ("sweep", "--out"), ("bench memory", "--out-dir")):
        line = next(ln for ln in invoke(*command.split(), "--help").splitlines() if option in ln)
        assert re.search(r"\[default: runs(/benchmarks)?\]", line), (command, line)
    ignored = (Path(__file__).resolve().parent.parent / ".gitignore").read_text().splitlines()
    assert "/runs/" in ignored


def test_eval_runs_a_per_head_policy_held_at_its_budget_in_decode(tiny_dir, tmp_path):
    """`--policy-arg decode_compress=true` reaches PyramidKV through `kvarena eval`: on long
    documents with a short prompt it compresses during decode at the run's budget, where the
    published prompt-only default never compresses."""
    data = Path(__file__).parent / "fixtures" / "data" / "niah"
    common = ("eval", "-t", "longdoc", "-m", str(tiny_dir), "--data", str(data),
              "--task-arg", "lengths=96", "--task-arg", "documents=2", "--task-arg", "prefix=16",
              "-p", "pyramidkv", "-a", "window=4", "--kv-budget", "32", "--block-size", "8",
              "--threads", "1", "--no-leaderboard", "--no-fidelity", "--out", str(tmp_path))
    invoke(*common, "-a", "decode_compress=true")
    invoke(*common)
    runs = {json.loads((p.parent / "config.json").read_text())["label"]: json.loads(p.read_text())
            for p in tmp_path.rglob("metrics.json")}
    decode = runs["pyramidkv+budget=32+decode_compress=true+window=4+bs=8"]
    prompt_only = runs["pyramidkv+budget=32+window=4+bs=8"]
    assert decode["events"]["compress"] >= 4 and decode["avg_kv_budget"] == 32
    assert 32 <= decode["avg_kv_kept"] < 32 + 2 * 8
    assert prompt_only["events"]["compress"] == 0 and prompt_only["avg_kv_kept"] > 50

"""`kvarena`: the command line (typer). Data flows one way: cli -> evals/analysis -> engine."""

from __future__ import annotations

# ruff: isort: skip_file
# `engine` first: importing it sets OpenMP's wait policy, which libgomp reads only when torch loads
# (engine/threads.py); every command imports torch later.
import engine  # noqa: F401

import json
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from evals.cli_common import (
    POLICY_NAMES,
    CompileOpt,
    ModelOpt,
    PolicyArgOpt,
    ThreadsOpt,
    console,
    fail,
    name_metavars,
    set_threads,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="An arena for KV-cache budgeting policies on a paged engine.")


@app.callback()
def _root() -> None:
    """An arena for KV-cache budgeting policies on a paged engine."""


def engine_kwargs(policy: str, policy_args: list[str], kv_cache_tokens: Optional[int],
                  block_size: Optional[int], max_num_seqs: int, **extra) -> dict:
    from engine.policies.base import parse_policy_args

    kwargs = dict(policy=policy, policy_args=parse_policy_args(policy_args),
                  max_num_seqs=max_num_seqs, **extra)
    if kv_cache_tokens is not None:
        kwargs["kv_cache_tokens"] = kv_cache_tokens
    if block_size is not None:
        kwargs["block_size"] = block_size
    return kwargs


@app.command()
def generate(
    prompts: list[str] = typer.Argument(None, help="Prompts (read from stdin, one per line, if none)."),
    model: str = ModelOpt,
    max_tokens: int = typer.Option(128, help="Most output tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None),
    chat: bool = typer.Option(True, help="Wrap each prompt in the model's chat template."),
    policy: str = typer.Option("full", "--policy", "-p", help=f"KV policy: {POLICY_NAMES}."),
    policy_arg: list[str] = PolicyArgOpt,
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV pool size in tokens."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV page."),
    max_num_seqs: int = typer.Option(64),
    compile: Optional[bool] = CompileOpt,
    threads: int = ThreadsOpt,
    json_out: bool = typer.Option(False, "--json", help="Print outputs and run stats as JSON."),
    trace_kept: bool = typer.Option(False, "--trace-kept",
                                    help="Record the positions each layer and KV head kept at every "
                                         "compaction: a summary per compaction (with --json: the "
                                         "evals.traces bit masks)."),
):
    """Generate text for prompts on the paged engine, with a live progress display."""
    from engine.config import ConfigError
    from engine.llm import LLM
    from engine.models.loader import ModelLoadError
    from engine.sampling import SamplingParams
    from engine.stats import never_compressed

    set_threads(threads)
    prompts = prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        fail("no prompt given (pass prompts as arguments or on stdin)")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens)
        with console.status(f"loading {model}"):
            extra = {} if compile is None else {"compile": compile}
            llm = LLM(model, **engine_kwargs(policy, policy_arg, kv_cache_tokens, block_size,
                                             max_num_seqs, trace_kept=trace_kept, **extra))
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p
                 for p in prompts]
        total = len(texts) * max_tokens
        with Progress(TextColumn("[bold]generate"), BarColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("", total=total)

            def on_step(tokens: int, done: int) -> None:
                bar.update(task, completed=tokens, description=f"{tokens} tok, {done}/{len(texts)} done")

            outputs = llm.generate(texts, params, on_step=on_step)
    except (ConfigError, ModelLoadError) as exc:
        fail(str(exc))
    stats = llm.last_stats
    if json_out:
        print(json.dumps({"outputs": [{"prompt": p, "text": o.text, "finish_reason": o.finish_reason,
                                       "output_tokens": o.num_output_tokens,
                                       **({"kept": _kept_json(o)} if trace_kept else {})}
                                      for p, o in zip(prompts, outputs)],
                          "stats": stats.to_dict(),
                          "warning": never_compressed(llm.policy, stats.compactions,
                                                      stats.kv_context)}, indent=2))
        return
    for prompt, out in zip(prompts, outputs):
        console.rule(prompt[:80])
        print(out.text)
        for line in _kept_summary(out) if trace_kept else []:
            console.print(f"[dim]{line}[/]")
    console.print(f"[green]{stats.summary()}[/]", soft_wrap=True)  # one line each, never cut
    console.print(f"[green]{stats.kv_summary()}[/]", soft_wrap=True)
    warning = never_compressed(llm.policy, stats.compactions, stats.kv_context)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")


def _kept_json(out) -> list[dict]:
    """An output's kept-position records in traces.jsonl's form (evals.traces.encode_kept)."""
    from evals.traces import encode_kept

    return [{"event": rec.event, "action": out.events[rec.event]["action"],
             **encode_kept(rec.positions, int(out.events[rec.event]["logical_len"]))}
            for rec in out.kept]


def _kept_summary(out) -> list[str]:
    """One line per compaction: when, how much, and how many of the prompt's positions layer 0's
    KV heads kept."""
    lines = []
    for rec in out.kept:
        e = out.events[rec.event]
        prompt = [int((h < out.num_prompt_tokens).sum()) for h in rec.positions[0]]
        lines.append(f"{e['action']} ({(e.get('info') or {}).get('trigger', 'boundary')}) at length "
                     f"{e['logical_len']}: {e['physical_before']} -> {e['physical_after']} slots; "
                     f"layer 0 keeps {prompt} of the {out.num_prompt_tokens} prompt positions per KV head")
    return lines


@app.command("list")
def list_command(
    json_out: bool = typer.Option(False, "--json", help="Print the listing as JSON."),
):
    """Registered KV policies with their arguments and defaults, and tasks with their options and
    their paper and cpu presets."""
    from rich.table import Column, Table

    from evals.cli_common import describe_registries

    listing = describe_registries()
    if json_out:
        print(json.dumps(listing, indent=2, default=str))
        return
    out = Console()
    for title, headers, rows in (
            ("KV policies: --policy NAME --policy-arg key=value",
             ("policy", "arguments (default)", "description"), policy_rows(listing)),
            ("Tasks: --task NAME", ("task", "presets (--preset)", "options (--task-arg)", "description"),
             task_rows(listing))):
        # fold: a value longer than its column goes on over the next lines instead of being cut
        table = Table(*(Column(h, overflow="fold") for h in headers), title=title,
                      title_justify="left", show_lines=True)
        for row in rows:
            table.add_row(*row)
        out.print(table)


def policy_rows(listing: dict) -> list[tuple[str, str, str]]:
    """`kvarena list`'s policy table: (name, every argument=default, description), values whole."""
    rows = []
    for name, p in listing["policies"].items():
        args = "\n".join(f"{k}={_show(v)}" for k, v in p["arguments"].items()) or "-"
        swept = f"sweep sets {p['fixed_budget']}" if p["fixed_budget"] else ""
        rows.append((name, args, f"{p['summary']} {swept}".strip()))
    return rows


def task_rows(listing: dict) -> list[tuple[str, str, str, str]]:
    """`kvarena list`'s task table: (name, each preset's defaults, every option=default,
    description), values whole."""
    rows = []
    for name, t in listing["tasks"].items():
        presets = "\n".join(f"{scale}: " + " ".join(f"{k}={_show(v)}" for k, v in d.items())
                             for scale, d in t["presets"].items())
        options = "\n".join(f"{k}={_show(v)}" for k, v in t["options"].items()) or "-"
        rows.append((name, presets, options, t["summary"]))
    return rows


def _show(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


@app.command("lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lm_eval_command(ctx: typer.Context) -> None:
    """lm-evaluation-harness on the engine: -m MODEL, -p POLICY, -a key=value (repeatable), and
    every argument of `lm-eval run` passed through unchanged (--help lists both)."""
    from evals.lm_eval_adapter import AdapterError, main

    try:
        main(list(ctx.args))
    except AdapterError as e:
        fail(str(e))


def _register_subcommands() -> None:
    from analysis.cli import analyze_app
    from evals.benchmarks import bench_app
    from evals.cli import register

    register(app)
    app.add_typer(bench_app, name="bench")
    app.add_typer(analyze_app, name="analyze")


_register_subcommands()
name_metavars(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

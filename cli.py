"""`kvarena`: the command line (typer). Data flows one way: cli -> evals/analysis -> engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="An arena for KV-cache budgeting policies on a paged engine.")
console = Console(stderr=True)

ModelOpt = typer.Option("smollm2-135m-instruct", "--model", "-m",
                        help="HF directory, .gguf file, or the embedded default's name.")
PolicyArgOpt = typer.Option([], "--policy-arg", "-a", help="Policy argument key=value (repeatable).")


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


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


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
    policy: str = typer.Option("full", help="KV policy name."),
    policy_arg: list[str] = PolicyArgOpt,
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV pool size in tokens."),
    block_size: Optional[int] = typer.Option(None, help="Tokens per KV page."),
    max_num_seqs: int = typer.Option(64),
    threads: int = typer.Option(2, help="torch CPU threads."),
    json_out: bool = typer.Option(False, "--json", help="Print outputs and run stats as JSON."),
):
    """Generate text for prompts on the paged engine, with a live progress display."""
    import torch

    from engine.config import ConfigError
    from engine.llm import LLM
    from engine.models.loader import ModelLoadError
    from engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    prompts = prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        fail("no prompt given (pass prompts as arguments or on stdin)")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens)
        with console.status(f"loading {model}"):
            llm = LLM(model, **engine_kwargs(policy, policy_arg, kv_cache_tokens, block_size,
                                             max_num_seqs))
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
                                       "output_tokens": o.num_output_tokens}
                                      for p, o in zip(prompts, outputs)],
                          "stats": stats.to_dict()}, indent=2))
        return
    for prompt, out in zip(prompts, outputs):
        console.rule(prompt[:80])
        print(out.text)
    console.print(f"[green]{stats.summary()}[/]")


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


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

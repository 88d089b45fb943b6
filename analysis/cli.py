"""`kvarena analyze ...`: the papers' studies.

    kvarena analyze replay    counterfactual compress-vs-grow NLL replay (GrowPage Sec. 5.3, Fig. 7)
    kvarena analyze demand    Spearman study of GrowPage's demand signal (Sec. 5.3, Fig. 6)
    kvarena analyze sparsity  attention concentration over decoding (Sec. 2, Fig. 3)
    kvarena analyze capacity  GrowPage capacity by minimum-sufficient-budget class (App. I, Fig. 11)

The study modules (analysis.replay, analysis.demand_study, analysis.sparsity) are imported inside
the commands, so `kvarena --help` does not pay for torch and the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.markup import escape

from evals.cli_common import ModelOpt, ThreadsOpt, console, fail

analyze_app = typer.Typer(no_args_is_help=True, help="Reproduce the papers' analysis studies.")

RESULTS_ROOT = Path("results/analysis")

PromptsOpt = typer.Option(None, "--prompts-file",
                          help="Text file, one prompt per line (default: the built-in math set).")
NumPromptsOpt = typer.Option(None, "--num-prompts", help="Use only the first N prompts (default: "
                             "all; the built-in set has 32, so intervals over requests are usable).")
BlockOpt = typer.Option(16, "--block-size", help="Tokens per KV page (CPU-scale default 16).")
OutOpt = typer.Option(None, "--out", help="Output directory (default: results/analysis/<study>-"
                                          "<model>-b<block>-t<tokens>-n<prompts>).")
TemperatureOpt = typer.Option(0.0, "--temperature", help="Reference decoding: 0 = greedy.")
SeedOpt = typer.Option(0, "--seed", help="Base seed (request i uses seed + i when sampling).")
ChatOpt = typer.Option(True, "--chat/--no-chat", help="Wrap prompts in the chat template.")
TopPOpt = typer.Option(0.99, "--top-p", help="Coverage p of the working sets (GrowPage: 0.99).")
DocumentsOpt = typer.Option(None, "--documents", help="Run on N long documents teacher-forced "
                            "from --data (the longdoc task's documents) instead of prompts.")
DocTokensOpt = typer.Option(4096, "--doc-tokens", help="Tokens per document (--documents).")
DataOpt = typer.Option(None, "--data", help="Corpus of the documents (as `kvarena eval -t "
                       "longdoc --data`).")


def _model_tag(model: str) -> str:
    from engine.models.loader import EMBEDDED_MODEL_NAMES

    if model.lower() in {n.lower() for n in EMBEDDED_MODEL_NAMES}:
        return "smollm2-135m"
    path = Path(model)
    return (path.stem if path.suffix else path.name).lower() or "model"


def _prepare(study: str, model: str, prompts_file, num_prompts, max_tokens: int, block_size: int,
             temperature: float, seed: int, chat: bool, out: Optional[Path], threads: int,
             ignore_eos: bool = False, suffix: str = ""):
    """Validate the shared options, load prompts and tokenise them with the model's tokenizer."""
    from analysis.common import RunSettings, encode_prompts, load_prompts
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.threads import set_threads

    if threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    if max_tokens < 1:
        fail(f"--max-tokens must be >= 1, got {max_tokens}")
    if block_size < 2:
        fail(f"--block-size must be >= 2, got {block_size}")
    set_threads(threads)
    prompts = load_prompts(prompts_file, num_prompts)
    prompt_ids = encode_prompts(load_tokenizer(resolve_model(model)), prompts, chat)
    settings = RunSettings(model=model, block_size=block_size, max_tokens=max_tokens,
                           num_prompts=len(prompts), temperature=temperature, seed=seed, chat=chat,
                           ignore_eos=ignore_eos)
    if out is None:
        out = RESULTS_ROOT / (f"{study}-{_model_tag(model)}-b{block_size}-t{max_tokens}"
                              f"-n{len(prompts)}{suffix}")
    console.print(f"[bold]{study}[/]: {len(prompts)} prompts "
                  f"({min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens), "
                  f"{max_tokens} output tokens, block {block_size} -> {out}")
    return prompt_ids, settings, out


def _run(study):
    """Run a study, turning bad input into a clear error instead of a traceback."""
    from engine.config import ConfigError
    from engine.models.loader import ModelLoadError

    try:
        return study()
    except (ConfigError, ModelLoadError, ValueError, RuntimeError) as exc:
        fail(str(exc))


@analyze_app.command()
def replay(
    model: str = ModelOpt,
    prompts_file: Optional[Path] = PromptsOpt,
    num_prompts: Optional[int] = NumPromptsOpt,
    max_tokens: int = typer.Option(320, "--max-tokens", help="Reference output tokens per prompt."),
    block_size: int = BlockOpt,
    window: Optional[int] = typer.Option(None, "--window",
                                         help="Tokens scored after each decision (default: 4 pages)."),
    max_boundaries: Optional[int] = typer.Option(
        None, "--max-boundaries", help="Demand boundaries per request to branch at (evenly spaced)."),
    policy_arg: list[str] = typer.Option(
        [], "--policy-arg", "-a",
        help="GrowPage knob key=value (repeatable); the replay sets protected_recent=8 (half a "
             "16-token page), the rest are GrowPage's own defaults and preset."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Reference runs to --max-tokens."),
    temperature: float = typer.Option(0.6, "--temperature", help="Reference decoding (paper: "
                                      "0.6, App. F.1; 0 = greedy)."),
    documents: Optional[int] = DocumentsOpt,
    doc_tokens: int = DocTokensOpt,
    data: Optional[str] = DataOpt,
    seed: int = SeedOpt,
    chat: bool = ChatOpt,
    out: Optional[Path] = OutOpt,
    threads: int = ThreadsOpt,
):
    """Counterfactual Compress & Hold vs Grow by One Page: NLL of the next reference tokens.
    With --documents the reference is the text itself (FullKV teacher-forced on it)."""
    _check_documents(documents, prompts_file, num_prompts)

    def study():
        from analysis.replay import (
            REPLAY_GROWPAGE_DEFAULTS,
            ReplayConfig,
            replay_study,
            resolved_window,
        )
        from engine.policies.base import build_policy, parse_policy_args

        args = {**REPLAY_GROWPAGE_DEFAULTS, **parse_policy_args(policy_arg)}
        typed = build_policy("growpage", args)  # validates names and coerces CLI strings
        growpage = {k: getattr(typed, k) for k in args}
        per_request = f"-k{max_boundaries}" if max_boundaries else ""
        config = ReplayConfig(window=window, max_boundaries=max_boundaries, growpage=growpage,
                              ignore_eos=ignore_eos)
        suffix = f"-w{resolved_window(window, block_size)}{per_request}"
        if documents is not None:
            docs = _documents("replay", model, documents, doc_tokens, data, block_size, threads,
                              out, suffix)
            return replay_study(model, docs.prompts, docs.settings, docs.path, config,
                                forced=docs.forced, extra=docs.info), docs.path
        prompt_ids, settings, path = _prepare("replay", model, prompts_file, num_prompts,
                                              max_tokens, block_size, temperature, seed, chat,
                                              out, threads, suffix=f"{suffix}-temp{temperature:g}")
        return replay_study(model, prompt_ids, settings, path, config), path

    summary, path = _run(study)
    from evals.intervals import fmt_interval

    gt = next(v for k, v in summary.items() if k.startswith("benefit_delta_gt"))
    le = next(v for k, v in summary.items() if k.startswith("benefit_delta_le"))
    line = (f"{summary['clean']} boundaries of {summary['requests']} requests "
            f"(95% CI over requests): mean A = {fmt_interval(summary['benefit'], 4)}; "
            f"delta > tau (n={gt['n']}): {fmt_interval(gt, 4)}; delta <= tau (n={le['n']}): "
            f"{fmt_interval(le, 4)}; gap: {fmt_interval(summary['benefit_gap_gt_minus_le'], 4)}; "
            f"Spearman(delta, A) = {fmt_interval(summary['spearman_delta_benefit'])}; cost of the "
            f"earlier compressions (NLL_grow - NLL_full) = "
            f"{fmt_interval(summary['cumulative_cost'], 4)}, whole-output natural - FullKV NLL = "
            f"{fmt_interval(summary['natural_excess'], 4)}")
    console.print(f"[green]{escape(line)}[/]  ({escape(str(path))})")


def _top_p_study(name: str, doc: str, run: Callable[..., dict],
                 report: Callable[[dict], str]) -> None:
    """Register `kvarena analyze <name>`: a study of a FullKV generation parameterised by the
    working-set coverage p. run(model, prompt_ids, settings, out_dir, top_p) -> summary;
    report(summary) -> the one-line result printed at the end."""

    def command(
        model: str = ModelOpt,
        prompts_file: Optional[Path] = PromptsOpt,
        num_prompts: Optional[int] = NumPromptsOpt,
        max_tokens: int = typer.Option(384, "--max-tokens", help="Output tokens per prompt."),
        block_size: int = BlockOpt,
        top_p: float = TopPOpt,
        temperature: float = TemperatureOpt,
        seed: int = SeedOpt,
        chat: bool = ChatOpt,
        out: Optional[Path] = OutOpt,
        threads: int = ThreadsOpt,
    ):
        def study():
            prompt_ids, settings, path = _prepare(name, model, prompts_file, num_prompts,
                                                  max_tokens, block_size, temperature, seed,
                                                  chat, out, threads)
            return run(model, prompt_ids, settings, path, top_p), path

        summary, path = _run(study)
        console.print(f"[green]{escape(report(summary))}[/]  ({escape(str(path))})")

    command.__doc__ = doc
    analyze_app.command(name)(command)


def _sparsity(model, prompt_ids, settings, path, top_p) -> dict:
    from analysis.sparsity import SparsityConfig, sparsity_study

    return sparsity_study(model, prompt_ids, settings, path, SparsityConfig(top_p=top_p))


def _sparsity_report(summary: dict) -> str:
    from evals.intervals import fmt_interval

    across = summary["across_requests"]
    return (f"{summary['requests']} requests (95% CI over requests): mean D_p / N_t = "
            f"{fmt_interval(across['dp_ratio_mean'])}, std of its {summary['smooth_steps']}-step "
            f"rolling mean = {fmt_interval(across['smoothed_ratio_std'])}, Spearman(step, "
            f"D_p / N_t) = {fmt_interval(summary['spearman_step_ratio'])}")


_top_p_study("sparsity", "p-coverage attention demand D_p of real decode queries over a FullKV "
             "generation.", _sparsity, _sparsity_report)


def _demand_report(summary: dict) -> str:
    from evals.intervals import fmt_interval

    main = summary["pooled"]["delta"]
    offset = summary["offset"]
    lines = [
        f"{summary['complete']} complete of {summary['decision_boundaries']} decision boundaries "
        f"({summary['boundaries']} in all), {summary['requests']} requests (95% CI over requests)",
        f"Spearman(delta, {summary['main_target']}) = {fmt_interval(main['spearman'])}; "
        f"position partialled "
        f"{fmt_interval(main['partial_spearman'])}",
        f"sign agreement = {fmt_interval(main['sign_agreement'])}, chance level "
        f"{fmt_interval(main['chance_sign_agreement'])}, after centring delta on its median "
        f"{fmt_interval(main['centred_sign_agreement'])}",
        "delta > 0 at " + ", ".join(
            f"{name.removeprefix('delta_positive_').replace('_', ' ')} "
            f"{fmt_interval(offset[name])}" for name in offset if name.startswith("delta")) +
        f"; change > 0 at {fmt_interval(offset.get('change_positive_complete_rows'))}",
    ]
    for name, target in summary["targets"].items():
        if name != summary["main_target"]:
            flag = " [shares a term with delta]" if target["shares_term_with_delta"] else ""
            lines.append(f"alternative target {name}{flag}: Spearman = "
                         f"{fmt_interval(main.get('spearman_' + name))}; position partialled "
                         f"{fmt_interval(main.get('partial_spearman_' + name))}")
    if "control" in summary:
        lines.append(f"control: Spearman(measured change, latent change) = "
                     f"{summary['control']['spearman_target_vs_latent']:.3f}")
    lines.append(f"Spearman(delta, position) = {fmt_interval(summary['spearman_position']['delta'])}")
    return "\n".join(lines)


@analyze_app.command()
def demand(
    model: str = ModelOpt,
    prompts_file: Optional[Path] = PromptsOpt,
    num_prompts: Optional[int] = NumPromptsOpt,
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Output tokens per prompt."),
    block_size: int = BlockOpt,
    horizon_tokens: int = typer.Option(
        256, "--horizon-tokens", help="Length of the current and the future window (paper: 256, "
        "the tokens of its next page)."),
    exclude_tokens: int = typer.Option(
        256, "--exclude-tokens", help="Most recent tokens left out of the candidate set C_t "
        "(paper: 256, its last page)."),
    control: str = typer.Option("none", "--control", help="A synthetic control instead of the "
                                "model (no model is loaded): 'positive' (future demand known by "
                                "construction), 'negative' (nothing to predict), 'nuisance' "
                                "(sinks, recency and drift, nothing to predict), 'nuisance-signal' "
                                "(the same with the positive control's signal)."),
    requests: int = typer.Option(16, "--control-requests", help="Requests of the control."),
    control_tokens: Optional[int] = typer.Option(
        None, "--control-tokens", help="Tokens per control request (default: 1.5 periods after "
        "the warm-up); set it to the model study's document length."),
    control_period: Optional[int] = typer.Option(
        None, "--control-period", help="Period of the control's oscillation in tokens (default: "
        "8 x (tau_L + horizon))."),
    documents: Optional[int] = DocumentsOpt,
    doc_tokens: int = DocTokensOpt,
    data: Optional[str] = DataOpt,
    initial_capacity: Optional[int] = typer.Option(
        None, "--initial-capacity", help="Tokens from which boundaries are decisions (default: "
        "GrowPage's start at the block size)."),
    per_query: bool = typer.Option(True, "--per-query/--no-per-query", help="Also the "
                                   "per-query targets (a sort per query; slow on long documents)."),
    resamples: int = typer.Option(2000, "--resamples", help="Bootstrap resamples of every "
                                  "interval (fewer: a quicker, coarser look)."),
    top_p: float = TopPOpt,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Decode every prompt to "
                                    "--max-tokens (the windows need long outputs)."),
    temperature: float = typer.Option(0.6, "--temperature", help="Sampling temperature "
                                      "(paper: 0.6, App. F.1; 0 = greedy)."),
    seed: int = SeedOpt,
    chat: bool = ChatOpt,
    out: Optional[Path] = OutOpt,
    threads: int = ThreadsOpt,
):
    """Spearman correlation of GrowPage's delta_t with the future attention-demand change
    (Fig. 6), at GrowPage's decision boundaries; --control runs a synthetic control instead."""
    from analysis.demand_control import CONTROLS

    if control not in ("none", *CONTROLS):
        fail(f"--control must be 'none' or one of {', '.join(CONTROLS)}, got {control!r}")
    _check_documents(documents, prompts_file, num_prompts)
    if documents is not None and control != "none":
        fail("--documents runs the model study; a --control runs without a model")
    if horizon_tokens < 1 or exclude_tokens < 1:
        fail("--horizon-tokens and --exclude-tokens must be >= 1")
    if resamples < 1:
        fail(f"--resamples must be >= 1, got {resamples}")

    def study():
        from analysis.demand_study import DemandConfig, demand_study

        config = DemandConfig(top_p=top_p, horizon_tokens=horizon_tokens,
                              exclude_tokens=exclude_tokens, resamples=resamples,
                              initial_capacity=initial_capacity, per_query=per_query)
        if control != "none":
            import torch

            from analysis.demand_control import SyntheticProcess, control_study

            torch.set_num_threads(threads)
            length = (f"-t{control_tokens}-b{block_size}" if control_tokens else "") + \
                (f"-p{control_period}" if control_period else "") + (f"-s{seed}" if seed else "")
            path = out or RESULTS_ROOT / (f"demand-control-{control}{length}-h{horizon_tokens}"
                                          f"-e{exclude_tokens}-n{requests}")
            console.print(f"[bold]demand[/]: {control} control, {requests} synthetic requests "
                          f"-> {path}")
            process = SyntheticProcess(**{
                "requests": requests, "seed": seed, "tokens": control_tokens,
                "period": control_period, **CONTROLS[control],
                **({"block_size": block_size} if control_tokens else {})})
            return control_study(process, config, path), path
        if documents is not None:
            docs = _documents("demand", model, documents, doc_tokens, data, block_size, threads,
                              out, f"-h{horizon_tokens}-e{exclude_tokens}")
            return demand_study(model, docs.prompts, docs.settings, docs.path, config,
                                forced=docs.forced, extra=docs.info), docs.path
        prompt_ids, settings, path = _prepare(
            "demand", model, prompts_file, num_prompts, max_tokens, block_size, temperature,
            seed, chat, out, threads, ignore_eos,
            suffix=f"-h{horizon_tokens}-e{exclude_tokens}-temp{temperature:g}")
        return demand_study(model, prompt_ids, settings, path, config), path

    summary, path = _run(study)
    console.print(f"[green]{escape(_demand_report(summary))}[/]  ({escape(str(path))})")


def _check_documents(documents, prompts_file, num_prompts) -> None:
    if documents is not None and (documents < 1 or prompts_file or num_prompts):
        fail("--documents takes N >= 1 and replaces --prompts-file / --num-prompts")


@dataclass(frozen=True)
class Documents:
    """A study's long documents: prompts (the first tokens) and forced continuations, the run's
    settings, its output directory and what config.json records about the documents."""

    prompts: list
    forced: list
    settings: object
    path: Path
    info: dict


def _documents(study: str, model: str, documents: int, doc_tokens: int, data, block_size: int,
               threads: int, out: Optional[Path], suffix: str) -> Documents:
    """The longdoc task's documents for a study: each a 64-token prompt and the rest
    teacher-forced, so every query is one of real text at thousands of tokens."""
    from analysis.common import RunSettings
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.threads import set_threads
    from evals.tasks.longdoc import LongDoc

    set_threads(threads)
    task = LongDoc(lengths=(doc_tokens,), documents=documents)
    problems = task.load(data, tokenizer=load_tokenizer(resolve_model(model))).problems
    requests = [task.token_request(p) for p in problems]
    settings = RunSettings(model=model, block_size=block_size, max_tokens=doc_tokens - task.prefix,
                           num_prompts=len(requests), temperature=0.0, seed=0, chat=False,
                           ignore_eos=True)
    path = out or RESULTS_ROOT / (f"{study}-docs-{_model_tag(model)}-b{block_size}-d{documents}"
                                  f"x{doc_tokens}{suffix}")
    console.print(f"[bold]{study}[/]: {len(requests)} documents x {doc_tokens} tokens "
                  f"({task.prefix}-token prompt, the rest forced), block {block_size} -> {path}")
    return Documents([list(r.prompt) for r in requests], [list(r.forced) for r in requests],
                     settings, path, {"documents": documents, "doc_tokens": doc_tokens,
                                      "prefix_tokens": task.prefix, "corpus": task.corpus})


@analyze_app.command()
def capacity(
    sweep: Path = typer.Option(..., "--sweep", help="A `kvarena sweep` output directory "
                               "(<out>/<model>/<task>/sweep_<label>/) or its sweep.csv."),
    eval_dir: Path = typer.Option(..., "--eval", help="The `kvarena eval` result directory of "
                                  "GrowPage on the same problems (<out>/<model>/<task>/<label>/)."),
    capacity_field: Optional[str] = typer.Option(
        None, "--capacity-field", help="Per-sample field of samples.jsonl to use as capacity "
        "(default: the time-averaged allocated KV the runner records)."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default: "
                                       "results/analysis/capacity-<task>-<eval label>)."),
):
    """Capacity alignment: GrowPage's per-problem capacity by the sweep's B* class (App. I)."""

    def study():
        from analysis.capacity import capacity_study, read_sweep, table_markdown

        path = out
        if path is None:
            task = read_sweep(sweep).task or "task"
            path = RESULTS_ROOT / f"capacity-{task}-{eval_dir.name}"
        summary = capacity_study(sweep, eval_dir, path, capacity_field, seed)
        return summary, path, table_markdown(summary, summary["capacity_field"])

    summary, path, table = _run(study)
    if summary["only_in_sweep"] or summary["only_in_eval"]:
        console.print(f"[yellow]left out: {summary['only_in_sweep']} problems only in the sweep, "
                      f"{summary['only_in_eval']} only in the eval[/]")
    if summary["seeds"]["same"] is False:
        console.print(f"[yellow]the sweep used seed {summary['seeds']['sweep']}, the eval "
                      f"{summary['seeds']['eval']} (App. I reruns with the same seed)[/]")
    typer.echo(table)
    console.print(f"[green]{summary['problems']} problems ({summary['unsolved']} Unsolved)[/]  "
                  f"({escape(str(path))})")

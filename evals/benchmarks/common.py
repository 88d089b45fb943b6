"""Shared pieces of the benchmarks: result tables, their rich/JSON/markdown renderings, machine
facts, engine runs and the output-fidelity metrics.

A benchmark's core function returns a `BenchResult` (one or more `Table`s, the workload scale, the
targets it checks); the typer command renders it and writes `runs/benchmarks/<name>.{json,md}`
(``--out-dir``). Every number compared in a benchmark is measured in the same process, one
configuration after another, so a ratio is what the benchmark reports; absolute tokens/s on a
shared 2-core machine are noise-prone and are shown for context only.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from engine.events import COMPACTION_COUNTERS
from engine.threads import openmp_state, set_threads
from evals import provenance
from evals.tables import markdown_table, md_cell

# The default output directory: untracked (the reference copies in results/benchmarks/ are written
# with --out-dir results/benchmarks).
RESULTS_DIR = Path("runs/benchmarks")


# ----------------------------------------------------------------------------------------------
# result tables


@dataclass(frozen=True)
class Column:
    """key: the row dict key; header: the printed header; fmt: a format spec for numbers
    (e.g. ".1f", ".1%"), or "" for str()."""

    key: str
    header: str
    fmt: str = ""


@dataclass
class Table:
    """One printed table: rows are dicts keyed by the columns' keys (extra keys stay in JSON)."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    caption: str = ""

    def column(self, key: str) -> list[Any]:
        return [row.get(key) for row in self.rows]


@dataclass
class Target:
    """A target the benchmark sets, checked against the measured value."""

    description: str
    value: float | None
    threshold: float
    comparison: str  # ">=" or "<"
    met: bool

    @classmethod
    def check(cls, description: str, value: float | None, comparison: str,
              threshold: float) -> "Target":
        if comparison not in (">=", "<"):
            raise ValueError(f"comparison must be '>=' or '<', got {comparison!r}")
        if value is None or not math.isfinite(value):
            met = False
        else:
            met = value >= threshold if comparison == ">=" else value < threshold
        return cls(description, value, threshold, comparison, met)


@dataclass
class BenchResult:
    name: str
    title: str
    scale: dict
    tables: list[Table]
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r}; tables: {[t.name for t in self.tables]}")

    def to_dict(self) -> dict:
        return {
            "name": self.name, "title": self.title, "scale": self.scale,
            "tables": [{"name": t.name, "title": t.title, "caption": t.caption,
                        "columns": [asdict(c) for c in t.columns], "rows": t.rows}
                       for t in self.tables],
            "targets": [asdict(t) for t in self.targets],
            "notes": self.notes,
        }


def format_value(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def render_rich(result: BenchResult, console) -> None:
    from rich.table import Table as RichTable

    console.rule(f"[bold]{result.title}")
    console.print("scale: " + ", ".join(f"{k}={v}" for k, v in result.scale.items()))
    for t in result.tables:
        table = RichTable(title=t.title, caption=t.caption or None, caption_justify="left")
        for c in t.columns:
            table.add_column(c.header, justify="left" if not c.fmt else "right")
        for row in t.rows:
            table.add_row(*(format_value(row.get(c.key), c.fmt) for c in t.columns))
        console.print(table)
    for target in result.targets:
        mark = "[green]met[/]" if target.met else "[red]NOT met[/]"
        console.print(f"target: {target.description}: {format_value(target.value, '.3f')} "
                      f"{target.comparison} {target.threshold:g} -> {mark}")
    for note in result.notes:
        console.print(f"note: {note}")


def render_markdown(result: BenchResult, command: str, facts: dict) -> str:
    lines = [f"# {result.title}", "", "Command:", "", "```", command, "```", "",
             "Scale: " + ", ".join(f"`{k}={v}`" for k, v in result.scale.items()), ""]
    for t in result.tables:
        lines += [f"## {t.title}", ""]
        lines.append(markdown_table([c.header for c in t.columns],
                                    [[format_value(row.get(c.key), c.fmt) for c in t.columns]
                                     for row in t.rows],
                                    numeric=[bool(c.fmt) for c in t.columns]))
        if t.caption:
            lines += ["", md_cell(t.caption)]
        lines.append("")
    if result.targets:
        lines += ["## Targets", ""]
        for target in result.targets:
            verdict = "met" if target.met else "**not met**"
            lines.append(f"- {target.description}: {format_value(target.value, '.3f')} "
                         f"{target.comparison} {target.threshold:g}: {verdict}")
        lines.append("")
    if result.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    lines += ["## Machine", ""] + [f"- {k}: {v}" for k, v in facts.items()] + [""]
    return "\n".join(lines)


def write_result(result: BenchResult, out_dir: Path, stem: str, command: str,
                 facts: dict) -> tuple[Path, Path]:
    """Write `<out_dir>/<stem>.json` (the result, command and facts) and `<stem>.md`."""
    from evals.jsonio import write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json(json_path, {"command": command, "machine": facts, **result.to_dict()})
    md_path.write_text(render_markdown(result, command, facts))
    return json_path, md_path


# ----------------------------------------------------------------------------------------------
# machine facts and the command wrapper


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _git_commit() -> str:
    """HEAD, plus a fingerprint of uncommitted changes to engine/ (several people edit the tree
    at once; the fingerprint tells which engine a result was measured on)."""
    state = provenance.git_state(("engine",))
    if state["commit"] is None:
        return "unknown"
    head = state["commit"][:7]
    if not state["dirty"]:
        return f"{head} (engine/ as committed)"
    return f"{head} + uncommitted engine/ changes (diff sha256 {state['diff_sha256']})"


def machine_facts(threads: int) -> dict:
    """The machine and code state of a benchmark (evals.provenance), plus its thread settings."""
    mach, vers = provenance.machine(), provenance.versions()
    return {
        "cpu": mach["cpu"], "cpu_isa": mach["cpu_isa"], "cpu_count": mach["cpu_count"],
        "memory": mach["memory"],
        "platform": mach["platform"], "device": mach["device"], "python": vers["python"],
        "torch": vers["torch"], "transformers": vers["transformers"], "kvarena": vers["kvarena"],
        "torch_threads": threads, **openmp_state(),
        "git_commit": _git_commit(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


command_line = provenance.command_line


def run_bench_command(core: Callable[..., BenchResult], *, threads: int, out_dir: Path,
                      quick: bool, ctx=None, **kwargs) -> BenchResult:
    """What every `kvarena bench` command does: set threads, run the core, print, write files.

    Quick runs write `<name>-quick.{json,md}` so they never overwrite a full run's files."""
    from rich.console import Console

    threads = set_threads(threads)
    console = Console(width=None if sys.stdout.isatty() else 220)
    facts = machine_facts(threads)  # before the run: the code state the run imports
    load_start, started = load_average(), time.perf_counter()
    result = core(quick=quick, log=lambda msg: console.print(f"[dim]{msg}[/]"), **kwargs)
    facts["load_average_start"] = load_start
    facts["load_average_end"] = load_average()
    facts["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    render_rich(result, console)
    stem = result.name + ("-quick" if quick else "")
    paths = write_result(result, out_dir, stem, command_line(ctx), facts)
    console.print(f"load average start {load_start} / end {facts['load_average_end']}; "
                  f"{facts['benchmark_seconds']} s; wrote {paths[0]} and {paths[1]}")
    return result


# ----------------------------------------------------------------------------------------------
# engine runs


@dataclass
class EngineRun:
    """One engine configuration run on a workload: outputs (submission order), run stats, and
    the wall and process CPU time (all threads, the compaction worker's included) measured around
    generate()."""

    label: str
    outputs: list
    stats: Any
    wall: float
    cpu: float

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


def wall_times(fn: Callable[[], Any], calls: int) -> list[float]:
    """Wall seconds of each of `calls` calls of fn, one after the other."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run_engine(model: str, prompts: Sequence[list[int]], params, *, label: str,
               warmup: bool = True, on_step: Callable[[int, int], None] | None = None,
               **engine_kwargs) -> EngineRun:
    """Build an LLM, warm it up (`warm_up`), run the workload (`on_step`: LLM.generate's, for the
    workload only), and free the engine (weights and KV pool) before returning."""
    from engine.llm import LLM

    llm = LLM(model, **engine_kwargs)
    try:
        if warmup:
            warm_up(llm, prompts)
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(list(prompts), params, on_step=on_step)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return EngineRun(label, outputs, llm.last_stats, wall, cpu)
    finally:
        del llm
        gc.collect()


def warm_up(llm, prompts: Sequence[list[int]]) -> None:
    """run_engine's warm-up: a short prompt from the workload's first (it shares no page with
    the workload), and two at once on a compiling engine so that both of its compiled decode
    graphs (batch 1 and the batch buckets, engine/decode_graph.py) exist."""
    from engine.sampling import SamplingParams

    warm = [list(prompts[0][:4])] + ([list(prompts[0][:3])] if llm.compiled else [])
    for batch in ([warm[:1], warm] if len(warm) > 1 else [warm]):
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=3))


def count(stats, *keys: str) -> int:
    return sum(int(stats.counts.get(k, 0)) for k in keys)


# ----------------------------------------------------------------------------------------------
# fidelity metrics


def position_agreement(reference: Sequence[int], tokens: Sequence[int]) -> float:
    """Share of the reference's positions where `tokens` has the same token (positions past the
    end of `tokens` count as disagreements). An empty reference agrees with anything."""
    if not reference:
        return 1.0
    same = sum(a == b for a, b in zip(reference, tokens))
    return same / len(reference)


def prefix_agreement(reference: Sequence[int], tokens: Sequence[int]) -> float:
    """Share of the reference reproduced before the first differing token."""
    if not reference:
        return 1.0
    n = 0
    for a, b in zip(reference, tokens):
        if a != b:
            break
        n += 1
    return n / len(reference)


def mean_agreement(references: Iterable[Sequence[int]], outputs: Iterable[Sequence[int]],
                   metric: Callable[[Sequence[int], Sequence[int]], float] = position_agreement
                   ) -> float:
    """Per-request agreement, averaged over requests (each request weighs the same)."""
    values = [metric(r, o) for r, o in zip(references, outputs, strict=True)]
    return sum(values) / len(values) if values else float("nan")


def mean_physical_len(output) -> float | None:
    """Physical KV length averaged over a request's decode steps, rebuilt from its events.

    Between events the physical length grows one slot per decoded token, as the logical one does.
    A compaction event (logical_len = tokens computed when it ran) resets it to physical_after; a
    preemption is followed by a re-prefill of every token, so the physical length is the logical
    one again until the next event. The decode steps are the positions
    num_prompt_tokens .. num_prompt_tokens + num_output_tokens - 2 (the last output token is
    sampled but never written to the cache); a request with one output token has none (None).
    """
    first, last = output.num_prompt_tokens, output.num_prompt_tokens + output.num_output_tokens - 1
    if last <= first:
        return None
    anchors: list[tuple[int, int]] = []  # (logical position, physical length at it)
    for e in output.events:
        if e["action"] == "grow":
            continue
        physical = e["logical_len"] if e["action"] == "preempt" else e["physical_after"]
        anchors.append((e["logical_len"], physical))
    total, a, anchor = 0, 0, (first, first)
    # An event at logical L is applied before the token at position L is decoded.
    for pos in range(first, last):
        while a < len(anchors) and anchors[a][0] <= pos:
            anchor = anchors[a]
            a += 1
        total += anchor[1] + (pos - anchor[0])
    return total / (last - first)


def finite(values: Iterable[Any]) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def policy_metrics(run: EngineRun, reference: EngineRun | None = None) -> dict:
    """The standard per-configuration numbers (docs/metrics.md), from one engine run.

    compaction_share: compaction_seconds / wall_time (scoring, top-k and compaction of every
        compression event; the demand estimate is not included).
    overhead: every stage timer of every capacity event (demand estimate, attention score, window
        mask, top-k, compaction) summed, over forward_seconds + compaction_seconds.
    agreement / prefix: position-wise / identical-prefix share of the reference's greedy tokens
        (see position_agreement, prefix_agreement), per request, averaged over requests.
    mean_physical: the physical KV length averaged over decode steps, then over requests.
    tps_cpu: output tokens per second of process CPU time (all threads). On a shared machine the
        wall clock also counts time other processes held the cores; CPU time counts only this
        process's work, so its ratios are the steadier ones (spinning threads would inflate it,
        which is one reason engine/threads.py bounds OpenMP's spin).
    """
    s = run.stats
    physical = [v for v in (mean_physical_len(o) for o in run.outputs) if v is not None]
    decode_time = s.forward_seconds + s.compaction_seconds
    row = {
        "tps": s.tps, "wall_s": s.wall_time, "output_tokens": s.output_tokens,
        "cpu_s": run.cpu, "tps_cpu": s.output_tokens / run.cpu if run.cpu > 0 else None,
        "mean_resident": s.mean_resident, "peak_pages": s.peak_pages,
        "avg_kv_budget": s.avg_kv_budget,
        "grow": count(s, "grow"), "compress": count(s, "compress"), "shrink": count(s, "shrink"),
        "fallback": count(s, "fallback"), "preemption": count(s, "preemption"),
        "compress_events": count(s, "compress", "shrink", "periodic_compress"),
        # Every compaction, decision or not (prompt compression, fallback compactions).
        "compactions": count(s, *COMPACTION_COUNTERS),
        "grow_ratio": s.grow_ratio,
        "compaction_seconds": s.compaction_seconds, "forward_seconds": s.forward_seconds,
        "stage_seconds": dict(s.stage_seconds),
        "compaction_share": s.compaction_seconds / s.wall_time if s.wall_time else None,
        "overhead": sum(s.stage_seconds.values()) / decode_time if decode_time else None,
        "mean_physical": sum(physical) / len(physical) if physical else None,
    }
    if reference is not None:
        row["agreement"] = mean_agreement(reference.token_ids, run.token_ids)
        row["prefix"] = mean_agreement(reference.token_ids, run.token_ids, prefix_agreement)
    return row

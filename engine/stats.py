"""Per-request outputs and run statistics, with the metric definitions of docs/metrics.md:

- TPS: total output tokens / wall time of the run: from its first step (the prompts' prefill
  included) until every request completes (`LLM.stream`).
- TPOT per request: (finish time - first token time) / (output tokens - 1); the mean is reported.
- Average KV budget (`avg_kv_budget`, GrowPage's Table 8 "Avg. KV Budget" and App. I's per-request
  capacity): the policy's KV budget (`KVPolicy.kv_budget`) averaged over a request's decode steps,
  mean over requests. A fixed-budget policy reads its nominal budget at every step (Zipage-4096 and
  GrowPage-Fixed read 4096, as in Table 8, however little a short request allocates); GrowPage
  reads its capacity (its initial capacity until its first decision, then the pages its decisions
  gave it); a policy without a budget (FullKV, Kara) reads its allocated slots.
- Average allocated KV (`avg_kv_allocated`): the slots a request actually holds (pages x
  block_size) averaged over its decode steps, mean over requests: the memory it occupied.
  Which table prints which: the mixed benchmark's Table 8 and Table 9 shaped tables print both
  (Table 8's column is avg_kv_budget); the leaderboard and the eval metrics carry both.
- Average kept KV (`avg_kv_kept`): the slots that hold a kept token, averaged over (layer, KV
  head) and over a request's decode steps, mean over requests, in the same per-head slot unit as
  `avg_kv_allocated`. With one length for every head it is the physical length; with per-head
  budgets (PyramidKV, AdaKV) pages are sized by the largest head, so allocated minus kept counts
  the write-page headroom plus the holes of the heads that keep fewer tokens.
- C: mean number of requests resident (running) per decode step.
- Decode step time (`decode_step_median_s`, `decode_step_fastest_s`): the wall time of a step's
  forward pass and sampling (`ModelRunner.run`; the scheduler's work around it is not in it),
  over the steps that only decode: its median and its fastest.
- Events (Table 9): what each capacity event counts as (its kind, the engine counter it adds to,
  whether it is a primary decision) is engine/events.py's one rule. `counts` are the scheduler's
  counters: "grow", "allocate", "fallback" (a grow decision the pool could not safely satisfy),
  "preemption", and one counter per finished compaction (`events.compaction_counter`), so
  "compress" and "shrink" hold boundary decisions only. The grow ratio is computed over the primary
  decisions before fallback handling, as Table 9's caption says: (grow + grow fallbacks) / (grow +
  grow fallbacks + compress + shrink). GrowPage-Fixed thus shows grow 0 and ratio 0.0, and
  GrowPage's Table 9 row 9,500 / (9,500 + 21,203) = 30.9% is this arithmetic with its 597
  fallbacks inside the 9,500 grow decisions.
- Compactions (`compactions`): every compaction that ran (a capacity decision's, a fallback's, a
  prompt compression, a periodic firing): what `kvarena generate` prints as "compress events".
- KV slots held at the end (`final_kv_len`): the KV slots a request holds when it finishes, mean
  over requests, beside `kv_context`, the tokens its context had by then (prompt plus output):
  kept < context means the policy dropped KV.

`never_compressed` is the one rule for "a compressing policy did not compress in this run"
(`kvarena generate` warns with it; an eval can call it on a segment's statistics).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from engine.events import is_compaction, primary_decisions
from engine.sequence import CapacityEvent, Sequence


@dataclass
class RequestOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_time: float | None  # seconds after the run started
    finish_time: float
    tpot: float | None
    avg_kv_budget: float | None
    num_preemptions: int
    avg_kv_allocated: float | None = None
    avg_kv_kept: float | None = None
    final_kv_len: int | None = None  # KV slots the request held when it finished (its compressed length)
    capacity_trace: list[int] = field(repr=False, default_factory=list)
    kept_trace: list[float] = field(repr=False, default_factory=list)  # kept slots per decode step
    events: list[dict] = field(repr=False, default_factory=list)
    token_logprobs: list[float] = field(repr=False, default_factory=list)
    kept: list = field(repr=False, default_factory=list)  # KeptRecords (EngineConfig.trace_kept)

    @classmethod
    def from_sequence(cls, index: int, seq: Sequence, text: str, t0: float) -> "RequestOutput":
        n = seq.num_output_tokens
        tpot = None
        if n > 1 and seq.first_token_time is not None:
            tpot = (seq.finish_time - seq.first_token_time) / (n - 1)
        trace = seq.capacity_trace
        budgets = seq.budget_trace
        return cls(
            index=index, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason or "", num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=n,
            first_token_time=None if seq.first_token_time is None else seq.first_token_time - t0,
            finish_time=seq.finish_time - t0, tpot=tpot,
            avg_kv_budget=statistics.fmean(budgets) if budgets else None,
            num_preemptions=seq.num_preemptions,
            avg_kv_allocated=statistics.fmean(trace) if trace else None,
            avg_kv_kept=statistics.fmean(seq.kept_slots_trace) if seq.kept_slots_trace else None,
            final_kv_len=seq.physical_len,
            capacity_trace=list(trace),
            kept_trace=list(seq.kept_slots_trace),
            events=[event_dict(e) for e in seq.events],
            token_logprobs=list(seq.token_logprobs),
            kept=list(seq.kept_trace.records) if seq.kept_trace is not None else [],
        )


def event_dict(event: CapacityEvent) -> dict:
    d = asdict(event)
    d["pages_freed"] = event.pages_freed
    return d


@dataclass
class StepRecord:
    running: int
    pages_used: int
    decodes: int
    threads: int = 1  # torch's intra-op threads for the step (engine/threads.py's governor)
    prefills: int = 0  # items of the step that prefill (a chunk of a prompt)
    seconds: float = 0.0  # wall time of the step's forward pass and sampling (ModelRunner.run)


@dataclass
class RunStats:
    num_requests: int
    output_tokens: int
    wall_time: float
    tps: float
    mean_tpot: float | None
    avg_kv_budget: float | None
    avg_kv_allocated: float | None
    mean_resident: float
    peak_pages: int
    mean_pages: float
    num_steps: int
    forward_seconds: float
    compaction_seconds: float
    counts: dict
    grow_ratio: float | None
    stage_seconds: dict
    avg_kv_kept: float | None = None
    compactions: int = 0
    final_kv_len: float | None = None  # mean over requests of RequestOutput.final_kv_len
    kv_context: float | None = None
    mean_threads: float | None = None  # torch threads per step, averaged over steps
    # Over the steps that only decode (no prefill chunk beside them): the median and the
    # fastest step's StepRecord.seconds; None without such steps.
    decode_step_median_s: float | None = None
    decode_step_fastest_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        tpot = f"{self.mean_tpot * 1000:.1f} ms" if self.mean_tpot else "n/a"
        return (f"{self.num_requests} requests, {self.output_tokens} tokens in "
                f"{self.wall_time:.2f} s: {self.tps:.1f} tok/s, TPOT {tpot}, "
                f"C {self.mean_resident:.1f}, peak pages {self.peak_pages}, "
                f"{self._memory()}"
                f"preemptions {self.counts.get('preemption', 0)}")

    def _memory(self) -> str:
        """The per-head slots allocated and kept, averaged over decode steps, when both are
        known, else nothing. Named "average" so it is not read as ``kv_summary``'s slots held at
        the end."""
        if self.avg_kv_allocated is None or self.avg_kv_kept is None:
            return ""
        return (f"average KV slots per head: allocated {self.avg_kv_allocated:.0f} / "
                f"kept {self.avg_kv_kept:.0f}, ")

    def kv_summary(self) -> str:
        """Compression and memory in one line: compress events (of them prompt compressions),
        the KV slots requests held at the end against their context's tokens, average budget and
        allocated slots."""
        prefill = sum(v for k, v in self.counts.items() if k.startswith("prefill_"))
        parts = [f"compress events {self.compactions} ({prefill} of the prompt)"]
        if self.final_kv_len is not None and self.kv_context is not None:
            parts.append(f"KV slots held at the end {self.final_kv_len:.0f} of "
                         f"{self.kv_context:.0f} context tokens")
        for label, value in (("avg KV budget", self.avg_kv_budget),
                             ("avg KV allocated", self.avg_kv_allocated)):
            parts.append(f"{label} {value:.0f}" if value is not None else f"{label} n/a")
        return ", ".join(parts)


def run_stats(outputs: list[RequestOutput], steps: list[StepRecord], events: list[CapacityEvent],
              counters: Counter, wall: float, forward_seconds: float,
              compaction_seconds: float) -> RunStats:
    tokens = sum(o.num_output_tokens for o in outputs)
    tpots = [o.tpot for o in outputs if o.tpot is not None]
    budgets = [o.avg_kv_budget for o in outputs if o.avg_kv_budget is not None]
    allocated = [o.avg_kv_allocated for o in outputs if o.avg_kv_allocated is not None]
    kept = [o.avg_kv_kept for o in outputs if o.avg_kv_kept is not None]
    decode_steps = [s for s in steps if s.decodes]
    decode_only = [s.seconds for s in decode_steps if not s.prefills]
    stages: Counter[str] = Counter()
    for e in events:
        stages.update(e.stages)
    decisions = primary_decisions(events)
    n_decisions = sum(decisions.values())
    counts = {k: int(v) for k, v in counters.items()}
    return RunStats(
        num_requests=len(outputs), output_tokens=tokens, wall_time=wall,
        tps=tokens / wall if wall > 0 else 0.0,
        mean_tpot=statistics.fmean(tpots) if tpots else None,
        avg_kv_budget=statistics.fmean(budgets) if budgets else None,
        avg_kv_allocated=statistics.fmean(allocated) if allocated else None,
        mean_resident=statistics.fmean(s.running for s in decode_steps) if decode_steps else 0.0,
        peak_pages=max((s.pages_used for s in steps), default=0),
        mean_pages=statistics.fmean(s.pages_used for s in steps) if steps else 0.0,
        num_steps=len(steps), forward_seconds=forward_seconds,
        mean_threads=statistics.fmean(s.threads for s in steps) if steps else None,
        decode_step_median_s=statistics.median(decode_only) if decode_only else None,
        decode_step_fastest_s=min(decode_only, default=None),
        compaction_seconds=compaction_seconds, counts=counts,
        grow_ratio=decisions["grow"] / n_decisions if n_decisions else None,
        stage_seconds=dict(stages), compactions=sum(is_compaction(e.action) for e in events),
        avg_kv_kept=statistics.fmean(kept) if kept else None,
        final_kv_len=_mean([o.final_kv_len for o in outputs if o.final_kv_len is not None]),
        kv_context=_mean([o.num_prompt_tokens + o.num_output_tokens for o in outputs
                          if o.final_kv_len is not None]),
    )


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def never_compressed(policy, compactions: int, kv_context: float | None = None) -> str | None:
    """The warning for a run in which a compressing policy (``policy.compresses``) ran no
    compaction, or None when it compressed or never compresses by design (FullKV).

    Such a run is FullKV under another name: every request stayed within the policy's budget, so
    its quality and memory figures say nothing about the policy. ``compactions`` is
    ``RunStats.compactions`` (``stats["compactions"]`` in a segment line); ``kv_context`` (the
    mean context length, ``RunStats.kv_context``) and the policy's ``budget`` field, when it has
    one, make the message say how far the requests were from compressing."""
    if not getattr(policy, "compresses", True) or compactions > 0:
        return None
    name = getattr(policy, "name", type(policy).__name__)
    budget = getattr(policy, "budget", None)
    reach = ""
    if kv_context is not None:
        reach = f" (requests reached {kv_context:.0f} tokens on average"
        reach += f", budget {budget})" if budget is not None else ")"
    return (f"policy {name} never compressed in this run{reach}: every request fit, so the run "
            f"is FullKV's; use longer prompts or more output tokens, or a smaller budget")

"""Per-request outputs and run statistics, with DESIGN.md's metric definitions:

- TPS: total output tokens / wall time from the start of decoding until every request completes.
- TPOT per request: (finish time - first token time) / (output tokens - 1); the mean is reported.
- Average KV budget: allocated capacity (pages x block_size) averaged over a request's decoding
  steps; the mean over requests is reported.
- C: mean number of requests resident (running) per decode step.
- Events: grow, compress, shrink, fallback, preemption; grow ratio = grows / primary decisions,
  the grow + compress + shrink decisions made at capacity boundaries (fallback compressions are
  counted apart). This reproduces GrowPage's Table 9 arithmetic, e.g. 9500 / (9500 + 21203) = 30.9%.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

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
    capacity_trace: list[int] = field(repr=False, default_factory=list)
    events: list[dict] = field(repr=False, default_factory=list)
    token_logprobs: list[float] = field(repr=False, default_factory=list)

    @classmethod
    def from_sequence(cls, index: int, seq: Sequence, text: str, t0: float) -> "RequestOutput":
        n = seq.num_output_tokens
        tpot = None
        if n > 1 and seq.first_token_time is not None:
            tpot = (seq.finish_time - seq.first_token_time) / (n - 1)
        trace = seq.capacity_trace
        return cls(
            index=index, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason or "", num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=n,
            first_token_time=None if seq.first_token_time is None else seq.first_token_time - t0,
            finish_time=seq.finish_time - t0, tpot=tpot,
            avg_kv_budget=statistics.fmean(trace) if trace else None,
            num_preemptions=seq.num_preemptions, capacity_trace=list(trace),
            events=[event_dict(e) for e in seq.events],
            token_logprobs=list(seq.token_logprobs),
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


@dataclass
class RunStats:
    num_requests: int
    output_tokens: int
    wall_time: float
    tps: float
    mean_tpot: float | None
    avg_kv_budget: float | None
    mean_resident: float
    peak_pages: int
    mean_pages: float
    num_steps: int
    forward_seconds: float
    compaction_seconds: float
    counts: dict
    grow_ratio: float | None
    stage_seconds: dict

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        tpot = f"{self.mean_tpot * 1000:.1f} ms" if self.mean_tpot else "n/a"
        return (f"{self.num_requests} requests, {self.output_tokens} tokens in "
                f"{self.wall_time:.2f} s: {self.tps:.1f} tok/s, TPOT {tpot}, "
                f"C {self.mean_resident:.1f}, peak pages {self.peak_pages}, "
                f"preemptions {self.counts.get('preemption', 0)}")


def run_stats(outputs: list[RequestOutput], steps: list[StepRecord], events: list[CapacityEvent],
              counters: Counter, wall: float, forward_seconds: float,
              compaction_seconds: float) -> RunStats:
    tokens = sum(o.num_output_tokens for o in outputs)
    tpots = [o.tpot for o in outputs if o.tpot is not None]
    budgets = [o.avg_kv_budget for o in outputs if o.avg_kv_budget is not None]
    decode_steps = [s for s in steps if s.decodes]
    stages: Counter[str] = Counter()
    for e in events:
        stages.update(e.stages)
    boundary = [e for e in events if e.info.get("trigger", "boundary") == "boundary"
                and e.action in ("grow", "compress", "shrink")]
    grows = sum(e.action == "grow" for e in boundary)
    counts = {k: int(v) for k, v in counters.items()}
    return RunStats(
        num_requests=len(outputs), output_tokens=tokens, wall_time=wall,
        tps=tokens / wall if wall > 0 else 0.0,
        mean_tpot=statistics.fmean(tpots) if tpots else None,
        avg_kv_budget=statistics.fmean(budgets) if budgets else None,
        mean_resident=statistics.fmean(s.running for s in decode_steps) if decode_steps else 0.0,
        peak_pages=max((s.pages_used for s in steps), default=0),
        mean_pages=statistics.fmean(s.pages_used for s in steps) if steps else 0.0,
        num_steps=len(steps), forward_seconds=forward_seconds,
        compaction_seconds=compaction_seconds, counts=counts,
        grow_ratio=grows / len(boundary) if boundary else None,
        stage_seconds=dict(stages),
    )

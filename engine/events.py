"""What a capacity event counts as: the one classification of capacity events (docs/metrics.md,
"Events"), used by the scheduler's counters, the run statistics and the evals' event counts.

An event is an `engine.sequence.CapacityEvent` or its dict form (`engine.stats.event_dict`, what
`RequestOutput.events` and the sample lines carry). Three of its fields decide what it counts as:
- `action`: "grow" or "allocate" (a page added, engine/scheduler.py `grow_kind`), "compress" or
  "shrink" (a compaction: KV slots rewritten, some dropped), "preempt";
- the trigger, `info["trigger"]`: "boundary" (the default: a capacity boundary), "prefill" (prompt
  compression, re-admission), "periodic" (a periodic schedule's firing, Kara's KvLLM) or "fallback";
- `fallback`: the compaction a fallback ran in place of a GROW the pool could not safely grant;
  `info["primary"]` names that GROW's kind ("grow" or "allocate").

Kinds (`EVENT_KINDS`, one per event): a fallback compaction is "fallback"; a compaction after a
prefill or from a periodic schedule is "prefill_compress" / "periodic_compress" (a shrink there
too: only boundary decisions tell compress and shrink apart); any other event is its action. So
"compress" and "shrink" hold boundary decisions only.

Engine counters (`Scheduler.counters`) use the kinds for finished compactions
(`compaction_counter`), except that a fallback's compaction counts as "fallback_compaction": the
scheduler counts "fallback" when the fallback replaces the GROW, whether or not its compaction
then runs.

Primary decisions (GrowPage Table 9, before fallback handling): boundary grows, compressions and
shrinks, plus each fallback that replaced a grow decision counted as the grow it was; allocation,
prefill, periodic and re-admission compressions are not decisions. The grow ratio is
grow / (grow + compress + shrink) over them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

DECISION_ACTIONS = ("grow", "compress", "shrink")
COMPACTION_ACTIONS = ("compress", "shrink")
TRIGGERED = ("prefill", "periodic")  # triggers whose compactions are kinds of their own
EVENT_KINDS = ("grow", "compress", "shrink", "fallback", "preempt", "prefill_compress",
               "periodic_compress", "allocate")
FALLBACK_COMPACTION = "fallback_compaction"
# Every counter a finished compaction adds to (compaction_counter).
COMPACTION_COUNTERS = ("compress", "shrink", FALLBACK_COMPACTION,
                       *(f"{t}_compress" for t in TRIGGERED))


def _fields(event: Any) -> tuple[str, str, bool, Any]:
    """(action, trigger, fallback, primary) of a CapacityEvent or its dict form."""
    if isinstance(event, Mapping):
        action, fallback, info = event.get("action"), event.get("fallback"), event.get("info")
    else:
        action, fallback, info = event.action, event.fallback, event.info
    info = info or {}
    return str(action), info.get("trigger", "boundary"), bool(fallback), info.get("primary")


def is_compaction(action: str) -> bool:
    """Whether a capacity event's action is a compaction (KV slots rewritten, some dropped)."""
    return action in COMPACTION_ACTIONS


def event_kind(event: Any) -> str:
    """The kind of one event (`EVENT_KINDS`, module docstring)."""
    action, trigger, fallback, _ = _fields(event)
    if fallback:
        return "fallback"
    if is_compaction(action) and trigger in TRIGGERED:
        return f"{trigger}_compress"
    return action


def compaction_counter(event: Any) -> str:
    """The engine counter a finished compaction adds to (`COMPACTION_COUNTERS`)."""
    kind = event_kind(event)
    return FALLBACK_COMPACTION if kind == "fallback" else kind


def primary_decision(event: Any) -> str | None:
    """The Table 9 primary decision ("grow" / "compress" / "shrink") an event is, or None."""
    action, trigger, fallback, primary = _fields(event)
    if fallback:
        return "grow" if primary == "grow" else None
    if trigger == "boundary" and action in DECISION_ACTIONS:
        return action
    return None


def primary_decisions(events: Iterable[Any]) -> Counter:
    """Counts of the primary decisions among `events`, with every decision action present."""
    out: Counter[str] = Counter(dict.fromkeys(DECISION_ACTIONS, 0))
    for e in events:
        decision = primary_decision(e)
        if decision is not None:
            out[decision] += 1
    return out


def event_counts(events: Iterable[Any]) -> tuple[dict, dict, dict]:
    """(counts by kind, primary decisions by action, stage seconds) of events (one request's, in
    a sample line); kinds and decisions that did not occur are left out."""
    events = list(events)
    kinds = dict(Counter(event_kind(e) for e in events))
    decisions = {k: v for k, v in primary_decisions(events).items() if v}
    stages: dict[str, float] = {}
    for e in events:
        for k, v in ((e.get("stages") if isinstance(e, Mapping) else e.stages) or {}).items():
            stages[k] = stages.get(k, 0.0) + float(v)
    return kinds, decisions, stages

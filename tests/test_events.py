"""engine/events.py: the one classification of capacity events (kinds, counters, decisions)."""

from engine.events import (
    COMPACTION_COUNTERS,
    EVENT_KINDS,
    compaction_counter,
    event_counts,
    event_kind,
    primary_decisions,
)
from engine.sequence import CapacityEvent
from engine.stats import event_dict


def capacity_event(action, trigger=None, fallback=False, primary=None, stages=None):
    info = {k: v for k, v in (("trigger", trigger), ("primary", primary)) if v is not None}
    return CapacityEvent(0.0, 0, action, 10, 8, 4, 2, 1, fallback=fallback, info=info,
                         stages=dict(stages or {}))


EVENTS = [capacity_event("grow", "boundary"),
          capacity_event("allocate"),
          capacity_event("compress", "prefill"),
          capacity_event("compress", "fallback", fallback=True, primary="grow"),
          capacity_event("compress", stages={"topk": 0.5}),
          capacity_event("shrink", "periodic"),
          capacity_event("shrink", "boundary", stages={"topk": 0.25}),
          capacity_event("preempt")]


def test_kinds_and_counters_by_trigger_and_fallback():
    kinds = [event_kind(e) for e in EVENTS]
    assert kinds == ["grow", "allocate", "prefill_compress", "fallback", "compress",
                     "periodic_compress", "shrink", "preempt"]
    assert set(kinds) <= set(EVENT_KINDS)
    compactions = [e for e in EVENTS if e.action in ("compress", "shrink")]
    counters = [compaction_counter(e) for e in compactions]
    assert counters == ["prefill_compress", "fallback_compaction", "compress", "periodic_compress",
                        "shrink"]
    assert set(counters) == set(COMPACTION_COUNTERS)  # the list names every counter, no more


def test_an_event_and_its_dict_form_count_the_same():
    as_dicts = [event_dict(e) for e in EVENTS]
    assert [event_kind(d) for d in as_dicts] == [event_kind(e) for e in EVENTS]
    assert event_counts(as_dicts) == event_counts(EVENTS)
    kinds, decisions, stages = event_counts(as_dicts)
    assert kinds == {"grow": 1, "allocate": 1, "prefill_compress": 1, "fallback": 1,
                     "compress": 1, "periodic_compress": 1, "shrink": 1, "preempt": 1}
    # the fallback counts as the grow it replaced; allocation, prompt and periodic: no decisions
    assert decisions == {"grow": 2, "compress": 1, "shrink": 1}
    assert stages == {"topk": 0.75}


def test_primary_decisions_keep_every_decision_action():
    assert primary_decisions([capacity_event("allocate")]) == {"grow": 0, "compress": 0,
                                                              "shrink": 0}
    # a fallback for page allocation (a fixed budget's opt-in) replaced no decision
    allocation_fallback = capacity_event("compress", "fallback", fallback=True, primary="allocate")
    assert sum(primary_decisions([allocation_fallback]).values()) == 0

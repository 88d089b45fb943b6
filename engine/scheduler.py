"""Continuous batching with paged KV, capacity boundaries, compaction and preemption.

Each step packs single-token decodes first, then prefill chunks, under `max_num_batched_tokens`
and `max_num_seqs`. Before a decode, a sequence whose pages are full is at a *capacity boundary*:
its policy answers GROW / COMPRESS / SHRINK. A GROW that cannot be granted asks the policy for a
fallback compression; failing that, the scheduler preempts the most recently admitted request
(recompute: it frees its pages, goes back to the front of the queue, and is re-prefilled later, where
the policy may compress it back to its capacity).

Two kinds of GROW (`grow_kind`). A *capacity decision* (the policy labels it info["action"] =
"grow", or it carries a demand estimate "delta") is GrowPage's "Grow by One Page": it is granted
only while the pool keeps a free-page watermark after it, `config.grow_watermark` of the pool
(vLLM's scheduler keeps 1% of the blocks free the same way), else it "cannot be safely satisfied"
(GrowPage Sec. 4.2) and falls back. Any other GROW is *page allocation* (FullKV, a fixed budget or
GrowPage below its cap or start): it takes any free page. Counters and events name them "grow" and
"allocate"; only "grow" enters the grow ratio (engine/events.py).

A request that can never fit (prompt longer than the model context, or more pages than the pool)
is rejected when added; a lone request that outgrows the whole pool with no way to compress finishes
with reason "kv_capacity" instead of hanging.

Forced runs (`config.chunked_forcing`, `KVPolicy.chunked_forcing`). A decoding request whose next
k >= 2 output tokens are all forced (`SamplingParams.forced_tokens`) runs them as one item of k
rows, a chunk in the prefill path: each row attends to the cache as it stands plus the run's
earlier rows, and every row's logits score (and sample, for the random stream) its forced token.
k stops at the free slots of the pages the request holds, so a boundary policy sees the same
boundaries: the decision before the run's first token is taken as for a decode, and the next one
after its last. It also stops at the request's max_tokens and the model's context, so a run never
finishes early, and at the policy's `forced_run_limit` (Kara's window fill: the run ends where
its tail fills a window, so `periodic` compresses it before the next token, as token by token).
Runs take what the step's token budget leaves after the one-token decodes, prefill
chunks and admissions, so every other request's share of a step is what it would be token by
token. Afterwards each token is accounted for as its own decode step (traces, `kv_budget`, stop
checks).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable

from engine.block_manager import BlockManager
from engine.compaction import CompactionWorker, PolicyError, execute, finalize, plan
from engine.config import ConfigError, EngineConfig
from engine.events import compaction_counter
from engine.policies.base import Action, Decision, KVPolicy, StageTimer
from engine.policy_view import SeqView
from engine.runner import ModelRunner, WorkItem
from engine.sequence import CapacityEvent, SeqStatus, Sequence


def prompt_unfit(n: int, max_model_len: int, num_pages: int, block_size: int) -> str | None:
    """Why a prompt of `n` tokens can never run (the one rule for it: `Scheduler.add`, and
    `LLM.why_unfit` for callers that check before submitting), or None. It needs room for one
    generated token, in the model's context and in the whole KV pool."""
    if n >= max_model_len:
        return (f"prompt of {n} tokens does not fit the model context of {max_model_len} tokens "
                f"(max_model_len); shorten it or raise max_model_len")
    if -(-(n + 1) // block_size) > num_pages:
        return (f"prompt of {n} tokens needs more KV pages than the whole pool holds "
                f"({num_pages} pages of {block_size}); raise kv_cache_tokens")
    return None


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner, policy: KVPolicy,
                 block_manager: BlockManager, eos_ids: set[int],
                 detokenize: Callable[[list[int]], str]):
        self.config = config
        self.runner = runner
        self.policy = policy
        self.bm = block_manager
        self.eos_ids = eos_ids
        self.detokenize = detokenize
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.worker = CompactionWorker() if config.async_compaction else None
        self.counters: Counter[str] = Counter()
        self.events: list[CapacityEvent] = []
        self.compaction_seconds = 0.0
        self.step_index = 0
        self.finished: list[Sequence] = []
        self._scheduled: set[int] = set()
        # Decided once per run: a policy that overrides `periodic` (say a subclass of one that
        # opted in) must see every step, so its forced tokens run one by one, unless the class
        # that defines its `periodic` also bounds its runs (`forced_run_limit`).
        self.chunked_forcing = (config.chunked_forcing and policy.chunked_forcing
                                and _periodic_is_bounded(type(policy)))
        # Free pages a capacity-decision GROW must leave (vLLM: int(watermark x blocks)).
        self.grow_reserve = int(config.grow_watermark * block_manager.num_pages)
        # Decided once: whether the policy prepares a step's boundary decisions together
        # (KVPolicy.prepare_boundaries); the share of that work each request's decision is
        # charged with in its event's "demand" stage, by sequence id.
        self.prepares_boundaries = \
            type(policy).prepare_boundaries is not KVPolicy.prepare_boundaries
        self._prepared_seconds: dict[int, float] = {}

    # -- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        n = seq.num_prompt_tokens
        limit = self.runner.max_model_len
        if n == 0:
            raise ConfigError("empty prompt: a request needs at least one token")
        reason = prompt_unfit(n, limit, self.bm.num_pages, self.bm.block_size)
        if reason:
            raise ConfigError(reason)
        seq.policy_state = self.policy.new_state()
        self.policy.on_admit(seq.policy_state, n, seq.params.kv_budget)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Requests still to run, or finished ones not yet drained (an abort between steps)."""
        return bool(self.waiting or self.running or self.finished)

    def abort(self, seq: Sequence) -> bool:
        """End `seq` between steps with finish reason "aborted" (its client gave up); its pages
        return to the pool. False if it had already finished. A request whose compaction runs in
        the background is aborted once that compaction is collected (until then the job holds
        its pages)."""
        if seq.status is SeqStatus.FINISHED:
            return False
        if seq.compacting:
            self.collect_compactions(wait=True)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "aborted")
        return True

    def view(self, seq: Sequence) -> SeqView:
        return SeqView(seq, self.runner)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> list[WorkItem]:
        self.step_index += 1
        self.collect_compactions()
        self._periodic()
        items = self._pack()
        if not items and self.running and not (self.worker and self.worker.busy):
            self._break_stall()
            items = self._pack()
        return items

    def _pack(self) -> list[WorkItem]:
        budget = self.config.max_num_batched_tokens
        items: list[WorkItem] = []
        self._scheduled = set()  # victims are never taken from requests already in this step
        if self.prepares_boundaries:
            self._prepare_boundaries()
        for seq in list(self.running):
            if budget == 0:
                break
            if self._decoding(seq):
                if self._ensure_slot(seq):
                    items.append(WorkItem(seq, 1))
                    self._scheduled.add(seq.seq_id)
                    budget -= 1
        for seq in list(self.running):
            if budget and seq.is_prefilling and not seq.compacting and seq.status is SeqStatus.RUNNING:
                item = self._chunk(seq, budget)
                if item:
                    items.append(item)
                    self._scheduled.add(seq.seq_id)
                    budget -= item.num_tokens
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            items.append(item)
            self._scheduled.add(item.seq.seq_id)
            budget -= item.num_tokens
        if self.chunked_forcing:
            self._extend_forced(items, budget)
        items.sort(key=lambda it: it.num_tokens > 1)  # the runner wants one-token items first
        return items

    def _extend_forced(self, items: list[WorkItem], budget: int) -> None:
        """Turn the step's one-token decodes whose next tokens are forced into forced runs
        (module docstring), within `budget` more tokens."""
        for item in items:
            if not budget:
                break
            if item.prefill:
                continue
            extra = min(self._forced_run(item.seq), budget + 1) - 1
            if extra > 0:
                item.num_tokens += extra
                item.forced = True
                budget -= extra

    def _forced_run(self, seq: Sequence) -> int:
        """How many decode steps of `seq`, from now, can run as one forced run: its next output
        tokens that are forced, up to the free slots of its pages, its max_tokens and the model's
        context (the last token of the run may end the request, no earlier one can)."""
        p, done = seq.params, seq.num_output_tokens
        run = min(len(p.forced_tokens) - done, p.max_tokens - done,
                  self.runner.max_model_len - seq.logical_len,
                  seq.num_pages * self.bm.block_size - seq.physical_len)
        limit = self.policy.forced_run_limit(self.view(seq)) if run > 1 else None
        return run if limit is None else min(run, limit)

    def _chunk(self, seq: Sequence, budget: int, reserve: int = 0) -> WorkItem | None:
        """The next prefill chunk that fits the token budget and the free pages, leaving `reserve`
        pages free."""
        bs = self.bm.block_size
        n = min(len(seq.token_ids) - seq.num_computed, budget)
        room = (seq.num_pages + self.bm.num_free - reserve) * bs - seq.physical_len
        n = min(n, room)
        if n <= 0:
            return None
        self.bm.grow(seq, self.bm.pages_needed(seq, n))
        return WorkItem(seq, n, prefill=True)

    def _admit(self, seq: Sequence, budget: int) -> WorkItem | None:
        if not seq.block_table:
            cached = self.bm.match_prefix(seq)
            seq.num_computed = seq.physical_len = seq.num_cached_prefix = cached
            self.counters["prefix_hit_tokens"] += cached
        # While others run, keep a watermark of free pages so a newcomer does not take the page a
        # running request needs next (which would preempt it, or the newcomer, right away).
        reserve = max(1, self.bm.num_pages // 100) if self.running else 0
        item = self._chunk(seq, budget, reserve)
        if item is None:
            self.bm.free_sequence(seq)
            seq.num_computed = seq.physical_len = seq.num_cached_prefix = 0
            return None
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        seq.query_slot = self.runner.bind_query_slot()
        self.running.append(seq)
        return item

    # -- capacity boundaries --------------------------------------------------------------------
    def _ensure_slot(self, seq: Sequence) -> bool:
        """True when `seq` has a free slot for its next token (after any boundary decision).

        A compaction with per-head counts gives back the pages past its widest count
        (engine/compaction.py), so it can leave the pages full: the policy is then asked again,
        at the boundary it now stands at, as an asynchronous compaction's next step would."""
        while self._full(seq):
            before = seq.physical_len
            if self._boundary(seq):
                return True
            if seq.compacting or seq.status is not SeqStatus.RUNNING or seq.physical_len >= before:
                return False
        return True

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        """A running request past its prefill with no compaction in flight: it decodes this
        step if it can."""
        return seq.status is SeqStatus.RUNNING and not seq.compacting and not seq.is_prefilling

    def _full(self, seq: Sequence) -> bool:
        """Its pages hold no free slot: the next token needs a boundary decision."""
        return seq.physical_len >= seq.num_pages * self.bm.block_size

    def _prepare_boundaries(self) -> None:
        """Hand the policy every decoding request that stands at a full boundary, before any is
        asked (KVPolicy.prepare_boundaries), and charge each an equal share of the time."""
        full = [seq for seq in self.running if self._decoding(seq) and self._full(seq)]
        if not full:
            return
        start = time.perf_counter()
        self.policy.prepare_boundaries([self.view(seq) for seq in full])
        share = (time.perf_counter() - start) / len(full)
        self._prepared_seconds = {seq.seq_id: share for seq in full}

    def _boundary(self, seq: Sequence) -> bool:
        """Ask the policy at a full boundary and apply its decision; True when a slot is free."""
        view = self.view(seq)
        timer = StageTimer()
        timer.stages["demand"] = self._prepared_seconds.pop(seq.seq_id, 0.0)
        with timer.stage("demand"):
            decision = self.policy.on_boundary(view)
        if decision.action is not Action.GROW and decision.target_len is not None \
                and decision.target_len >= seq.num_pages * self.bm.block_size:
            raise PolicyError(
                f"{self.policy.name}: a boundary compression must free slots "
                f"(target {decision.target_len}, capacity {seq.num_pages * self.bm.block_size})"
            )
        return self._apply(seq, view, decision, timer, trigger="boundary")

    def _apply(self, seq: Sequence, view: SeqView, decision: Decision, timer: StageTimer,
               trigger: str) -> bool:
        if decision.action is not Action.GROW:
            return self._compact(seq, view, decision, trigger, timer=timer)
        kind = grow_kind(decision)
        reserve = self.grow_reserve if kind == "grow" else 0
        if self.bm.num_free > reserve:
            self._grow(seq, decision, timer)
            return True
        fallback = self.policy.fallback(view)
        if fallback is not None and fallback.action is not Action.GROW:
            self.counters["fallback"] += 1
            fallback.info.setdefault("primary", kind)  # the GROW it replaces (grow ratio)
            return self._compact(seq, view, fallback, "fallback", timer=timer, is_fallback=True)
        if self.bm.num_free:  # no fallback: the watermark yields to a free page
            self._grow(seq, decision, timer)
            return True
        if not self._free_a_page(seq):
            return False
        self._grow(seq, decision, timer)
        return True

    def _grow(self, seq: Sequence, decision: Decision, timer: StageTimer) -> None:
        pages_before = seq.num_pages
        self.bm.grow(seq, 1)
        kind = grow_kind(decision)
        self.counters[kind] += 1
        if decision.info or self.policy.compresses:
            self._record(CapacityEvent(
                time.perf_counter(), seq.seq_id, kind, seq.num_computed, seq.physical_len,
                seq.physical_len, pages_before, seq.num_pages, info=dict(decision.info),
                stages=dict(timer.stages)), seq)

    def _free_a_page(self, seq: Sequence) -> bool:
        """Preempt other requests until a page is free. False if `seq` itself had to yield."""
        while not self.bm.num_free:
            victim = self._victim(exclude=seq)
            if victim is None:
                if self.worker and self.worker.busy:
                    return False  # a compaction in flight will return slots or pages
                if len(self.running) == 1:
                    self._finish(seq, "kv_capacity")
                    return False
                self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _victim(self, exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and not seq.compacting and seq.seq_id not in self._scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        phys, pages = seq.physical_len, seq.num_pages
        self.bm.free_sequence(seq)
        self._release_slot(seq)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.policy.on_preempt(seq.policy_state)
        self.waiting.appendleft(seq)
        self.counters["preemption"] += 1
        self._record(CapacityEvent(time.perf_counter(), seq.seq_id, "preempt", seq.logical_len,
                                   phys, 0, pages, 0), seq)

    def _break_stall(self) -> None:
        """Nothing could run (every running request waits for pages): make room."""
        if len(self.running) == 1:
            self._finish(self.running[0], "kv_capacity")
        else:
            self._preempt(self.running[-1])

    # -- compaction -----------------------------------------------------------------------------
    def _compact(self, seq: Sequence, view: SeqView, decision: Decision, trigger: str,
                 timer: StageTimer | None = None, is_fallback: bool = False) -> bool:
        job = plan(seq, decision, self.bm, decision.action.value, is_fallback)
        while job is None:
            victim = self._victim(exclude=seq)
            if victim is None:
                return False
            self._preempt(victim)
            job = plan(seq, decision, self.bm, decision.action.value, is_fallback)
        job.decision.info.setdefault("trigger", trigger)
        if timer is not None:
            job.timer.stages.update(timer.stages)
        if self.worker is not None:
            self.worker.submit(job, self.policy, view, self.runner.kv_cache(),
                               self.runner.backend.compact)
            return False
        execute(job, self.policy, view, self.runner.kv_cache(), self.runner.backend.compact)
        self._finish_job(job)
        return seq.physical_len < seq.num_pages * self.bm.block_size

    def _finish_job(self, job) -> None:
        event = finalize(job, self.bm)
        self.counters[compaction_counter(event)] += 1
        self.compaction_seconds += sum(v for k, v in event.stages.items() if k != "demand")
        self.events.append(event)

    def collect_compactions(self, wait: bool = False) -> None:
        if self.worker is not None:
            for job in self.worker.done(wait=wait):
                self._finish_job(job)

    def _periodic(self) -> None:
        views = [self.view(s) for s in self.running if not s.compacting and not s.is_prefilling]
        for view, decision in self.policy.periodic(self.step_index, views):
            if decision.action is not Action.GROW:
                self._compact(view.seq, view, decision, "periodic")

    # -- after the forward pass -----------------------------------------------------------------
    def postprocess(self, items: list[WorkItem], tokens: list[int]) -> None:
        self._scheduled = set()
        sampled = iter(tokens)
        now = time.perf_counter()
        prefilled = []
        for item in items:
            seq = item.seq
            if not item.prefill:
                self._decoded(item, [next(sampled) for _ in range(item.rows)], now)
                continue
            samples = item.samples  # read before the lengths move
            seq.num_computed += item.num_tokens
            seq.physical_len += item.num_tokens
            self.bm.register_prompt_pages(seq)
            if samples:
                seq.token_ids.append(next(sampled))
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._stop_reason(seq)
                if reason:
                    self._finish(seq, reason, now)
                    continue
            prefilled.append(seq)
        # Compress after every item is accounted for: a compaction may preempt another request.
        for seq in prefilled:
            if seq.status is SeqStatus.RUNNING:
                self._after_prefill(seq)

    def _decoded(self, item: WorkItem, tokens: list[int], now: float) -> None:
        """Account for a decode item's tokens one decode step at a time (a forced run's in
        order): lengths, the per-step traces at the physical length of that step, the token,
        the stop checks."""
        seq = item.seq
        for i, token in enumerate(tokens):
            seq.num_computed += 1
            seq.physical_len += 1
            allocated = seq.num_pages * self.bm.block_size
            budget = self.policy.kv_budget(seq.policy_state, seq.num_pages)
            seq.capacity_trace.append(allocated)
            seq.kept_slots_trace.append(seq.kept_slots)
            seq.budget_trace.append(allocated if budget is None else budget)
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq)
            if reason:
                if i != len(tokens) - 1:  # `_forced_run` bounds a run so that this cannot happen
                    raise RuntimeError(f"sequence {seq.seq_id} stopped ({reason}) "
                                       f"{len(tokens) - 1 - i} tokens before the end of its run")
                self._finish(seq, reason, now)

    def drain_finished(self) -> list[Sequence]:
        done, self.finished = self.finished, []
        return done

    def _after_prefill(self, seq: Sequence) -> None:
        view = self.view(seq)
        decision = self.policy.after_prefill(view, final=not seq.is_prefilling)
        if decision is not None and decision.action is not Action.GROW:
            self._compact(seq, view, decision, "prefill")

    def _stop_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        last = seq.token_ids[-1]
        # A forced token never stops the request: a scored continuation may contain EOS or a stop
        # string and is still scored to its end.
        forcing = seq.num_output_tokens <= len(p.forced_tokens)
        if not forcing and not p.ignore_eos and last in self.eos_ids:
            return "stop"
        if p.stop and not forcing and self._stop_string_hit(seq):
            return "stop"
        if p.forced_tokens and seq.num_output_tokens == len(p.forced_tokens) \
                and p.max_tokens <= len(p.forced_tokens):
            return "forced"
        if seq.num_output_tokens >= p.max_tokens or seq.logical_len >= self.runner.max_model_len:
            return "length"
        return None

    def _stop_string_hit(self, seq: Sequence) -> bool:
        """Did the newest token complete a stop string? Decodes only the tail that token can
        complete (`SamplingParams.stop_tail_tokens`); the whole text is decoded once, on a hit, to
        cut it at the first stop string."""
        p = seq.params
        tail = self.detokenize(seq.output_token_ids[-p.stop_tail_tokens:])
        if not any(s in tail for s in p.stop):
            return False
        text = self.detokenize(seq.output_token_ids)
        hits = [text.find(s) for s in p.stop if s in text]
        if not hits:  # the tail decoded differently from the whole text: no stop yet
            return False
        seq.text = text[: min(hits)]
        return True

    def _finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        seq.finish_reason = reason
        seq.finish_time = now or time.perf_counter()
        seq.status = SeqStatus.FINISHED
        self.bm.free_sequence(seq)
        self._release_slot(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.counters[f"finish_{reason}"] += 1
        self.finished.append(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.query_slot is not None:
            self.runner.release_query_slot(seq.query_slot)
            seq.query_slot = None

    def _record(self, event: CapacityEvent, seq: Sequence) -> None:
        seq.events.append(event)
        self.events.append(event)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.collect_compactions(wait=True)
            self.worker.shutdown()


def grow_kind(decision: Decision) -> str:
    """"grow" for a capacity decision (labelled so, or carrying a demand estimate), "allocate"
    for page allocation (module docstring)."""
    label = decision.info.get("action")
    if label in ("grow", "allocate"):
        return label
    return "grow" if "delta" in decision.info else "allocate"


def _periodic_is_bounded(cls: type) -> bool:
    """Whether forced runs may skip steps of `cls.periodic`: it is KVPolicy's (no schedule), or
    the class that defines it defines `forced_run_limit` too (at it or below it)."""
    owner = next(c for c in cls.__mro__ if "periodic" in vars(c))
    if owner is KVPolicy:
        return True
    bound = next(c for c in cls.__mro__ if "forced_run_limit" in vars(c))
    return bound is not KVPolicy and issubclass(bound, owner)

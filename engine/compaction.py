"""Compressed PagedAttention's compaction: plan, execute, finalize.

plan (scheduler thread): choose the target pages. The sequence keeps `keep_pages` of its pages; any
of those that is shared (prefix cache, ref_count > 1) is replaced by a fresh page, because a shared
page is never written in place (copy-on-compress); the pages it gives up are released only at
finalize, after the copy, so other requests keep reading intact prefix pages meanwhile. Reused own
pages lose their prefix-cache identity before they are overwritten.

execute (scheduler thread, or the background worker when async): ask the policy which slots each
(layer, KV head) keeps, then gather those K/V rows (and per-slot scores) to slots 0..target_len-1 of
the target pages, in order.

finalize (scheduler thread): swap the block table, set the physical length, release pages, and record
the event with its stage timings.

No host syncs on CUDA: policies return each row's kept slots ascending (topk_keep, select_chunks)
and the targets are fresh pages or the sequence's own pages from the front, which is the Triton
compaction kernel's ordering precondition by construction (engine/kernels/compact.py), so the
hazard check (a device-to-host sync per call) is skipped; K and V move in one launch (the
backend's `compact`; on CPU float32 the C kernel moves them in place, no temporary copy). On CPU
the order is checked (free there) so a policy that breaks it fails loudly in CPU runs and tests.
With async compaction on CUDA the worker runs on its own stream: the copy overlaps the other
requests' decode steps instead of queueing behind them on the default stream.

Per-head budgets (a `HeadKeep` from select, docs/architecture.md): row (l, h) moves its
counts[l, h] kept slots to the front as usual; its ignored tail entries become slot i -> target
i (a self-copy in place, a harmless copy into fresh pages), which keeps the ordering
precondition. finalize sets the physical length to max(counts), gives back the pages past it
(keeping whatever headroom the decision asked for beyond ceil(target_len / b)) and records the
counts on the sequence, whose heads then mask their holes in attention. The counts come to the
host once per event (a sync on CUDA).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.attention import KVCache
from engine.block_manager import BlockManager
from engine.policies.base import Action, Decision, HeadKeep, KVPolicy, PolicyView, StageTimer
from engine.sequence import CapacityEvent, Sequence


class PolicyError(RuntimeError):
    """A policy returned something that breaks the engine's invariants."""


@dataclass
class CompactionJob:
    seq: Sequence
    decision: Decision
    kind: str
    new_table: list[int]
    release: list[int]
    fallback: bool = False
    timer: StageTimer = field(default_factory=StageTimer)
    started: float = field(default_factory=time.perf_counter)
    physical_before: int = 0
    pages_before: int = 0
    counts: torch.Tensor | None = None  # [layers, kv_heads] kept per head (HeadKeep), CPU


def plan(seq: Sequence, decision: Decision, bm: BlockManager, kind: str,
         fallback: bool = False) -> CompactionJob | None:
    """Reserve target pages; None when copy-on-compress needs more free pages than there are."""
    bs = bm.block_size
    target = decision.target_len
    if target is None or not 0 <= target <= seq.physical_len:
        raise PolicyError(f"compaction target {target} outside 0..{seq.physical_len}")
    keep = decision.keep_pages
    if keep is None:
        keep = seq.num_pages if decision.action is Action.COMPRESS else math.ceil(target / bs)
    keep = max(keep, math.ceil(target / bs))
    if keep > seq.num_pages:
        raise PolicyError(f"compaction keeps {keep} pages but the sequence holds {seq.num_pages}")
    old = seq.block_table
    shared = [i for i in range(keep) if bm.is_shared(old[i])]
    if len(shared) > bm.num_free:
        return None
    new_table = list(old[:keep])
    release = list(old[keep:])
    for i in shared:
        release.append(old[i])
        new_table[i] = bm.allocate()
    for page in new_table:
        bm.make_private(page)
    return CompactionJob(seq, decision, kind, new_table, release, fallback,
                         physical_before=seq.physical_len, pages_before=seq.num_pages)


def execute(job: CompactionJob, policy: KVPolicy, view: PolicyView, kv: KVCache,
            move: Callable) -> None:
    """Select and move the kept slots. Reads the old block table, writes the new one. `move`:
    the engine backend's `compact` (engine/kernels/backend.py)."""
    seq, target = job.seq, job.decision.target_len
    keep = policy.select(view, target, job.timer)
    counts = None
    if isinstance(keep, HeadKeep):
        keep, counts = keep.slots, keep.counts
    L, H = kv.k.shape[0], kv.k.shape[1]
    if tuple(keep.shape) != (L, H, target):
        raise PolicyError(
            f"{policy.name}.select returned shape {tuple(keep.shape)}, expected {(L, H, target)}"
        )
    real = None
    if counts is not None:
        job.counts = _check_counts(policy, counts, L, H, target)
        real = torch.arange(target, device=keep.device) < job.counts.to(keep.device)[..., None]
    if not keep.is_cuda:
        _check_rows(policy, seq, keep, real)
    if real is not None:
        # Ignored tail entries copy slot i onto target i (see the module docstring).
        keep = torch.where(real, keep, torch.arange(target, device=keep.device))
    if seq.kept_trace is not None:  # opt-in (EngineConfig.trace_kept): positions, not slots
        seq.kept_trace.compacted(seq.num_computed, seq.physical_len, keep,
                                 job.counts if counts is not None else None)
    with job.timer.stage("compaction"):
        keep = keep.to(device=kv.k.device, dtype=torch.long)
        src = kv.flat_slots(seq.block_table).take(keep)
        dst = kv.flat_slots(job.new_table)[:target]
        move(kv.k, src, dst, kv.v)
        if kv.scores is not None:
            move(kv.scores, src, dst)


def _check_counts(policy: KVPolicy, counts: torch.Tensor, layers: int, heads: int,
                  target: int) -> torch.Tensor:
    """A HeadKeep's counts, checked and on the host: [layers, kv_heads] int64 in 0..target."""
    counts = counts.to("cpu", torch.long)
    if tuple(counts.shape) != (layers, heads):
        raise PolicyError(f"{policy.name}.select returned counts of shape {tuple(counts.shape)}, "
                          f"expected {(layers, heads)}")
    if counts.numel() and not (0 <= int(counts.min()) and int(counts.max()) <= target):
        raise PolicyError(f"{policy.name}.select returned counts in "
                          f"[{int(counts.min())}, {int(counts.max())}], outside 0..{target}")
    return counts


def _check_rows(policy: KVPolicy, seq: Sequence, keep: torch.Tensor,
                real: torch.Tensor | None) -> None:
    """CPU-only checks (free there): each row's kept entries strictly ascending, and none of
    them inside the head's hole from an earlier per-head compaction (stale KV)."""
    if keep.shape[-1] > 1:
        rising = keep[..., 1:] > keep[..., :-1]
        if real is not None:
            rising = rising | ~real[..., 1:]
        if not bool(rising.all()):
            raise PolicyError(f"{policy.name}.select must return each row's slots strictly "
                              "ascending")
    holes = seq.holes()
    if holes is not None and keep.numel():
        holes = holes.long()
        inside = (keep >= holes[..., 0:1]) & (keep < holes[..., 1:2])
        if real is not None:
            inside = inside & real
        if bool(inside.any()):
            raise PolicyError(f"{policy.name}.select kept a slot inside a head's hole (a slot "
                              "that head no longer holds; see PolicyView.head_lens)")


def finalize(job: CompactionJob, bm: BlockManager) -> CapacityEvent:
    seq = job.seq
    target = job.decision.target_len
    if job.counts is not None:
        longest = int(job.counts.max()) if job.counts.numel() else 0
        # Pages sized by the largest head, keeping the headroom the decision asked for.
        bs = bm.block_size
        headroom = len(job.new_table) - math.ceil(target / bs)
        need = math.ceil(longest / bs) + headroom
        job.release.extend(job.new_table[need:])
        job.new_table = job.new_table[:need]
        target = longest
    seq.block_table = job.new_table
    seq.physical_len = target
    seq.set_head_lens(job.counts, target)
    for page in job.release:
        bm.release(page)
    event = CapacityEvent(
        time=time.perf_counter(), seq_id=seq.seq_id, action=job.kind,
        logical_len=seq.num_computed, physical_before=job.physical_before,
        physical_after=seq.physical_len, pages_before=job.pages_before,
        pages_after=seq.num_pages, fallback=job.fallback, info=dict(job.decision.info),
        stages=dict(job.timer.stages),
    )
    if job.counts is not None and job.counts.numel():
        event.info.update(head_kept_min=int(job.counts.min()), head_kept_max=int(job.counts.max()),
                          kept_slots=seq.kept_slots)
    seq.events.append(event)
    if seq.kept_trace is not None:
        seq.kept_trace.finished(len(seq.events) - 1, seq.physical_len)
    return event


class CompactionWorker:
    """Runs `execute` for one job at a time on a background thread (Zipage's async pipeline: the
    compacting request skips decode steps while the others keep decoding).

    On CUDA the thread issues its kernels on a stream of its own. Ordering: the job's stream
    first waits for everything the submitting stream had queued (the request's last K/V
    writes); the job counts as done only once its stream has drained (the worker thread
    synchronises its own stream, never the scheduler's), so finalize, and every later step that
    reads the compacted pages, runs after the copy. Meanwhile the request's pages are touched by
    nobody else: it skips decode (``compacting``) and shared pages were replaced at plan time.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-compaction")
        self._jobs: list[tuple[CompactionJob, Future]] = []
        self._stream = None

    def _stream_for(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def submit(self, job: CompactionJob, policy: KVPolicy, view: PolicyView, kv: KVCache,
               move: Callable) -> None:
        job.seq.compacting = True
        stream = self._stream_for(kv.k.device)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv.k.device))
        self._jobs.append((job, self._pool.submit(_execute_on, stream, ready, job, policy, view,
                                                  kv, move)))

    def done(self, wait: bool = False) -> list[CompactionJob]:
        """Jobs that finished (all of them when wait=True); re-raises a job's exception."""
        finished, pending = [], []
        for job, fut in self._jobs:
            if wait or fut.done():
                fut.result()
                job.seq.compacting = False
                finished.append(job)
            else:
                pending.append((job, fut))
        self._jobs = pending
        return finished

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _execute_on(stream, ready, job: CompactionJob, policy: KVPolicy, view: PolicyView,
                kv: KVCache, move: Callable) -> None:
    """`execute` on ``stream`` (None: the current stream, e.g. CPU) after event ``ready``."""
    if stream is None:
        execute(job, policy, view, kv, move)
        return
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        execute(job, policy, view, kv, move)
    stream.synchronize()

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
hazard check (a device-to-host sync per call) is skipped; K and V move in one launch. On CPU the
order is checked (free there) so a policy that breaks it fails loudly in CPU runs and tests.
With async compaction on CUDA the worker runs on its own stream: the copy overlaps the other
requests' decode steps instead of queueing behind them on the default stream.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.attention import KVCache
from engine.block_manager import BlockManager
from engine.kernels._common import upload
from engine.kernels.compact import compact_kv, compact_slots
from engine.policies.base import Action, Decision, KVPolicy, PolicyView, StageTimer
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


def execute(job: CompactionJob, policy: KVPolicy, view: PolicyView, kv: KVCache) -> None:
    """Select and move the kept slots. Reads the old block table, writes the new one."""
    seq, target = job.seq, job.decision.target_len
    keep = policy.select(view, target, job.timer)
    L, H = kv.k.shape[0], kv.k.shape[1]
    if tuple(keep.shape) != (L, H, target):
        raise PolicyError(
            f"{policy.name}.select returned shape {tuple(keep.shape)}, expected {(L, H, target)}"
        )
    if not keep.is_cuda and target > 1 and not bool((keep[..., 1:] > keep[..., :-1]).all()):
        raise PolicyError(f"{policy.name}.select must return each row's slots strictly ascending")
    if seq.kept_trace is not None:  # opt-in (EngineConfig.trace_kept): positions, not slots
        seq.kept_trace.compacted(seq.num_computed, seq.physical_len, keep)
    with job.timer.stage("compaction"):
        bs = kv.block_size
        old = upload(seq.block_table, kv.k.device)
        keep = keep.to(device=kv.k.device, dtype=torch.long)
        src = old[keep // bs] * bs + keep % bs
        new = upload(job.new_table, kv.k.device)
        pos = torch.arange(target, device=kv.k.device)
        dst = new[pos // bs] * bs + pos % bs
        compact_kv(kv.k, kv.v, src, dst, ordered=True)
        if kv.scores is not None:
            compact_slots(kv.scores, src, dst, ordered=True)


def finalize(job: CompactionJob, bm: BlockManager) -> CapacityEvent:
    seq = job.seq
    seq.block_table = job.new_table
    seq.physical_len = job.decision.target_len
    for page in job.release:
        bm.release(page)
    event = CapacityEvent(
        time=time.perf_counter(), seq_id=seq.seq_id, action=job.kind,
        logical_len=seq.num_computed, physical_before=job.physical_before,
        physical_after=seq.physical_len, pages_before=job.pages_before,
        pages_after=seq.num_pages, fallback=job.fallback, info=dict(job.decision.info),
        stages=dict(job.timer.stages),
    )
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

    def submit(self, job: CompactionJob, policy: KVPolicy, view: PolicyView, kv: KVCache) -> None:
        job.seq.compacting = True
        stream = self._stream_for(kv.k.device)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv.k.device))
        self._jobs.append((job, self._pool.submit(_execute_on, stream, ready, job, policy, view, kv)))

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
                kv: KVCache) -> None:
    """`execute` on ``stream`` (None: the current stream, e.g. CPU) after event ``ready``."""
    if stream is None:
        execute(job, policy, view, kv)
        return
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        execute(job, policy, view, kv)
    stream.synchronize()

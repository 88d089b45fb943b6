"""The decode step as one compiled graph: torch.compile of the model's forward for one-token
rows, batch sizes padded to buckets, and on CUDA one captured CUDA graph per bucket.

A step qualifies when every item is a single token (decodes, one-token prefill tails); prefill
and mixed steps run eager. Its rows are padded to the next bucket (1, 2, 4, ..., max_num_seqs),
and padded rows are harmless by construction: slot -1 (nothing stored), context length 0 (a zero
attention row), position 0, token 0, and their query signals go to the pool's scratch slot.
Real rows never read padded rows (attention is per row), so their logits are those of the
unpadded batch.

Static inputs. Every per-step tensor is a view of one int64 device buffer `meta` laid out field
by field, [fields x max_rows] then the block tables [max_rows, max_blocks]; a step fills the
bucket's rows of the same layout on the host and copies it with one non-blocking transfer (on
CPU the graph reads the host buffer itself). A bucket's graph reads the first rows of each
field, so the input views (and on CUDA their addresses) never change. Block tables have the
fixed width max_blocks (the most pages a sequence can hold), so the table width never
recompiles; the kernels read only each row's own length.

Host buffers. The host side is two pinned buffers used in turn, each fenced by a CUDA event
recorded after its copy and waited on before the buffer is written again. Sampling syncs most
steps, but a step whose rows sample nothing (one-token prefill chunks that are not the last)
returns without a sync, so with one buffer the next step could overwrite it while its copy is
still queued. The wait is normally free: the copy two steps back has long run. On CPU the graph
reads its single host buffer and the events are no-ops.

Shapes. Rows are marked dynamic for buckets >= 2 (one compiled graph serves them all; size 1 is
specialised by the compiler anyway), so usually two compiles per engine; on CUDA each bucket is
then warmed up and captured once, in decreasing size, sharing one memory pool (nano-vLLM's
order), and a step replays its bucket's graph after the copy.

Inside the graph: the model's forward with attention as the fused `kvarena::store_and_decode` op
(engine/kernels/ops.py), the policies' query signals as fixed-shape writes into the preallocated
pool (engine/query_state.py's DecodeCapture), and the LM head over every row. No host sync and
no per-sequence work happen between the metadata copy and the logits.

Compile artifacts: inductor's FX graph cache is on and lives under the project's cache
(``$KVARENA_CACHE/inductor``, unless TORCHINDUCTOR_CACHE_DIR is set), so a second run of the
same model and shapes starts from disk; the first compile of a process prints its seconds once.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from engine.attention import ForwardContext, KVCache
from engine.models.loader import cache_root
from engine.query_state import DecodeCapture, QueryStatePool

# Per-row int64 fields of the metadata buffer, in layout order.
FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens",
          "recent_slot", "ring", "ema_slot", "ema_init")
_reported_compile = False


class HostEvent:
    """The CPU stand-in for a host buffer's CUDA event: nothing is in flight, nothing to wait."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs: [1, 2, 4, ..., max_num_seqs]."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} decode rows exceed the largest bucket {buckets[-1]}")


def use_project_compile_cache() -> None:
    """Point inductor's on-disk caches at $KVARENA_CACHE/inductor (unless the user chose a
    directory) and turn its FX graph cache on, before the first compile."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the variable on first use, so that value means unset.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")

    inductor_config.fx_graph_cache = True


class DecodeGraph:
    """The compiled decode step of one engine (module docstring).

    model: the engine's CausalLM; kv: its KVCache; queries: its QueryStatePool; max_rows: the
    largest bucket (max_num_seqs); max_blocks: block-table width. compile=False runs the same
    graph function eagerly (the meta-device host-sync test; debugging). native: attention
    through the CPU C kernels where they apply (ForwardContext.native). staged: whether the
    metadata goes through the two fenced host buffers and a copy (default: off the CPU; on for
    a CPU graph only in tests of the buffers)."""

    def __init__(self, model, kv: KVCache, queries: QueryStatePool, scale: float, max_rows: int,
                 max_blocks: int, device, compile: bool = True, native: bool = False,
                 staged: bool | None = None):
        self.model, self.kv, self.queries, self.scale = model, kv, queries, scale
        self.native = native
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_rows)
        self.max_rows, self.max_blocks = max_rows, max_blocks
        size = len(FIELDS) * max_rows + max_rows * max_blocks
        self.staged = self.device.type != "cpu" if staged is None else staged
        pin = self.device.type == "cuda"
        # Host buffers used in turn and the events fencing their copies (module docstring).
        self.hosts = [torch.zeros(size, dtype=torch.long, pin_memory=pin)
                      for _ in range(2 if self.staged else 1)]
        self.events = [torch.cuda.Event() if pin else HostEvent() for _ in self.hosts]
        self._turn = 0
        # Unstaged (CPU), the graph reads the host buffer itself: no copy.
        self.meta = (torch.zeros(size, dtype=torch.long, device=self.device) if self.staged
                     else self.hosts[0])
        self._no_pages = [-1] * max_blocks
        # What each field holds in a padded row (module docstring), [len(FIELDS)].
        scratch = queries.scratch
        defaults = {"slot_mapping": -1, "recent_slot": scratch, "ema_slot": scratch}
        self._padding = torch.tensor([defaults.get(name, 0) for name in FIELDS])
        self._inputs = {b: self._views(b) for b in self.buckets}
        self.compiled = compile
        self.fn = self.forward  # what a step calls: `forward`, compiled unless compile=False
        if compile:
            use_project_compile_cache()
            # Compiled entries are guarded on shapes (the KV pool's among them), so engines of a
            # process with other shapes add their own entries (two each: batch 1 and the
            # buckets); past dynamo's default limit of 8 the step would quietly run eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(self.forward, fullgraph=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.compile_seconds = 0.0
        self.steps = 0  # decode steps run through the graph

    # -- inputs -------------------------------------------------------------------------------
    def _views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """The bucket's input tensors: views of `meta` (first `bucket` rows of every field)."""
        n = self.max_rows
        fields = [self.meta[i * n:i * n + bucket] for i in range(len(FIELDS))]
        start = len(FIELDS) * n
        tables = self.meta[start:start + n * self.max_blocks].view(n, self.max_blocks)[:bucket]
        views = (*fields, tables)
        if bucket >= 2:
            for t in views:
                # maybe_: a guard the compiler adds on the size recompiles instead of failing.
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return views

    def fits(self, tables: list[list[int]]) -> bool:
        """Whether a decode batch with these block tables can run here (rows and width)."""
        return len(tables) <= self.max_rows and all(len(t) <= self.max_blocks for t in tables)

    def load(self, columns: list[list[int] | torch.Tensor], tables: list[list[int]],
             bucket: int | None = None) -> tuple[int, tuple]:
        """Write one step's metadata (`run` has the arguments) into the host buffer, padded rows
        getting their defaults, and copy it to the device in one non-blocking transfer.
        bucket: pad to this bucket instead of the smallest that fits (warm-up: all padding).
        Returns the bucket and its input views, the arguments of `forward`."""
        n, w = self.max_rows, self.max_blocks
        rows = len(tables)
        bucket = bucket or bucket_for(max(rows, 1), self.buckets)
        host, event = self._next_host()
        # Only the bucket's rows are written: its graph reads nothing else.
        fields = host[:len(FIELDS) * n].view(len(FIELDS), n)[:, :bucket]
        fields[:, rows:] = self._padding[:, None]
        for field, col in zip(fields, columns):
            field[:rows] = torch.as_tensor(col, dtype=torch.long)
        flat: list[int] = []
        for t in tables:
            flat += t
            flat += self._no_pages[:w - len(t)]
        flat += self._no_pages * (bucket - rows)
        start = len(FIELDS) * n
        host[start:start + bucket * w] = torch.tensor(flat, dtype=torch.long)
        if self.staged:
            self.meta.copy_(host, non_blocking=True)
            event.record()
        return bucket, self._inputs[bucket]

    def _next_host(self) -> tuple[torch.Tensor, HostEvent | torch.cuda.Event]:
        """The host buffer this step fills, and its event, once the copy that last read the
        buffer has run (module docstring: host buffers)."""
        turn = self._turn
        self._turn = (turn + 1) % len(self.hosts)
        self.events[turn].synchronize()
        return self.hosts[turn], self.events[turn]

    # -- the graph ------------------------------------------------------------------------------
    def forward(self, input_ids, positions, slot_mapping, context_lens, recent_slot, ring,
                 ema_slot, ema_init, block_tables) -> torch.Tensor:
        """[B] rows -> logits [B, vocab]; the function torch.compile traces."""
        ctx = ForwardContext(self.kv, self.scale, slot_mapping, num_decode=input_ids.shape[0],
                             decode_block_tables=block_tables, decode_context_lens=context_lens,
                             fused_decode=True, native=self.native)
        if self.queries.active:
            ctx.capture = DecodeCapture(self.queries, recent_slot, ring, ema_slot, ema_init)
        hidden = self.model(input_ids, positions, ctx)
        return self.model.compute_logits(hidden, native=self.native)

    def _call(self, bucket: int) -> torch.Tensor:
        global _reported_compile
        first = not _reported_compile and self.compiled
        start = time.perf_counter()
        out = self.fn(*self._inputs[bucket])
        if first:
            _reported_compile = True
            self.compile_seconds = time.perf_counter() - start
            print(f"kvarena: compiled the decode step in {self.compile_seconds:.1f} s "
                  f"(cached under {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", file=sys.stderr)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """CUDA only: warm up every bucket (compiling it) and capture one CUDA graph per bucket,
        largest first, sharing one memory pool. Warm-up rows are all padding (nothing stored).
        Under inference mode, as every step runs (ModelRunner.run): the compiled entry and the
        captured kernels are those of a step, without autograd."""
        pool = None
        for bucket in reversed(self.buckets):
            self.load([[] for _ in FIELDS], [], bucket)
            for _ in range(2):
                self._call(bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.fn(*self._inputs[bucket])
            pool = graph.pool()
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, columns: list[list[int] | torch.Tensor], tables: list[list[int]]) -> torch.Tensor:
        """One decode step. columns: the FIELDS' per-row values of the real rows, lists or [rows]
        int64 host tensors (ids, positions, slots, context lengths, then DecodeCapture's four
        columns); tables: their block tables.
        Returns logits [rows, vocab] (on CUDA a view of the graph's output, valid until the next
        step)."""
        rows = len(tables)
        self.steps += 1
        bucket, _ = self.load(columns, tables)
        if bucket in self.graphs:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self._call(bucket)
        return out[:rows]

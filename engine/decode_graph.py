"""The decode step as one compiled graph: torch.compile of the model's forward for one-token
rows, batch sizes padded to buckets, and on CUDA one captured CUDA graph per (bucket, table
width).

A step qualifies when every item is a single token (decodes, one-token prefill tails); prefill
and mixed steps run eager. Its rows are padded to the next bucket (1, 2, 4, ..., max_num_seqs),
and padded rows are harmless by construction: slot -1 (nothing stored), context length 0 (a zero
attention row), position 0, token 0, and their query signals go to the pool's scratch slot.
Real rows never read padded rows (attention is per row), so their logits are those of the
unpadded batch.

Static inputs. Every per-row tensor is a view of one int64 device buffer `meta`, laid out field
by field [fields x max_rows]; a step fills the bucket's rows on the host and copies them with one
non-blocking transfer (on CPU the graph reads the host buffer itself). A bucket's graph reads the
first rows of each field, so the input views (and on CUDA their addresses) never change.

Block tables. They live in a persistent device tensor `tables` [max_rows + 1, max_blocks + 1]
(max_blocks: the most pages a sequence can hold), one row per sequence that runs graph steps: its
`table_row` field picks it inside the graph, and the last row, all -1, serves padded rows. A step
writes only what changed since the step that last wrote a row: the new entries of a table that
grew in place, the whole row of a table that was replaced (compaction, preemption:
`Sequence.table_version`) or of a row taken over from a sequence that left, with -1 past the new
length. The changes travel in the same transfer, after the fields, as flat indices then pages,
and are scattered into `tables` before the graph runs. So a step's host work grows with its rows
and with the pages that changed, never with max_blocks. The kernels read only each row's own
length.

Host buffers. The host side is two pinned buffers used in turn, each fenced by a CUDA event
recorded after its copy and waited on before the buffer is written again. Sampling syncs most
steps, but a step whose rows sample nothing (one-token prefill chunks that are not the last)
returns without a sync, so with one buffer the next step could overwrite it while its copy is
still queued. The wait is normally free: the copy two steps back has long run. On CPU the graph
reads its single host buffer and the events are no-ops.

Split-K. The graph reads the tables' first `width` columns, the narrowest width of its bucket
(`table_widths`: powers of two of pages from 2, and max_blocks) that covers the batch's longest
context. The Triton decode kernel sizes its flash-decoding partitions from the table width it is
given (kernels/paged_attention.py, `decode_partitions`), so at batch 1 a 2k context is split
into partitions that all hold slots rather than into the partitions of a max_model_len-wide
table, of which one would work. A width whose split is a single partition serves every narrower
width as well (one partition reads just each row's own length), so a bucket keeps only the
widest of those: a large batch has one width. Any covering width gives the same rows.

Shapes. Rows are marked dynamic for buckets >= 2 and the table width for every bucket, so one
compiled graph serves all widths and buckets >= 2 (batch 1 is specialised by the compiler, and so
would a width of 1 be, hence widths from 2; the spare column of `tables` keeps every width's view
non-contiguous, which a full-width view would otherwise be and compile apart): usually two
compiles per engine. On CUDA each (bucket, width) is then warmed up and captured once, in
decreasing size, sharing one memory pool (nano-vLLM's order), and a step replays its graph after
the copy.

Inside the graph: the model's forward through the engine backend's graph form
(engine/kernels/backend.py), attention as the fused `kvarena::store_and_decode` op (the C
backend's `c_store_and_decode`; engine/kernels/ops.py), the policies' query signals as
fixed-shape writes into the preallocated pool (engine/query_state.py's DecodeCapture), and the LM
head over every row. No host sync and no per-sequence work happen between the metadata copy and
the logits.

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
from engine.kernels import backend as backends
from engine.kernels.paged_attention import decode_partitions
from engine.paths import cache_root
from engine.query_state import DecodeCapture, QueryStatePool

# Per-row int64 fields of the metadata buffer, in layout order: the caller's columns
# (DecodeGraph.run), then the row of `tables` that each row reads.
FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens",
          "recent_slot", "ring", "ema_slot", "ema_init", "table_row")
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


def table_widths(bucket: int, kv_heads: int, block_size: int, max_blocks: int) -> list[int]:
    """The block-table widths (pages) a batch bucket's graph reads, ascending (module docstring:
    split-K): powers of two from 2 below max_blocks, then max_blocks, of which the widths that
    the decode kernel runs as one partition are represented by the widest of them."""
    widths, w = [], min(2, max_blocks)
    while w < max_blocks:
        widths.append(w)
        w *= 2
    widths.append(max_blocks)
    split = [w for w in widths if decode_partitions(bucket, kv_heads, w * block_size)[0] > 1]
    single = [w for w in widths if w not in split]
    return single[-1:] + split


def width_for(widths: list[int], pages: int) -> int:
    """The narrowest of `widths` (ascending) holding `pages` pages."""
    for w in widths:
        if w >= pages:
            return w
    raise ValueError(f"{pages} pages exceed the widest block table {widths[-1]}")


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
    largest bucket (max_num_seqs); max_blocks: the most pages a sequence holds (the widest
    block table). compile=False runs the same graph function eagerly (the meta-device host-sync
    test; debugging). backend: the engine's (engine/kernels/backend.py), whose graph form the
    step runs (default: the device's kernels without the C kernels or packing). staged: whether
    the metadata goes through the two fenced host buffers and a copy (default: off the CPU; on
    for a CPU graph only in tests of the buffers)."""

    def __init__(self, model, kv: KVCache, queries: QueryStatePool, scale: float, max_rows: int,
                 max_blocks: int, device, compile: bool = True, backend=None,
                 staged: bool | None = None):
        self.model, self.kv, self.queries, self.scale = model, kv, queries, scale
        self.device = torch.device(device)
        self.ops = (backend or backends.default(self.device)).graph
        self.buckets = batch_buckets(max_rows)
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.block_size = kv.k.shape[3]
        # The fields, then room for the (flat index, page) pairs of a step that rewrites every
        # row of the tables, the most one can change.
        self._fields_size = len(FIELDS) * max_rows
        size = self._fields_size + 2 * max_rows * max_blocks
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
        # Persistent block tables, with one spare column (module docstring), and on the host
        # what each row holds: its sequence, the table version and the length written (-1
        # beyond).
        self.tables = torch.full((max_rows + 1, max_blocks + 1), -1, dtype=torch.long,
                                 device=self.device)
        self._row_stride = max_blocks + 1
        self._row_of: dict[int, int] = {}
        self._owner: list[int | None] = [None] * max_rows
        self._version: list[int | None] = [None] * max_rows
        self._written = [0] * max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self.table_writes = 0  # table entries the last step wrote
        # What each field holds in a padded row (module docstring), [len(FIELDS)].
        scratch = queries.scratch
        defaults = {"slot_mapping": -1, "recent_slot": scratch, "ema_slot": scratch,
                    "table_row": max_rows}
        self._padding = torch.tensor([defaults.get(name, 0) for name in FIELDS])
        kv_heads = kv.k.shape[1]
        self.widths = {b: table_widths(b, kv_heads, self.block_size, max_blocks)
                       for b in self.buckets}
        self._inputs = {(b, w): self._views(b, w) for b in self.buckets for w in self.widths[b]}
        self.compiled = compile
        self.fn = self.forward  # what a step calls: `forward`, compiled unless compile=False
        if compile:
            use_project_compile_cache()
            # Compiled entries are guarded on shapes (the KV pool's among them), so engines of a
            # process with other shapes add their own entries (two each: batch 1 and the
            # buckets); past dynamo's default limit of 8 the step would quietly run eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fn = torch.compile(self.forward, fullgraph=True)
        # (bucket, width) -> the captured graph and its output
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.compile_seconds = 0.0
        self.steps = 0  # decode steps run through the graph

    # -- inputs -------------------------------------------------------------------------------
    def _views(self, bucket: int, width: int) -> tuple[torch.Tensor, ...]:
        """The input tensors of a (bucket, width): views of `meta` (first `bucket` rows of every
        field), then the first `width` columns of the persistent tables."""
        n = self.max_rows
        fields = [self.meta[i * n:i * n + bucket] for i in range(len(FIELDS))]
        tables = self.tables[:, :width]
        # maybe_: a guard the compiler adds on the size recompiles instead of failing.
        if bucket >= 2:
            for t in fields:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(tables, 1)
        return (*fields, tables)

    def fits(self, tables: list[list[int]]) -> bool:
        """Whether a decode batch with these block tables can run here (rows and width)."""
        return len(tables) <= self.max_rows and all(len(t) <= self.max_blocks for t in tables)

    def load(self, columns: list[list[int] | torch.Tensor], seqs: list,
             bucket: int | None = None, width: int | None = None) -> tuple[tuple[int, int], tuple]:
        """Write one step's metadata (`run` has the arguments) into a host buffer, padded rows
        getting their defaults, with the table entries that changed, copy it to the device in
        one non-blocking transfer and scatter the entries into `tables`.
        bucket, width: pad to this bucket and read this width instead of the smallest that fit
        (warm-up: all padding). Returns the (bucket, width) and its input views, the arguments
        of `forward`."""
        rows = len(seqs)
        bucket = bucket or bucket_for(max(rows, 1), self.buckets)
        if width is None:
            longest = max(columns[FIELDS.index("context_lens")], default=0)
            width = width_for(self.widths[bucket], -(-int(longest) // self.block_size))
        host, event = self._next_host()
        table_rows, index, pages = self._table_changes(seqs)
        # Only the bucket's rows are written: its graph reads nothing else.
        fields = host[:self._fields_size].view(len(FIELDS), self.max_rows)[:, :bucket]
        fields[:, rows:] = self._padding[:, None]
        for field, col in zip(fields, (*columns, table_rows)):
            field[:rows] = torch.as_tensor(col, dtype=torch.long)
        changed, start = len(index), self._fields_size
        if changed:
            host[start:start + 2 * changed] = torch.tensor(index + pages, dtype=torch.long)
        if self.staged:
            self.meta[:start + 2 * changed].copy_(host[:start + 2 * changed], non_blocking=True)
            event.record()
        if changed:
            self.tables.view(-1).index_copy_(0, self.meta[start:start + changed],
                                             self.meta[start + changed:start + 2 * changed])
        self.table_writes = changed
        return (bucket, width), self._inputs[bucket, width]

    def _table_changes(self, seqs: list) -> tuple[list[int], list[int], list[int]]:
        """Each sequence's row of `tables` (taken on its first step) and the entries to write,
        as flat indices into `tables` and their pages (module docstring: block tables)."""
        rows, index, pages = [], [], []
        w = self._row_stride
        for seq in seqs:
            row = self._row_of.get(seq.seq_id)
            if row is None:
                row = self._take_row(seq.seq_id, seqs)
            rows.append(row)
            table, version = seq.block_table, seq.table_version
            count, written = len(table), self._written[row]
            if version != self._version[row]:
                start = 0  # replaced, or a row new to this sequence: all of it
            elif count != written:
                start = min(count, written)  # grown in place: the new entries only
            else:
                continue
            base = row * w
            index.extend(range(base + start, base + max(count, written)))
            pages.extend(table[start:])
            pages.extend([-1] * (written - count))
            self._version[row], self._written[row] = version, count
        return rows, index, pages

    def _take_row(self, seq_id: int, seqs: list) -> int:
        """A free row of `tables` for a sequence's first graph step. With none free, the rows of
        sequences outside this step are given back first (finished or preempted ones, whose
        rows are otherwise kept: a preempted sequence's table version moves on anyway)."""
        if not self._free:
            live = {seq.seq_id for seq in seqs}
            for row, owner in enumerate(self._owner):
                if owner is not None and owner not in live:
                    del self._row_of[owner]
                    self._owner[row] = None
                    self._free.append(row)
        row = self._free.pop()
        self._owner[row], self._row_of[seq_id] = seq_id, row
        self._version[row] = None  # written in full, the previous owner's tail cleared
        return row

    def _next_host(self) -> tuple[torch.Tensor, HostEvent | torch.cuda.Event]:
        """The host buffer this step fills, and its event, once the copy that last read the
        buffer has run (module docstring: host buffers)."""
        turn = self._turn
        self._turn = (turn + 1) % len(self.hosts)
        self.events[turn].synchronize()
        return self.hosts[turn], self.events[turn]

    # -- the graph ------------------------------------------------------------------------------
    def forward(self, input_ids, positions, slot_mapping, context_lens, recent_slot, ring,
                 ema_slot, ema_init, table_row, tables) -> torch.Tensor:
        """[B] rows -> logits [B, vocab]; the function torch.compile traces. tables: the
        persistent tables [max_rows + 1, width], of which row b reads row table_row[b]."""
        block_tables = tables.index_select(0, table_row)
        ctx = ForwardContext(self.kv, self.scale, slot_mapping, self.ops,
                             num_decode=input_ids.shape[0], decode_block_tables=block_tables,
                             decode_context_lens=context_lens)
        if self.queries.active:
            ctx.capture = DecodeCapture(self.queries, recent_slot, ring, ema_slot, ema_init)
        hidden = self.model(input_ids, positions, ctx)
        return self.model.compute_logits(hidden, self.ops)

    def _call(self, key: tuple[int, int]) -> torch.Tensor:
        global _reported_compile
        first = not _reported_compile and self.compiled
        start = time.perf_counter()
        out = self.fn(*self._inputs[key])
        if first:
            _reported_compile = True
            self.compile_seconds = time.perf_counter() - start
            print(f"kvarena: compiled the decode step in {self.compile_seconds:.1f} s "
                  f"(cached under {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", file=sys.stderr)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """CUDA only: warm up every (bucket, width) (compiling it) and capture one CUDA graph for
        each, largest first, sharing one memory pool. Warm-up rows are all padding (nothing
        stored). Under inference mode, as every step runs (ModelRunner.run): the compiled entry
        and the captured kernels are those of a step, without autograd."""
        pool = None
        for bucket in reversed(self.buckets):
            for width in reversed(self.widths[bucket]):
                key, inputs = self.load([[] for _ in FIELDS[:-1]], [], bucket, width)
                for _ in range(2):
                    self._call(key)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.fn(*inputs)
                pool = graph.pool()
                self.graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, columns: list[list[int] | torch.Tensor], seqs: list) -> torch.Tensor:
        """One decode step. columns: the FIELDS' per-row values of the real rows but the last,
        lists or [rows] int64 host tensors (ids, positions, slots, context lengths, then
        DecodeCapture's four columns); seqs: their sequences (seq_id, block_table,
        table_version). Returns logits [rows, vocab] (on CUDA a view of the graph's output,
        valid until the next step)."""
        rows = len(seqs)
        self.steps += 1
        key, _ = self.load(columns, seqs)
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
        else:
            out = self._call(key)
        return out[:rows]

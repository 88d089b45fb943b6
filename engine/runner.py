"""Model runner: loads the model, owns the KV cache, turns a scheduled step into tensors, runs the
forward pass and samples.

KV pool sizing: on CPU the pool is sized explicitly (kv_cache_tokens, or kv_cache_bytes, with a CPU
default); on CUDA with neither given, it takes 0.9 x (`gpu_memory_utilization` x device memory -
memory in use once the weights are loaded): the tenth left over is for activations, which no
forward pass measures beforehand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import memory
from engine.attention import ForwardContext, KVCache
from engine.config import CPU_KV_CACHE_TOKENS, ConfigError, EngineConfig
from engine.decode_graph import FIELDS as DECODE_FIELDS
from engine.decode_graph import DecodeGraph
from engine.kernels import backend as backends
from engine.kernels._common import upload
from engine.kernels.attention_scores import held_rows
from engine.models import ARCHITECTURES, build_model, load_weights, random_tensors
from engine.models.llama import ArchFlags, head_dim_of
from engine.models.loader import iter_safetensors, load_config
from engine.models.rope import RopeRows
from engine.models.shape import parameter_counts
from engine.policies.base import SignalSpec
from engine.query_state import QueryStatePool
from engine.sampling import logprob_block_rows, request_generator, sample_tensor, token_logprobs
from engine.sequence import Sequence


@dataclass
class WorkItem:
    """One sequence's share of a step: `num_tokens` tokens starting at seq.num_computed.

    forced: a forced run, `num_tokens` decode steps of teacher forcing as one chunk: its inputs are
    the sequence's last token and the next `num_tokens - 1` forced tokens (not yet appended), and
    every row yields an output token (engine/scheduler.py)."""

    seq: Sequence
    num_tokens: int
    prefill: bool = False
    forced: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row yields the next token
        (every row of a forced run yields one)."""
        return self.forced or self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)

    @property
    def rows(self) -> int:
        """Output tokens (rows of sampled logits) the item yields when it samples."""
        return self.num_tokens if self.forced else 1

    def input_ids(self) -> list[int]:
        """The token ids of the item's rows, in order."""
        seq, start = self.seq, self.seq.num_computed
        if not self.forced:
            return seq.token_ids[start:start + self.num_tokens]
        first = seq.num_output_tokens
        return [seq.token_ids[start], *seq.params.forced_tokens[first:first + self.num_tokens - 1]]


class ModelRunner:
    noise: torch.Generator | None = None  # set in __init__ (reseed_noise)
    logprob_rows: int | None = None  # token_logprobs' blocks, set in __init__

    def __init__(self, config: EngineConfig, model_dir, signals: SignalSpec):
        self.config = config
        self.device = torch.device(config.device)
        self.hf_config = load_config(model_dir)
        model_dtype = checkpoint_dtype(self.hf_config)
        self.dtype = config.torch_dtype(model_dtype if isinstance(model_dtype, torch.dtype) else None)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {config.max_model_len} exceeds the model's limit {limit}"
            )
        self.max_model_len = config.max_model_len or limit
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.head_dim ** -0.5
        self.block_size = config.block_size
        # Which implementation runs each op of a forward pass, chosen once here.
        self.backend = backends.choose(self.device, self.dtype, config.cpu_native_kernels,
                                       config.cpu_packed_weights)
        # A pool sized from the GPU's free memory is sized once the weights are there.
        pages = None if self._pool_from_free_memory() else self._num_pages()
        memory.check_fits(self.device, *self.footprint(signals, pages))
        self.model = build_model(self.hf_config, self.max_model_len, self.device, self.dtype)
        tensors = (random_tensors(self.model, config.seed, self.device) if config.load_format == "dummy"
                   else iter_safetensors(model_dir))
        load_weights(self.model, tensors, self.device, self.dtype, self.backend)
        self.kv = self._allocate_kv(signals.slot_scores, pages)
        # tests/analysis: called with (items, logits of sampled rows): each item owns `item.rows`
        # consecutive rows, row j scoring its output token seq.num_output_tokens + j; the logits
        # are valid during the call only (a compiled CUDA step reuses its output buffer).
        self.logits_hook = None
        self.logprob_rows = logprob_block_rows(self.device, self.hf_config.vocab_size)
        self.signals = signals
        self.queries = self._query_pool(signals)
        # The noise of sampled requests without their own seed (engine/sampling.py), one draw per
        # step for all of them; LLM.stream reseeds it.
        self.reseed_noise()
        self.graph = self._decode_graph() if config.compile else None

    @property
    def native_kernels(self) -> bool:
        """Whether decode steps run the C kernels (engine/kernels/cpu_native.py): asked for
        (``EngineConfig.cpu_native_kernels``), on the CPU in float32, and the library built and
        loaded (an installation without their sources warns and runs the torch ops)."""
        return self.backend.name == "c"

    def _decode_graph(self) -> DecodeGraph:
        """The compiled decode step (engine/decode_graph.py). Block tables are as wide as the
        most pages a sequence can hold; on meta the graph runs uncompiled (a dry run)."""
        max_blocks = min(-(-self.max_model_len // self.block_size), self.num_pages)
        graph = DecodeGraph(self.model, self.kv, self.queries, self.scale, self.config.max_num_seqs,
                            max_blocks, self.device, compile=self.device.type != "meta",
                            backend=self.backend)
        if self.backend.cuda_graphs:
            graph.capture()
        return graph

    def _rebuild_graph(self) -> None:
        """The compiled step holds the model, the KV cache and the query pools it was built on:
        after one of them is replaced, build it again (inductor's on-disk cache makes that a
        cache hit; on CUDA the graphs are captured again)."""
        if self.graph is not None:
            self.graph = self._decode_graph()

    def load_state(self, tensors) -> None:
        """Replace the weights with checkpoint-named (name, tensor) pairs, e.g. a transformers
        model's `state_dict().items()`, so the engine and that model compute with the same
        weights (the GPU check compares them on random 8B-shaped weights)."""
        self.model = build_model(self.hf_config, self.max_model_len, self.device, self.dtype)
        load_weights(self.model, tensors, self.device, self.dtype, self.backend)
        self._rebuild_graph()

    def footprint(self, signals: SignalSpec, pages: int | None) -> tuple[dict[str, int], dict[str, int]]:
        """The bytes this runner will allocate (engine.memory), by what they hold: (on its
        device, on the host). ``pages``: the KV pool's (None: not counted)."""
        cfg, hf = self.config, self.hf_config
        elem = self.dtype.itemsize
        arch = ARCHITECTURES.get(getattr(hf, "model_type", None))
        flags = arch.arch_flags(hf) if arch is not None else ArchFlags()
        params, projections = parameter_counts(hf, flags.qkv_bias, flags.qk_norm)
        packed = projections if self.backend.packs else 0
        slots = cfg.max_num_seqs + 1
        query_row = self.num_layers * self.num_q_heads * self.head_dim
        rope = self.max_model_len * self.head_dim
        kv = 0
        if pages is not None:
            kv = pages * self.bytes_per_page
            if signals.slot_scores:
                kv += pages * self.block_size * self.num_layers * self.num_kv_heads * 4
        emas = len(signals.ema_betas)
        on_device = {"weights": (params + packed) * elem, "KV pool": kv,
                     "query pools": slots * query_row * (signals.recent_queries * elem + emas * 4),
                     "rotary tables": rope * 3 * 4}
        on_host = {"layer objects": self.num_layers * memory.LAYER_OBJECT_BYTES,
                   "query positions": slots * (8 * signals.recent_queries + (1 if emas else 0)),
                   "rotary tables": rope * 3 * 8}
        if cfg.compile:  # DecodeGraph's row fields and block tables, on the host and the device
            width = -(-self.max_model_len // self.block_size)
            tables = cfg.max_num_seqs * (len(DECODE_FIELDS) + min(width, pages or width)) * 8
            on_host["decode step tables"] = tables
            if self.device.type != "cpu":
                on_device["decode step tables"] = tables
        return on_device, on_host

    def _query_pool(self, signals: SignalSpec) -> QueryStatePool:
        return QueryStatePool(signals, self.num_layers, self.config.max_num_seqs,
                              self.num_q_heads, self.head_dim, self.device, self.dtype)

    def use_signals(self, signals: SignalSpec) -> None:
        """Give a newly chosen policy's signals their pools (between runs, with no request
        running): the query pool and the per-slot scores are re-allocated only when they differ
        from the current ones; the KV pages themselves stay."""
        if signals == self.signals:
            return
        memory.check_fits(self.device, *self.footprint(signals, self.num_pages))
        self.queries = self._query_pool(signals)
        if signals.slot_scores != (self.kv.scores is not None):
            scores = (torch.zeros(self.kv.k.shape[:-1], device=self.device, dtype=torch.float32)
                      if signals.slot_scores else None)
            self.kv = KVCache(self.kv.k, self.kv.v, scores)
        self.signals = signals
        self._rebuild_graph()

    # -- memory -----------------------------------------------------------------------------
    @property
    def bytes_per_page(self) -> int:
        per_slot = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_slot * self.block_size * torch.tensor([], dtype=self.dtype).element_size()

    def _pool_from_free_memory(self) -> bool:
        cfg = self.config
        return cfg.is_cuda and cfg.kv_cache_tokens is None and cfg.kv_cache_bytes is None

    def _num_pages(self) -> int:
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            pages = cfg.kv_cache_tokens // self.block_size
        elif cfg.kv_cache_bytes is not None:
            pages = cfg.kv_cache_bytes // self.bytes_per_page
        elif cfg.is_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_utilization - (total - free)
            pages = int(budget * 0.9) // self.bytes_per_page  # leave room for activations
        else:
            pages = CPU_KV_CACHE_TOKENS // self.block_size
        if pages < 1:
            raise ConfigError("the KV pool is smaller than one page; raise kv_cache_tokens/bytes")
        return pages

    def _allocate_kv(self, with_scores: bool, pages: int | None = None) -> KVCache:
        # Head-major layout (KVCache docstring); scores drop only the trailing head_dim.
        pages = self._num_pages() if pages is None else pages
        shape = (self.num_layers, self.num_kv_heads, pages, self.block_size, self.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        scores = torch.zeros(shape[:-1], device=self.device, dtype=torch.float32) if with_scores else None
        return KVCache(k, v, scores)

    @property
    def num_pages(self) -> int:
        return self.kv.k.shape[2]

    # -- the scheduler's door to the pools ------------------------------------------------------
    def bind_query_slot(self) -> int | None:
        """A query-signal slot for a request that starts running, or None when the policy reads
        no query signals."""
        return self.queries.bind() if self.queries.active else None

    def release_query_slot(self, slot: int) -> None:
        self.queries.release(slot)

    def kv_cache(self) -> KVCache:
        """The KV pages (and per-slot scores) a compaction rewrites in place. Read it when the
        compaction runs: `use_signals` may replace it between runs."""
        return self.kv

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, items: list[WorkItem]) -> list[int]:
        """Forward the step's tokens and sample one token for each item that `samples` (one per
        row of a forced run). Single-token items must come first (the decode group)."""
        sampled = [it for it in items if it.samples]
        logits = self.forward(items)
        if not sampled:
            return []
        if self.logits_hook is not None:
            self.logits_hook(sampled, logits)
        return self._pick(sampled, logits)

    def _pick(self, sampled: list[WorkItem], logits: torch.Tensor) -> list[int]:
        """The step's next tokens, `item.rows` per item in order, brought to the host in one
        transfer (with any log-probabilities requested, which are appended to their sequences).
        logits: [R, vocab]."""
        tokens, logprobs = self.pick_on_device(sampled, logits)
        if logprobs is None:
            return tokens.tolist()
        # Token ids are exact in fp64 (vocabularies are far below 2**53), so one copy carries both.
        ids, values = torch.stack([tokens.double(), logprobs.double()]).tolist()
        row = 0
        for item in sampled:
            if item.seq.params.logprobs:
                item.seq.token_logprobs.extend(values[row:row + item.rows])
            row += item.rows
        return [int(t) for t in ids]

    def pick_on_device(self, sampled: list[WorkItem], logits: torch.Tensor):
        """Sample, then apply forced tokens, on the logits' device with no host sync.
        logits: [R, vocab], `item.rows` rows per item -> (tokens [R] long, logprobs [R] fp32 or
        None when no row asks). A forced run's rows sample too, in order, so a seeded request's
        random stream advances one draw per output token as it does token by token (unseeded
        requests share one stream, engine/sampling.py)."""
        outputs = [(it.seq, it.seq.num_output_tokens + j) for it in sampled for j in range(it.rows)]
        seqs = [s for s, _ in outputs]
        params = [s.params for s in seqs]
        forced = [(i, s.params.forced_tokens[k]) for i, (s, k) in enumerate(outputs)
                  if k < len(s.params.forced_tokens)]
        if len(forced) == len(outputs) and all(p.greedy for p in params):
            # every row forced and greedy: no draw to advance, so the argmax would be discarded
            tokens = torch.tensor([t for _, t in forced], dtype=torch.long).to(self.device)
        else:
            tokens = sample_tensor(logits, params, [self._generator(s) for s in seqs],
                                   self.noise)
            if forced:
                rows, ids = torch.tensor(forced, dtype=torch.long).T.to(self.device)
                tokens = tokens.index_copy(0, rows, ids)
        if not any(p.logprobs for p in params):
            return tokens, None
        return tokens, token_logprobs(logits, tokens, self.logprob_rows)

    def reseed_noise(self) -> None:
        """Restart the unseeded requests' shared noise from EngineConfig.seed (a `generate` call's
        unseeded outputs do not depend on the calls before it)."""
        self.noise = request_generator(self.config.seed, self.device)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request's own generator; None for greedy and unseeded requests (these
        draw from `noise`)."""
        if seq.params.greedy or seq.params.seed is None:
            return None
        if seq.generator is None:
            seq.generator = request_generator(seq.seed, self.device)
        return seq.generator

    def forward(self, items: list[WorkItem]) -> torch.Tensor | None:
        """The step's device work: logits [S, vocab] of the S rows that sample (`item.rows` per
        item that `samples`), in order; None when none does. A step of one-token items runs the
        compiled decode graph when the engine has one and the step is whole (`whole_step`);
        anything else (prefill chunks, forced runs, steps with per-head holes) runs eager."""
        whole = whole_step(items)
        if whole and self.graph is not None and self.graph.fits([it.seq.block_table for it in items]):
            return self._graph_forward(items)
        input_ids, positions, ctx, sample_rows = self._prepare(items)
        logits = self.model.sampled_logits(input_ids, positions, ctx, sample_rows)
        if ctx.capture is not None:
            ctx.capture.flush()
        return logits

    def _graph_forward(self, items: list[WorkItem]) -> torch.Tensor | None:
        """`forward` through the DecodeGraph: one metadata copy, the graph, the sampled rows."""
        bs = self.block_size
        ids, pos, slots, lens, query_slots, decoding, sample_rows = [], [], [], [], [], [], []
        for i, item in enumerate(items):
            seq = item.seq
            phys, start = seq.physical_len, seq.num_computed
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(seq.block_table[phys // bs] * bs + phys % bs)
            lens.append(phys + 1)
            query_slots.append(-1 if seq.query_slot is None else seq.query_slot)
            decoding.append(not item.prefill)
            if item.samples:
                sample_rows.append(i)
        columns = [ids, pos, slots, lens, *self.queries.prepare_decode(query_slots, pos, decoding)]
        logits = self.graph.run(columns, [it.seq for it in items])
        if not sample_rows:
            return None
        if len(sample_rows) == len(items):
            return logits
        return logits[upload(sample_rows, self.device)]

    def _prepare(self, items: list[WorkItem]):
        bs = self.block_size
        ids, pos, slots, sample_rows, capture = [], [], [], [], []
        for item in items:
            seq, n = item.seq, item.num_tokens
            row = len(ids)
            start = seq.num_computed
            ids.extend(item.input_ids())
            pos.extend(range(start, start + n))
            for s in range(seq.physical_len, seq.physical_len + n):
                slots.append(seq.block_table[s // bs] * bs + s % bs)
            if item.samples:
                sample_rows.extend(range(row + n - item.rows, row + n))
            if seq.query_slot is not None:
                capture.append((row, n, start, seq.query_slot, not item.prefill))
        dev = self.device
        # upload: pinned, non-blocking copies on CUDA (engine/kernels/_common.py)
        ctx = self._context(items, upload(slots, dev))
        if self.queries.active and capture:
            self.queries.prepare(capture)
            ctx.capture = self.queries
        return upload(ids, dev), upload(pos, dev), ctx, upload(sample_rows, dev)

    def _context(self, items: list[WorkItem], slot_mapping,
                 bases: dict[int, int] | None = None) -> ForwardContext:
        """The pass's ForwardContext; `bases` (seq_id -> slot) replaces an item's physical length
        as where its rows start (a recomputation over slots that already hold its KV)."""
        dev = self.device
        decode = [it for it in items if it.num_tokens == 1]
        chunks = [it for it in items if it.num_tokens > 1]
        ctx = ForwardContext(self.kv, self.scale, slot_mapping, self.backend,
                             num_decode=len(decode))
        if decode:
            ctx.decode_block_tables = _tables([it.seq.block_table for it in decode], dev)
            ctx.decode_context_lens = upload([_base(it, bases) + 1 for it in decode], dev)
            ctx.decode_holes = self._holes(decode)
        if chunks:
            q_max = max(it.num_tokens for it in chunks)
            pad = [b * q_max + i for b, it in enumerate(chunks) for i in range(it.num_tokens)]
            ctx.prefill_block_tables = _tables([it.seq.block_table for it in chunks], dev)
            ctx.prefill_base_lens = upload([_base(it, bases) for it in chunks], dev)
            ctx.prefill_q_lens = upload([it.num_tokens for it in chunks], dev)
            ctx.prefill_pad_index = upload(pad, dev)
            ctx.prefill_q_max = q_max
            ctx.prefill_holes = self._holes(chunks)
        return ctx

    def _holes(self, items: list[WorkItem]) -> torch.Tensor | None:
        """Per-head holes of a group, [layers, B, kv_heads, 2] int32; None when no item has one
        (then attention takes the uniform path)."""
        holes = [it.seq.holes() for it in items]
        if all(h is None for h in holes):
            return None
        none = torch.zeros(self.num_layers, self.num_kv_heads, 2, dtype=torch.int32)
        stacked = torch.stack([none if h is None else h for h in holes], dim=1)
        return stacked.to(self.device)

    # -- policy signals -----------------------------------------------------------------------
    def gather_slots(self, cache: torch.Tensor, seq: Sequence, layers: slice | None = None,
                     start: int = 0, end: int | None = None) -> torch.Tensor:
        """cache [layers, kv_heads, pages, bs, *rest] -> [layers, kv_heads, end - start, *rest] for
        the sequence's physical slots [start, end) (end defaults to physical_len); only the pages
        covering the range are read."""
        end = seq.physical_len if end is None else end
        if not 0 <= start <= end <= seq.physical_len:
            raise ValueError(f"slot range [{start}, {end}) outside 0..{seq.physical_len}")
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        table = self._pages(seq, first, last)
        c = cache if layers is None else cache[layers]
        dense = torch.index_select(c, 2, table).flatten(2, 3)
        return dense[:, :, start - first * bs: end - first * bs]

    def gather_head_slots(self, cache: torch.Tensor, seq: Sequence,
                          slots: torch.Tensor) -> torch.Tensor:
        """PolicyView.keys_at for any cache [layers, kv_heads, pages, bs, *rest]: slots int64
        [layers, kv_heads, n] of the sequence's physical slots -> [layers, kv_heads, n, *rest],
        one index_select of whole rows (no dense copy of the sequence first)."""
        layers, heads, _, bs = cache.shape[:4]
        if slots.dim() != 3 or slots.shape[:2] != (layers, heads):
            raise ValueError(f"slots {tuple(slots.shape)} must be [{layers}, {heads}, n]")
        n = seq.physical_len
        if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < n:
            raise ValueError(f"slots outside the sequence's physical slots 0..{n - 1}")
        return held_rows(cache, self._pages(seq, 0, -(-n // bs)), slots.to(self.device, torch.long))

    def query_probs(self, seq: Sequence, queries: torch.Tensor, layers: slice | None = None,
                    length: int | None = None, scale: float | None = None,
                    group_mean: bool = False, key_limit: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None,
                    query_reduce: str = "none") -> torch.Tensor:
        """PolicyView.query_probs: queries [layers, n, q_heads, d] over the sequence's physical
        slots [0, length), or over the slot map `slots` [layers, kv_heads, width], through the
        backend's kernel (the keys read where they lie)."""
        if slots is not None:
            if length is not None:
                raise ValueError("query_probs takes a length or a slot map, not both")
            if slots.numel() and int(slots.max()) >= seq.physical_len:
                raise ValueError(f"slots past the sequence's {seq.physical_len} physical slots")
            length, pages = slots.shape[-1], -(-seq.physical_len // self.block_size)
            slots = slots.to(self.device, torch.long)
        else:
            length = seq.physical_len if length is None else length
            if not 0 <= length <= seq.physical_len:
                raise ValueError(f"length {length} outside 0..{seq.physical_len}")
            pages = -(-length // self.block_size)
        table = self._pages(seq, 0, pages)
        cache = self.kv.k if layers is None else self.kv.k[layers]
        scale = queries.shape[-1] ** -0.5 if scale is None else scale
        if key_limit is not None:
            key_limit = key_limit.to(self.device)
        return self.backend.query_probs(queries, cache, table, length, key_limit, scale,
                                        group_mean, slots, query_reduce)

    def apply_rope(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """PolicyView.apply_rope: q [..., T, heads, d] rotated at positions [T] by the backend's
        RoPE, the one the forward pass applies (one C call on the C backend, where the torch form
        makes several passes over q)."""
        rows = self.model.rope.rows(positions)
        lead = q.shape[:-3].numel()
        if lead > 1:  # one row of cos / sin per rotated row
            rows = RopeRows(rows.cos.repeat(lead, 1, 1), rows.sin.repeat(lead, 1, 1))
        return self.backend.rope(q.reshape(-1, *q.shape[-2:]), rows).view(q.shape)

    def key_redundancy(self, seq: Sequence, threshold: float, temperature: float,
                       spare_first: bool, block: int | None = None) -> torch.Tensor:
        """PolicyView.key_redundancy: [layers, kv_heads, physical_len] over the sequence's
        physical slots, through the backend's kernel."""
        length = seq.physical_len
        table = self._pages(seq, 0, -(-length // self.block_size))
        return self.backend.key_redundancy(self.kv.k, table, length, threshold, temperature,
                                           spare_first, block)

    def _pages(self, seq: Sequence, first: int, last: int) -> torch.Tensor:
        """The sequence's pages [first, last) of its block table, int64 on the device, uploaded
        without a host sync (`upload`)."""
        return upload(seq.block_table[first:last], self.device)

    def recompute_queries(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Post-RoPE queries of uncompressed physical slots [start, end): [layers, n, q_heads, d]
        (`recompute_queries_batch` for one span)."""
        return self.recompute_queries_batch([(seq, start, end)])[0]

    @torch.inference_mode()
    def recompute_queries_batch(self, spans: list[tuple[Sequence, int, int]]) -> list[torch.Tensor]:
        """Post-RoPE queries of each (sequence, start, end) span of uncompressed physical slots:
        [layers, end - start, q_heads, d] each, in order.

        One forward pass over every span's tokens (`CausalLM.recomputed_queries`), each span a
        chunk that reads its own cached KV (its slots already hold these tokens' keys) and stores
        nothing; the final norm and LM head are skipped. Several spans in one pass read each
        weight once for all of their rows."""
        if len({seq.seq_id for seq, _, _ in spans}) != len(spans):
            raise ValueError("one span per sequence")
        for seq, start, end in spans:
            if not 0 <= start < end <= seq.physical_len:
                raise ValueError(f"slots [{start}, {end}) outside 0..{seq.physical_len}")
        # one-token spans first: the pass's layout puts its one-token items before the chunks
        order = sorted(range(len(spans)), key=lambda i: spans[i][2] - spans[i][1] > 1)
        ids, positions, items, bases = [], [], [], {}
        for i in order:
            seq, start, end = spans[i]
            first = seq.num_computed - seq.physical_len + start
            ids.extend(seq.token_ids[first:first + end - start])
            positions.extend(range(first, first + end - start))
            items.append(WorkItem(seq, end - start))
            bases[seq.seq_id] = start
        ctx = self._context(items, None, bases)
        queries = self.model.recomputed_queries(upload(ids, self.device),
                                                upload(positions, self.device), ctx)
        rows = queries.split([it.num_tokens for it in items], dim=1)
        out: list[torch.Tensor] = [None] * len(spans)  # type: ignore[list-item]
        for i, q in zip(order, rows):
            out[i] = q
        return out


def whole_step(items: list[WorkItem]) -> bool:
    """Whether a step is whole: every item one token, none with per-head holes (PyramidKV,
    Ada-KV). The compiled decode graph takes no hole masks and no chunks, so only a whole step
    runs through it; this is that rule's one place."""
    return bool(items) and all(it.num_tokens == 1 and it.seq.holes() is None for it in items)


def _base(item: WorkItem, bases: dict[int, int] | None) -> int:
    return item.seq.physical_len if bases is None else bases[item.seq.seq_id]


def _tables(tables: list[list[int]], device) -> torch.Tensor:
    """[B, widest] block tables padded with -1, in one non-blocking upload."""
    width = max(len(t) for t in tables)
    flat = [page for t in tables for page in t + [-1] * (width - len(t))]
    return upload(flat, device).view(len(tables), width)


def checkpoint_dtype(hf_config) -> torch.dtype | str | None:
    """The dtype a config declares. transformers >= 4.56 calls it ``dtype`` and warns on every read
    of ``torch_dtype``; older releases only have ``torch_dtype``, read from the instance's own
    fields so that no deprecated property is touched."""
    value = getattr(hf_config, "dtype", None)
    return value if value is not None else vars(hf_config).get("torch_dtype")

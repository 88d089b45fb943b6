"""The compiled decode step (engine/decode_graph.py): the paged custom ops, padding to buckets,
the compiled graph against its eager run, and no host sync inside a decode step."""

from __future__ import annotations

import pytest
import torch

import engine.kernels.ops  # noqa: F401  (registers torch.ops.kvarena.*)
from engine.config import EngineConfig
from engine.decode_graph import batch_buckets, bucket_for
from engine.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from engine.policies.base import SignalSpec
from engine.runner import ModelRunner, WorkItem
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from tiny_models import make_tiny_llama_dir

L, KH, H, D, BS, PAGES = 2, 2, 4, 16, 4, 12


def caches():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(L, KH, PAGES, BS, D, generator=g)
    return k, torch.randn(L, KH, PAGES, BS, D, generator=g)


def decode_inputs(batch=3):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, H, D, generator=g)
    key, value = torch.randn(batch, KH, D, generator=g), torch.randn(batch, KH, D, generator=g)
    tables = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [5, -1, -1, -1]][:batch])
    lens = torch.tensor([10, 6, 1][:batch])
    slots = torch.stack([tables[b, (n - 1) // BS] * BS + (n - 1) % BS for b, n in enumerate(lens)])
    return q, key, value, slots, tables, lens


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]
    assert bucket_for(5, batch_buckets(12)) == 8 and bucket_for(12, batch_buckets(12)) == 12
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(13, batch_buckets(12))


def test_table_widths_follow_the_decode_split():
    """Llama-3.1-8B's shapes (8 kv heads, a 131,072-token limit in pages of 256: 512 pages): a
    batch bucket reads the narrowest of its widths that covers its longest context, so the
    decode kernel's split follows the context; buckets whose every width runs as one partition
    keep only the full width."""
    from engine.decode_graph import table_widths, width_for
    from engine.kernels.paged_attention import decode_partitions

    widths = {b: table_widths(b, 8, 256, 512) for b in batch_buckets(64)}
    assert widths[1] == widths[32] == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert widths[64] == [512]  # 512 programs already: one partition at any width
    # batch 1, a 2k context: 4 partitions of 512 slots, each holding slots; the full width
    # gave 64 partitions of 2048 slots, of which one held any
    assert width_for(widths[1], 8) == 8 and decode_partitions(1, 8, 8 * 256) == (4, 512)
    assert decode_partitions(1, 8, 512 * 256) == (64, 2048)
    assert width_for(widths[1], 9) == 16 and width_for(widths[64], 9) == 512
    for bucket, kept in widths.items():  # the first kept width: the widest single partition
        parts = [decode_partitions(bucket, 8, w * 256)[0] for w in kept]
        assert all(p > 1 for p in parts[1:]) and kept == sorted(kept) and kept[-1] == 512
        if parts[0] == 1 and kept[0] < 512:
            assert decode_partitions(bucket, 8, 2 * kept[0] * 256)[0] > 1
    assert table_widths(4, 2, 4, 16) == [16] and table_widths(1, 8, 256, 1) == [1]
    with pytest.raises(ValueError, match="exceed"):
        width_for([2, 4], 5)


def test_a_step_reads_the_width_of_its_longest_context():
    """DecodeGraph.load picks (bucket, width) from the rows and the longest context; the views
    it returns are that wide (meta tensors at the 8B shapes: nothing allocated)."""
    from engine.attention import KVCache
    from engine.decode_graph import FIELDS, DecodeGraph
    from engine.query_state import QueryStatePool

    k = torch.empty(1, 8, 4096, 256, 128, device="meta")
    pool = QueryStatePool(SignalSpec(), 1, 64, 32, 128, "meta", torch.bfloat16)
    graph = DecodeGraph(None, KVCache(k, k), pool, 1.0, 64, 512, "meta", compile=False)
    for rows, longest, key in ((1, 2000, (1, 8)), (1, 2049, (1, 16)), (20, 2000, (32, 8)),
                               (64, 2000, (64, 512)), (3, 1, (4, 2)), (1, 131072, (1, 512))):
        seqs = []
        for _ in range(rows):
            seq = Sequence([1], SamplingParams(), 0)
            seq.block_table = [0] * -(-longest // 256)
            seqs.append(seq)
        columns = [[0] * rows for _ in FIELDS[:-1]]
        columns[3] = [longest] * rows
        got, inputs = graph.load(columns, seqs)
        assert got == key and inputs[-1].shape == (65, key[1])
        assert inputs[0].shape == (key[0],)


def test_ops_equal_the_kernels_and_pass_opcheck():
    k, v = caches()
    q, key, value, slots, tables, lens = decode_inputs()
    k2, v2 = k.clone(), v.clone()
    out = torch.ops.kvarena.store_and_decode(q, key, value, k2, v2, slots, tables, lens, 1, 0.25)
    ref_k, ref_v = k.clone(), v.clone()
    torch.ops.kvarena.store_kv(key, value, ref_k, ref_v, slots, 1)
    assert torch.equal(k2, ref_k) and torch.equal(v2, ref_v)
    assert torch.equal(k2[0], k[0])  # only the named layer is written
    ref = paged_decode_attention_torch(q, ref_k[1], ref_v[1], tables, lens, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.ops.kvarena.paged_decode_attention(q, ref_k, ref_v, tables, lens, 1, 0.25), ref)
    qp = torch.randn(2, 3, H, D)
    base, qlens = torch.tensor([4, 1]), torch.tensor([3, 2])
    torch.testing.assert_close(
        torch.ops.kvarena.paged_prefill_attention(qp, k, v, tables[:2], base, qlens, 0, 0.25),
        paged_prefill_attention_torch(qp, k[0], v[0], tables[:2], base, qlens, 0.25))
    # fake implementations agree with the real ones (shapes, strides, aliasing, mutation)
    torch.library.opcheck(torch.ops.kvarena.store_and_decode.default,
                          (q, key, value, k.clone(), v.clone(), slots, tables, lens, 0, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kvarena.paged_prefill_attention.default,
                          (qp, k, v, tables[:2], base, qlens, 0, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_ops_trace_without_graph_breaks():
    k, v = caches()
    q, key, value, slots, tables, lens = decode_inputs()

    def step(q, key, value, slots, tables, lens):
        x = q
        for layer in range(L):
            x = torch.ops.kvarena.store_and_decode(x * 2, key, value, k, v, slots, tables, lens,
                                                   layer, 0.25) + 1
        return x

    k0, v0 = k.clone(), v.clone()
    graph = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: no break
    out = graph(q, key, value, slots, tables, lens)
    k.copy_(k0), v.copy_(v0)
    assert torch.equal(out, step(q, key, value, slots, tables, lens))


# -- the graph on a tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("graph"), num_hidden_layers=2))


def make_runner(model_dir, device="cpu", compile=False, signals=SignalSpec(recent_queries=2,
                                                                           ema_betas=(0.9, 0.99))):
    config = EngineConfig(model=model_dir, device=device, block_size=BS, kv_cache_tokens=BS * 16,
                          max_num_seqs=4, compile=compile)
    return ModelRunner(config, model_dir, signals)


def decode_items(runner, lengths=(9, 3, 5)):
    """One-token items of sequences with `lengths` tokens whose KV (all but the last token) is
    in disjoint pages, each with a query slot."""
    items, page = [], 0
    for n in lengths:
        seq = Sequence(list(range(3, 3 + n)), SamplingParams(temperature=0.0), 0)
        pages = -(-n // BS)
        seq.block_table = list(range(page, page + pages))
        page += pages
        seq.num_computed = seq.physical_len = n - 1
        seq.query_slot = runner.queries.bind()
        items.append(WorkItem(seq, 1))
    return items


def state(runner):
    q = runner.queries
    return [t.clone() for t in (runner.kv.k, runner.kv.v, q.recent, q.ema)]


def test_padded_graph_step_equals_eager_step_and_writes_only_real_slots(model_dir):
    torch.manual_seed(0)
    eager = make_runner(model_dir)
    graph = make_runner(model_dir, compile=True)
    assert graph.graph is not None and eager.graph is None
    for r in (eager, graph):  # same random cache contents on both sides
        g = torch.Generator().manual_seed(3)
        r.kv.k.copy_(torch.randn(r.kv.k.shape, generator=g))
        r.kv.v.copy_(torch.randn(r.kv.v.shape, generator=g))
    before = state(graph)
    items_e, items_g = decode_items(eager), decode_items(graph)  # 3 rows -> bucket 4
    with torch.inference_mode():
        ref = eager.forward(items_e)
        out = graph.forward(items_g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    scratch = graph.queries.scratch  # written by the graph's padded row only
    for i, (a, b) in enumerate(zip(state(graph), state(eager))):
        if i >= 2:  # the query pools, slot-major: the scratch slot differs
            a, b = a[:scratch], b[:scratch]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the padded row wrote no KV: exactly the three real slots changed in every layer and head
    changed = (state(graph)[0] != before[0]).any(-1)  # [L, KH, pages, bs]
    assert int(changed.sum()) == 3 * L * KH
    assert not torch.equal(state(graph)[3][scratch], before[3][scratch])  # padding -> scratch


def test_graph_steps_at_two_table_widths_equal_eager_and_share_one_compile(tmp_path):
    """A graph with 256-page tables (bucket 1 reads 128 or 256 pages: 2 kv heads, 1024 slots
    split in 2): a 300-token and a 600-token context read different widths through the same
    compiled graph, with the eager step's logits. Tables repeat the pool's 16 pages."""
    from torch._dynamo.utils import counters

    from engine.decode_graph import DecodeGraph

    model_dir = str(make_tiny_llama_dir(tmp_path, num_hidden_layers=1,
                                        max_position_embeddings=1024))
    eager = make_runner(model_dir)
    runner = make_runner(model_dir, compile=True)
    runner.graph = DecodeGraph(runner.model, runner.kv, runner.queries, runner.scale, 4, 256,
                               "cpu", backend=runner.backend)
    assert runner.graph.widths[1] == [128, 256]
    for r in (eager, runner):
        g = torch.Generator().manual_seed(5)
        r.kv.k.copy_(torch.randn(r.kv.k.shape, generator=g))
        r.kv.v.copy_(torch.randn(r.kv.v.shape, generator=g))
    compiles = []
    for n, width in ((300, 128), (600, 256)):
        items = []
        for _ in range(2):  # one for each runner
            seq = Sequence([3 + i % 300 for i in range(n)], SamplingParams(temperature=0.0), 0)
            seq.block_table = [i % 16 for i in range(-(-n // BS))]
            seq.num_computed = seq.physical_len = n - 1
            items.append(WorkItem(seq, 1))
        with torch.inference_mode():
            ref = eager.forward(items[:1])
            out = runner.forward(items[1:])
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert runner.graph._inputs[1, width][-1].shape[1] == width
        compiles.append(counters["stats"]["unique_graphs"])
    assert compiles[1] == compiles[0]  # the second width compiled nothing


class SyncGuard(torch.overrides.TorchFunctionMode):
    """Fails on host reads of a device tensor's values (the meta device already raises on data
    access; this names the call). Host-side bookkeeping tensors (CPU) are allowed."""

    BANNED = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.BANNED and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type != "cpu":
            raise AssertionError(f"host sync inside a decode step: Tensor.{name}")
        return func(*args, **(kwargs or {}))


def test_decode_step_has_no_host_sync(model_dir):
    """The compiled step's device work (metadata copy, model, signals, LM head) run on `meta`
    tensors, where any read of a value on the host raises: no `.item()`, `.tolist()`, `.cpu()`
    or truthiness between the metadata copy and the logits."""
    runner = make_runner(model_dir, device="meta", compile=True)
    assert runner.kv.k.is_meta and not runner.graph.compiled  # meta runs the graph uncompiled
    items = decode_items(runner)
    items[1].seq.params = SamplingParams(temperature=0.0)
    with torch.inference_mode(), SyncGuard():
        logits = runner.forward(items)
    assert logits.is_meta and logits.shape == (3, runner.hf_config.vocab_size)


def test_a_batched_query_recomputation_stays_on_the_device(model_dir):
    """Kara's batched window recomputation (`recompute_queries_batch`: a one-token span and two
    chunks in one pass, the results split back in the callers' order) with the cache and model
    on `meta`: the ids, positions, tables and lengths go up the way a step's do, nothing is read
    back on the host (SyncGuard) and no host tensor meets a device one (DeviceGuard). On CUDA
    the attention is Triton's (its interpreter tests); here a shape-only stand-in takes its
    place, since the torch twins that `meta` would run plan on the host."""
    from dataclasses import replace

    from device_guard import DeviceGuard

    def attention(q, k_cache_l, v_cache_l, ctx, holes):
        return torch.empty_like(q)

    runner = make_runner(model_dir, device="meta")
    runner.backend = replace(runner.backend, decode=attention, prefill=attention)
    seqs = [item.seq for item in decode_items(runner, lengths=(9, 3, 12))]
    spans = [(seqs[0], 2, 8), (seqs[1], 1, 2), (seqs[2], 0, 11)]
    with torch.inference_mode(), SyncGuard(), DeviceGuard("meta"):
        queries = runner.recompute_queries_batch(spans)
    config = runner.hf_config
    shape = (config.num_hidden_layers, config.num_attention_heads, runner.model.head_dim)
    assert [tuple(q.shape) for q in queries] == [(shape[0], end - start, *shape[1:])
                                                 for _, start, end in spans]
    assert all(q.is_meta for q in queries)


def test_host_sync_check_can_fail(model_dir, monkeypatch):
    runner = make_runner(model_dir, device="meta", compile=True)
    items = decode_items(runner)
    original = runner.model.compute_logits

    def syncing(hidden, ops):
        if hidden.abs().max() > 0:  # a tensor's truthiness: a host sync
            pass
        return original(hidden, ops)

    monkeypatch.setattr(runner.model, "compute_logits", syncing)
    with torch.inference_mode(), pytest.raises((AssertionError, RuntimeError, NotImplementedError)):
        with SyncGuard():
            runner.forward(items)


def test_an_all_padding_step_writes_no_kv_and_no_bound_slot(model_dir):
    """The CUDA graphs' warm-up and capture run buckets of padding only (DecodeGraph.capture):
    nothing reaches the KV cache or a slot other than the scratch one."""
    from engine.decode_graph import FIELDS, DecodeGraph

    runner = make_runner(model_dir)
    graph = DecodeGraph(runner.model, runner.kv, runner.queries, runner.scale, 4, 4, "cpu",
                        compile=False)
    before = state(runner)
    with torch.inference_mode():
        for bucket in graph.buckets:
            _, inputs = graph.load([[] for _ in FIELDS[:-1]], [], bucket)
            assert inputs[0].shape[0] == bucket
            graph.forward(*inputs)
    after = state(runner)
    scratch = runner.queries.scratch
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert torch.equal(after[2][:scratch], before[2][:scratch])
    assert torch.equal(after[3][:scratch], before[3][:scratch])


class FencedCopy:
    """A fake CUDA event for one host buffer: `record` marks the buffer's copy as queued (and
    remembers what the copy must read), `synchronize` lets it complete. Writing the buffer while
    its copy is queued, or queueing a second copy before the first completed, fails."""

    def __init__(self, buffer: torch.Tensor, log: list):
        self.buffer, self.log, self.queued = buffer, log, None

    def record(self):
        assert self.queued is None, "a host buffer was reused before its copy completed"
        self.queued = self.buffer.clone()
        self.log.append(("record", self))

    def synchronize(self):
        if self.queued is not None:
            assert torch.equal(self.buffer, self.queued), "a queued copy's buffer was overwritten"
        self.queued = None
        self.log.append(("sync", self))


def test_host_buffers_alternate_and_wait_for_their_copies(model_dir):
    """The staged metadata (DecodeGraph's CUDA path, here on CPU): two host buffers in turn, each
    written only after the event recorded behind its last copy, and the device buffer receiving
    each step's values."""
    from engine.decode_graph import FIELDS, DecodeGraph

    runner = make_runner(model_dir)
    graph = DecodeGraph(runner.model, runner.kv, runner.queries, runner.scale, 4, 4, "cpu",
                        compile=False, staged=True)
    assert len(graph.hosts) == 2 and graph.meta.data_ptr() not in {h.data_ptr() for h in graph.hosts}
    log: list = []
    graph.events = [FencedCopy(h, log) for h in graph.hosts]
    for step in range(6):
        seqs = [it.seq for it in decode_items(runner, lengths=(9, 3, 5)[:1 + step % 3])]
        columns = [[step + i for i in range(len(seqs))] for _ in FIELDS[:-1]]
        graph.load(columns, seqs)
        event = graph.events[step % 2]  # buffers in turn
        assert log[-2:] == [("sync", event), ("record", event)]
        used = len(FIELDS) * 4 + 2 * graph.table_writes  # the fields, the changed entries
        assert torch.equal(graph.meta[:used], graph.hosts[step % 2][:used])
        for s in seqs:
            runner.queries.release(s.query_slot)
    for event in graph.events:  # the last copies' buffers are still untouched
        event.synchronize()
    # on CPU, unstaged: one buffer that the graph reads itself, events that do nothing
    plain = DecodeGraph(runner.model, runner.kv, runner.queries, runner.scale, 4, 4, "cpu",
                        compile=False)
    assert len(plain.hosts) == 1 and plain.meta is plain.hosts[0]


def table_steps(seed: int, steps: int = 80, max_rows: int = 4, longest: int = 8):
    """A random run's decode batches, as lists of Sequences whose tables change between steps
    the ways the engine changes them: growth in place, compaction replacing the table (shorter,
    or as long with fresh pages: copy-on-compress), preemption (an empty table, regrown later),
    finishing (new sequences take over rows), and sequences sitting a step out."""
    import random

    rng = random.Random(seed)
    pages = iter(range(10**6))
    running: list[Sequence] = []
    for _ in range(steps):
        while len(running) < max_rows and rng.random() < 0.4:
            seq = Sequence([1, 2, 3], SamplingParams(), 0)
            seq.block_table.extend(next(pages) for _ in range(rng.randint(1, 3)))
            running.append(seq)
        for seq in running:
            r, n = rng.random(), len(seq.block_table)
            if r < 0.25 and n < longest:
                seq.block_table.extend(next(pages) for _ in range(rng.randint(1, longest - n)))
            elif r < 0.32 and n:
                seq.block_table = seq.block_table[:rng.randint(1, n)]  # shrink
            elif r < 0.38 and n:
                seq.block_table = [next(pages) if rng.random() < 0.5 else p  # copy-on-compress
                                   for p in seq.block_table]
            elif r < 0.42:
                seq.reset_for_recompute()  # preemption
        if running and rng.random() < 0.1:
            running.remove(rng.choice(running))  # finished
        batch = [s for s in running if s.block_table and rng.random() < 0.85]
        if batch:
            rng.shuffle(batch)
            yield batch


def table_graph(runner, max_blocks: int, staged: bool = False):
    from engine.decode_graph import DecodeGraph

    return DecodeGraph(runner.model, runner.kv, runner.queries, runner.scale, 4, max_blocks,
                       "cpu", compile=False, staged=staged)


def load_step(graph, seqs):
    """Load a step (context lengths filling each table) -> the tables the graph reads [bucket,
    width] and the bucket."""
    from engine.decode_graph import FIELDS

    lens = [len(s.block_table) * BS for s in seqs]
    columns = [[0] * len(seqs) for _ in FIELDS[:-1]]
    columns[3] = lens
    (bucket, width), inputs = graph.load(columns, seqs)
    *_, table_row, tables = inputs
    assert tables.shape[1] == width >= max(len(s.block_table) for s in seqs)
    return tables.index_select(0, table_row), bucket


def rebuilt(seqs, bucket: int, width: int) -> torch.Tensor:
    """The step's block tables built from scratch: [bucket, width], -1 padded."""
    full = torch.full((bucket, width), -1, dtype=torch.long)
    for i, seq in enumerate(seqs):
        full[i, :len(seq.block_table)] = torch.tensor(seq.block_table)
    return full


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_persistent_tables_equal_a_full_rebuild_every_step(model_dir, staged):
    """Grows, compactions, shrinks, preemptions and rows passed on to new sequences: after every
    step the tables the graph reads are the step's tables built from scratch."""
    runner = make_runner(model_dir)
    graph = table_graph(runner, 8, staged)
    steady, seen = 0, set()
    for seqs in table_steps(seed=1 + staged):
        read, bucket = load_step(graph, seqs)
        assert torch.equal(read, rebuilt(seqs, bucket, read.shape[1]))
        seen.update(s.seq_id for s in seqs)
        if graph.table_writes == 0:
            steady += 1
            again, _ = load_step(graph, seqs)  # nothing changed: nothing written
            assert graph.table_writes == 0 and torch.equal(again, read)
    assert steady > 5 and len(seen) > 2 * graph.max_rows  # rows were taken over


def test_host_ints_per_step_do_not_grow_with_the_table_width(model_dir, monkeypatch):
    """The ints a step turns into tensors on the host (fields and changed table entries) are the
    same for a table 8 pages wide and one 256 wide; the tables read agree."""
    from engine.decode_graph import FIELDS

    runner = make_runner(model_dir)
    narrow, wide = table_graph(runner, 8), table_graph(runner, 256)
    counted = []
    tensor, as_tensor = torch.tensor, torch.as_tensor

    def count(make):
        def counting(data, *args, **kwargs):
            if isinstance(data, (list, tuple)):
                counted[-1] += len(data) if not data or not isinstance(data[0], list) \
                    else sum(map(len, data))
            return make(data, *args, **kwargs)
        return counting

    monkeypatch.setattr(torch, "tensor", count(tensor))
    monkeypatch.setattr(torch, "as_tensor", count(as_tensor))
    for seqs in table_steps(seed=7):
        ints, reads = [], []
        for graph in (narrow, wide):
            counted.append(0)
            read, _ = load_step(graph, seqs)
            ints.append(counted.pop())
            reads.append(read)
        # one int per field and row, two per changed table entry
        assert ints[0] == ints[1] == len(FIELDS) * len(seqs) + 2 * narrow.table_writes
        assert narrow.table_writes == wide.table_writes
        assert torch.equal(reads[0], reads[1][:, :8]) and (reads[1][:, 8:] == -1).all()

"""The sampler: exact semantics on CPU, everything on the logits' device, batch-independent seeds."""

from __future__ import annotations

import pytest
import torch

from device_guard import DeviceGuard, HostMixError
from engine.config import ConfigError
from engine.sampling import (
    CPU_LOGPROB_FLOATS,
    SamplingParams,
    logprob_block_rows,
    request_generator,
    sample,
    sample_tensor,
    token_logprobs,
)

VOCAB = 50
MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, seed=1),
         SamplingParams(temperature=0.6, top_k=5, seed=2), SamplingParams(temperature=1.3, top_p=0.8),
         SamplingParams(temperature=0.6, top_k=3, top_p=0.5)]


def logits_for(n: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, VOCAB, generator=g) * 3).to(device)


def naive_token(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The documented rule, one row at a time: temperature, top-k, then top-p over the sorted
    distribution (a token survives while the mass before it is below top_p), then the exponential
    race argmax p / E with E = -log(1 - U), U one uniform draw per vocabulary entry."""
    probs = torch.softmax(row / p.temperature, dim=-1)
    order = sorted(range(VOCAB), key=lambda i: -row[i].item())
    keep, mass = set(), 0.0
    for rank, tok in enumerate(order):
        if (p.top_k and rank >= p.top_k) or mass >= p.top_p:
            break
        keep.add(tok)
        mass += probs[tok].item()
    kept = torch.tensor([probs[i].item() if i in keep else 0.0 for i in range(VOCAB)])
    kept = kept / kept.sum()
    noise = torch.rand(VOCAB, generator=gen)
    race = [kept[i].item() / max(-torch.log1p(-noise[i]).item(), 1e-20) for i in range(VOCAB)]
    return max(range(VOCAB), key=lambda i: race[i])


def test_cpu_sampling_follows_the_documented_rule_row_by_row():
    logits = logits_for(len(MIXED))
    gens = [request_generator(7 + i, "cpu") for i in range(len(MIXED))]
    refs = [request_generator(7 + i, "cpu") for i in range(len(MIXED))]
    for _ in range(3):  # successive draws continue each row's own stream
        got = sample(logits, MIXED, gens)
        want = [int(logits[i].argmax()) if p.greedy else naive_token(logits[i], p, refs[i])
                for i, p in enumerate(MIXED)]
        assert got == want


def test_a_row_samples_the_same_whatever_shares_its_batch():
    logits = logits_for(len(MIXED))
    alone = sample(logits[2:3], MIXED[2:3], [request_generator(5, "cpu")])
    batch = sample(logits, MIXED, [request_generator(5 if i == 2 else 100 + i, "cpu")
                                   for i in range(len(MIXED))])
    assert batch[2] == alone[0]


def test_sampler_keeps_every_tensor_on_the_logits_device():
    logits = logits_for(len(MIXED), "meta")
    gens = [request_generator(i, "meta") for i in range(len(MIXED))]
    with DeviceGuard("meta"):
        tokens = sample_tensor(logits, MIXED, gens)
        logp = token_logprobs(logits, tokens)
    assert tokens.device.type == "meta" and tokens.shape == (len(MIXED),)
    assert logp.device.type == "meta" and logp.shape == (len(MIXED),)


def test_token_logprobs_in_blocks_equal_one_pass_bit_for_bit():
    logits = torch.randn(11, 300) * 4
    tokens = torch.randint(0, 300, (11,))
    whole = token_logprobs(logits, tokens)
    assert torch.equal(whole, torch.log_softmax(logits, -1)[torch.arange(11), tokens])
    for rows in (1, 3, 11, 40):
        assert torch.equal(token_logprobs(logits, tokens, rows), whole)
    assert token_logprobs(logits[:0], tokens[:0], 3).shape == (0,)
    # the CPU's blocks hold at most CPU_LOGPROB_FLOATS; a GPU takes every row at once
    assert logprob_block_rows(torch.device("cpu"), 49152) * 49152 <= CPU_LOGPROB_FLOATS
    assert logprob_block_rows(torch.device("cpu"), 2 * CPU_LOGPROB_FLOATS) == 1
    assert logprob_block_rows(torch.device("cuda"), 49152) is None


def test_guard_catches_a_host_index_and_a_generator_on_another_device():
    logits = logits_for(2, "meta")
    with DeviceGuard("meta"), pytest.raises(HostMixError):
        logits.index_select(0, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="generator is on cpu"):
        sample_tensor(logits, MIXED[1:3], [request_generator(0, "cpu")] * 2)


def test_runner_picks_forces_and_scores_on_device():
    """The runner's pick (sampling, forced tokens, log-probs) before its one transfer, on meta."""
    from engine.runner import ModelRunner, WorkItem
    from engine.sequence import Sequence

    seqs = [Sequence([1, 2], SamplingParams(temperature=0.6, seed=3, logprobs=True), 3),
            Sequence([1, 2], SamplingParams(temperature=0.0, forced_tokens=(4, 5)), 4)]
    runner = ModelRunner.__new__(ModelRunner)  # only the sampling half: no model needed
    runner.device = torch.device("meta")
    with DeviceGuard("meta"):
        tokens, logp = runner.pick_on_device([WorkItem(s, 1) for s in seqs], logits_for(2, "meta"))
    assert tokens.device.type == logp.device.type == "meta" and logp.shape == (2,)


def test_runner_pick_of_only_forced_greedy_rows_takes_the_forced_ids():
    """Every row forced and greedy (a forced run's page): the forced ids, uploaded without an
    argmax, their log-probabilities scored as any row's; on meta, nothing reaches the host."""
    from engine.runner import ModelRunner, WorkItem
    from engine.sequence import Sequence

    def seqs():
        return [Sequence([1, 2], SamplingParams(temperature=0.0, forced_tokens=(4, 5, 6),
                                                logprobs=True), 3),
                Sequence([1, 2], SamplingParams(temperature=0.0, forced_tokens=(7,)), 4)]

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("meta")
    with DeviceGuard("meta"):
        tokens, logp = runner.pick_on_device([WorkItem(s, n, forced=n > 1) for s, n in zip(seqs(), (2, 1))],
                                             logits_for(3, "meta"))
    assert tokens.device.type == logp.device.type == "meta" and logp.shape == (3,)
    runner.device = torch.device("cpu")
    logits = logits_for(3)
    items = [WorkItem(s, n, forced=n > 1) for s, n in zip(seqs(), (2, 1))]
    tokens, logp = runner.pick_on_device(items, logits)
    assert tokens.tolist() == [4, 5, 7]
    assert torch.equal(logp, torch.log_softmax(logits, dim=-1)[[0, 1, 2], [4, 5, 7]])


def test_runner_pick_forces_tokens_and_records_logprobs_on_cpu():
    from engine.runner import ModelRunner, WorkItem
    from engine.sequence import Sequence

    seqs = [Sequence([1, 2], SamplingParams(temperature=0.6, seed=3, logprobs=True), 3),
            Sequence([1, 2], SamplingParams(temperature=0.0, forced_tokens=(4, 5), logprobs=True), 4),
            Sequence([1, 2], SamplingParams(temperature=0.0), 5)]
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    logits = logits_for(3)
    tokens = runner._pick([WorkItem(s, 1) for s in seqs], logits)
    assert tokens[1] == 4 and tokens[2] == int(logits[2].argmax())
    logp = torch.log_softmax(logits, -1)
    assert seqs[0].token_logprobs == [pytest.approx(logp[0, tokens[0]].item())]
    assert seqs[1].token_logprobs == [pytest.approx(logp[1, 4].item())]
    assert seqs[2].token_logprobs == []


def test_stop_tail_covers_the_longest_stop_string():
    assert SamplingParams(stop=("ab", "Question:")).stop_tail_tokens == 4 * 9 + 4
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_cuda_sampling_is_on_device_and_reproducible():
    logits = logits_for(len(MIXED), "cuda")
    first = sample(logits, MIXED, [request_generator(i, "cuda") for i in range(len(MIXED))])
    again = sample(logits, MIXED, [request_generator(i, "cuda") for i in range(len(MIXED))])
    assert first == again and first[0] == int(logits[0].argmax())


def reference_sample_tensor(logits, params, generators):
    """The sampler as it was before unseeded rows shared one draw: every sampled row draws its
    own vector from its own generator, in row order."""
    from engine.sampling import SamplingTensors, _filtered_probs

    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    tensors = SamplingTensors.build(params, logits.shape[1], logits.device)
    if tensors is None:
        return tokens
    sub = logits.index_select(0, tensors.rows) / tensors.temperatures
    probs = _filtered_probs(sub, tensors) if tensors.filtered else torch.softmax(sub, dim=-1)
    noise = torch.stack([torch.rand(probs.shape[1], generator=generators[i])
                         for i, p in enumerate(params) if not p.greedy])
    race = probs / (-torch.log1p(-noise)).clamp_min(1e-20)
    return tokens.index_copy(0, tensors.rows, race.argmax(dim=-1))


def test_greedy_and_seeded_rows_sample_as_before_beside_unseeded_ones():
    """Seeded rows keep their own streams and greedy rows their argmax, token for token, whatever
    unseeded rows share the batch; with a generator for every sampled row nothing changes."""
    params = MIXED * 4
    logits = logits_for(len(params)) + torch.randn(len(params), VOCAB) * 0.1
    kept = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]

    def gens():
        return [request_generator(40 + i, "cpu") for i in range(len(params))]

    ref_gens, all_gens = gens(), gens()
    # as the runner passes them: no generator for unseeded rows
    mine = [g if params[i].seed is not None else None for i, g in enumerate(gens())]
    shared = torch.Generator().manual_seed(0)
    for _ in range(4):  # successive steps continue each seeded row's stream
        want = reference_sample_tensor(logits, params, ref_gens)
        got = sample_tensor(logits, params, mine, shared)
        assert got[kept].tolist() == want[kept].tolist()
    ref_gens = gens()
    for _ in range(2):
        assert torch.equal(sample_tensor(logits, params, all_gens),
                           reference_sample_tensor(logits, params, ref_gens))


def test_unseeded_rows_draw_one_noise_tensor_per_step(monkeypatch):
    rand, calls = torch.rand, []

    def counting(*args, **kwargs):
        calls.append(tuple(args[0]))
        return rand(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", counting)
    params = [SamplingParams(temperature=0.7, top_k=5)] * 64
    logits = logits_for(64)
    tokens = sample_tensor(logits, params, [None] * 64, torch.Generator().manual_seed(3))
    assert calls == [(64, VOCAB)] and tokens.shape == (64,)
    again = sample_tensor(logits, params, [None] * 64, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)  # the same shared stream, the same tokens
    calls.clear()
    gens = [request_generator(1, "cpu") if i in (5, 9) else None for i in range(64)]
    sample_tensor(logits, params, gens, torch.Generator().manual_seed(3))
    assert calls == [(62, VOCAB), (VOCAB,), (VOCAB,)]  # seeded rows keep their own draws
    # unseeded rows follow the documented rule, row i fed row i of the shared draw
    monkeypatch.setattr(torch, "rand", rand)
    three = MIXED[3:5] + [SamplingParams(temperature=1.0)]
    got = sample(logits[:3], three, [None] * 3, torch.Generator().manual_seed(8))
    noise = rand((3, VOCAB), generator=torch.Generator().manual_seed(8))
    for i, p in enumerate(three):
        monkeypatch.setattr(torch, "rand", lambda *a, _row=noise[i], **k: _row)
        assert got[i] == naive_token(logits[i], p, None)


def test_runner_gives_generators_to_seeded_requests_only():
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    seeded = Sequence([1], SamplingParams(temperature=0.6, seed=3), 3)
    unseeded = Sequence([1], SamplingParams(temperature=0.6), 4)
    greedy = Sequence([1], SamplingParams(temperature=0.0, seed=5), 5)
    assert runner._generator(seeded) is seeded.generator is not None
    assert runner._generator(unseeded) is None and unseeded.generator is None
    assert runner._generator(greedy) is None

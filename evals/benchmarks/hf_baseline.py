"""The transformers baseline: the same weights through `AutoModelForCausalLM.generate`, run the way
a user would on CPU: float32, left-padded static batches, greedy (`do_sample=False`).

EOS handling matches the engine's `ignore_eos=True`: the model's generation config gets
`eos_token_id = None`, so generate() has no EOS stopping criterion and every row produces exactly
`max_new_tokens` tokens, EOS included, as the engine does. (`min_new_tokens` would be wrong: it
masks the EOS logit and so changes which token is chosen.) A static batch runs to the longest
`max_new_tokens` among its requests; only each request's own first `max_tokens` tokens are kept and
counted as useful output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class HFRun:
    """tokens: each request's own output tokens (submission order); wall / cpu: wall and process
    CPU seconds inside generate() calls; computed_tokens: rows x max_new_tokens over all batches
    (useful or not)."""

    tokens: list[list[int]]
    wall: float
    cpu: float
    computed_tokens: int
    num_batches: int

    @property
    def useful_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def load_hf_model(model_dir):
    """The model in float32 eval mode, with EOS stopping disabled (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def pad_token_id(model, tokenizer) -> int:
    for value in (tokenizer.pad_token_id, model.config.pad_token_id, tokenizer.eos_token_id, 0):
        if isinstance(value, int):
            return value
    return 0


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[list[int]], max_new_tokens: int,
                   pad_id: int) -> list[list[int]]:
    """One left-padded batch: returns every row's `max_new_tokens` new tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad_id)
    new = out[:, width:]
    if new.shape[1] != max_new_tokens:  # an EOS criterion slipped in: the comparison is void
        raise RuntimeError(f"transformers stopped after {new.shape[1]} of {max_new_tokens} tokens; "
                           f"EOS stopping was not disabled")
    return new.tolist()


def run_static_batches(model, prompts: Sequence[list[int]], max_tokens: Sequence[int],
                       batch_size: int, pad_id: int) -> HFRun:
    """Fixed-size batches in submission order, each to the longest max_tokens in it."""
    if batch_size < 1:
        raise ValueError(f"hf batch size must be >= 1, got {batch_size}")
    tokens: list[list[int]] = []
    wall, cpu, computed, batches = 0.0, 0.0, 0, 0
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        lengths = list(max_tokens[start:start + batch_size])
        longest = max(lengths)
        t0, c0 = time.perf_counter(), time.process_time()
        rows = generate_batch(model, chunk, longest, pad_id)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        tokens += [row[:n] for row, n in zip(rows, lengths)]
        computed += len(chunk) * longest
        batches += 1
    return HFRun(tokens, wall, cpu, computed, batches)

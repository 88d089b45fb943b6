"""Random-weights models from a config alone: a small byte-level tokenizer and an HF-format
directory holding only config.json, generation_config.json and that tokenizer.

With `EngineConfig.load_format="dummy"` the engine fills such a model with seeded random weights
(`engine.models.random_tensors`), so 8B shapes can be timed and counted without an 8B checkpoint
(`kvarena bench step`, scripts/gpu_check.sh); the tests build their tiny checkpoints with the same
tokenizer (tests/tiny_models.py).

The tokenizer is a byte-level BPE trained in milliseconds on a few sentences, so it round-trips any
text exactly: 3 special tokens (``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2, the
SmolLM2 layout), the 256 byte symbols, learned merges, then ``<|reserved_k|>`` specials if the corpus
runs out of merges; ChatML template, eos ``<|im_end|>``. A model whose vocabulary is larger than
the tokenizer's decodes the ids beyond it to nothing, which is all a random model's text needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Enough distinct pairs for a few hundred merges; the sentences resemble the workloads (math, code).
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks of token slots.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Let x be a real number such that x^2 - 5x + 6 = 0. Find the sum of all possible values of x.",
    "A careful reader checks every step of the reasoning before writing the final answer.",
    "Compression keeps the most important tokens; growth appends a new page from the free pool.",
)

def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens (ChatML, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < base:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer: need >= {base}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(_CORPUS) * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN, pad_token=PAD_TOKEN
    )
    missing = vocab_size - len(tokenizer)
    if missing > 0:  # the corpus ran out of merges: fill up like real vocabularies do
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [f"<|reserved_{k}|>" for k in range(missing)]},
            replace_extra_special_tokens=False,
        )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer



# Shapes of the published configs (their config.json files), without rope scaling: step time and
# launch counts do not depend on the rotary frequencies.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=8192, tie_word_embeddings=False),
    # The CPU dry run's stand-in: the same code paths at a size that runs in seconds.
    "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                 rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}
TOKENIZER_VOCAB = 320


def write_config_dir(out: Path, shape: str | dict[str, Any], **overrides) -> Path:
    """An HF-format directory for random weights: config.json (a named `SHAPES` entry or a dict of
    config fields, then `overrides`, e.g. num_hidden_layers=2), generation_config.json and the
    small tokenizer. Returns `out`."""
    from transformers import AutoConfig, GenerationConfig

    fields = dict(SHAPES[shape] if isinstance(shape, str) else shape, **overrides)
    model_type = fields.pop("model_type")
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **fields, **ids)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig(**ids).save_pretrained(out)
    make_tokenizer(min(TOKENIZER_VOCAB, config.vocab_size)).save_pretrained(out)
    (out / "random_weights.json").write_text(json.dumps({"shape": shape if isinstance(shape, str)
                                                         else "custom", **overrides}))
    return out

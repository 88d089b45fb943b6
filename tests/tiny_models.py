"""Tiny random Hugging Face checkpoints for tests (no hub access, no downloads).

Each ``make_tiny_*_dir`` writes an HF-format directory -- ``config.json``, ``model.safetensors``
(float32), ``generation_config.json`` and a tokenizer -- that loads offline with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``::

    from tiny_models import make_tiny_llama_dir   # tests/ is on sys.path under pytest
    model_dir = make_tiny_llama_dir(tmp_path, num_hidden_layers=3)

The tokenizer is a byte-level BPE trained in milliseconds on a few sentences, so it round-trips any
text exactly. Its vocabulary is exactly the model's ``vocab_size``: 3 special tokens
(``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2, the SmolLM2 layout), the 256 byte
symbols, learned merges, then ``<|reserved_k|>`` specials if the corpus runs out of merges. The
chat template is ChatML and the eos token is ``<|im_end|>``.

Weights are random but not transformers' init: every parameter, norms included, is drawn from a
seeded generator, so a loader that swaps two tensors of the same shape (e.g. the two norms of a
layer) is caught. Embeddings are small (std 0.1) so that tied models do not lock onto one token.

``write_tiny_gguf`` exports such a directory the way llama.cpp's ``convert_hf_to_gguf.py`` does
(tensor names, metadata keys, the Q/K row permutation for the ``llama`` architecture, a ``gpt2``
tokenizer), to test GGUF loading without a real model file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The tokenizer is the random-weights models' (engine/models/random_model.py).
from engine.models.random_model import make_tokenizer as make_tiny_tokenizer

# Per architecture: HF config class name, whether embeddings are tied by default.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True},
}

_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


# ----------------------------------------------------------------------------------------------
# tokenizer


# ----------------------------------------------------------------------------------------------
# model directories


def _config_class(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]


def _model_class(arch: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]


def _build_config(arch: str, overrides: dict[str, Any]):
    config_cls = _config_class(arch)
    known = set(config_cls().to_dict()) | {"rope_theta", "rope_scaling", "rope_parameters"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown {arch} config override(s) {unknown}; valid keys: {sorted(known)}")
    kwargs = {**_COMMON_DEFAULTS, **_ARCH_DEFAULTS[arch], **overrides}
    return config_cls(**kwargs)


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter from a seeded generator (see module docstring for why)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            elif name.endswith(".bias"):
                values = 0.1 * torch.randn(param.shape, generator=gen)
            elif "embed_tokens" in name:
                # small: with tied embeddings a large input embedding dominates the residual stream
                # and greedy decoding locks onto one token
                values = 0.1 * torch.randn(param.shape, generator=gen)
            else:  # [out, in] projections: unit-variance outputs for unit-variance inputs
                values = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            param.copy_(values)


def _make_tiny_dir(arch: str, tmp_path: os.PathLike, name: str | None, seed: int, overrides: dict) -> Path:
    from transformers import GenerationConfig

    config = _build_config(arch, overrides)
    out = Path(tmp_path) / (name or f"tiny-{arch}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; pass another tmp_path or name=")
    torch.manual_seed(seed)  # transformers' own init runs first; keep it deterministic too
    model = _model_class(arch)(config).to(torch.float32).eval()
    _randomize_(model, seed)
    model.save_pretrained(out)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    return out


def make_tiny_llama_dir(tmp_path: os.PathLike, *, name: str | None = None, seed: int = 0,
                        **overrides) -> Path:
    """Tiny random Llama (SmolLM2-like: GQA, untied by default) in ``tmp_path/name``.

    ``overrides`` are LlamaConfig fields (e.g. ``num_hidden_layers=3``, ``tie_word_embeddings=True``,
    ``rope_scaling={"rope_type": "linear", "factor": 2.0}``); unknown keys raise TypeError.
    Defaults: vocab 320, hidden 64, ffn 128, 2 layers, 4 heads, 2 KV heads, head_dim 16.
    """
    return _make_tiny_dir("llama", tmp_path, name, seed, overrides)


def make_tiny_qwen2_dir(tmp_path: os.PathLike, *, name: str | None = None, seed: int = 0,
                        **overrides) -> Path:
    """Tiny random Qwen2 (q/k/v biases, tied embeddings by default); see ``make_tiny_llama_dir``."""
    return _make_tiny_dir("qwen2", tmp_path, name, seed, overrides)


def make_tiny_qwen3_dir(tmp_path: os.PathLike, *, name: str | None = None, seed: int = 0,
                        **overrides) -> Path:
    """Tiny random Qwen3 (per-head q/k RMSNorm, tied embeddings by default); see ``make_tiny_llama_dir``."""
    return _make_tiny_dir("qwen3", tmp_path, name, seed, overrides)


# ----------------------------------------------------------------------------------------------
# GGUF export (llama.cpp conventions)

_GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: HF half-split rotary layout -> interleaved pairs.

    ``weights: [n_head * head_dim, ...]`` (a weight or a bias). Within each head, HF row
    ``half * head_dim/2 + j`` moves to row ``2 * j + half``.
    """
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_tensor_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_GGUF_BLOCK_NAMES[rest]}.{kind}"


def _add_tokenizer_metadata(writer, model_dir: Path, config) -> None:
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _add_rope_metadata(writer, config) -> None:
    import gguf

    rope = dict(config.rope_parameters or {})
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"write_tiny_gguf does not export rope_type {rope_type!r}")


def write_tiny_gguf(
    model_dir: os.PathLike, gguf_path: os.PathLike, *, float_type: str = "f32",
    drop_tensors: tuple[str, ...] = (),
) -> Path:
    """Export an HF directory (from ``make_tiny_*_dir``) to a GGUF file as llama.cpp would.

    ``float_type``: "f32" or "f16" for 2-D weights (norms and biases stay f32, like llama.cpp).
    ``drop_tensors``: GGUF tensor names to leave out (to build broken files in tests).
    Q and K (weights and biases) are permuted with ``llama_cpp_permute`` for ``llama`` only;
    llama.cpp runs qwen2/qwen3 with NeoX (half-split) rotary, so their rows are left alone.
    """
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    if float_type not in ("f32", "f16"):
        raise ValueError(f"float_type must be 'f32' or 'f16', got {float_type!r}")
    model_dir, gguf_path = Path(model_dir), Path(gguf_path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    arch = config.model_type
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    _add_rope_metadata(writer, config)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float_type == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    _add_tokenizer_metadata(writer, model_dir, config)

    state = load_file(str(model_dir / "model.safetensors"))
    for hf_name, weights in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = weights.astype(np.float32)
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            weights = llama_cpp_permute(weights, heads)
        if float_type == "f16" and weights.ndim == 2:
            weights = weights.astype(np.float16)
        if _gguf_tensor_name(hf_name) not in drop_tensors:
            writer.add_tensor(_gguf_tensor_name(hf_name), np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path

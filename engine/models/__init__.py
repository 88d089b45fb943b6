"""Model architectures by `model_type`, and weight loading into them."""

from __future__ import annotations

import torch

from engine.config import ConfigError
from engine.models.llama import CausalLM, LlamaForCausalLM
from engine.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_model(config, max_len: int, device, dtype) -> CausalLM:
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    with torch.device("meta"):
        model = ARCHITECTURES[model_type](config, max_len, device, dtype)
    return model


def load_weights(model: CausalLM, tensors, device, dtype) -> None:
    """Fill a meta-initialised model from (name, tensor) pairs; every parameter must be present.
    Then fuses q/k/v and gate/up (engine/models/llama.py's docstring)."""
    params = dict(model.named_parameters())
    loaded = {}
    for name, tensor in tensors:
        if name not in params:
            if name.endswith("rotary_emb.inv_freq") or (model.tied and name == "lm_head.weight"):
                continue
            raise ConfigError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ConfigError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(params[name].shape)}"
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ConfigError(f"checkpoint is missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    model.load_state_dict(loaded, strict=True, assign=True)
    model.fuse_projections()
    model.eval()

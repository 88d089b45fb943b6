"""Model architectures by `model_type`, and weight loading into them."""

from __future__ import annotations

import torch

from engine.config import ConfigError
from engine.kernels.backend import Backend
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


def load_weights(model: CausalLM, tensors, device, dtype, backend: Backend | None = None) -> None:
    """Fill a meta-initialised model from (name, tensor) pairs; every parameter must be present.
    Then fuses q/k/v and gate/up (engine/models/llama.py's docstring) and, where the engine's
    `backend` packs weights, packs the projections in its layout (engine/kernels/linear.py)."""
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
    if backend is not None and backend.packs:
        model.pack_weights(backend)
    model.eval()


def random_tensors(model: CausalLM, seed: int, device="cpu"):
    """(name, tensor) pairs for every parameter of a meta-initialised model, drawn in fp32 from a
    generator seeded with `seed` on `device` (`EngineConfig.load_format="dummy"`; on a GPU this
    takes seconds for 8B weights, where a CPU generator would take minutes). The same seed on the
    same device gives the same weights, so a transformers model filled from this equals the
    engine's. Norms near 1, projections scaled by 1/sqrt(fan_in) so activations stay O(1)
    through many layers, embeddings and biases small."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device)

    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            yield name, 1.0 + 0.05 * randn(param.shape)
        elif name.endswith(".bias") or "embed_tokens" in name:
            yield name, 0.02 * randn(param.shape)
        else:
            yield name, randn(param.shape) / param.shape[-1] ** 0.5

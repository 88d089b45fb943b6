"""Llama-family decoder (Llama 2/3, SmolLM2), written for the paged engine.

Parameter names follow Hugging Face exactly, so checkpoints load by name. Tokens of a step are
flattened: hidden states are [T, hidden]; attention is delegated to engine.attention.attend with a
ForwardContext describing pages and lengths. Architecture differences (Qwen3's q/k RMSNorm, Qwen2's
qkv bias) are flags of `ArchFlags`, so one implementation serves the family (see qwen3.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.attention import ForwardContext, attend
from engine.models.rope import Rope


@dataclass(frozen=True)
class ArchFlags:
    qk_norm: bool = False
    qkv_bias: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, flags: ArchFlags, rope: Rope):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        hidden = config.hidden_size
        bias = flags.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """x: [T, hidden], positions: [T] -> [T, hidden]."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q_pre = q  # "after query normalisation, before RoPE": what GrowPage summarises
        q, k = self.rope.apply(q, positions), self.rope.apply(k, positions)
        out = attend(self.layer_idx, q_pre, q, k, v, ctx)
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, flags: ArchFlags, rope: Rope):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, flags, rope)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, ctx):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config, flags: ArchFlags, rope: Rope):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, flags, rope) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, ctx, num_layers: int | None = None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers[:num_layers]:
            x = layer(x, positions, ctx)
        return x if num_layers is not None else self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only LM. forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab]."""

    flags = ArchFlags()

    def __init__(self, config, max_len: int, device, dtype):
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        self.rope = Rope(self.head_dim, max_len, config, device)
        self.model = DecoderModel(config, self.arch_flags(config), self.rope)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def arch_flags(cls, config) -> ArchFlags:
        return ArchFlags(qkv_bias=bool(getattr(config, "attention_bias", False)))

    def forward(self, input_ids, positions, ctx, num_layers: int | None = None):
        return self.model(input_ids, positions, ctx, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return hidden @ weight.t()


class LlamaForCausalLM(CausalLM):
    pass


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

"""Llama-family decoder (Llama 2/3, SmolLM2), written for the paged engine.

Parameter names follow Hugging Face exactly, so checkpoints load by name. Tokens of a step are
flattened: hidden states are [T, hidden]; attention is delegated to engine.attention.attend with a
ForwardContext describing pages and lengths. Architecture differences (Qwen3's q/k RMSNorm, Qwen2's
qkv bias) are flags of `ArchFlags`, so one implementation serves the family (see qwen3.py).

After loading, `CausalLM.fuse_projections` concatenates q/k/v into one weight and gate/up into
another; the named parameters become views of the fused tensors, so state_dict names, shapes and
values are unchanged and memory is not doubled. At batch 1 a decode step is a chain of small
matrix-vector products (SmolLM2-135M: 30 layers x 4 fused projections + the LM head = 121; 211
unfused) whose per-call overhead is a visible share of the step, so fewer, larger calls help; each
output element is still the same dot product, so results match the unfused layers
(tests/test_engine.py checks it). The rotary cos/sin rows are gathered once per
forward pass instead of twice per layer.

Every op of a layer (projections, RMSNorm with the residual add, RoPE, SiLU-mul, attention's
store and kernels) runs through the backend the pass's ForwardContext carries
(engine/kernels/backend.py: Triton, the CPU C kernels or the torch twins, chosen once per engine),
so each layer has one body whatever runs it. Where the backend packs weights (CPU float32),
`CausalLM.pack_weights` gives every projection and the LM head a packed copy in its layout (C
column panels or oneDNN's; engine/kernels/linear.py has why), and `DecoderModel.stack_layers`
asks it for a whole stack over them: the C backend hands an eager step's layers, final norm
and LM head (decode steps, forced runs' pages) to one C call (through
`CausalLM.sampled_logits`), the same kernels in the same order without the Python between
them, the policies' query signals written from every layer's pre-RoPE queries, where the
layers have no q/k norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import ForwardContext, attend
from engine.models.rope import Rope, RopeRows

if TYPE_CHECKING:
    from engine.kernels.backend import Backend


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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of six; in fp32 it equals the upcasting formula below bit for
            # bit (no casts to round), which tests/test_engine.py checks.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, flags: ArchFlags):
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
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: torch.Tensor | None = None  # set by pack()
        self.o_packed: torch.Tensor | None = None

    def fuse(self) -> None:
        """q/k/v weights (and biases) -> one [q + 2 kv, hidden] tensor; the projections' parameters
        become views of it (module docstring)."""
        self.qkv_weight = _fuse([self.q_proj, self.k_proj, self.v_proj], "weight")
        self.qkv_bias = _fuse([self.q_proj, self.k_proj, self.v_proj], "bias")

    def pack(self, ops: Backend) -> None:
        """Packed copies of the fused q/k/v and the output projection (module docstring)."""
        self.qkv_packed = ops.pack(_fused(self.qkv_weight))
        self.o_packed = ops.pack(self.o_proj.weight)

    def forward(self, x: torch.Tensor, rope: RopeRows, ctx: ForwardContext):
        """x: [T, hidden], rope: the step's cos/sin rows -> [T, hidden]."""
        T = x.shape[0]
        H, KH, d = self.num_heads, self.num_kv_heads, self.head_dim
        ops = ctx.backend
        qkv = ops.linear(x, _fused(self.qkv_weight), self.qkv_packed, self.qkv_bias)
        v = qkv[:, (H + KH) * d:].view(T, KH, d)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :H * d].view(T, H, d))
            k = self.k_norm(qkv[:, H * d:(H + KH) * d].view(T, KH, d))
            q_pre = q  # "after query normalisation, before RoPE": what GrowPage summarises
            q, k = ops.rope(q, rope), ops.rope(k, rope)
        else:
            # q and k rotated in one pass over their adjacent heads.
            qk = qkv[:, :(H + KH) * d].view(T, H + KH, d)
            q_pre = qk[:, :H]
            qk = ops.rope(qk, rope)
            q, k = qk[:, :H], qk[:, H:]
        out = attend(self.layer_idx, q_pre, q, k, v, ctx)
        return ops.linear(out.reshape(T, -1), self.o_proj.weight, self.o_packed)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()
        self.gate_up_packed: torch.Tensor | None = None  # set by pack()
        self.down_packed: torch.Tensor | None = None

    def fuse(self) -> None:
        """gate/up weights -> one [2 * intermediate, hidden] tensor (module docstring)."""
        self.gate_up_weight = _fuse([self.gate_proj, self.up_proj], "weight")

    def pack(self, ops: Backend) -> None:
        """Packed copies of the fused gate/up and the down projection."""
        self.gate_up_packed = ops.pack(_fused(self.gate_up_weight))
        self.down_packed = ops.pack(self.down_proj.weight)

    def forward(self, x: torch.Tensor, ops: Backend) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], through the pass's backend `ops`."""
        gate_up = ops.linear(x, _fused(self.gate_up_weight), self.gate_up_packed)
        return ops.linear(ops.silu_mul(gate_up), self.down_proj.weight, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, flags: ArchFlags):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, flags)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope: RopeRows, ctx):
        """x: [T, hidden], this pass's own tensor (the C backend adds the attention's residual
        into it in place) -> [T, hidden]."""
        ops = ctx.backend
        h = ops.rms_norm(x, self.input_layernorm)
        x, h = ops.add_rms_norm(x, self.self_attn(h, rope, ctx), self.post_attention_layernorm)
        return x + self.mlp(h, ops)


class DecoderModel(nn.Module):
    def __init__(self, config, flags: ArchFlags, rope: Rope):
        super().__init__()
        self.rope = rope
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, flags) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.stack = None  # the backend's whole stack, set by stack_layers()

    def stack_layers(self, ops: Backend, head: torch.Tensor, vocab: int) -> None:
        """The backend's whole stack over the layers' norms and packed projections, the
        final norm and the LM head's packed copy `head` (for `vocab` outputs), where the backend
        has one (module docstring) and the layers need nothing it lacks (q/k norms)."""
        attn = [layer.self_attn for layer in self.layers]
        first = attn[0]
        if first.qk_norm:
            return
        self.stack = ops.layer_stack(
            [{"input_norm": layer.input_layernorm.weight.detach(), "qkv": a.qkv_packed,
              "qkv_bias": None if a.qkv_bias is None else a.qkv_bias.detach(), "o": a.o_packed,
              "post_norm": layer.post_attention_layernorm.weight.detach(),
              "gate_up": layer.mlp.gate_up_packed, "down": layer.mlp.down_packed}
             for layer, a in zip(self.layers, attn)],
            self.norm.weight.detach(), first.num_heads, first.num_kv_heads, first.head_dim,
            self.norm.eps, head, vocab)

    def forward(self, input_ids, positions, ctx, num_layers: int | None = None):
        """input_ids, positions [T] -> the final norm's output [T, hidden] (the first
        `num_layers` layers' output, without the norm, when given). A step that the backend's
        whole stack serves comes through `CausalLM.sampled_logits` instead."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.rows(positions)  # gathered once, shared by every layer
        for layer in self.layers[:num_layers]:
            x = layer(x, rope, ctx)
        if num_layers is not None:
            return x
        return ctx.backend.rms_norm(x, self.norm)


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
        self.head_packed: torch.Tensor | None = None  # set by pack_weights()

    @classmethod
    def arch_flags(cls, config) -> ArchFlags:
        return ArchFlags(qkv_bias=bool(getattr(config, "attention_bias", False)))

    def forward(self, input_ids, positions, ctx, num_layers: int | None = None):
        return self.model(input_ids, positions, ctx, num_layers)

    def sampled_logits(self, input_ids, positions, ctx, sample_rows) -> torch.Tensor | None:
        """input_ids, positions [T], sample_rows [S] (ascending rows) -> logits [S, vocab] of
        those rows, None when S = 0. A step whose every row samples runs its layers, final norm
        and LM head in one call where the backend's whole stack serves it (`step_stack`); the
        same arithmetic as the forward pass and compute_logits."""
        ops = ctx.backend
        if sample_rows.numel() == input_ids.numel():
            logits = ops.step_stack(self.model, input_ids, positions, ctx)
            if logits is not None:
                return logits
        hidden = self.forward(input_ids, positions, ctx)
        if not sample_rows.numel():
            return None
        return self.compute_logits(hidden[sample_rows], ops)

    def recomputed_queries(self, input_ids, positions, ctx) -> torch.Tensor:
        """input_ids, positions [T] of a recomputation pass (ctx stores nothing) -> every
        layer's post-RoPE queries [layers, T, q_heads, d]: in one call where the backend's whole
        stack serves it (`recompute_stack`), else the layers one by one, collecting them."""
        queries = ctx.backend.recompute_stack(self.model, input_ids, positions, ctx)
        if queries is not None:
            return queries
        ctx.collect = []
        self.model(input_ids, positions, ctx, num_layers=len(self.model.layers))
        return torch.stack(ctx.collect)

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up of every layer (module docstring); call after the weights are
        loaded. Idempotent."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def pack_weights(self, ops: Backend) -> None:
        """Packed copies of every projection and of the LM head in the layout of the backend
        `ops` (`Backend.packs`), used by the forward pass from now on, and the backend's whole
        stack over them (module docstring); call after fuse_projections()."""
        for layer in self.model.layers:
            layer.self_attn.pack(ops)
            layer.mlp.pack(ops)
        self.head_packed = ops.pack(self._head_weight())
        self.model.stack_layers(ops, self.head_packed, self._head_weight().shape[0])

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, ops: Backend) -> torch.Tensor:
        """hidden [N, hidden] -> [N, vocab] through the backend `ops` (the pass's)."""
        return ops.linear(hidden, self._head_weight(), self.head_packed)


class LlamaForCausalLM(CausalLM):
    pass


def _fuse(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' `attr` tensors along dim 0 and re-point each linear's parameter
    at its slice of the result. None when they have no such tensor (no bias)."""
    parts = [getattr(m, attr) for m in linears]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for m, p in zip(linears, parts):
        n = p.shape[0]
        setattr(m, attr, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused


def _fused(weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        raise RuntimeError("projections are not fused: call CausalLM.fuse_projections() after "
                           "loading the weights (engine.models.load_weights does)")
    return weight


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

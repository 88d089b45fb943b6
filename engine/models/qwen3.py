"""Qwen3 (q/k RMSNorm on each head before RoPE) and Qwen2 (q/k/v projections with bias) as flags
on the shared Llama-family decoder."""

from __future__ import annotations

from engine.models.llama import ArchFlags, CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch_flags(cls, config) -> ArchFlags:
        return ArchFlags(qk_norm=True, qkv_bias=bool(getattr(config, "attention_bias", False)))


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def arch_flags(cls, config) -> ArchFlags:
        return ArchFlags(qkv_bias=True)

"""ChunkKV (fixed budget): SnapKV's observation-window scores, kept in whole fixed-size chunks.

The slots before the observation window are cut into fixed chunks of `chunk_size` slots starting at
slot 0 (the last chunk may be shorter). A chunk's score is the mean over its tokens of their
SnapKV scores summed over every KV head of the layer (kvpress's ChunkKVPress: sum over heads, mean
over the chunk), so all heads of a layer keep the same slots (ChunkKV's semantic chunks; it is
also what makes its layer-wise index reuse possible). The mean ranks whole chunks as the sum
does; it differs only for the trailing partial chunk, which competes by its tokens' average
instead of losing by its length. The best chunks are kept whole until `target_len - window`
slots are taken; the window is always kept.

Exact budget: whole chunks rarely add up to `target_len - window`, and Compressed PagedAttention
needs every row to keep exactly `target_len`. The first chunk in rank order that would overshoot
is trimmed to the slots still missing, keeping its best slots by head-summed token score (so the
trim is also shared by the layer's heads); lower-ranked chunks are not used.

After decode-time compactions the slots of a layer are its retained tokens in order, so a chunk is
then `chunk_size` consecutive *retained* tokens rather than a contiguous span of the original text.

Timing, triggers and fallback are SnapKV's (prompt compression, decode threshold budget + one page).

Defaults (paper -> here):

| knob        | ChunkKV                                   | kvarena default (CPU preset)          |
|-------------|-------------------------------------------|---------------------------------------|
| chunk_size  | 10 (paper default; kvpress registry: 20)  | 10                                    |
| budget      | fixed KV sizes / ratios on LongBench      | None -> 8 pages: 256 at b=32, 2048 at b=256 |
| scorer      | SnapKV-style window attention             | SnapKV's: window 32, max-pool 7       |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, register_policy
from engine.policies.scoring import select_chunks
from engine.policies.snapkv import SnapKV


def chunkkv_keep(score: torch.Tensor, target_len: int, window: int, chunk_size: int) -> torch.Tensor:
    """ChunkKV's kept slots for one request.

    score: `[layers, kv_heads, length]` token scores (the last `window` slots are always kept);
    Returns int64 `[layers, kv_heads, target_len]`, ascending, identical across a layer's heads.
    """
    layers, kv_heads, length = score.shape
    window = min(window, length)
    region = length - window
    per_layer = score[..., :region].float().sum(dim=1)                       # [L, region]
    chosen = select_chunks(per_layer, chunk_size, target_len - window)       # [L, k]
    recent = torch.arange(region, length, device=score.device).expand(layers, window)
    keep = torch.cat([chosen, recent], dim=-1)
    return keep[:, None, :].expand(layers, kv_heads, target_len).contiguous()


@register_policy
@dataclass
class ChunkKV(SnapKV):
    """SnapKV scores with chunk-level selection shared by a layer's heads (module docstring).

    chunk_size: slots per chunk (>= 1; 1 degenerates to per-layer token top-k).
    Other fields: see SnapKV.
    """

    name = "chunkkv"

    chunk_size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1:
            raise ConfigError(f"chunkkv: chunk_size must be >= 1 slots, got {self.chunk_size}")

    def choose(self, view: PolicyView, score: torch.Tensor, target_len: int,
               protected: torch.Tensor) -> torch.Tensor:
        if target_len < self.window:
            raise ValueError(f"chunkkv: target_len {target_len} is below the window {self.window}")
        return chunkkv_keep(score, target_len, self.window, self.chunk_size)

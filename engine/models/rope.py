"""Rotary position embeddings (HF "rotate half" layout), with Llama-3 and linear scaling.

Keys are cached after RoPE, so a retained key keeps its original position forever; queries are
rotated at their true logical position. Policies reuse `Rope.apply` to rotate stored pre-RoPE
queries (GrowPage's summaries, Zipage's query cache) at a chosen position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import ConfigError


def rope_parameters(config) -> tuple[float, dict]:
    """(theta, scaling dict) from a transformers config, old (rope_theta/rope_scaling) or new
    (rope_parameters) style."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or params)
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3 frequency scaling: long wavelengths are divided by `factor`, short ones kept, and
    the band in between interpolated smoothly."""
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


_SCALINGS = {
    "default": lambda inv, s: inv,
    "llama3": _llama3_inv_freq,
    "linear": lambda inv, s: inv / s["factor"],
}


@dataclass(frozen=True)
class RopeRows:
    """The cos and sin rows of one forward pass's positions, [T, 1, d] each; `sin` carries the
    sign of the rotate-half pairing in its first half (-sin there), so a rotation is two
    multiplies and one add. Gathered once per pass and shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, d] -> rotated, same shape (HF's x * cos + rotate_half(x) * sin:
        rotate_half(x) * sin == swap_halves(x) * signed_sin exactly, as negation is exact)."""
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos.to(x.dtype) + swapped * self.sin.to(x.dtype)


class Rope:
    """cos/sin tables for positions [0, max_len). apply(x [..., T, heads, d], positions [T])."""

    def __init__(self, head_dim: int, max_len: int, config, device, dtype=torch.float32):
        theta, scaling = rope_parameters(config)
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if kind not in _SCALINGS:
            raise ConfigError(
                f"rope scaling {kind!r} is not supported; supported: {sorted(_SCALINGS)}"
            )
        inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
        )
        inv_freq = _SCALINGS[kind](inv_freq, scaling)
        angles = torch.arange(max_len, dtype=torch.float64, device="cpu")[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        half = head_dim // 2
        self._signed_sin = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
        self.max_len = max_len

    def rows(self, positions: torch.Tensor) -> RopeRows:
        """positions [T] -> the cos/sin rows every layer of a pass uses."""
        return RopeRows(self.cos[positions].unsqueeze(-2), self._signed_sin[positions].unsqueeze(-2))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, d] rotated at positions [T]."""
        return self.rows(positions).rotate(x)

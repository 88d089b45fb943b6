"""StreamingLLM (fixed budget): attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024;
mit-han-lab/streaming-llm). The cache keeps the first `sink` tokens (the attention sinks, Sec. 3.2)
and the most recent `budget - sink` tokens; everything between is evicted. No score is computed,
so every (layer, KV head) keeps the same slots and the policy reads no signal.

When it runs: the fixed-budget capacity rule (fixed_budget.py): pages grow to `budget` plus one
write page, then the request compacts back to `budget` at that page boundary, so the window slides
a page at a time instead of a token at a time as in the paper's rolling cache (the kept set at a
compaction is exactly the paper's for that length). A prompt longer than the budget is cut to the
sinks and its last tokens after prefill.

Defaults (paper/code -> here):

| knob      | StreamingLLM                                    | kvarena default                  |
|-----------|-------------------------------------------------|----------------------------------|
| sink      | 4 initial tokens (Sec. 3.2, Table 2; start_size | 4                                |
|           | 4 in `examples/run_streaming_llama.py`)         |                                  |
| recent    | recent_size 2000 in the example script          | budget - sink                    |
| budget    | 4 + 2000 = 2004 in the example script           | None -> 8 pages (task preset:    |
|           |                                                 | GrowPage Table 5 on paper)       |

Left open by the paper / departures: StreamingLLM re-assigns positions inside the cache (a token's
RoPE position is its slot index) so that generation can run past the pre-training window. Here
keys keep the positions they were cached with (RoPE is applied before caching, as in kvpress's
StreamingLLMPress), which is the same for sequences within the model's context, the only ones the
engine admits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, StageTimer, register_policy
from engine.policies.fixed_budget import FixedBudgetPolicy


def streaming_keep(length: int, target_len: int, sink: int) -> torch.Tensor:
    """Kept slots of one row: the first `sink` and the last `target_len - sink`. int64 `[target_len]`."""
    if not 0 <= sink <= target_len <= length:
        raise ValueError(f"cannot keep {target_len} of {length} slots with {sink} sinks")
    return torch.cat([torch.arange(sink), torch.arange(length - (target_len - sink), length)])


@register_policy
@dataclass
class StreamingLLM(FixedBudgetPolicy):
    """Attention sinks + recent window under a fixed per-request budget (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    sink: initial tokens always kept.
    """

    name = "streamingllm"
    protected_label = "attention sinks plus one recent token"

    sink: int = 4

    def __post_init__(self) -> None:
        if self.sink < 0:
            raise ConfigError(f"{self.name}: sink must be >= 0 initial tokens, got {self.sink}")
        self._check_budget()

    @property
    def num_protected(self) -> int:
        """The sinks, plus the newest token (a window of at least one)."""
        return self.sink + 1

    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor:
        """Kept slots `[layers, kv_heads, target_len]`: the same sinks + recent window in every row."""
        with timer.stage("select"):
            keep = streaming_keep(view.physical_len, target_len, self.sink)
            return keep.expand(self.engine.num_layers, self.engine.num_kv_heads, target_len).clone()

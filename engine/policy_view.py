"""The engine's implementation of `PolicyView`: one sequence, seen by its policy."""

from __future__ import annotations

from typing import Any

import torch

from engine.sequence import Sequence


class SeqView:
    """Lengths of `seq` plus accessors to its KV and query signals (see policies.base.PolicyView)."""

    def __init__(self, seq: Sequence, runner) -> None:
        self.seq = seq
        self._runner = runner

    # -- lengths --------------------------------------------------------------------------------
    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def logical_len(self) -> int:
        return self.seq.logical_len

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed

    @property
    def physical_len(self) -> int:
        return self.seq.physical_len

    @property
    def num_pages(self) -> int:
        return self.seq.num_pages

    @property
    def block_size(self) -> int:
        return self._runner.block_size

    @property
    def fused_reduce(self) -> bool:
        return self._runner.backend.fused_reduce

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.seq.is_prefilling

    def head_lens(self) -> tuple[torch.Tensor, int] | None:
        """(counts [layers, kv_heads], compacted_len) after a per-head compaction, else None."""
        if self.seq.head_lens is None:
            return None
        return self.seq.head_lens.clone(), self.seq.compacted_len

    @property
    def state(self) -> Any:
        return self.seq.policy_state

    @state.setter
    def state(self, value: Any) -> None:
        self.seq.policy_state = value

    # -- KV -------------------------------------------------------------------------------------
    def keys(self, layers: slice | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self._runner.gather_slots(self._runner.kv.k, self.seq, layers, start, end)

    def values(self, layers: slice | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self._runner.gather_slots(self._runner.kv.v, self.seq, layers, start, end)

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        return self._runner.gather_head_slots(self._runner.kv.k, self.seq, slots)

    def query_probs(self, queries: torch.Tensor, layers: slice | None = None,
                    length: int | None = None, scale: float | None = None,
                    group_mean: bool = False, key_limit: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None,
                    query_reduce: str = "none") -> torch.Tensor:
        return self._runner.query_probs(self.seq, queries, layers, length, scale, group_mean,
                                        key_limit, slots, query_reduce)

    def key_redundancy(self, threshold: float = 0.5, temperature: float = 1.0,
                       spare_first: bool = False, block: int | None = None) -> torch.Tensor:
        return self._runner.key_redundancy(self.seq, threshold, temperature, spare_first, block)

    def slot_scores(self) -> torch.Tensor:
        scores = self._runner.kv.scores
        if scores is None:
            raise RuntimeError("slot scores were not declared in the policy's signals()")
        return self._runner.gather_slots(scores, self.seq)

    def set_slot_scores(self, scores: torch.Tensor) -> None:
        """scores: [layers, kv_heads, physical_len] (cache: [layers, kv_heads, pages, block_size])."""
        kv = self._runner.kv
        cache = kv.scores
        slots = kv.flat_slots(self.seq.block_table)[:self.seq.physical_len]
        flat = cache.view(cache.shape[0], cache.shape[1], -1)
        flat[:, :, slots] = scores.to(cache.dtype)

    # -- queries --------------------------------------------------------------------------------
    def recent_queries(self, rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        queries, positions = self._runner.queries.recent_of(self._slot())
        if rope:
            queries = self.apply_rope(queries, positions.to(queries.device))
        return queries, positions

    def query_ema(self) -> tuple[torch.Tensor, bool]:
        return self._runner.queries.ema_of(self._slot())

    def apply_rope(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._runner.apply_rope(q, positions)

    def recompute_queries(self, start: int, end: int) -> torch.Tensor:
        return self._runner.recompute_queries(self.seq, start, end)

    def recompute_queries_batch(self, spans: list[tuple[SeqView, int, int]]) -> list[torch.Tensor]:
        if any(view._runner is not self._runner for view, _, _ in spans):
            raise ValueError("recompute_queries_batch: every view must belong to this engine")
        return self._runner.recompute_queries_batch([(v.seq, lo, hi) for v, lo, hi in spans])

    def _slot(self) -> int:
        if self.seq.query_slot is None:
            raise RuntimeError(f"sequence {self.seq.seq_id} holds no query slot")
        return self.seq.query_slot

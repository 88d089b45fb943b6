"""A FullKV policy that shows every real decode query to an analysis (the studies' probe).

The engine's public policy contract is enough to observe real attention without touching the
engine: a policy that declares `SignalSpec(recent_queries=1)` gets the newest query of every layer
in its per-request slot, and `periodic(step, views)` is called once per scheduler step with a view
of every decoding request. Right after a forward pass the newest query is that of the token just
processed (position num_computed - 1) and the cache holds its own key too, so
softmax(q . K^T * scale) over all physical slots is exactly the attention distribution the model
computed for it (the probe recomputes it in float32).

A `DecodeTap` always grows at capacity boundaries, so the KV cache is the FullKV cache: physical
slot s holds logical position s. Subclasses implement `observe` (and may add signals and boundary
work). Per-request state objects are created in submission order (the engine calls `new_state`
once per request as it is added), so `states[i]` belongs to the i-th prompt of a generate() call.

Which queries are seen: the last prompt row (its logits give the first output token) and then one
query per decode step, except the query of the final step (the request finishes inside that step,
before another `periodic` call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from engine.policies.base import Decision, KVPolicy, PolicyView, SignalSpec


@dataclass
class TapState:
    """Per-request probe state. index: the request's position in the generate() call."""

    index: int
    last_position: int = -1


@dataclass
class DecodeTap(KVPolicy):
    """FullKV behaviour plus a per-step callback with each request's newest real query."""

    name: ClassVar[str] = "analysis-tap"  # never registered: analyses pass the instance to LLM
    states: list = field(default_factory=list, init=False, repr=False, compare=False)

    def signals(self) -> SignalSpec:
        return SignalSpec(recent_queries=1)

    def make_state(self, index: int) -> TapState:
        return TapState(index)

    def new_state(self) -> Any:
        state = self.make_state(len(self.states))
        self.states.append(state)
        return state

    def reset(self) -> None:
        """Forget the states of a previous generate() call (indices restart at 0)."""
        self.states = []

    def on_boundary(self, view: PolicyView) -> Decision:
        return Decision.grow()

    def on_preempt(self, state: Any) -> None:
        raise RuntimeError(
            "an analysis run was preempted, which would re-prefill the request and break the "
            "per-step record; raise kv_cache_tokens (the studies size it with common.pool_tokens)"
        )

    def periodic(self, step: int, views: list[PolicyView]) -> list:
        for view in views:
            queries, positions = view.recent_queries(rope=True)
            if queries.shape[1] == 0:
                continue
            position = int(positions[-1])
            state = view.state
            if position == state.last_position:  # not scheduled last step: nothing new
                continue
            if view.physical_len != view.num_computed or position != view.num_computed - 1:
                raise RuntimeError(
                    f"{self.name}: sequence {view.seq_id} is not an uncompressed FullKV cache "
                    f"(physical {view.physical_len}, computed {view.num_computed}, query position "
                    f"{position}); the probe needs slot s == position s"
                )
            state.last_position = position
            self.observe(view, state, queries[:, -1].float(), position)
        return []

    def observe(self, view: PolicyView, state: Any, query: torch.Tensor, position: int) -> None:
        """query: [layers, q_heads, head_dim] post-RoPE query of logical position `position`; the
        view's keys cover positions 0..position."""
        raise NotImplementedError

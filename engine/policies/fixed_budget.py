"""The capacity rule shared by the fixed-budget policies (Zipage, SnapKV, ChunkKV, R-KV, MorphKV,
G-KV, StreamingLLM, H2O, TOVA).

A request grows page by page until it holds ceil(budget / b) + 1 pages (the budget plus one write
page); at that boundary it compacts back to `budget` slots and keeps its pages, so one page of slots
is free for the next tokens. A prompt longer than the budget (or a re-admitted, re-prefilled request)
is compacted to the budget after its last prefill chunk and gives back the pages beyond it.

A GROW that finds no free page (a request still below its cap) does not compress early by default:
the scheduler preempts another request, as Zipage's and nano-vLLM's schedulers do (Zipage suspends
or preempts, it never shrinks a request below its budget on memory pressure). Compressing instead
is GrowPage's scheduler-aware fallback (GrowPage Sec. 4.2); `fallback_compress=True` gives the
fixed-budget policies that fallback too (compact to one page less than the request holds, if that
still leaves room for the protected tokens), so the two runtimes can be compared policy by policy.

Below the cap a boundary is page allocation, not a capacity decision: the scheduler labels these
GROWs "allocate" (engine/scheduler.py), so a fixed budget's grow ratio is 0.

Subclasses give `budget` (tokens, None = DEFAULT_BUDGET_PAGES pages of the engine's block), the
number of always-kept tokens (`num_protected`, named by `protected_label` in errors) and the
`boundary_reason` label of their boundary events.

Per-request budgets (one mechanism for every fixed-budget policy). A request's budget is, in order:
1. `SamplingParams.kv_budget` when the request carries one (tokens; Kara's comparison protocol
   gives each baseline sequence the compressed length Kara realised on it, evals/run/matched_budget.py);
2. `budget_ratio` when set: `ceil(budget_ratio * prompt_tokens)`, the *kept* share of the request's
   *prompt* length (kvpress's convention for the length: the context a press compresses; kvpress's
   `compression_ratio` is the *removed* share, so `compression_ratio=c` is `budget_ratio=1-c`);
   `budget` and `budget_ratio` are exclusive;
3. `budget` (tokens; None and no ratio: DEFAULT_BUDGET_PAGES pages).
It is resolved once, when the request is admitted (`on_admit`), stored in the request's
`BudgetState` (it survives preemption), aligned by `align_budget` (Zipage: whole pages), and must
exceed the protected tokens: a budget that cannot be met is a ConfigError when the request is added,
before any step runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.config import ConfigError
from engine.policies.base import Decision, EngineSpec, KVPolicy, PolicyView
from engine.policies.scoring import fallback_target

DEFAULT_BUDGET_PAGES = 8  # 2048 tokens at the papers' block 256 (Zipage's max_cache_blocks_per_seq)


@dataclass
class BudgetState:
    """Per-request state of a fixed-budget policy (policies with more state subclass it).

    budget: this request's budget in tokens, resolved at admission from a per-request budget
        (`SamplingParams.kv_budget`, e.g. a budget matched to Kara's run) or from `budget_ratio`;
        None: the policy's `budget`.
    """

    budget: int | None = None


@dataclass
class FixedBudgetPolicy(KVPolicy):
    budget: int | None = None
    budget_ratio: float | None = None
    fallback_compress: bool = False

    has_budget: ClassVar[bool] = True
    boundary_reason: ClassVar[str] = "budget"
    # Every decision is a boundary's, a fallback's or a prompt's; scores are computed at
    # compaction from the recent-query cache and the persisted per-slot score.
    chunked_forcing = True
    protected_label: ClassVar[str] = "protected tokens"

    @property
    def num_protected(self) -> int:
        raise NotImplementedError

    def _check_budget(self) -> None:
        if self.budget is not None and self.budget_ratio is not None:
            raise ConfigError(
                f"{self.name}: give either budget (tokens) or budget_ratio (a share of the prompt), "
                f"not both (got budget={self.budget}, budget_ratio={self.budget_ratio})")
        if self.budget_ratio is not None and not 0.0 < self.budget_ratio <= 1.0:
            raise ConfigError(
                f"{self.name}: budget_ratio must be in (0, 1] (the kept share of the prompt), "
                f"got {self.budget_ratio}")
        if self.budget is not None:
            self._check_tokens(self.budget, "budget")

    def _check_tokens(self, budget: int, what: str) -> None:
        if budget <= 0:
            raise ConfigError(f"{self.name}: {what} must be a positive number of tokens, got {budget}")
        if budget <= self.num_protected:
            raise ConfigError(
                f"{self.name}: {what} ({budget}) must exceed the "
                f"{self.describe_protected()}, which are always kept")

    def describe_protected(self) -> str:
        return f"{self.protected_label} ({self.num_protected})"

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        if self.budget is None and self.budget_ratio is None:
            self.budget = DEFAULT_BUDGET_PAGES * engine.block_size
        self._check_budget()

    # -- per-request budgets -------------------------------------------------------------------
    def new_state(self) -> Any:
        return BudgetState()

    def align_budget(self, tokens: int) -> int:
        """A per-request budget as this policy can hold it (Zipage: whole pages). Default: as is."""
        return tokens

    def resolve_budget(self, num_prompt_tokens: int, kv_budget: int | None) -> int | None:
        """The budget (tokens) of a request with this prompt length: `kv_budget` when given, else
        `ceil(budget_ratio * num_prompt_tokens)`, aligned by `align_budget`; None when neither
        applies (the request uses `budget`). Raises ConfigError for one that cannot be met."""
        if kv_budget is not None:
            tokens, what = kv_budget, "the request's own budget (SamplingParams.kv_budget)"
        elif self.budget_ratio is not None:
            tokens = math.ceil(self.budget_ratio * num_prompt_tokens)
            what = f"budget_ratio {self.budget_ratio} of a {num_prompt_tokens}-token prompt"
        else:
            return None
        aligned = self.align_budget(tokens)
        if aligned != tokens:
            what += f" ({tokens} tokens, rounded down to whole pages of {self.block_size})"
        self._check_tokens(aligned, what)
        return aligned

    def on_admit(self, state: Any, num_prompt_tokens: int, kv_budget: int | None) -> None:
        budget = self.resolve_budget(num_prompt_tokens, kv_budget)
        if budget is not None:
            if not isinstance(state, BudgetState):
                raise RuntimeError(f"{self.name}: per-request budgets need a BudgetState, got {state!r}")
            state.budget = budget

    def request_budget(self, state: Any) -> int:
        """The budget of the request holding `state` (its own, or the policy's)."""
        own = state.budget if isinstance(state, BudgetState) else None
        if own is not None:
            return own
        if self.budget is None:
            raise RuntimeError(f"{self.name}: a request without a resolved budget (budget_ratio "
                               f"applies at admission)")
        return self.budget

    def pages_cap(self, budget: int) -> int:
        """Most pages a request with this budget holds: the budget's pages plus one write page."""
        return math.ceil(budget / self.block_size) + 1

    @property
    def cap_pages(self) -> int:
        """The cap of a request at the policy's nominal `budget`."""
        return self.pages_cap(self.budget)

    @property
    def holds_budget(self) -> bool:
        """True when every request is held at its budget through decode (compacted back to it at
        its page boundaries), so that a per-request budget (Kara's matched lengths,
        evals/run/matched_budget.py) bounds the whole request. False for a policy configured to
        compress only the prompt (per_head.py)."""
        return True

    def max_pages(self, view: PolicyView) -> int | None:
        return self.pages_cap(self.request_budget(view.state))

    def kv_budget(self, state, num_pages: int) -> int:
        """The nominal budget at every step (GrowPage's Table 8 reads Zipage-4096 as 4096), however
        few pages the request holds yet and not counting the write page (engine/stats.py)."""
        return self.request_budget(state)

    def on_boundary(self, view: PolicyView) -> Decision:
        budget = self.request_budget(view.state)
        cap = self.pages_cap(budget)
        if view.num_pages < cap:
            return Decision.grow()
        # Hold the pages (one write page stays free); a request somehow above the cap gives back
        # the excess.
        keep = cap if view.num_pages > cap else None
        return Decision.compress(budget, keep_pages=keep, reason=self.boundary_reason,
                                 budget=budget)

    def fallback(self, view: PolicyView) -> Decision | None:
        if not self.fallback_compress:
            return None  # the scheduler preempts another request instead
        target = fallback_target(view.num_pages, view.block_size, self.num_protected)
        if target is None or target >= view.physical_len:
            return None
        return Decision.compress(target, reason="fallback", budget=self.request_budget(view.state))

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        budget = self.request_budget(view.state)
        if not final or view.physical_len <= budget:
            return None
        return Decision.compress(budget, keep_pages=math.ceil(budget / self.block_size),
                                 reason="prefill", budget=budget)


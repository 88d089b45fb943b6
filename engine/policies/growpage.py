"""GrowPage: on-demand KV budgeting by page (paper Sec. 3-4, App. E).

At every capacity boundary (the request's pages are full) GrowPage compares the attention working
sets of two query summaries, a short (beta_S) and a long (beta_L) EMA of the pre-RoPE decode query:

    delta = r_S - r_L,   r_x = mean over (layer, KV head) of K^x / |C|   (Eq. 7-8)

and either grows by one page (delta > tau: demand is widening) or *Compresses & Holds*: it keeps its
pages and compacts to (P - 1) x b occupied slots, so exactly one page of slots is free again
(Eq. 9-10). Capacity only grows (the default policy never returns pages while a request runs).

Defaults: the paper's values are the field defaults; the fields tied to the paper's block of 256
(token counts, the EMA betas) default to None and are resolved from the engine's block size:

| knob                  | paper (b = 256)             | CPU preset (b = 32)         | field              |
|-----------------------|-----------------------------|-----------------------------|--------------------|
| beta_S                | 0.9 (10 tokens)             | 0.9 (10 tokens)             | beta_short         |
| beta_L                | 0.999 (1000 tok = 3.9 pages)| 0.992 (125 tok = 3.9 pages) | beta_long          |
| Top-p coverage p      | 0.99                        | same                        | top_p              |
| demand threshold tau  | 0                           | same                        | tau                |
| demand metric         | Top-p working set           | same                        | metric             |
| protected recent      | 16 tokens                   | 16 tokens                   | protected_recent   |
| local quota k_loc     | 64 (= b / 4)                | 8 (= b / 4)                 | k_loc              |
| initial capacity      | not stated; 9 pages = 2304  | 9 pages = 288               | initial_capacity   |
| maximum capacity      | none                        | none                        | max_capacity       |
| candidate set C       | all but the last 256 slots  | all but the last 32 slots   | (one page, fixed)  |

Initial capacity: the paper does not state it. GrowPage "invokes capacity control only when the
current KV allocation is exhausted" and "does not use these predefined budgets" (Sec. 3.3,
App. F.1): below its initial capacity P0 a request simply receives pages (page allocation, not a
capacity decision); from there on every boundary is a decision. Between two decisions a request
decodes exactly one page (a grow adds an empty page, a Compress & Hold frees one page of slots), so
a request of n pages (prompt + output) whose control starts at P0 pages meets max(0, n - P0)
decisions. Two readings of the paper's tables (Qwen3-8B, AMC23, 1,280 requests, b = 256) bound P0,
and they disagree:
- Table 9 bound. GrowPage-Fixed starts (and stays) at its 16-page cap: 22,285 Compress & Hold =
  sum_i max(0, n_i - 16), 17.41 decisions a request; GrowPage: 9,500 + 21,203 = 30,703 =
  sum_i max(0, n_i - P0), 23.99 a request. IF both runs wrote outputs of equal length, the
  difference 8,418 = sum_i min(max(0, n_i - P0), 16 - P0) <= 1,280 x (16 - P0), so
  P0 <= 16 - 6.58 = 9.42 pages.
- Table 8's implied start. Output tokens = TPS x total time: GrowPage 2,261 x 1.42 h x 3,600 /
  1,280 = 9,030 tokens a request, GrowPage-Fixed 1,874 x 1.59 h x 3,600 / 1,280 = 8,380, so the
  outputs are NOT of equal length (GrowPage's 7.7% longer). In pages, plus about half a page for
  rounding each request up and a prompt of under half a page: n = 35.3 + 0.5 + (0 .. 0.4) =
  35.8 .. 36.2 for GrowPage, P0 ~ n - 23.99 = 11.8 .. 12.2; the same method on Fixed gives
  32.7 + 0.5 + (0 .. 0.4) - 17.41 = 15.8 .. 16.2, recovering its known 16 (the mean-request
  reading ignores requests that end below P0, which would lower the estimate a little).
So the tables pin P0 only to roughly 9 - 12 pages (2,300 - 3,100 tokens). The default is 9 pages
(2,304 tokens at b = 256, 288 at b = 32, 144 at b = 16), the Table 9 bound rounded down, kept as a
page count so every block size has the same number of pages; it is the one start rule of the
project's runs (benchmarks and reference runs use the policy default and choose the block size so
that requests pass it). `kvarena bench mixed --start-sweep 6,9,12` measures how much it matters.
The start is a parameter of its own and is never a fixed baseline's budget (the evals give
`budget` fields the task's budget, never `initial_capacity`).

EMA betas (`preset_betas`, `preset="auto"` by default). beta_L = 0.999 averages over 1 / (1 - beta) = 1000
tokens, 3.9 pages at b = 256; at b = 32 the same beta spans 31 pages, longer than the CPU-scale
requests, so the long summary would barely leave its initial query. The "auto" preset keeps the
long time constant in pages: beta_L = 1 - 1 / (3.90625 x b) (0.999 at b = 256, 0.992 at 32, 0.984
at 16). beta_S keeps its 10-token time constant: scaled by pages it would be 1.25 tokens at b = 32
(beta_S = 0.2) and below one token at b < 26 (no valid beta), i.e. the current query, the Table 2
ablation (beta_S = 0) the paper finds less accurate; it smooths token-level query noise, which does
not shrink with the page. "auto" loses Table 2's point, though: the paper's long/short time-constant
ratio is 100 (1000 / 10 tokens), "auto"'s is 6.25 at b = 16 and 12.5 at b = 32, close to the
(0.9, 0.99) ablation (ratio 10) the paper finds worse. "ratio" keeps the ratio of 100 at every
block size: tau_S = max(1, 10 b / 256) tokens (the short constant in pages, never under one token)
and tau_L = 100 tau_S, i.e. (0, 0.99) at b = 16 (tau_L = 100 tokens = 6.25 pages), (0.2, 0.992) at
b = 32, the paper's pair at b = 256; below b = 26 its short summary is the current query, so no
preset keeps the ratio, the long constant in pages and a smoothed short summary at once at
b = 16. "paper" uses (0.9, 0.999) at any block size (ratio 100, tau_L = 62 pages at b = 16);
"pages" scales both (beta_S = max(0, 1 - 1 / (0.0390625 x b)), ratio 100 where b >= 26, 62.5 at
b = 16). Explicit beta_short/beta_long win over the preset. The betas size the engine's EMA pool,
so they are resolved in `prepare(block_size)`, which the engine calls before it reads `signals()`.

Threshold (`threshold`). The paper grows iff delta > tau with tau = 0. On the embedded CPU model
delta carries a positive offset (results/analysis/README.md: delta > 0 at most decision
boundaries while the future change is positive at about half), so GrowPage grows at nearly every
decision and behaves like FullKV after its start, and Random/Inverse/Fixed cannot be told apart.
threshold="median" is NOT in the paper and is off by default: each decision compares
delta - median(the request's earlier deltas) with tau (the first decision, with no history,
compares delta itself), which removes a constant offset so the ablations can be compared at this
scale. The event records keep the raw delta and add `delta_centred`.

Choices where the paper is silent (each also noted where it is implemented):
- Capacities are counted in allocated slots (pages x b). A request's capacity (the Table 8
  "Avg. KV Budget" reading, `kv_budget`) is its initial capacity until its first decision and the
  pages its decisions left it with afterwards.
- Accounting (Table 9): a boundary below the initial capacity answers a GROW labelled
  action="allocate" (no demand estimate, not a decision); decisions from the initial capacity on are
  labelled "grow" / "compress" / "shrink" and alone enter the grow ratio. Their reason is "demand"
  only when the rule computed delta (GrowPage-Fixed says "fixed", GrowPage-Random "random").
- Fallback (Sec. 4.2, "cannot be safely satisfied"): the scheduler grants a Grow decision only while
  the pool keeps its free-page watermark (EngineConfig.grow_watermark, vLLM's 1%); otherwise it asks
  `fallback`, which answers Compress & Hold. Below-start allocation never falls back (the request
  takes a free page, or the scheduler preempts), as Table 9 implies: GrowPage-Fixed allocates up to
  16 pages under memory pressure (19 preemptions) yet records 0 fallbacks.
- GQA: a KV head's distribution is the mean of its query heads' distributions (demand.py).
- Compress & Hold scores every slot except the protected recent ones (the last
  `protected_recent`), normalising each view's attention over exactly those candidates, so
  a_S and a_L are distributions over the same set before their max is taken (Eq. 9). The demand
  estimate instead uses C = all slots but the most recent page (Eq. 7).
- Block-local quota: "historical blocks" are the request's physical pages at compression time
  (after earlier compactions a page holds a contiguous run of that head's retained tokens); the last
  page's block holds only its unprotected slots. If the quotas alone would exceed the budget (only
  possible when re-admission compresses a long history into few pages), the quota shrinks to
  budget // pages.
- Re-admission: after a preemption the request is re-prefilled; `after_prefill(final=True)`
  compresses it back to the capacity it held (Compress & Hold shape: (P - 1) x b slots in P pages,
  so one page of slots is free), if its history no longer fits those P pages. The capacity lives in
  the per-request state, which the engine keeps across preemption (`on_preempt(state)` marks it).
- Queries: the summaries are calibrated with the most recent decode query and rotated to position
  view.num_computed (the token about to be decoded). A summary that was never initialised (a
  boundary or re-admission before the first decode step of a fresh slot) is taken to be the current
  query, which is exactly the paper's initialisation rule.

Variants (App. H.1) live in growpage_variants.py and differ only in their `CapacityRule`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from engine.config import ConfigError, require_int
from engine.policies.base import (
    Action,
    Decision,
    EngineSpec,
    KVPolicy,
    PolicyView,
    SignalSpec,
    StageTimer,
    pages_for,
    register_policy,
)
from engine.policies.demand import (
    DEMAND_METRICS,
    Demand,
    attention_scale,
    calibrate_rms,
    demand_ratios,
    trend_means,
)

PAPER_BLOCK_SIZE = 256
PAPER_K_LOC = 64
# Not stated by the paper: Table 9 gives P0 <= 9.42 pages if outputs were of equal length, Table 8's
# output lengths imply about 12 (module docstring); 9 pages = 2304 tokens at b = 256.
DEFAULT_INITIAL_PAGES = 9
PAPER_BETA_SHORT = 0.9   # 10-token time constant
PAPER_BETA_LONG = 0.999  # 1000 tokens = 3.90625 pages of 256
PAPER_TIME_RATIO = 100  # tau_L / tau_S = 1000 / 10 tokens (Table 2's default pair)
BETA_PRESETS = ("auto", "paper", "pages", "ratio")
# How delta is compared with tau. "fixed" is the paper's rule (delta > tau). "median" is NOT the
# paper's: the rule reads delta minus the running median of the request's earlier deltas, which
# removes a constant offset of delta (module docstring, "Threshold").
THRESHOLDS = ("fixed", "median")


def preset_betas(preset: str, block_size: int) -> tuple[float, float]:
    """(beta_S, beta_L) of a preset at a block size (module docstring, "EMA betas").

    "paper": (0.9, 0.999). "auto": beta_L keeps the paper's time constant in pages,
    1 - 1 / (pages x b) with pages = 1000 / 256; beta_S stays 0.9. "pages": both time constants in
    pages (beta_S clipped at 0, the current query, where its time constant is under one token).
    "ratio": the long/short time-constant ratio of the paper (100) at every block size, with the
    short constant in pages but never under one token: tau_S = max(1, 10 b / 256) tokens,
    tau_L = 100 tau_S ((0, 0.99) at b = 16, (0.2, 0.992) at 32, the paper's at 256).
    """
    if preset not in BETA_PRESETS:
        raise ConfigError(f"growpage: unknown preset {preset!r}; valid: {list(BETA_PRESETS)}")
    if preset == "paper" or block_size == PAPER_BLOCK_SIZE:
        return PAPER_BETA_SHORT, PAPER_BETA_LONG

    def from_tokens(tokens: float) -> float:
        return max(0.0, round(1.0 - 1.0 / tokens, 12))

    def in_pages(beta: float) -> float:
        return from_tokens(1.0 / (1.0 - beta) / PAPER_BLOCK_SIZE * block_size)

    if preset == "ratio":
        short_tokens = max(1.0, 1.0 / (1.0 - PAPER_BETA_SHORT) / PAPER_BLOCK_SIZE * block_size)
        return from_tokens(short_tokens), from_tokens(PAPER_TIME_RATIO * short_tokens)
    short = in_pages(PAPER_BETA_SHORT) if preset == "pages" else PAPER_BETA_SHORT
    return short, in_pages(PAPER_BETA_LONG)


def time_constants(betas: tuple[float, float]) -> tuple[float, float]:
    """(tau_S, tau_L) in tokens, 1 / (1 - beta): the span each summary averages over."""
    return tuple(1.0 / (1.0 - b) for b in betas)


# -- Compress & Hold selection (pure) ---------------------------------------------------------


def local_global_keep(
    scores: torch.Tensor, budget: int, block_size: int, k_loc: int
) -> torch.Tensor:
    """Eq. 10: per row, the top-k_loc of every block, then the global top scores up to `budget`.

    scores: [layers, kv_heads, c] finite scores of the candidate slots 0..c-1 (block j = slots
        j*b .. (j+1)*b - 1; the last block may be partial).
    budget: slots to keep per row, 0 <= budget <= c.
    Returns a bool mask [layers, kv_heads, c] with exactly `budget` True in every row.
    If the blocks' quotas add up to more than the budget, the quota becomes budget // blocks.
    """
    layers, heads, c = scores.shape
    if not 0 <= budget <= c:
        raise ValueError(f"budget {budget} must be within [0, {c}] candidates")
    keep = torch.zeros(layers, heads, c, dtype=torch.bool, device=scores.device)
    if budget == 0:
        return keep
    blocks = -(-c // block_size)
    sizes = [min(block_size, c - j * block_size) for j in range(blocks)]
    quota = min(k_loc, block_size)
    if sum(min(quota, s) for s in sizes) > budget:
        quota = budget // blocks
    num_local = sum(min(quota, s) for s in sizes)
    if quota > 0:
        padded = scores.new_full((layers, heads, blocks * block_size), float("-inf"))
        padded[..., :c] = scores
        vals, idx = padded.view(layers, heads, blocks, block_size).topk(quota, dim=-1)
        idx = idx + torch.arange(blocks, device=scores.device).view(1, 1, -1, 1) * block_size
        local = torch.zeros(layers, heads, blocks * block_size, dtype=torch.bool,
                            device=scores.device)
        # Padding slots of a short last block carry -inf and must not count as kept.
        local.scatter_(-1, idx.flatten(2), torch.isfinite(vals).flatten(2))
        keep |= local[..., :c]
    rest = budget - num_local
    if rest > 0:
        remaining = scores.masked_fill(keep, float("-inf"))
        keep.scatter_(-1, remaining.topk(rest, dim=-1).indices, True)
    return keep


def keep_to_slots(keep: torch.Tensor, num_protected: int) -> torch.Tensor:
    """Append the protected recent slots to a candidate keep-mask and list the kept slot indices.

    keep: [layers, kv_heads, c] bool, the same count in every row; the protected slots are
    c .. c + num_protected - 1. Returns [layers, kv_heads, count + num_protected] int64, ascending.
    """
    layers, heads, _ = keep.shape
    full = torch.cat([keep, keep.new_ones(layers, heads, num_protected)], dim=-1)
    count = int(full[0, 0].sum()) if layers and heads else 0
    return full.nonzero()[:, -1].reshape(layers, heads, count)


# -- capacity rules ---------------------------------------------------------------------------


class CapacityRule(Protocol):
    """Maps the demand trend at a boundary to an action (before capacity limits are applied).

    needs_demand: the rule reads delta (the policy estimates it only then).
    reason: the decision's label in its event record ("demand" only when delta was estimated).
    """

    needs_demand: bool
    reason: str

    def decide(self, delta: float | None) -> Action: ...


@dataclass(frozen=True)
class TrendRule:
    """GrowPage: grow by one page iff delta > tau, else Compress & Hold (Sec. 3.2)."""

    tau: float
    needs_demand: ClassVar[bool] = True
    reason: ClassVar[str] = "demand"

    def decide(self, delta: float | None) -> Action:
        return Action.GROW if delta > self.tau else Action.COMPRESS


# -- policy -----------------------------------------------------------------------------------


@dataclass
class GrowPageState:
    """Per-request capacity-control state.

    active: capacity control has started (the allocation reached the initial capacity); before
        that, boundaries are page allocation, not decisions.
    capacity_pages: pages granted by the latest decision; what a re-admission is compressed back to.
    preempted: set by `on_preempt`, cleared when the re-admitted request is compressed back.
    last_demand: the latest demand numbers, attached to a fallback's event record.
    deltas: every delta this request's decisions computed, oldest first (threshold="median").
    prepared: its next decision's demand, computed with the step's other boundaries.
    """

    active: bool = False
    capacity_pages: int = 0
    preempted: bool = False
    last_demand: dict = field(default_factory=dict)
    deltas: list = field(default_factory=list)
    # (physical_len, num_computed, Demand) from `prepare_boundaries`: used by the next boundary
    # decision when the request is still where it was
    prepared: tuple | None = None


@register_policy
@dataclass
class GrowPage(KVPolicy):
    """GrowPage with the paper's defaults (see the module docstring for the CPU preset).

    beta_short, beta_long: EMA decays of the short/long query summaries, 0 <= beta_S < beta_L < 1
        (beta_S = 0 makes the short summary the current query, a Table 2 ablation); None = the
        preset's value at the engine's block size.
    preset: "auto" | "paper" | "pages" (module docstring, "EMA betas"); fills the betas left None.
    top_p: coverage p of the working set K (Eq. 7).
    tau: demand threshold; GROW iff delta > tau (App. D.1 sweeps -0.003..0.003).
    threshold: "fixed" (the paper: delta is compared with tau as it is) or "median" (NOT the
        paper's rule, off by default: the rule reads delta minus the running median of the
        request's earlier deltas, removing a constant offset; module docstring, "Threshold").
    metric: "top_p" (K / |C|) or "entropy" (exp(H) / |C|, the Table 2 ablation).
    k_loc: block-local retention quota per page; None = b / 4 (64 at b = 256, App. D.2).
    protected_recent: most recent slots never evicted by a compaction.
    initial_capacity: tokens (a multiple of b) where capacity control starts; below it a boundary
        allocates a page without a decision. None = 9 pages (the paper does not state it; module
        docstring). Never a fixed baseline's budget.
    max_capacity: tokens (a multiple of b) a request never grows past; None = unbounded.
    layer_chunk: layers scored per pass (bounds the temporaries: a gathered copy of the keys
        where the backend gathers, the [layers, heads, n] probabilities); None: as many as
        keep them under LAYER_CHUNK_BYTES at the engine's maximum length (all 30 of SmolLM2's
        at 8k; 7 of an 8B model's with 8 KV heads of 128 and 32 query heads at 32k).
    """

    name = "growpage"
    has_budget = True
    # Decisions only at boundaries, from the recent query and the EMA summaries, which a forced
    # run updates row by row (engine/query_state.py).
    chunked_forcing = True

    beta_short: float | None = None
    beta_long: float | None = None
    preset: str = "auto"
    top_p: float = 0.99
    tau: float = 0.0
    threshold: str = "fixed"
    metric: str = "top_p"
    k_loc: int | None = None
    protected_recent: int = 16
    initial_capacity: int | None = None
    max_capacity: int | None = None
    layer_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.preset not in BETA_PRESETS:
            raise ConfigError(f"{self.name}: unknown preset {self.preset!r}; "
                              f"valid: {list(BETA_PRESETS)}")
        self._beta_block: int | None = None
        for key in ("beta_short", "beta_long"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{self.name}: {key} must be in [0, 1), got {value}")
        if self.beta_short is not None and self.beta_long is not None:
            self._check_betas(self.beta_short, self.beta_long)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{self.name}: top_p must be in (0, 1], got {self.top_p}")
        if self.threshold not in THRESHOLDS:
            raise ConfigError(f"{self.name}: unknown threshold {self.threshold!r}; "
                              f"valid: {list(THRESHOLDS)}")
        if self.metric not in DEMAND_METRICS:
            raise ConfigError(
                f"{self.name}: unknown metric {self.metric!r}; valid: {sorted(DEMAND_METRICS)}"
            )
        if not -1.0 <= self.tau <= 1.0:
            raise ConfigError(f"{self.name}: tau compares ratio differences, need |tau| <= 1, "
                              f"got {self.tau}")
        require_int(f"{self.name}: k_loc", self.k_loc, 0, optional=True)
        require_int(f"{self.name}: protected_recent", self.protected_recent, 0)
        require_int(f"{self.name}: initial_capacity", self.initial_capacity, 1, optional=True)
        require_int(f"{self.name}: max_capacity", self.max_capacity, 1, optional=True)
        require_int(f"{self.name}: layer_chunk", self.layer_chunk, 1, optional=True)
        if (self.initial_capacity is not None and self.max_capacity is not None
                and self.max_capacity < self.initial_capacity):
            raise ConfigError(
                f"{self.name}: max_capacity {self.max_capacity} is below initial_capacity "
                f"{self.initial_capacity}"
            )

    # -- binding and resolved knobs -----------------------------------------------------------

    def _check_betas(self, short: float, long: float) -> None:
        if not 0.0 <= short < long < 1.0:
            raise ConfigError(
                f"{self.name}: need 0 <= beta_short < beta_long < 1, got beta_short={short}, "
                f"beta_long={long} (preset {self.preset!r} fills the ones left None)")

    def prepare(self, block_size: int) -> None:
        """Resolve the EMA betas for the engine's block size (they size the engine's EMA pool)."""
        if self._beta_block is not None and self._beta_block != block_size:
            raise ConfigError(f"{self.name}: betas were resolved for block_size "
                              f"{self._beta_block}, the engine uses {block_size}")
        short, long = preset_betas(self.preset, block_size)
        short = short if self.beta_short is None else self.beta_short
        long = long if self.beta_long is None else self.beta_long
        self._check_betas(short, long)
        self.betas = (short, long)
        self._beta_block = block_size

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        b = engine.block_size
        self.prepare(b)
        if engine.num_q_heads % engine.num_kv_heads:
            raise ConfigError(f"{self.name}: q_heads {engine.num_q_heads} is not a multiple of "
                              f"kv_heads {engine.num_kv_heads}")
        if self.protected_recent >= b:
            raise ConfigError(f"{self.name}: protected_recent {self.protected_recent} must be "
                              f"below block_size {b} so a compaction has history to select")
        self.k_loc_slots = b * PAPER_K_LOC // PAPER_BLOCK_SIZE if self.k_loc is None else self.k_loc
        if self.k_loc_slots > b:
            raise ConfigError(f"{self.name}: k_loc {self.k_loc} exceeds block_size {b}")
        self.initial_pages = self._pages("initial_capacity", self.initial_capacity,
                                         DEFAULT_INITIAL_PAGES)
        if self.initial_pages < 2:
            raise ConfigError(f"{self.name}: initial_capacity must be at least 2 pages "
                              f"({2 * b} tokens) so Compress & Hold keeps a page of history")
        self.growth_cap_pages = self._pages("max_capacity", self.max_capacity, None)
        self.min_pages: int | None = None  # only GrowPage-Shrink returns pages
        self.chunk_layers = self.layer_chunk or _chunk_layers(engine)
        self.rule: CapacityRule = self.make_rule()

    def _pages(self, knob: str, tokens: int | None, default_pages: int | None) -> int | None:
        """A token-count knob as whole pages; None -> default_pages (paper pages, any block)."""
        b = self.block_size
        if tokens is None:
            return default_pages
        if tokens % b:
            raise ConfigError(f"{self.name}: {knob}={tokens} must be a multiple of block_size {b}")
        return tokens // b

    def make_rule(self) -> CapacityRule:
        return TrendRule(self.tau)

    def effective_params(self) -> dict:
        """The knobs after block-size scaling (for result directories and reports)."""
        b = self.block_size
        return {
            "block_size": b, "preset": self.preset, "beta_short": self.betas[0],
            "beta_long": self.betas[1],
            "top_p": self.top_p, "tau": self.tau, "threshold": self.threshold,
            "metric": self.metric,
            "k_loc": self.k_loc_slots, "protected_recent": self.protected_recent,
            "initial_capacity": self.initial_pages * b,
            "max_capacity": None if self.growth_cap_pages is None else self.growth_cap_pages * b,
        }

    def signals(self) -> SignalSpec:
        if self._beta_block is None:
            raise RuntimeError(f"{self.name}: signals() needs the betas, resolved by "
                               "prepare(block_size) (the engine calls it first)")
        return SignalSpec(recent_queries=1, ema_betas=self.betas)

    def new_state(self) -> GrowPageState:
        return GrowPageState()

    def max_pages(self, view: PolicyView) -> int | None:
        cap = self.growth_cap_pages
        if cap is None or view.is_prefilling:
            return None
        # A prompt longer than the cap keeps its pages; Compress & Hold never returns them.
        return max(cap, pages_for(view.num_prompt_tokens, self.block_size))

    # -- decisions ----------------------------------------------------------------------------

    def kv_budget(self, state: GrowPageState, num_pages: int) -> int:
        """The request's capacity in slots at a decode step (Table 8's reading, stats.py): the
        initial capacity until its first decision, then the pages its decisions left it with."""
        pages = num_pages if state.active else max(self.initial_pages, num_pages)
        return pages * self.block_size

    def on_boundary(self, view: PolicyView) -> Decision:
        state = _state(view)
        state.last_demand = {}
        pages = view.num_pages
        if self._below_start(state, pages):
            state.capacity_pages = pages + 1
            return Decision.grow(action="allocate", reason="below_initial")
        state.active = True
        info: dict = {"reason": self.rule.reason}
        delta = None
        if self.rule.needs_demand:
            demand = self._prepared(view, state) or self.demand(view)
            state.last_demand = demand.info()
            delta = demand.delta - self._offset(state)
            state.deltas.append(demand.delta)
            if self.threshold != "fixed":
                state.last_demand["delta_centred"] = delta
            info.update(state.last_demand)
        action = self.rule.decide(delta)
        if action is Action.GROW and self.growth_cap_pages is not None \
                and pages + 1 > self.growth_cap_pages:
            action, info["reason"] = Action.COMPRESS, "at_max"
        if action is Action.SHRINK and (self.min_pages is None or pages - 1 < self.min_pages):
            action, info["reason"] = Action.COMPRESS, "at_min"
        if action is Action.GROW:
            return self._grow(state, pages, info)
        if action is Action.SHRINK:
            return self._shrink(state, pages, info)
        return self._hold(state, pages, info)

    def _below_start(self, state: GrowPageState, pages: int) -> bool:
        """A boundary below the initial capacity before any decision: page allocation."""
        return not state.active and pages < self.initial_pages

    def _offset(self, state: GrowPageState) -> float:
        """What the rule subtracts from delta: 0 ("fixed"), or the median of the request's
        earlier deltas ("median"; 0 at its first decision, which has none)."""
        if self.threshold == "fixed" or not state.deltas:
            return 0.0
        return float(statistics.median(state.deltas))

    def fallback(self, view: PolicyView) -> Decision | None:
        """A Grow decision could not be safely satisfied (the pool is at its free-page watermark):
        Compress & Hold instead (Sec. 4.2). None for below-start allocation (not a decision: the
        scheduler takes a free page or preempts) and for a single page (no history page to
        compact into)."""
        state = _state(view)
        if not state.active or view.num_pages < 2:
            return None
        return self._hold(state, view.num_pages, {**state.last_demand, "reason": "fallback"})

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        """Compress a re-admitted (preempted, re-prefilled) request back to its capacity."""
        if not final:
            return None
        state = _state(view)
        pages = state.capacity_pages
        if not state.preempted or pages == 0:
            # A fresh request (or one preempted during its first prefill): its prompt pages are
            # its capacity; the decode boundaries take it from here.
            state.preempted = False
            state.capacity_pages = view.num_pages
            return None
        state.preempted = False
        b = self.block_size
        if view.physical_len <= pages * b:
            state.capacity_pages = max(pages, view.num_pages)
            return None
        pages = max(pages, 2)
        state.capacity_pages = pages
        return Decision.compress((pages - 1) * b, keep_pages=pages, action="compress",
                                 reason="readmission", capacity=pages * b)

    def on_preempt(self, state: GrowPageState) -> None:
        """The request lost its KV and will be re-prefilled; `capacity_pages` (kept up to date by
        every decision) is what `after_prefill` restores."""
        if not isinstance(state, GrowPageState):
            raise RuntimeError(f"GrowPage got {type(state).__name__} state at preemption")
        state.preempted = True
        state.prepared = None  # its summaries restart with the re-prefilled request

    def _grow(self, state: GrowPageState, pages: int, info: dict) -> Decision:
        state.capacity_pages = pages + 1
        return Decision.grow(**info, action="grow")

    def _hold(self, state: GrowPageState, pages: int, info: dict) -> Decision:
        """Compress & Hold: keep the P pages, compact to (P - 1) x b slots."""
        state.capacity_pages = pages
        return Decision.compress((pages - 1) * self.block_size, **info, action="compress")

    def _shrink(self, state: GrowPageState, pages: int, info: dict) -> Decision:
        """Compact two pages' worth of history and return one page: (P - 2) x b slots in P - 1
        pages, so one page of slots stays free (App. H.1)."""
        state.capacity_pages = pages - 1
        return Decision.shrink((pages - 2) * self.block_size, keep_pages=pages - 1, **info,
                               action="shrink")

    # -- demand estimate and selection --------------------------------------------------------

    def summary_queries(self, view: PolicyView) -> torch.Tensor:
        """Calibrated, rotated short/long summaries: [layers, 2, q_heads, head_dim] float32."""
        return self._summaries([view])[0]

    def _summaries(self, views: list[PolicyView]) -> list[torch.Tensor]:
        """summary_queries of several requests: one calibration and one rotation for all (the
        same values as one request at a time: both act per layer, summary and head)."""
        raw, current = [], []
        for view in views:
            recent, _ = view.recent_queries(rope=False)
            if recent.shape[1] == 0:
                raise RuntimeError(
                    f"{self.name}: the engine provided no recent query for sequence "
                    f"{view.seq_id}; recent_queries must hold the last decode (or last prefill) "
                    "query")
            q = recent[:, -1].float()
            ema, ready = view.query_ema()
            raw.append(ema.float() if ready else q.unsqueeze(1).expand(-1, 2, -1, -1))
            current.append(q)
        layers, _, heads, dim = raw[0].shape
        # [V * layers, 2, heads, dim] against [V * layers, heads, dim]: per (request, layer) rows
        calibrated = calibrate_rms(torch.stack(raw).flatten(0, 1), torch.stack(current).flatten(0, 1))
        # [layers, 2V, heads, dim], request i's two summaries rotated at its own position
        by_layer = calibrated.view(len(views), layers, 2, heads, dim).transpose(0, 1)
        positions = torch.cat([torch.full((2,), view.num_computed, dtype=torch.long,
                                          device=calibrated.device) for view in views])
        rotated = views[0].apply_rope(by_layer.reshape(layers, 2 * len(views), heads, dim),
                                      positions).float()
        return [rotated[:, 2 * i:2 * i + 2] for i in range(len(views))]

    def demand(self, view: PolicyView, exclude: int | None = None) -> Demand:
        """The demand trend over C = all physical slots but the most recent `exclude` (None: one
        page, Eq. 7-8; the demand study sets it in tokens, as the paper's 256)."""
        candidates = view.physical_len - (self.block_size if exclude is None else exclude)
        if candidates <= 0:
            return Demand(0.0, 0.0, 0)
        r_short, r_long = _to_host(self._trends([view], [candidates]))[0]
        return Demand(r_short, r_long, candidates)

    def _trends(self, views: list[PolicyView], candidates: list[int]) -> list[torch.Tensor]:
        """(r_S, r_L) of each request over its first `candidates` slots, where the keys lie:
        float64 [2] each. The requests' summaries and metrics are formed together (one call
        each for all of them), their attention request by request over its own pages."""
        chunks = [self._summary_probs(view, c, q)
                  for view, c, q in zip(views, candidates, self._summaries(views))]
        parts: list[list[torch.Tensor]] = [[] for _ in views]
        for probs in zip(*chunks):  # one chunk of layers of every request
            for part, ratios in zip(parts, demand_ratios(list(probs), self.metric, self.top_p)):
                part.append(ratios)
        return [trend_means(torch.cat(part)) for part in parts]

    def prepare_boundaries(self, views: list[PolicyView]) -> None:
        """The demand of every request whose boundary will be a decision this step, computed
        request by request on the device and brought to the host at once (KVPolicy's
        docstring); each is used by the request's `on_boundary` if its KV has not changed."""
        if not self.rule.needs_demand:
            return
        pending = []
        for view in views:
            state = _state(view)
            candidates = view.physical_len - self.block_size
            if candidates <= 0 or self._below_start(state, view.num_pages):
                continue  # no demand to compute, or an allocation below the start
            pending.append((view, state, candidates))
        if not pending:
            return
        trends = self._trends([view for view, *_ in pending], [c for *_, c in pending])
        for (view, state, candidates), (r_short, r_long) in zip(pending, _to_host(trends)):
            state.prepared = (view.physical_len, view.num_computed,
                              Demand(r_short, r_long, candidates))

    @staticmethod
    def _prepared(view: PolicyView, state: GrowPageState) -> Demand | None:
        """The demand `prepare_boundaries` computed for this request, if it still stands where
        it stood then (taken once)."""
        prepared, state.prepared = state.prepared, None
        if prepared is None or prepared[:2] != (view.physical_len, view.num_computed):
            return None
        return prepared[2]

    def _summary_probs(self, view: PolicyView, candidates: int,
                       queries: torch.Tensor | None = None):
        """Per chunk of layers, the summaries' attention over slots [0, candidates), one
        distribution per KV head (demand.group_attention_probs' contract, computed by the engine
        where the keys lie): [layers', 2 (SHORT, LONG), kv_heads, candidates]. queries: the
        view's summary_queries, if already formed."""
        queries = self.summary_queries(view) if queries is None else queries
        scale = attention_scale(queries.shape[-1])
        for lo, hi in self._layer_chunks(queries.shape[0]):
            yield view.query_probs(queries[lo:hi], slice(lo, hi), candidates, scale,
                                   group_mean=True).transpose(1, 2)

    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor:
        """Compress & Hold selection (Eq. 9-10): [layers, kv_heads, target_len] kept slots."""
        n = view.physical_len
        if not 0 < target_len <= n:
            raise ValueError(f"{self.name}: target_len {target_len} must be within [1, {n}]")
        protected = min(self.protected_recent, target_len)
        candidates = n - protected
        with timer.stage("score"):
            # s = max(a_S, a_L)
            scores = torch.cat([probs.amax(dim=1)
                                for probs in self._summary_probs(view, candidates)])
        with timer.stage("topk"):
            keep = local_global_keep(scores, target_len - protected, self.block_size,
                                     self.k_loc_slots)
        with timer.stage("window_mask"):
            return keep_to_slots(keep, protected)

    def _layer_chunks(self, layers: int) -> list[tuple[int, int]]:
        step = self.chunk_layers
        return [(lo, min(lo + step, layers)) for lo in range(0, layers, step)]


# What one pass of the demand estimate or the scores may hold in temporaries (untuned).
LAYER_CHUNK_BYTES = 1 << 30


def _chunk_layers(engine: EngineSpec) -> int:
    """Layers per pass (`layer_chunk` None): per layer at the engine's maximum length, a float32
    copy of the keys (kv_heads x length x head_dim) and the two views' logits and probabilities
    per query head (2 x 2 x q_heads x length)."""
    length = engine.max_model_len
    per_layer = 4 * length * (engine.num_kv_heads * engine.head_dim + 4 * engine.num_q_heads)
    return max(1, min(engine.num_layers, LAYER_CHUNK_BYTES // per_layer))


def _state(view: PolicyView) -> GrowPageState:
    if not isinstance(view.state, GrowPageState):
        raise RuntimeError(
            f"sequence {view.seq_id} carries {type(view.state).__name__} state; GrowPage needs the "
            "GrowPageState from its new_state()"
        )
    return view.state


def _to_host(trends: list[torch.Tensor]) -> list[list[float]]:
    """Float64 [2] tensors, on the device, as Python pairs: one transfer (one wait for the
    device) for all of them."""
    return torch.stack(trends).tolist()

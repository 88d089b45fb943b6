"""The contract between the scheduler and a KV policy.

The scheduler owns queues, pages and timing; a policy owns only decisions and token selection. It
never sees the queues: it receives a `PolicyView` of one sequence (lengths, pages, and accessors for
the signals it declared) and answers with a `Decision`.

When the scheduler asks:
- `on_boundary(view)`: a decode step finds the sequence's pages full (physical_len equals
  num_pages * block_size). Answer GROW (one more page), COMPRESS (compact to `target_len` inside the
  current pages) or SHRINK (compact and return pages).
- `fallback(view)`: a GROW found no free page. Answer a compression, or None to let the scheduler
  preempt.
- `on_admit(state, num_prompt_tokens, kv_budget)`: once, when a request is added (a fixed-budget
  policy resolves the request's own budget: `SamplingParams.kv_budget` or `budget_ratio`).
- `after_prefill(view, final)`: after each prefill chunk (final=True after the last one). Prompt
  compression (SnapKV/ChunkKV/Kara) and re-compression of a re-admitted (preempted) request live here
  (the per-request state survives preemption; `on_preempt(state)` is called at each preemption).
- `periodic(step, views)`: once per scheduler step, for schedules that are not boundary-triggered
  (KvLLM's periodic policy). Returns (view, decision) pairs.
- `kv_budget(state, num_pages)`: after every decode step (the request's budget, engine/stats.py).
- `select(view, target_len, timer)`: for a COMPRESS/SHRINK decision, the physical slots each
  (layer, KV head) keeps: `[layers, kv_heads, target_len]` int64, ascending in every row, all rows
  the same count (Compressed PagedAttention: one block table and one physical length per sequence).
  The engine then compacts those slots, in order, to the front of the sequence's target pages.
  A policy with per-(layer, head) budgets (PyramidKV, AdaKV) returns a `HeadKeep` instead: rows of
  unequal counts, at most `target_len`; the pages are then sized by the largest count and each
  head's unused tail is a masked hole (docs/architecture.md, "Per-head budgets").
  Contract: `select` runs before any new KV is written for that sequence (a sequence being
  compacted is not scheduled), so the view's lengths are those the decision was made on.

Forced runs (`chunked_forcing`): a policy that decides only at capacity boundaries may let the
scheduler run a request's teacher-forced tokens up to its next page boundary as one step. Its
hooks are then called exactly as token by token (the same boundaries, the same `kv_budget` calls),
its recent queries and EMA summaries hold what the tokens' decode steps would have left, and only
`periodic` sees fewer steps; a policy with a periodic schedule or per-step state leaves it False.

Signals: a policy declares what it reads in `signals()`; the engine keeps them in preallocated slot
pools bound to running requests (never allocated per step) and exposes them through the view.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Protocol

import torch

from engine.config import ConfigError, unknown_name


class Action(enum.Enum):
    GROW = "grow"
    COMPRESS = "compress"
    SHRINK = "shrink"


@dataclass(frozen=True)
class Decision:
    """A policy's answer.

    target_len: physical length after compaction (COMPRESS/SHRINK).
    keep_pages: pages the sequence keeps afterwards. None means: COMPRESS holds its current pages
        (GrowPage's Compress & Hold, Zipage), SHRINK keeps ceil(target_len / block_size).
    info: free-form accounting (e.g. GrowPage's delta, r_S, r_L) copied into the event record.
    """

    action: Action
    target_len: int | None = None
    keep_pages: int | None = None
    info: dict = field(default_factory=dict)

    @staticmethod
    def grow(**info: Any) -> "Decision":
        return Decision(Action.GROW, info=info)

    @staticmethod
    def compress(target_len: int, keep_pages: int | None = None, **info: Any) -> "Decision":
        return Decision(Action.COMPRESS, target_len, keep_pages, info)

    @staticmethod
    def shrink(target_len: int, keep_pages: int | None = None, **info: Any) -> "Decision":
        return Decision(Action.SHRINK, target_len, keep_pages, info)


@dataclass(frozen=True)
class HeadKeep:
    """A selection with per-(layer, KV head) counts (per-layer / per-head budgets).

    slots:  `[layers, kv_heads, K]` int64, K = the decision's target_len. Row (l, h) lists the
            physical slots head h of layer l keeps in its first `counts[l, h]` entries, strictly
            ascending; the entries after them are ignored.
    counts: `[layers, kv_heads]` int64, 0 <= counts <= K. The sequence's physical length becomes
            max(counts); head (l, h) then holds a hole of max(counts) - counts[l, h] slots.
    All counts equal to K is exactly the plain `[layers, kv_heads, K]` selection.
    """

    slots: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class SignalSpec:
    """What a policy reads; the engine sizes its slot pools from this.

    recent_queries: keep the last n pre-RoPE queries of every layer (all query heads), per request.
    ema_betas: keep one EMA of the pre-RoPE decode query per beta (GrowPage: (0.9, 0.999)).
    slot_scores: keep one float per KV slot and head (Zipage's decayed global score); compacted with
        the KV.
    """

    recent_queries: int = 0
    ema_betas: tuple[float, ...] = ()
    slot_scores: bool = False

    def merge(self, other: "SignalSpec") -> "SignalSpec":
        return SignalSpec(
            max(self.recent_queries, other.recent_queries),
            self.ema_betas or other.ema_betas,
            self.slot_scores or other.slot_scores,
        )


@dataclass(frozen=True)
class EngineSpec:
    """Engine facts a policy validates against when bound."""

    block_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    max_model_len: int

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


class PolicyView(Protocol):
    """Read access to one sequence and its signals (implemented by the engine)."""

    seq_id: int
    logical_len: int       # tokens that exist (prompt + output)
    num_computed: int      # logical tokens whose KV was produced (position of the next token)
    physical_len: int      # occupied KV slots
    num_pages: int
    block_size: int
    num_prompt_tokens: int
    state: Any             # the policy's per-request state (from new_state)
    is_prefilling: bool
    fused_reduce: bool     # query_probs reduces as it computes: a call holds only its output

    def keys(self, layers: slice | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Keys of physical slots [start, end) (default: all, 0..physical_len-1):
        [layers, kv_heads, end - start, head_dim]."""

    def values(self, layers: slice | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Values, same layout as keys()."""

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys of per-(layer, KV head) physical slots, read from the pages in one gather:
        slots int64 [layers, kv_heads, n], each in [0, physical_len) -> [layers, kv_heads, n,
        head_dim] (entry [l, h, i] is head h of layer l at slot slots[l, h, i])."""

    def query_probs(self, queries: torch.Tensor, layers: slice | None = None,
                    length: int | None = None, scale: float | None = None,
                    group_mean: bool = False, key_limit: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None,
                    query_reduce: str = "none") -> torch.Tensor:
        """Softmax attention of queries [layers, n, q_heads, head_dim] (post-RoPE; `layers` of
        the model's) over the keys of physical slots [0, length) (default: all), computed in
        float32 where the keys lie: [layers, q_heads, n, length], or with group_mean [layers,
        kv_heads, n, length] (each GQA group's mean). scale None: head_dim ** -0.5.
        key_limit: [n] int, query i sees columns j < key_limit[i] (None: all). slots: instead of
        a length, a per-head layout [layers, kv_heads, width] of physical slots (< 0: hidden),
        as attention_scores.paged_query_probs' `slots`. query_reduce "sum" or "mean": the n
        axis reduced, [layers, q_heads or kv_heads, length]."""

    def key_redundancy(self, threshold: float = 0.5, temperature: float = 1.0,
                       spare_first: bool = False, block: int | None = None) -> torch.Tensor:
        """R-KV's redundancy of every physical slot's key over all pairs, or over the pairs inside
        each run of `block` slots (engine/kernels/redundancy.py: key_redundancy's definition),
        computed where the keys lie: [layers, kv_heads, physical_len] float32."""

    def recent_queries(self, rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n queries (n = min(signals().recent_queries, available)), oldest first.

        Returns (queries [layers, n, q_heads, head_dim] (RoPE applied at their own positions when
        rope=True), positions [n] logical positions).
        """

    def query_ema(self) -> tuple[torch.Tensor, bool]:
        """(ema [layers, len(ema_betas), q_heads, head_dim] pre-RoPE, initialised?)."""

    def apply_rope(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE at given positions. q: [..., n, q_heads, head_dim], positions: [n]."""

    def slot_scores(self) -> torch.Tensor:
        """The persistent per-slot score: [layers, kv_heads, physical_len] (a copy). Slots written
        since the policy last called set_slot_scores hold stale values from the page's previous
        owner: a policy tracks which prefix it has scored."""

    def set_slot_scores(self, scores: torch.Tensor) -> None:
        """Write [layers, kv_heads, physical_len] scores back to the sequence's slots."""

    def head_lens(self) -> tuple[torch.Tensor, int] | None:
        """None when every (layer, KV head) holds all physical slots; after a compaction with
        per-head counts (`HeadKeep`), (counts [layers, kv_heads] int64, compacted_len): head
        (l, h) holds slots [0, counts[l, h]) and [compacted_len, physical_len), and the slots
        between are a hole whose keys and values are stale (never keep them)."""

    def recompute_queries(self, start: int, end: int) -> torch.Tensor:
        """Post-RoPE queries of the tokens in physical slots [start, end), recomputed by a forward
        pass that reads the cached KV and writes none. The slots must be uncompressed (slot s holds
        logical position num_computed - physical_len + s). Returns [layers, end-start, q_heads, d].
        """

    def recompute_queries_batch(self, spans: list[tuple[PolicyView, int, int]]) -> list[torch.Tensor]:
        """`recompute_queries` for several requests of this view's engine, (view, start, end) each
        (one span per request), in one forward pass that reads every weight once for all of their
        rows: [layers, end - start, q_heads, d] each, in order."""


class StageTimer:
    """Accumulates wall time per named stage (score, window_mask, topk, compaction, demand...)."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - start


@dataclass
class KVPolicy:
    """Base class of every policy. Subclasses are dataclasses whose fields are the paper's knobs
    (paper defaults or the documented CPU-scale preset), validated in __post_init__ / bind()."""

    name: ClassVar[str] = ""
    # False for a policy that never compacts (FullKV): its GROWs are plain page allocation, so
    # the scheduler records no capacity event for them (engine/scheduler.py).
    compresses: ClassVar[bool] = True
    # True for a policy with a nominal KV budget per request (`kv_budget` returns it: a fixed
    # budget, GrowPage's capacity); False where it has none (FullKV, prompt-only and retention
    # policies), whose budget column stays blank in tables (evals/leaderboard.py).
    has_budget: ClassVar[bool] = False
    # True for a policy that acts only at capacity boundaries (`on_boundary`, `fallback`,
    # `select`), or whose `periodic` can say when it next acts on a request
    # (`forced_run_limit`), and that keeps no state that must see every decode step: the
    # scheduler may then run a request's forced tokens up to its next page boundary (or that
    # limit) as one chunk (teacher forcing at prefill speed, engine/scheduler.py). False (the
    # default) runs every forced token as its own decode step.
    chunked_forcing: ClassVar[bool] = False
    engine: EngineSpec | None = field(default=None, init=False, repr=False, compare=False)

    def prepare(self, block_size: int) -> None:
        """Called by the engine with its block size before it reads `signals()` (GrowPage resolves
        its block-size-dependent EMA betas here); `bind` follows."""

    def bind(self, engine: EngineSpec) -> None:
        """Called once by the engine; validate against block size and model shape here."""
        self.engine = engine

    def signals(self) -> SignalSpec:
        return SignalSpec()

    def new_state(self) -> Any:
        """Per-request state, created once when the request is added. It survives preemption (so a
        policy can remember the capacity a request had); `on_preempt` is called at each one."""
        return None

    def on_admit(self, state: Any, num_prompt_tokens: int, kv_budget: int | None) -> None:
        """Called once when a request is added, after `new_state`: `kv_budget` is the request's own
        budget (`SamplingParams.kv_budget`, tokens) or None. A fixed-budget policy resolves the
        request's budget here (fixed_budget.py); the others take none. Raise ConfigError for a
        budget that cannot be met: the request is refused before anything runs."""
        if kv_budget is not None:
            raise ConfigError(f"policy {self.name!r} takes no per-request KV budget "
                              f"(got kv_budget={kv_budget}); use a fixed-budget policy")

    def on_preempt(self, state: Any) -> None:
        """The request lost all its KV and will be re-prefilled (prompt + generated tokens); reset
        whatever in `state` refers to physical slots (e.g. a compressed-region boundary)."""

    def prepare_boundaries(self, views: list[PolicyView]) -> None:
        """Called once per step, before `on_boundary`, with every decoding request that stands
        at a full boundary (the scheduler then asks them one by one). A policy whose boundary
        decision reads device results can compute them for all of them here and bring them to
        the host together: one wait for the device per step instead of one per request. The
        requests may be asked in any order, or not at all this step (the step's token budget),
        and a decision may change another's KV first (a preemption): what is prepared must be
        checked against the request when it is used."""

    def on_boundary(self, view: PolicyView) -> Decision:
        return Decision.grow()

    def fallback(self, view: PolicyView) -> Decision | None:
        return None

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        return None

    def periodic(self, step: int, views: list[PolicyView]) -> list[tuple[PolicyView, Decision]]:
        return []

    def forced_run_limit(self, view: PolicyView) -> int | None:
        """For a policy whose `periodic` acts on a request's own state (not on the step count):
        the most decode steps the request can take, from now, before `periodic` may act on it
        (>= 1), so its forced tokens can run as one chunk up to there. None (the default): no
        limit of the policy's own (a boundary policy's runs stop at the page boundary anyway).
        The scheduler lets a policy that overrides `periodic` run forced chunks only where the
        class that defines `periodic` also defines this (engine/scheduler.py)."""
        return None

    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor:
        raise NotImplementedError(f"policy {self.name!r} never compresses")

    def kv_budget(self, state: Any, num_pages: int) -> int | None:
        """The request's KV budget in slots at a decode step where it holds `num_pages` pages:
        a fixed-budget policy's nominal budget, GrowPage's per-request capacity. None (FullKV and
        policies without one): the allocated slots, num_pages x block_size. Averaged per request
        as the average KV budget (engine/stats.py)."""
        return None

    def max_pages(self, view: PolicyView) -> int | None:
        """Most pages a request may hold (None: unbounded). The engine does not call it; the tests
        check a request's pages against it."""
        return None

    @property
    def block_size(self) -> int:
        if self.engine is None:
            raise RuntimeError(f"policy {self.name!r} used before the engine bound it")
        return self.engine.block_size


# -- registry ---------------------------------------------------------------------------------

POLICIES: dict[str, type[KVPolicy]] = {}


def register_policy(cls: type[KVPolicy]) -> type[KVPolicy]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a class-level `name`")
    if cls.name in POLICIES:
        raise TypeError(f"policy name {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


def policy_registry() -> dict[str, type[KVPolicy]]:
    """Every registered policy by name, in registration order. The one door to the registry:
    the first call imports `engine.policies`, whose modules register the built-ins, so no caller
    needs an import for its side effect."""
    import engine.policies  # noqa: F401  (the package's modules register the built-ins)

    return POLICIES


def policy_lineage(name: str) -> tuple[str, ...]:
    """The registered names a policy answers to, most specific first: its own, then those of the
    registered policies it is a variant of (Kara's ablations: ("kara-wo-t2c", "kara")). Callers
    that keep settings by policy name (a task's defaults) match against it instead of the
    classes. An unregistered name is only itself."""
    registry = policy_registry()
    cls = registry.get(name)
    if cls is None:
        return (name,)
    return tuple(k.name for k in cls.__mro__ if registry.get(getattr(k, "name", "")) is k)


def policy_fields(cls: type[KVPolicy]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def policy_class(name: str) -> type[KVPolicy]:
    """The policy registered as ``name``: where every caller resolves a policy's name, so an
    unknown one always gets the same message, with the closest names (ConfigError)."""
    registry = policy_registry()
    if name not in registry:
        raise ConfigError(unknown_name("policy", name, registry, "policies"))
    return registry[name]


def build_policy(name: str, args: dict[str, Any] | None = None) -> KVPolicy:
    """Instantiate a registered policy; string values (from the CLI) are coerced to field types."""
    cls = policy_class(name)
    fields = policy_fields(cls)
    args = dict(args or {})
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown argument(s) {unknown} for policy {name!r}; valid: {sorted(fields)}"
        )
    coerced = {k: _coerce(name, k, v, fields[k]) for k, v in args.items()}
    try:
        return cls(**coerced)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"policy {name!r}: {exc}") from exc


def parse_policy_args(items: list[str]) -> dict[str, str]:
    """CLI `k=v` strings to a dict (values stay strings; build_policy coerces them)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"policy argument {item!r} must look like key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def _coerce(policy: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    if not isinstance(value, str):
        return value
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind.startswith("int"):
            return None if value.lower() == "none" and "None" in kind else int(value)
        if kind.startswith("float"):
            return None if value.lower() == "none" and "None" in kind else float(value)
        if kind.startswith("tuple"):
            return tuple(float(x) for x in value.split(","))
    except ValueError:
        raise ConfigError(
            f"policy {policy!r}: argument {key}={value!r} is not a valid {kind}"
        ) from None
    return value


def pages_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)

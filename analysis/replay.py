"""Counterfactual compress-vs-grow NLL replay (GrowPage Sec. 5.3, "Capacity Expansion Benefit
Analysis", Figure 7).

1. Reference: FullKV decodes each prompt (sampled with a per-request seed, at 0.6 by default in the
   CLI as in the paper's App. F.1, or greedy) and records the log-probability of every output
   token; this token sequence is the shared future of every branch, and its NLL is the floor.
   On long documents (`forced`) the reference is FullKV teacher-forced on the document's text.
2. Natural run: GrowPage, teacher-forced on the reference (`SamplingParams(forced_tokens=...)`), so
   its capacity boundaries and decisions are those GrowPage makes on that trajectory. Every boundary
   where GrowPage estimates demand (capacity control is on) is a *demand boundary* k, with its
   delta_k, r_S, r_L from the event record.
3. Branches: for a demand boundary k, two teacher-forced runs replay GrowPage's recorded decisions at
   demand boundaries 0..k-1 and then force (a) Compress & Hold or (b) Grow by One Page at k. Each
   stops after the N reference tokens that follow the decision, whose NLL it records:
       A_k = NLL_compress - NLL_grow   (the growth advantage; > 0: growing helps).

The branches are `ForcedGrowPage` requests: a GrowPage subclass (passed to LLM as an instance, not
registered) whose per-request state carries the plan; every branch of every request and boundary is
submitted in one generate() call. Prefix caching is off in every analysis engine: with a cache hit
the engine prefills a prompt's last token alone, as a one-token step that updates GrowPage's query
summaries (a full prefill does not), so a branch that hit the cache would start from different
summaries than the natural run.

Choices where the paper is silent:
- The window N defaults to four pages (4 b tokens; at b = 16, 64 tokens): one page is only 16
  tokens here, whose NLL barely registers one compression, where the paper scores the tokens of
  its 256-token page. Within the first page no later decision mixes into the comparison (both
  branches leave b free slots); after it, later boundaries follow GrowPage's own rule in both.
- The cumulative cost of earlier compressions: the grow branch at k replays the natural run's
  decisions before k and then loses nothing new, so nll_grow - nll_full (`cumulative_cost`) is
  what the earlier Compress & Holds already cost on the same window; `earlier_compressions`
  counts them, and the summary splits the cost by whether there were any. Over each whole output,
  the natural run's NLL minus FullKV's (`natural_excess`) is the cost of all of GrowPage's
  compressions.
- The window starts with the first token whose prediction can see the decision: at a boundary the
  engine is about to process position m (its KV goes into the freed or new slot), and the logits of
  that step predict output token o = m + 1 - prompt_len; the window is outputs [o, o + N).
- Earlier decisions are replayed from the record rather than recomputed, so both branches share the
  natural run's capacity history even if float noise in a batch of different shape flipped a delta
  near tau; `delta_branch` (the delta the grow branch computed at k) checks the replay.
- Boundaries whose window runs past the reference's end are skipped; `--max-boundaries` keeps an
  evenly spaced subset per request to bound the cost (each branch decodes from the prompt).
- Intervals: the boundaries of one request share its trajectory and its earlier decisions, so
  every summary number (mean NLLs, A overall and on each side of tau, their gap, the per-bin means,
  Spearman(delta, A)) carries a 95% bootstrap interval over requests (evals/intervals.py), not a
  p-value that counts boundaries as independent.
- The KV pool is sized so that nothing is preempted and no GROW falls back. A row is `clean` when
  both forced decisions show in the events, neither branch was preempted or fell back, and the grow
  branch computed the natural run's delta at k (|delta_branch - delta| <= 1e-6: the branch really
  replayed the same state); other rows are kept in the CSV and left out of the summary.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd

from analysis.common import (
    RunSettings,
    finite_or_none,
    forced_length,
    pearson,
    pool_tokens,
    progress,
    quantile_bins,
    spearman,
    use_agg_backend,
    write_json,
)
from engine.policies.base import Action, Decision, PolicyView
from engine.policies.growpage import GrowPage, GrowPageState
from evals.intervals import RESAMPLES, cluster_bootstrap, fmt_interval, mean_skipping_nan

# The one knob the replay sets: the protected recent window is half a page, as in GrowPage's b = 32
# preset (16 of 32), because GrowPage's 16 tokens would be the whole 16-token page. Everything else
# is GrowPage's own default at the engine's block size (never overridden here): the initial
# capacity in pages (9 pages = 144 tokens at b = 16) and the EMA betas of its preset (beta_L keeps
# the paper's time constant in pages: 0.984 at b = 16). config.json records the resolved values.
REPLAY_GROWPAGE_DEFAULTS: dict = {"protected_recent": 8}
# A branch replays the natural run exactly when it recomputes the same delta (a mean of Top-p counts:
# any changed count moves it by far more than this).
DELTA_REPLAY_TOLERANCE = 1e-6
WINDOW_PAGES = 4  # the default window, in pages (module docstring)


def resolved_window(window: int | None, block_size: int) -> int:
    """Tokens scored after each decision: `window`, or WINDOW_PAGES pages when None."""
    return window or WINDOW_PAGES * block_size


@dataclass(frozen=True)
class ForcePlan:
    """A branch: take `replay[i]` at demand boundary i < k, then `force` at k = len(replay)."""

    replay: tuple[Action, ...]
    force: Action

    def __post_init__(self) -> None:
        if self.force not in (Action.GROW, Action.COMPRESS):
            raise ValueError(f"a branch forces GROW or COMPRESS, got {self.force}")

    @property
    def index(self) -> int:
        return len(self.replay)


@dataclass
class ReplayState(GrowPageState):
    """GrowPage's state plus the branch plan and the count of demand boundaries seen."""

    plan: ForcePlan | None = None
    demand_index: int = 0


@dataclass
class ForcedGrowPage(GrowPage):
    """GrowPage that follows a per-request `ForcePlan` (None: GrowPage's own decisions).

    Queue one plan per request with `queue_plans` before generate(); requests take them in
    submission order (the engine creates per-request state as it adds each request). Every demand
    boundary's event info gains `demand_index`, `natural` (GrowPage's own action) and `control`
    ("natural", "replayed" or "forced").
    """

    name: ClassVar[str] = "replay-forced"
    plans: deque = field(default_factory=deque, init=False, repr=False, compare=False)

    def queue_plans(self, plans: list[ForcePlan | None]) -> None:
        self.plans.extend(plans)

    def new_state(self) -> ReplayState:
        return ReplayState(plan=self.plans.popleft() if self.plans else None)

    def on_boundary(self, view: PolicyView) -> Decision:
        decision = super().on_boundary(view)
        if "delta" not in decision.info:  # below the initial capacity: no demand estimate
            return decision
        state: ReplayState = view.state
        index = state.demand_index
        state.demand_index += 1
        chosen, control = decision.action, "natural"
        plan = state.plan
        if plan is not None and index < plan.index:
            chosen, control = plan.replay[index], "replayed"
        elif plan is not None and index == plan.index:
            chosen, control = plan.force, "forced"
        info = {k: v for k, v in decision.info.items() if k != "action"}
        info.update(demand_index=index, natural=decision.action.value, control=control)
        if chosen is Action.GROW:
            return self._grow(state, view.num_pages, info)
        if chosen is Action.COMPRESS:
            return self._hold(state, view.num_pages, info)
        raise ValueError(f"{self.name}: cannot replay action {chosen}")


@dataclass(frozen=True)
class ReplayConfig:
    """window: tokens scored after each decision (None: WINDOW_PAGES pages). max_boundaries: demand
    boundaries per request to branch at (None: all), evenly spaced. growpage: GrowPage knobs.
    ignore_eos: let the reference run to max_tokens. max_num_seqs: requests decoded together."""

    window: int | None = None
    max_boundaries: int | None = None
    growpage: dict = field(default_factory=lambda: dict(REPLAY_GROWPAGE_DEFAULTS))
    ignore_eos: bool = False
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"--window must be >= 1 token, got {self.window}")
        if self.max_boundaries is not None and self.max_boundaries < 1:
            raise ValueError(f"--max-boundaries must be >= 1, got {self.max_boundaries}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass
class Boundary:
    """A demand boundary of the natural run."""

    request: int
    index: int
    position: int       # logical position m about to be processed
    output_index: int   # first window token o = m + 1 - prompt_len
    pages: int
    action: str
    delta: float
    r_S: float
    r_L: float


def window_nll(logprobs: list[float], start: int, size: int) -> float:
    """Mean negative log-likelihood of output tokens [start, start + size)."""
    if start < 0 or start + size > len(logprobs):
        raise ValueError(f"window [{start}, {start + size}) outside {len(logprobs)} log-probs")
    return -float(np.mean(logprobs[start:start + size]))


def demand_boundaries(events: list[dict], request: int, prompt_len: int) -> list[Boundary]:
    """The natural run's demand boundaries, in order (events carrying a `demand_index`)."""
    found = sorted((e for e in events if "demand_index" in e["info"] and not e["fallback"]),
                   key=lambda e: e["info"]["demand_index"])
    out = []
    for e in found:
        info = e["info"]
        m = e["logical_len"]
        out.append(Boundary(request, info["demand_index"], m, m + 1 - prompt_len, e["pages_before"],
                            e["action"], info["delta"], info["r_S"], info["r_L"]))
    if [b.index for b in out] != list(range(len(out))):
        raise RuntimeError(f"request {request}: demand boundaries are not 0..n-1 (a GROW fell back "
                           "or the run was preempted); raise the KV pool")
    return out


def pick_evenly(items: list, limit: int | None) -> list:
    """At most `limit` items, evenly spaced, first and last included."""
    if limit is None or len(items) <= limit:
        return list(items)
    idx = np.unique(np.round(np.linspace(0, len(items) - 1, limit)).astype(int))
    return [items[i] for i in idx]


def forced_event(events: list[dict], index: int) -> dict | None:
    for e in events:
        if e["info"].get("demand_index") == index and e["info"].get("control") == "forced":
            return e
    return None


def _disturbed(out) -> bool:
    return any(e["action"] == "preempt" or e["fallback"] for e in out.events)


@dataclass
class ReplayResult:
    rows: pd.DataFrame
    references: list          # RequestOutput of the FullKV reference per prompt
    natural: list             # RequestOutput of the natural GrowPage run per prompt
    boundaries: list          # every demand boundary of the natural run (Boundary)
    policy_params: dict = field(default_factory=dict)  # GrowPage's resolved knobs


def run_replay(model: str, prompt_ids: list[list[int]], max_tokens: int, block_size: int,
               temperature: float = 0.0, seed: int = 0, config: ReplayConfig = ReplayConfig(),
               show_progress: bool = True,
               forced: list[list[int]] | None = None) -> ReplayResult:
    """Reference, natural GrowPage run, then both branches at every selected demand boundary.
    forced: per prompt, a text to teacher-force as the reference (long documents) instead of
    decoding one; `max_tokens` is then the longest of them."""
    import gc

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    window = resolved_window(config.window, block_size)
    if forced is not None:
        max_tokens = forced_length(forced, prompt_ids)
    longest = max(len(p) for p in prompt_ids) + max_tokens + window
    full = LLM(model, block_size=block_size, policy="full", max_num_seqs=config.max_num_seqs,
               enable_prefix_caching=False,
               kv_cache_tokens=pool_tokens(min(len(prompt_ids), config.max_num_seqs), longest,
                                           block_size))
    ref_params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens,
                                 logprobs=True, ignore_eos=config.ignore_eos)
                  for i in range(len(prompt_ids))] if forced is None else \
        [_teacher(f, len(f)) for f in forced]
    total = sum(p.max_tokens for p in ref_params)
    with progress("reference (FullKV)", total, show_progress) as on_step:
        references = full.generate(prompt_ids, ref_params, on_step=on_step)
    del full
    gc.collect()

    policy = ForcedGrowPage(**config.growpage)
    llm = LLM(model, block_size=block_size, policy=policy, max_num_seqs=config.max_num_seqs,
              enable_prefix_caching=False,
              kv_cache_tokens=pool_tokens(config.max_num_seqs, longest, block_size,
                                          spare_pages=8 + math.ceil(longest / block_size)))
    forced = [_teacher(ref.token_ids, len(ref.token_ids)) for ref in references]
    total = sum(len(r.token_ids) for r in references)
    with progress("natural GrowPage run", total, show_progress) as on_step:
        natural = llm.generate(prompt_ids, forced, on_step=on_step)
    if any(_disturbed(o) for o in natural):
        raise RuntimeError("the natural GrowPage run was preempted or fell back; the pool is too "
                           "small for this workload")

    boundaries, selected = [], []
    for r, (ids, out, ref) in enumerate(zip(prompt_ids, natural, references)):
        found = demand_boundaries(out.events, r, len(ids))
        boundaries.extend(found)
        usable = [b for b in found if b.output_index + window <= len(ref.token_ids)]
        selected.extend(pick_evenly(usable, config.max_boundaries))
    actions = {(b.request, b.index): Action(b.action) for b in boundaries}

    prompts, params, plans = [], [], []
    for b in selected:
        history = tuple(actions[(b.request, i)] for i in range(b.index))
        ref = references[b.request].token_ids
        for force in (Action.GROW, Action.COMPRESS):
            prompts.append(prompt_ids[b.request])
            params.append(_teacher(ref, b.output_index + window))
            plans.append(ForcePlan(history, force))
    branches = []
    if selected:
        policy.queue_plans(plans)
        total = sum(p.max_tokens for p in params)
        with progress("branches", total, show_progress) as on_step:
            branches = llm.generate(prompts, params, on_step=on_step)
        if policy.plans:
            raise RuntimeError(f"{len(policy.plans)} branch plans were not consumed")
    rows = [{**_row(b, references, natural, branches[2 * i], branches[2 * i + 1], window),
             "earlier_compressions": sum(actions[(b.request, i)] is Action.COMPRESS
                                         for i in range(b.index)),
             "natural_excess": _excess(natural[b.request], references[b.request])}
            for i, b in enumerate(selected)]
    columns = ["request", "boundary", "position", "output_index", "pages", "delta", "r_S", "r_L",
               "natural_action", "nll_full", "nll_grow", "nll_compress", "benefit",
               "nll_natural", "cumulative_cost", "earlier_compressions", "natural_excess",
               "delta_branch", "window", "clean"]
    frame = pd.DataFrame(rows, columns=columns)
    return ReplayResult(frame, references, natural, boundaries, policy.effective_params())


def _excess(natural, reference) -> float:
    """Mean NLL per output token of the natural GrowPage run minus FullKV's, whole output."""
    n = len(reference.token_logprobs)
    return window_nll(natural.token_logprobs, 0, n) - window_nll(reference.token_logprobs, 0, n)


def _teacher(tokens: list[int], count: int):
    from engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, forced_tokens=tuple(tokens[:count]), max_tokens=count,
                          logprobs=True, ignore_eos=True)


def _row(b: Boundary, references, natural, grow, compress, window: int) -> dict:
    o = b.output_index
    nll_grow = window_nll(grow.token_logprobs, o, window)
    nll_compress = window_nll(compress.token_logprobs, o, window)
    grow_event = forced_event(grow.events, b.index)
    compress_event = forced_event(compress.events, b.index)
    delta_branch = grow_event["info"]["delta"] if grow_event is not None else math.nan
    clean = (grow_event is not None and grow_event["action"] == "grow"
             and compress_event is not None and compress_event["action"] == "compress"
             and not _disturbed(grow) and not _disturbed(compress)
             and abs(delta_branch - b.delta) <= DELTA_REPLAY_TOLERANCE)
    return {
        "request": b.request, "boundary": b.index, "position": b.position, "output_index": o,
        "pages": b.pages, "delta": b.delta, "r_S": b.r_S, "r_L": b.r_L,
        "natural_action": b.action,
        "nll_full": window_nll(references[b.request].token_logprobs, o, window),
        "nll_grow": nll_grow, "nll_compress": nll_compress, "benefit": nll_compress - nll_grow,
        "nll_natural": window_nll(natural[b.request].token_logprobs, o, window),
        "cumulative_cost": nll_grow - window_nll(references[b.request].token_logprobs, o, window),
        "delta_branch": delta_branch,
        "window": window, "clean": clean,
    }


def delta_bin_labels(delta: pd.Series, bins: int) -> np.ndarray:
    """Equal-count bins of delta (ascending), as quantile_bins forms them: label per row."""
    order = np.argsort(delta.to_numpy(dtype=float), kind="stable")
    labels = np.zeros(len(delta), dtype=int)
    for k, chunk in enumerate(np.array_split(order, min(bins, max(len(delta), 1)))):
        labels[chunk] = k
    return labels


def summarize_replay(frame: pd.DataFrame, tau: float = 0.0, bins: int = 4,
                     resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Mean NLLs, the growth advantage A = NLL_compress - NLL_grow overall, split by delta > tau
    (GrowPage's own decision) and by delta quantile bins, the difference between the two sides of
    tau, and Spearman(delta, A), over the clean rows. Every number comes with a 95% cluster
    bootstrap interval over requests (the boundaries of one request share its trajectory, so they
    are not independent draws); the bins are formed once on the observed deltas and each resample
    averages the rows of a bin it drew."""
    rows = frame[frame["clean"]].reset_index(drop=True)
    rows["bin"] = delta_bin_labels(rows["delta"], bins) if len(rows) else []
    gt, le = f"benefit_delta_gt_{tau:g}", f"benefit_delta_le_{tau:g}"

    mean = mean_skipping_nan

    def per_request(f, column: str):
        """column's value at each request's first row, in row order (one per request, however
        often drawn), as DataFrame.drop_duplicates("request") keeps them."""
        return f[column][np.sort(np.unique(f["request"], return_index=True)[1])]

    # Statistics of `Columns` (name -> numpy array; evals/intervals.py), so each of the 2,000
    # resamples slices arrays instead of building a DataFrame.
    stats = {
        "nll_full": lambda f: mean(f["nll_full"]), "nll_grow": lambda f: mean(f["nll_grow"]),
        "nll_compress": lambda f: mean(f["nll_compress"]), "benefit": lambda f: mean(f["benefit"]),
        "benefit_positive_fraction": lambda f: mean(f["benefit"] > 0),
        gt: lambda f: mean(f["benefit"][f["delta"] > tau]),
        le: lambda f: mean(f["benefit"][f["delta"] <= tau]),
        "benefit_gap_gt_minus_le": lambda f: mean(f["benefit"][f["delta"] > tau])
        - mean(f["benefit"][f["delta"] <= tau]),
        "spearman_delta_benefit": lambda f: spearman(f["delta"], f["benefit"]),
        "pearson_delta_benefit": lambda f: pearson(f["delta"], f["benefit"]),
        "spearman_delta_position": lambda f: spearman(f["delta"], f["position"]),
        "spearman_benefit_position": lambda f: spearman(f["benefit"], f["position"]),
        "natural_grow_fraction": lambda f: mean(f["natural_action"] == "grow"),
        "cumulative_cost": lambda f: mean(f["cumulative_cost"]),
        "cumulative_cost_after_compressions":
            lambda f: mean(f["cumulative_cost"][f["earlier_compressions"] > 0]),
        "cumulative_cost_without_compressions":
            lambda f: mean(f["cumulative_cost"][f["earlier_compressions"] == 0]),
        "natural_excess": lambda f: mean(per_request(f, "natural_excess")),
    }
    labels = sorted(set(rows["bin"])) if len(rows) else []
    for k in labels:
        stats[f"bin{k}"] = lambda f, k=k: mean(f["benefit"][f["bin"] == k])
    intervals = cluster_bootstrap(rows, "request", stats, resamples=resamples, seed=seed,
                                  as_arrays=True) if len(rows) else {}

    def get(key: str) -> dict | None:
        return intervals[key].to_dict() if key in intervals else None

    summary = {"rows": int(len(frame)), "clean": int(len(rows)),
               "requests": int(rows["request"].nunique()) if len(rows) else 0,
               "window": int(frame["window"].iloc[0]) if len(frame) else None,
               "intervals": "95% percentile bootstrap over requests (whole requests resampled)"}
    for key in stats:
        if not key.startswith("bin"):
            summary[key] = get(key)
    for key in (gt, le):
        part = rows[rows["delta"] > tau] if key == gt else rows[rows["delta"] <= tau]
        summary[key] = {"n": int(len(part)), "requests": int(part["request"].nunique()),
                        **(get(key) or {})}
    described = quantile_bins(rows["delta"], rows["benefit"], bins) if len(rows) else []
    summary["delta_bins"] = [{**b, "interval": get(f"bin{k}")} for k, b in zip(labels, described)]
    summary["max_abs_delta_branch_error"] = finite_or_none(
        float((rows["delta_branch"] - rows["delta"]).abs().max())) if len(rows) else None
    return summary


def plot_replay(frame: pd.DataFrame, summary: dict, path: Path, tau: float = 0.0) -> None:
    """Left: growth advantage vs delta per boundary. Right: mean advantage per delta quantile bin
    with its 95% bootstrap interval over requests, the layout of the paper's Figure 7."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    rows = frame[frame["clean"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for request, g in rows.groupby("request"):
        left.scatter(g["delta"], g["benefit"], s=10, alpha=0.6, color=f"C{int(request) % 10}")
    left.axhline(0, color="grey", linewidth=0.8)
    left.axvline(tau, color="C3", linewidth=0.8, linestyle="--", label=f"tau = {tau:g}")
    left.set_title(f"Growth advantage A = NLL_compress - NLL_grow ({len(rows)} boundaries, "
                   f"{summary.get('requests')} requests, window {summary.get('window')} tokens)\n"
                   f"Spearman(delta, A) = {fmt_interval(summary.get('spearman_delta_benefit'))} "
                   "(95% CI over requests)", fontsize=9)
    left.set_xlabel("GrowPage delta at the boundary")
    left.set_ylabel("A (nats/token)")
    left.legend(fontsize=7)
    bins = summary.get("delta_bins", [])
    labels = [f"[{b['x_min']:.3g}, {b['x_max']:.3g}]\nn={b['n']}" for b in bins]
    means = [b["mean"] for b in bins]
    lows = [m - (b["interval"]["low"] if b["interval"] and b["interval"]["low"] is not None else m)
            for m, b in zip(means, bins)]
    highs = [(b["interval"]["high"] if b["interval"] and b["interval"]["high"] is not None else m)
             - m for m, b in zip(means, bins)]
    right.bar(range(len(bins)), means, yerr=[lows, highs], color="C0", capsize=4)
    right.set_xticks(range(len(bins)), labels, fontsize=8)
    right.axhline(0, color="grey", linewidth=0.8)
    right.set_xlabel("delta quantile bin")
    right.set_ylabel("mean A (nats/token), 95% CI over requests")
    right.set_title("Growth advantage by delta range")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replay_study(model: str, prompt_ids: list[list[int]], settings: RunSettings, out: Path,
                 config: ReplayConfig = ReplayConfig(), show_progress: bool = True,
                 forced: list[list[int]] | None = None, extra: dict | None = None) -> dict:
    """Run, then write replay.csv, boundaries.csv, replay.png, summary.json, config.json.
    forced: see `run_replay`; extra: more settings for config.json (the documents' source)."""
    out.mkdir(parents=True, exist_ok=True)
    result = run_replay(model, prompt_ids, settings.max_tokens, settings.block_size,
                        settings.temperature, settings.seed, config, show_progress, forced)
    if result.rows.empty:
        raise RuntimeError("no demand boundary with a full window: raise --max-tokens or lower "
                           "the GrowPage initial_capacity / --block-size")
    result.rows.to_csv(out / "replay.csv", index=False, float_format="%.6g")
    pd.DataFrame([b.__dict__ for b in result.boundaries]).to_csv(
        out / "boundaries.csv", index=False, float_format="%.6g")
    tau = float(config.growpage.get("tau", 0.0))
    summary = summarize_replay(result.rows, tau)
    summary["reference_output_tokens"] = [len(r.token_ids) for r in result.references]
    plot_replay(result.rows, summary, out / "replay.png", tau)
    write_json(out / "summary.json", summary)
    window = resolved_window(config.window, settings.block_size)
    write_json(out / "config.json", {**settings.__dict__, "window": window,
                                     "max_boundaries": config.max_boundaries,
                                     "growpage": config.growpage,
                                     "growpage_params": result.policy_params,
                                     "ignore_eos": config.ignore_eos,
                                     "max_num_seqs": config.max_num_seqs, **(extra or {})})
    return summary
